"""Pre-quantized checkpoints in the compressed-tensors format (what llm-compressor writes, what vLLM loads).

Supported: `quantization_config` with `quant_method: compressed-tensors`, format `pack-quantized`, one
config group of integer weight-only quantization (no input activations, no KV-cache scheme):
- W8A16: 8 bits, strategy `channel`, symmetric -> the engine's int8 layout;
- W4A16: 4 bits, strategy `group` (32, 64, 128 or 256), symmetric -> the engine's int4 layout, zeros 0.
Anything else raises `UnsupportedModelError` naming the setting.

How: each quantized linear's `weight_packed` (int32 words, packed by the library's `pack_to_int32`),
`weight_scale` and `weight_shape` are unpacked with the library's own `unpack_from_int32`, so the
bit layout is never re-implemented here. The integers and scales become the engine's representation
(kernels/weight_quantization.py) and are registered on the linear as non-persistent buffers
(`QUANTIZED_BUFFERS`); the linear's `weight` gets the dequantized values, so the model still runs
(and traces) as transformers' own. graphs/passes/quantize_linears.py then uses the checkpoint's
integers for these linears instead of quantizing, and their recipes read the buffers back on a
warm start. Reading needs the `compressed-tensors` package, imported only for such folders.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from compiled_engine.errors import ModelLoadError, UnsupportedModelError
from compiled_engine.records.weight_quantization import (
    INT4_GROUP_SIZES,
    QUANTIZED_BUFFERS,
    WeightQuantization,
)

_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
SUPPORTED = (
    "compressed-tensors pack-quantized W8A16 (8-bit, per channel, symmetric) or W4A16 (4-bit, group "
    f"{'/'.join(map(str, INT4_GROUP_SIZES))}, symmetric), weights only"
)


def _unsupported(path: Path, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{path}'s quantization_config is not supported: {why}; the engine loads {SUPPORTED}"
    )


def checkpoint_quantization(config: Mapping[str, Any] | None, path: Path) -> WeightQuantization | None:
    """The scheme a config.json `quantization_config` (a dict) describes; None without one."""
    if config is None:
        return None
    if hasattr(config, "to_dict"):  # transformers may hand a parsed config object
        config = config.to_dict()
    method = config.get("quant_method")
    if method != "compressed-tensors":
        raise _unsupported(path, f"quant_method {method!r}")
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise _unsupported(path, f"{len(groups)} config groups (one is supported)")
    (group,) = groups.values()
    fmt = group.get("format") or config.get("format")
    if fmt != "pack-quantized":
        raise _unsupported(path, f"format {fmt!r}")
    if group.get("input_activations") or group.get("output_activations") or config.get("kv_cache_scheme"):
        raise _unsupported(path, "activation or KV-cache quantization")
    weights = group.get("weights") or {}
    bits, strategy = weights.get("num_bits"), weights.get("strategy")
    if weights.get("type", "int") != "int" or weights.get("dynamic"):
        raise _unsupported(path, f"weights of type {weights.get('type')!r}, dynamic={weights.get('dynamic')}")
    if not weights.get("symmetric", True):
        raise _unsupported(path, "asymmetric weights (zero points)")
    if bits == 8 and strategy == "channel":
        return WeightQuantization("int8", source="compressed-tensors")
    if bits == 4 and strategy == "group":
        group_size = weights.get("group_size")
        if group_size not in INT4_GROUP_SIZES:
            raise _unsupported(path, f"4-bit group size {group_size!r}")
        return WeightQuantization("int4", group_size, symmetric=True, source="compressed-tensors")
    raise _unsupported(path, f"{bits}-bit weights with strategy {strategy!r}")


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """A compressed checkpoint's quantized linears: their engine-layout parts by module name, and
    the dequantized weights."""

    quantization: WeightQuantization
    parts: dict[str, dict[str, torch.Tensor]]
    dequantized: dict[str, torch.Tensor]  # "<module>.weight" -> the float weight it stands for

    @staticmethod
    def compressed_names(where: Mapping[str, Path]) -> dict[str, Path]:
        """The checkpoint's tensors of quantized linears (what the plain loader must not see)."""
        return {name: path for name, path in where.items() if name.rsplit(".", 1)[-1] in _SUFFIXES}

    @classmethod
    def read(
        cls, where: Mapping[str, Path], quantization: WeightQuantization, dtype: torch.dtype
    ) -> QuantizedCheckpoint:
        try:
            from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
        except ImportError as exc:
            raise ModelLoadError(
                "this checkpoint is quantized in the compressed-tensors format: install the "
                "`compressed-tensors` package to load it"
            ) from exc
        compressed = cls.compressed_names(where)
        modules = sorted({name.rsplit(".", 1)[0] for name in compressed})
        bits = 8 if quantization.scheme == "int8" else 4
        parts: dict[str, dict[str, torch.Tensor]] = {}
        dequantized: dict[str, torch.Tensor] = {}
        for module in modules:
            tensors = {}
            for suffix in ("weight_packed", "weight_scale", "weight_shape"):
                name = f"{module}.{suffix}"
                if name not in where:
                    raise ModelLoadError(f"{where[next(iter(compressed))].parent} lacks {name}")
                with safe_open(where[name], framework="pt", device="cpu") as reader:
                    tensors[suffix] = reader.get_tensor(name)
            shape = torch.Size(int(d) for d in tensors["weight_shape"].tolist())
            values = unpack_from_int32(tensors["weight_packed"], bits, shape)  # int8, signed range
            scales = tensors["weight_scale"].to(dtype)
            if quantization.scheme == "int8":
                layout = {"qweight": values.contiguous(), "scales": scales.reshape(-1).contiguous()}
                weight = values.float() * scales.float().reshape(-1, 1)
            else:
                assert quantization.group_size is not None
                unsigned = (values.to(torch.int16) + 8).to(torch.uint8)
                layout = {
                    "qweight": (unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)).contiguous(),
                    "scales": scales.contiguous(),
                    "zeros": torch.zeros_like(scales),
                }
                weight = values.float() * scales.float().repeat_interleave(quantization.group_size, dim=1)
            parts[module] = layout
            dequantized[f"{module}.weight"] = weight.to(dtype)
        return cls(quantization, parts, dequantized)

    def attach(self, model: torch.nn.Module) -> None:
        """Register each linear's quantized parts on it (non-persistent buffers, QUANTIZED_BUFFERS)."""
        for module_name, layout in self.parts.items():
            try:
                module = model.get_submodule(module_name)
            except AttributeError as exc:
                raise ModelLoadError(
                    f"the checkpoint quantizes {module_name}, which {type(model).__name__} does not have"
                ) from exc
            for part, tensor in layout.items():
                module.register_buffer(QUANTIZED_BUFFERS[part], tensor, persistent=False)
