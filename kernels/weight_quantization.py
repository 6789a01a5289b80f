"""Weight-only quantization of a linear's weight: the numbers, and where they can run.

The one representation every kernel reads (kernels/quantized_linear.py for torch's kernels,
kernels/cpu_gemv_quantized.py for the C++ GEMV), whatever produced it (the engine at load,
graphs/passes/quantize_linears.py, or a compressed-tensors checkpoint):

- int8: `qweight` int8 [N, K], `scales` [N] in the model dtype;  w[n, k] = qweight[n, k] * scales[n]
  (symmetric, scale = max |w[n, :]| / 127).
- int4: `qweight` uint8 [N, K / 2], two values per byte (even k in the low nibble, odd k in the
  high one), each 0..15; `scales`, `zeros` [N, K / group_size] in the model dtype;
  w[n, k] = (q[n, k] - 8) * scales[n, g] + zeros[n, g] with g = k // group_size, which is torch's
  int4 CPU kernel's own formula (`_weight_int4pack_mm_for_cpu`). The engine quantizes
  asymmetrically (zeros = the group's value at q = 8, from its min and max); a symmetric
  checkpoint has zeros 0.

Scales and zeros are computed in float32 and rounded to the model dtype before the integers are
chosen, so the integers are the best ones for the scales the kernels actually multiply by.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from compiled_engine.kernels.source_version import source_version
from compiled_engine.records.weight_quantization import WeightQuantization

WEIGHT_QUANTIZATION_VERSION = source_version(__name__)

# Activation (and scale) dtypes torch's int8/int4 CPU kernels and the C++ GEMV take.
QUANTIZED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class QuantizedWeight(NamedTuple):
    """A linear weight [N, K] in one of the layouts of the module docstring (`zeros`: int4 only)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int | None  # int4's input features per scale; None for int8

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        k = int(self.qweight.shape[1])
        return k if self.group_size is None else 2 * k


def check_quantization_runs(
    quantization: WeightQuantization, dtype: torch.dtype, device: torch.device
) -> None:
    """ValueError unless `quantization`'s kernels run a `dtype` model on `device`."""
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"quantization={quantization.scheme!r} runs on the CPU only for now, not on "
            f"{torch.device(device).type}: its kernels are torch's int8/int4 CPU kernels and the C++ GEMV"
        )
    if dtype not in QUANTIZED_DTYPES:
        raise ValueError(
            f"quantization={quantization.scheme!r} cannot run a {dtype} model: its kernels take "
            f"{', '.join(str(d).removeprefix('torch.') for d in QUANTIZED_DTYPES)} activations"
        )


def output_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's LM head module (transformers' `get_output_embeddings`), None where it has none."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None


def quantized_linear_names(
    model: torch.nn.Module, lm_head: bool = False
) -> list[tuple[str, torch.nn.Linear]]:
    """(name, module) of every `nn.Linear` a scheme quantizes: all but the output embedding (LM head),
    which is included with `lm_head` (WeightQuantization.lm_head, EngineArgs' quantize_lm_head)."""
    head = None if lm_head else output_embeddings(model)
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    ]


def check_model_quantizable(model: torch.nn.Module, quantization: WeightQuantization) -> None:
    """ValueError naming the first linear the scheme cannot hold (int4: in_features not a multiple
    of the group size). Run at load, before anything is traced or compiled."""
    if quantization.group_size is None:
        return
    for name, module in quantized_linear_names(model, quantization.quantizes_lm_head()):
        if module.in_features % quantization.group_size:
            raise ValueError(
                f"quantization={quantization.scheme!r} with group size {quantization.group_size} cannot "
                f"quantize {name}: its {module.in_features} input features are not a multiple of "
                f"{quantization.group_size}; choose a quantization_group_size that divides every "
                "linear's input features"
            )


def quantize_weight(weight: torch.Tensor, quantization: WeightQuantization) -> QuantizedWeight:
    """`weight` [N, K] in `quantization`'s layout (module docstring); scales in the weight's dtype."""
    if weight.dim() != 2:
        raise ValueError(f"a linear weight is 2-D, got shape {tuple(weight.shape)}")
    if quantization.scheme == "int8":
        return quantize_int8(weight)
    assert quantization.group_size is not None  # WeightQuantization checks int4 has one
    return quantize_int4(weight, quantization.group_size, symmetric=quantization.symmetric)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8, one scale per output feature (row)."""
    with torch.no_grad():
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(weight.dtype)
        q = torch.round(w / scales.float()[:, None]).clamp_(-128, 127).to(torch.int8)
        return QuantizedWeight(q.contiguous(), scales.contiguous(), None, None)


def quantize_int4(weight: torch.Tensor, group_size: int, symmetric: bool = False) -> QuantizedWeight:
    """int4 per `group_size` input features of each output feature: min/max (asymmetric) by default."""
    n, k = weight.shape
    if k % group_size or group_size % 2:
        raise ValueError(f"int4 group size {group_size} must be even and divide in_features={k}")
    with torch.no_grad():
        w = weight.detach().float().reshape(n, k // group_size, group_size)
        tiny = torch.finfo(torch.float32).tiny
        if symmetric:  # q - 8 in -8..7: the scale maps the largest magnitude to -8 or 7
            scales = (w.abs().amax(dim=2) / 7.5).clamp_min(tiny)
            zeros = torch.zeros_like(scales)
        else:
            low, high = w.amin(dim=2), w.amax(dim=2)
            scales = ((high - low) / 15).clamp_min(tiny)
            zeros = low + 8 * scales  # the value at q = 8
        scales, zeros = scales.to(weight.dtype), zeros.to(weight.dtype)
        q = torch.round((w - zeros.float()[..., None]) / scales.float()[..., None] + 8).clamp_(0, 15)
        q = q.to(torch.uint8).reshape(n, k)
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        return QuantizedWeight(packed, scales.contiguous(), zeros.contiguous(), group_size)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] nibbles -> uint8 [N, K] values 0..15 (even k from the low nibble)."""
    low, high = qweight & 0x0F, qweight >> 4
    return torch.stack([low, high], dim=-1).reshape(qweight.shape[0], -1)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] a quantized one stands for (the references tests compare against)."""
    if weight.group_size is None:
        return (weight.qweight.float() * weight.scales.float()[:, None]).to(dtype)
    assert weight.zeros is not None
    q = unpack_int4(weight.qweight).float() - 8
    scales = weight.scales.float().repeat_interleave(weight.group_size, dim=1)
    zeros = weight.zeros.float().repeat_interleave(weight.group_size, dim=1)
    return (q * scales + zeros).to(dtype)
