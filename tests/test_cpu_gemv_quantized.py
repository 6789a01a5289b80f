"""The C++ GEMV's int8/int4 variants (kernels/cpu_gemv_quantized.py) against `F.linear` over the
dequantized weight, on every path this CPU can run (the portable one forced too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_engine.kernels.cpu_gemv import ISA_AVX2, ISA_AVX512, ISA_PORTABLE, best_isa
from compiled_engine.kernels.cpu_gemv_quantized import (
    PACKED_QUANTIZED_WEIGHTS,
    cpu_gemv_int4,
    cpu_gemv_int4_linear,
    cpu_gemv_int8,
    cpu_gemv_int8_linear,
    cpu_gemv_quantized_available,
)
from compiled_engine.kernels.quantized_linear import int4_weight_linear, int8_weight_linear
from compiled_engine.kernels.weight_quantization import dequantize, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not cpu_gemv_quantized_available(torch.float32), reason="no C++ compiler")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ISAS = [isa for isa in (ISA_PORTABLE, ISA_AVX2, ISA_AVX512) if isa <= best_isa()]
# (rows, in_features, out_features): out_features past one 64-feature block and not a multiple
# of it, rows past the kernel's 4 per pass. Odd in_features take the float loops; even ones, with
# bf16 / fp16 x, the integer ones (x in int16 per 256 inputs: 600 ends in a part chunk).
INT8_SHAPES = [
    (1, 33, 70), (2, 129, 200), (3, 7, 5), (5, 515, 131), (1, 600, 70), (2, 512, 131), (7, 66, 200)
]  # fmt: skip
# (3, 896, 200, 128): the integer loops at a group of 128; (1, 8192, 70, 8192): a group past
# kMaxX16Group (4096), where int32 sums of int16 x could overflow, so the float loops run it.
INT4_SHAPES = [
    (1, 64, 70, 32), (2, 256, 131, 64), (5, 128, 5, 32), (4, 256, 64, 256), (3, 896, 200, 128),
    (1, 8192, 70, 8192),
]  # fmt: skip


def _check(got: torch.Tensor, x: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == x.dtype and got.shape == expected.shape
    scale = expected.abs().max().clamp_min(1.0)
    tolerance = 1e-5 if x.dtype == torch.float32 else 1e-2
    assert ((got.float() - expected).abs().max() / scale).item() < tolerance


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows, in_features, out_features", INT8_SHAPES)
def test_int8_matches_the_dequantized_linear(dtype, isa, rows, in_features, out_features) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    q = quantize_int8(torch.randn(out_features, in_features, generator=generator).to(dtype))
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    b = torch.randn(out_features, generator=generator).to(dtype)
    w = dequantize(q)
    _check(cpu_gemv_int8_linear(x, q.qweight, q.scales, b, isa=isa), x, F.linear(x.float(), w, b.float()))
    _check(cpu_gemv_int8_linear(x, q.qweight, q.scales, None, isa=isa), x, F.linear(x.float(), w))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows, in_features, out_features, group_size", INT4_SHAPES)
def test_int4_matches_the_dequantized_linear(dtype, isa, rows, in_features, out_features, group_size) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=generator) + 0.5
    q = quantize_int4(w.to(dtype), group_size)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    b = torch.randn(out_features, generator=generator).to(dtype)
    expected = F.linear(x.float(), dequantize(q), b.float())
    _check(cpu_gemv_int4_linear(x, q.qweight, q.scales, q.zeros, group_size, b, isa=isa), x, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_ops_agree_with_torchs_kernels(dtype) -> None:
    # Same operands, same maths: what lets graphs/passes/cpu_gemv_quantized.py swap one for the other.
    x = torch.randn(1, 3, 128).to(dtype)
    q8 = quantize_int8(torch.randn(96, 128).to(dtype))
    q4 = quantize_int4(torch.randn(96, 128).to(dtype), 32)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        cpu_gemv_int8(x, q8.qweight, q8.scales, None).float(),
        int8_weight_linear(x, q8.qweight, q8.scales, None).float(),
        rtol=tolerance,
        atol=tolerance,
    )
    torch.testing.assert_close(
        cpu_gemv_int4(x, q4.qweight, q4.scales, q4.zeros, 32, None).float(),
        int4_weight_linear(x, q4.qweight, q4.scales, q4.zeros, 32, None).float(),
        rtol=tolerance,
        atol=tolerance,
    )


def test_batched_and_empty_inputs_and_repacking() -> None:
    q = quantize_int8(torch.randn(70, 33))
    batched = torch.randn(1, 3, 33)
    got = cpu_gemv_int8(batched, q.qweight, q.scales, None)
    assert got.shape == (1, 3, 70)
    _check(got[0], batched[0], F.linear(batched[0], dequantize(q)))
    assert cpu_gemv_int8(torch.randn(1, 0, 33), q.qweight, q.scales, None).shape == (1, 0, 70)
    packed_before = len(PACKED_QUANTIZED_WEIGHTS)
    with torch.no_grad():
        q.scales.mul_(0.5)  # changed in place: repacked on the next call
    again = cpu_gemv_int8(batched, q.qweight, q.scales, None)
    _check(again[0], batched[0], F.linear(batched[0], dequantize(q)))
    assert len(PACKED_QUANTIZED_WEIGHTS) == packed_before


def test_bad_arguments_are_refused() -> None:
    q = quantize_int8(torch.randn(8, 16))
    with pytest.raises(ValueError, match="x has 15 features, the weight takes 16"):
        cpu_gemv_int8_linear(torch.randn(1, 15), q.qweight, q.scales)
    with pytest.raises(ValueError, match="activations"):
        cpu_gemv_int8_linear(torch.randn(1, 16, dtype=torch.float64), q.qweight, q.scales)


@pytest.mark.parametrize("many_rows", [False, True], ids=["gemv", "many-rows"])
def test_bf16_scales_stream_packed_halves_with_the_same_result(many_rows) -> None:
    # bf16 scales and zeros are packed a second time as one 32-bit word per group and output (the
    # AVX-512 paths read those: half the bytes of the float32 scales and offsets); float32 scales
    # of the same values have no such copy. Same maths, so the outputs agree bit for bit.
    from compiled_engine.kernels.cpu_gemv_quantized import (
        cpu_gemm_int4_linear,
        gemm_int4_reference,
    )

    generator = torch.Generator().manual_seed(5)
    q = quantize_int4((torch.randn(131, 256, generator=generator) + 0.5).to(torch.bfloat16), 32)
    x = torch.randn(20 if many_rows else 3, 256, generator=generator).to(torch.bfloat16)
    linear = cpu_gemm_int4_linear if many_rows else cpu_gemv_int4_linear
    got = linear(x, q.qweight, q.scales, q.zeros, 32)
    assert len(PACKED_QUANTIZED_WEIGHTS.get(q.qweight, q.scales, q.zeros, 32).tensors) == 4
    scales, zeros = q.scales.float(), q.zeros.float()
    assert len(PACKED_QUANTIZED_WEIGHTS.get(q.qweight.clone(), scales, zeros, 32).tensors) == 3
    assert torch.equal(linear(x, q.qweight.clone(), scales, zeros, 32), got)
    # many rows: on AVX2 x rounded to int8 (gemm_int4_reference says what the call computes)
    _check(got, x, gemm_int4_reference(x, q) if many_rows else F.linear(x.float(), dequantize(q)))
