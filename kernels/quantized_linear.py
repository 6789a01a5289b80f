"""Weight-only quantized linears as ops the graphs call, on torch's own CPU kernels.

- `int8_weight_linear(x, qweight, scales, bias)`: `aten._weight_int8pack_mm`, which takes the
  int8 [N, K] weight as it is (kernels/weight_quantization.py) and dequantizes per output channel.
- `int4_weight_linear(x, qweight, scales, zeros, group_size, bias)`: `aten._weight_int4pack_mm_for_cpu`,
  which needs the weight re-laid out by `aten._convert_weight_to_int4pack_for_cpu` (from int32
  values, N a multiple of 16) and the scales and zeros interleaved as [K / group, N, 2]. That copy
  is made on the first call with a `qweight` and kept, weakly keyed on it, as kernels/onednn_linear.py
  keeps oneDNN's packed weights: the graphs (and so the compile cache's recipes) hold only the
  canonical layout.

Both keep x's leading dimensions, add the bias in x's dtype, and run under Inductor as extern
calls (their fake impls give the output's shape). The C++ GEMV variants of the same operands
(kernels/cpu_gemv_quantized.py) replace them in the buckets where the policy measured them faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from compiled_engine.kernels.source_version import source_version
from compiled_engine.kernels.weight_quantization import unpack_int4

QUANTIZED_LINEAR_VERSION = source_version(__name__, "compiled_engine.kernels.weight_quantization")

# torch's int4 CPU layout packs output features in tiles of this many.
_INT4_N_TILE = 16


def _version(tensor: torch.Tensor) -> int:
    return -1 if tensor.is_inference() else tensor._version


class TorchInt4Weights:
    """torch's int4 CPU layout of each canonical int4 weight: (packed, scale_and_zeros, padded N)."""

    def __init__(self) -> None:
        self._copies: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __len__(self) -> int:
        return len(self._copies)

    def get(
        self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        version = (_version(qweight), _version(scales), _version(zeros), scales.dtype)
        entry = self._copies.get(qweight)
        if entry is None or entry[0] != version:
            entry = (version, *pack_for_torch_int4(qweight, scales, zeros))
            self._copies[qweight] = entry
        return entry[1], entry[2]


def pack_for_torch_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch's packed int4 weight, its [K / group, N_padded, 2] scales and zeros); output features
    padded to a multiple of 16 with zeros (their outputs are dropped)."""
    n = qweight.shape[0]
    padded_n = -(-n // _INT4_N_TILE) * _INT4_N_TILE
    with torch.no_grad():
        values = unpack_int4(qweight).to(torch.int32)
        if padded_n != n:
            values = F.pad(values, (0, 0, 0, padded_n - n), value=8)
            scales = F.pad(scales, (0, 0, 0, padded_n - n))
            zeros = F.pad(zeros, (0, 0, 0, padded_n - n))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.contiguous(), 1)
        scale_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()
    return packed, scale_and_zeros


TORCH_INT4_WEIGHTS = TorchInt4Weights()


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    rows = x.reshape(-1, in_features)
    return rows if rows.is_contiguous() else rows.contiguous()


# torch 2.13's bf16 int8 kernel reads in_features in steps of 16: other sizes gave wrong sums (or
# crashed) in tests/test_weight_quantization.py, so they run in float32 (any size works there).
_INT8_BF16_K_STEP = 16


def _int8_weight_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    rows = _rows(x, qweight.shape[1])
    if x.dtype == torch.bfloat16 and qweight.shape[1] % _INT8_BF16_K_STEP:
        out = torch.ops.aten._weight_int8pack_mm(rows.float(), qweight, scales.float()).to(x.dtype)
    else:
        out = torch.ops.aten._weight_int8pack_mm(rows, qweight, scales)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], qweight.shape[0])


def _int4_weight_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    n = qweight.shape[0]
    packed, scale_and_zeros = TORCH_INT4_WEIGHTS.get(qweight, scales, zeros)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        _rows(x, 2 * qweight.shape[1]), packed, group_size, scale_and_zeros
    )
    if out.shape[1] != n:
        out = out[:, :n]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


# The output's shape, for tracing; shared with the C++ GEMV's ops (kernels/cpu_gemv_quantized.py).
def int8_linear_fake(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def int4_linear_fake(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


# The low-level torch.library API, as for onednn_linear: one call per linear per step.
_LIBRARY = torch.library.Library("compiled_engine", "FRAGMENT")
_LIBRARY.define("int8_weight_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor")
_LIBRARY.define(
    "int4_weight_linear(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group_size, "
    "Tensor? bias) -> Tensor"
)
_LIBRARY.impl("int8_weight_linear", _int8_weight_linear, "CPU")
_LIBRARY.impl("int4_weight_linear", _int4_weight_linear, "CPU")
torch.library.register_fake("compiled_engine::int8_weight_linear", int8_linear_fake, lib=_LIBRARY)
torch.library.register_fake("compiled_engine::int4_weight_linear", int4_linear_fake, lib=_LIBRARY)

# x @ dequantized(qweight)^T (+ bias), on torch's int8 / int4 CPU kernels (module docstring).
int8_weight_linear = torch.ops.compiled_engine.int8_weight_linear.default
int4_weight_linear = torch.ops.compiled_engine.int4_weight_linear.default
