"""`compiled_engine::widened_linear`: a bf16 / fp16 linear computed as an fp32 GEMM, for CPUs whose
GEMMs have no native half-precision path.

Why: on a CPU without AVX-512 BF16 or AMX (an AMD Zen 3 here: AVX2 + FMA only) oneDNN reports no
bf16 support, so bf16 weights cannot be packed (kernels/onednn_linear.py), and torch's own bf16
GEMM took 2.5x the time of the fp32 GEMM at 16 rows, 5.5x at 64 and 7x at 512 (all of bench-small's
linears at 64 rows: 159 ms against 29; bench/test_widened_linear.py, docs/performance.md, "bf16
linears on a CPU without bf16 GEMMs").
Widening the weight to fp32 costs one pass over it, far less than that difference wherever the
GEMM does a few multiply-adds per weight. So this op widens the weight, a block of output features
at a time, into a reused fp32 scratch (small enough to stay in cache for the GEMM that reads it
next, and no fresh allocation per call, whose page faults cost more than the copy), widens x,
runs torch's fp32 GEMM and rounds the result to x's dtype once. That is torch's own bf16 GEMM's
arithmetic, products summed in fp32 and rounded at the end, in another summation order.

The weight stays in the model's dtype (the user picked bf16 for its memory; a kept fp32 copy
would triple it). Which buckets run it is measured per machine (graphs/gemv_policy.py): it is
timed where oneDNN cannot run the dtype, in the place of its packed GEMM.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F

DTYPES = (torch.bfloat16, torch.float16)
# fp32 scratch elements per block of output features (8 MiB): a block's widened weight stays in
# L3 for the GEMM that reads it. Weights up to this size (every linear of bench-small and of the
# Qwen2.5-0.5B shape's layers) are one block; an LM head takes several.
SCRATCH_ELEMENTS = 2 * 2**20

# One scratch per thread that runs a step: the graphs read it the way they read packed weights
# (kernels/onednn_linear.py's PACKED_WEIGHTS), as state of the op, not an input.
_scratch = threading.local()


def widened_linear_available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether the op runs a `dtype` linear on `device`."""
    return torch.device(device).type == "cpu" and dtype in DTYPES


@functools.cache  # the CPU's report does not change; dense_linear asks on every call
def native_half_gemm(dtype: torch.dtype) -> bool:
    """Whether torch's CPU GEMM has a native path for `dtype` here: oneDNN's support report for
    bf16 / fp16 (AVX-512 BF16 / AMX, AVX-512 FP16); every other dtype counts as native."""
    if dtype not in DTYPES:
        return True
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def widened_dtypes_code() -> int:
    """The half-precision dtypes whose GEMMs are widened where no policy times them (bit 0: bf16,
    bit 1: fp16), for kernels/cpu_ops.cpp's `ce_cpu_ops_configure`."""
    return (0 if native_half_gemm(torch.bfloat16) else 1) | (0 if native_half_gemm(torch.float16) else 2)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, or the widened GEMM where torch's GEMM has no native path for the dtype: for the
    quantized ops' many-rows path, which dequantizes a weight and runs no policy (kernels/cpu_ops.cpp
    does the same, bit for bit)."""
    if x.dtype == weight.dtype and x.dtype in DTYPES and not native_half_gemm(x.dtype):
        return widened_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _scratch_of(elements: int) -> torch.Tensor:
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < elements:
        buffer = torch.empty(elements, dtype=torch.float32)
        _scratch.buffer = buffer
    return buffer[:elements]


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError(f"widened_linear runs on CPU tensors, got {x.device} and {weight.device}")
    if weight.dtype not in DTYPES or x.dtype != weight.dtype:
        raise ValueError(
            "widened_linear takes bfloat16 or float16 x and weight of one dtype, "
            f"got {x.dtype} and {weight.dtype}"
        )
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"widened_linear: x {tuple(x.shape)} does not match a [out, in] weight {tuple(weight.shape)}"
        )
    if bias is not None and (bias.dtype != x.dtype or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(
            f"widened_linear: bias {bias.dtype} {tuple(bias.shape)}, expected {x.dtype} ({weight.shape[0]},)"
        )


def _widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    _check(x, weight, bias)
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features).float()
    bias32 = bias.float() if bias is not None else None
    block = max(1, SCRATCH_ELEMENTS // max(1, in_features))
    if block >= out_features:
        widened = _scratch_of(out_features * in_features).view(out_features, in_features)
        widened.copy_(weight)
        out = F.linear(rows, widened, bias32).to(x.dtype)
    else:
        out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
        scratch = _scratch_of(block * in_features)
        for start in range(0, out_features, block):
            end = min(out_features, start + block)
            widened = scratch[: (end - start) * in_features].view(end - start, in_features)
            widened.copy_(weight[start:end])
            part_bias = bias32[start:end] if bias32 is not None else None
            out[:, start:end] = F.linear(rows, widened, part_bias)
    return out.view(*x.shape[:-1], out_features)


def _widened_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# The low-level registration, as onednn_linear's: a few Python calls a linear, not custom_op's wrapper.
_LIBRARY = torch.library.Library("compiled_engine", "FRAGMENT")
_LIBRARY.define("widened_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.impl("widened_linear", _widened_linear, "CompositeExplicitAutograd")
torch.library.register_fake("compiled_engine::widened_linear", _widened_linear_fake, lib=_LIBRARY)

# `F.linear(x, weight, bias)` for bf16 / fp16 x and weight, in fp32 maths, rounded once.
widened_linear = torch.ops.compiled_engine.widened_linear.default
