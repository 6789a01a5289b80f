"""The CPU kernels' AVX2 paths, each forced, against the float32 reference: the float GEMV
(kernels/cpu_gemv.py: float32, bf16 widened by shifts, fp16 through F16C), the int8/int4 GEMV (its
float loops, and for bf16 / fp16 x its vpmaddwd integer ones) and the many-rows ops' AVX2
widen-once path (kernels/cpu_gemv_quantized.py), at 1, 3, 16 and 64
rows (past the kernels' 4 rows per pass and their 64-row slab), odd sizes and strided inputs.

On a CPU with AVX-512 the many-rows ops keep their own paths, so there `cpu_gemm_*` forced to AVX2
runs the AVX2 GEMV; the widen-once path itself is checked where it is this CPU's (AVX2-only)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_engine.kernels.cpu_gemv import ISA_AVX2, best_isa, cpu_gemv_available, cpu_gemv_linear
from compiled_engine.kernels.cpu_gemv_quantized import (
    cpu_gemm_int4_linear,
    cpu_gemm_int8_linear,
    cpu_gemv_int4_linear,
    cpu_gemv_int8_linear,
    gemm_int4_reference,
    gemm_int4_rounds_x_to_int8,
    int8_x_reference,
    many_rows_path_available,
)
from compiled_engine.kernels.weight_quantization import dequantize, quantize_int4, quantize_int8

pytestmark = [
    pytest.mark.skipif(not cpu_gemv_available(torch.float32), reason="no C++ compiler"),
    pytest.mark.skipif(best_isa() < ISA_AVX2, reason="this CPU lacks AVX2 + FMA + F16C"),
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROWS = (1, 3, 16, 64)


def _strided(rows: int, in_features: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Rows that are a column slice of a wider tensor: row stride in_features + 11, not in_features."""
    wide = torch.randn(rows, in_features + 11, generator=generator).to(dtype)
    return wide[:, 5 : 5 + in_features]


def _check(got: torch.Tensor, x: torch.Tensor, expected: torch.Tensor) -> None:
    # The reference sums in float32 from the same rounded inputs, as the kernels do; they round
    # once to the output dtype.
    assert got.dtype == x.dtype and got.shape == expected.shape
    scale = expected.abs().max().clamp_min(1.0)
    tolerance = 1e-5 if x.dtype == torch.float32 else 1e-2
    assert ((got.float() - expected).abs().max() / scale).item() < tolerance


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_float_gemv(dtype, rows) -> None:
    generator = torch.Generator().manual_seed(rows)
    in_features, out_features = 131, 197  # odd k (bf16 pads a zero pair), 4 blocks, the last partial
    w = torch.randn(out_features, in_features, generator=generator).to(dtype)
    b = torch.randn(out_features, generator=generator).to(dtype)
    x = _strided(rows, in_features, dtype, generator)
    expected = F.linear(x.float(), w.float(), b.float())
    _check(cpu_gemv_linear(x, w, b, isa=ISA_AVX2), x, expected)
    _check(cpu_gemv_linear(x.contiguous(), w, None, isa=ISA_AVX2), x, expected - b.float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("many_rows", [False, True], ids=["gemv", "gemm"])
@pytest.mark.parametrize("in_features", [133, 600])
def test_int8(dtype, rows, many_rows, in_features) -> None:
    # 133: k past 4 of the dequantize-once path's chunks, odd (the GEMV's float loop); 600: even,
    # so the GEMV takes its integer loop for bf16 / fp16 x, over two 256-input chunks and a part.
    generator = torch.Generator().manual_seed(100 + rows)
    out_features = 131
    q = quantize_int8(torch.randn(out_features, in_features, generator=generator).to(dtype))
    b = torch.randn(out_features, generator=generator).to(dtype)
    x = _strided(rows, in_features, dtype, generator)
    linear = cpu_gemm_int8_linear if many_rows else cpu_gemv_int8_linear
    _check(linear(x, q.qweight, q.scales, b, isa=ISA_AVX2), x, F.linear(x.float(), dequantize(q), b.float()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("many_rows", [False, True], ids=["gemv", "gemm"])
def test_int4(dtype, rows, many_rows) -> None:
    generator = torch.Generator().manual_seed(200 + rows)
    in_features, out_features, group_size = 160, 133, 32  # 5 groups, chunks that end mid-group
    w = torch.randn(out_features, in_features, generator=generator) + 0.5
    q = quantize_int4(w.to(dtype), group_size)
    b = torch.randn(out_features, generator=generator).to(dtype)
    x = _strided(rows, in_features, dtype, generator)
    linear = cpu_gemm_int4_linear if many_rows else cpu_gemv_int4_linear
    got = linear(x, q.qweight, q.scales, q.zeros, group_size, b, isa=ISA_AVX2)
    # many rows: bf16 / fp16 x rounded to int8 per 32 inputs (int8_x_reference), in the reference too
    rounded = many_rows and gemm_int4_rounds_x_to_int8(x, group_size, ISA_AVX2)
    assert rounded == (many_rows and rows >= 8 and dtype != torch.float32)
    expected = gemm_int4_reference(x, q, ISA_AVX2) if many_rows else F.linear(x.float(), dequantize(q))
    _check(got, x, expected + b.float())


@pytest.mark.skipif(
    not many_rows_path_available(), reason="the dequantize-once path runs where AVX2 is the best ISA"
)
def test_the_many_rows_ops_default_to_the_dequantize_once_path_past_one_slab() -> None:
    # 70 rows: a 64-row slab and a 6-row one; the default path (no isa) is the AVX2 one here.
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(70, 96, generator=generator).to(torch.bfloat16)
    q8 = quantize_int8(torch.randn(65, 96, generator=generator).to(torch.bfloat16))
    q4 = quantize_int4(torch.randn(65, 96, generator=generator).to(torch.bfloat16), 32)
    _check(cpu_gemm_int8_linear(x, q8.qweight, q8.scales), x, F.linear(x.float(), dequantize(q8)))
    got4 = cpu_gemm_int4_linear(x, q4.qweight, q4.scales, q4.zeros, 32)
    assert gemm_int4_rounds_x_to_int8(x, 32)  # bf16 x in int8 per 32 inputs
    _check(got4, x, int8_x_reference(x, q4))
