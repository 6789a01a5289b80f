"""Compressed-tensors checkpoints for tests, written by the library's own compressor from a tiny
random model: the folders llm-compressor would write for W8A16 (8-bit, per channel) and W4A16
(4-bit, grouped) weight-only quantization."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from transformers import AutoModelForCausalLM

from tests.model_factory import make_tiny_model


def _calibrate(module: torch.nn.Module, args: QuantizationArgs) -> None:
    """Weight scales from the weight's own min and max (what llm-compressor's min-max observer does)."""
    weight = module.weight.detach()
    if args.strategy == "group":
        weight = weight.reshape(weight.shape[0], -1, args.group_size)
    lows, highs = weight.amin(dim=-1), weight.amax(dim=-1)
    scale, zero_point = calculate_qparams(lows, highs, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))


def make_compressed_checkpoint(
    root: Path, bits: int, group_size: int | None = None, seed: int = 0, **tiny_model: object
) -> Path:
    """A tiny llama saved pack-quantized: `bits` 8 per channel, or 4 in groups of `group_size`."""
    source = make_tiny_model(root, "llama", seed=seed, name=f"float-{bits}-{group_size}-{seed}", **tiny_model)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    args = QuantizationArgs(
        num_bits=bits,
        type="int",
        symmetric=True,
        strategy="channel" if group_size is None else "group",
        group_size=group_size,
    )
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"],
        format="pack-quantized",
    )
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            _calibrate(module, args)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    out = root / f"compressed-w{bits}a16-{group_size}-{seed}"
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for path in source.iterdir():  # the tokenizer and generation config
        if path.name not in {"config.json", "model.safetensors"} and path.is_file():
            shutil.copy(path, out / path.name)
    return out
