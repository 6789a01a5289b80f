"""The quantized kernel's many-rows ops (`cpu_gemm_int8` / `cpu_gemm_int4`, kernels/cpu_gemv_quantized.py)
against `F.linear` over the dequantized weight in float32: the AMX tile path and the AVX-512
widen-once path where this CPU has them, and the GEMV paths they fall back to (forced), at 1 to 100
rows, odd sizes and strided inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_engine.graphs.passes.cpu_gemv_quantized import CpuGemmQuantized
from compiled_engine.kernels.cpu_gemv import (
    ISA_AVX2,
    ISA_AVX512,
    ISA_AVX512_BF16,
    ISA_PORTABLE,
    best_isa,
)
from compiled_engine.kernels.cpu_gemv_quantized import (
    ISA_AMX,
    avx512_many_rows_available,
    cpu_gemm_int4,
    cpu_gemm_int4_linear,
    cpu_gemm_int8,
    cpu_gemm_int8_linear,
    cpu_gemm_quantized_available,
    cpu_gemv_quantized_available,
    gemm_int4_reference,
    gemm_int4_rounds_x_to_int8,
    int8_x_reference,
    many_rows_path_available,
    tiles_available,
)
from compiled_engine.kernels.quantized_linear import int4_weight_linear, int8_weight_linear
from compiled_engine.kernels.weight_quantization import dequantize, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not cpu_gemv_quantized_available(torch.float32), reason="no C++ compiler")

# The tile path and the AVX-512 widen-once path (ISA_AVX512_BF16) where they run, and the GEMV
# paths the ops take without them (ISA_AVX2: from 8 rows the widen-once path on a CPU whose best
# path is AVX2 (integer for bf16 x and even in_features, else dequantized to float), the AVX2
# GEMV below 8 rows or elsewhere; ISA_AVX512: the AVX-512 GEMV's loops).
ISAS = [isa for isa in (ISA_PORTABLE, ISA_AVX2, ISA_AVX512) if isa <= best_isa()]
ISAS += [ISA_AVX512_BF16] if avx512_many_rows_available() else []
ISAS += [ISA_AMX] if tiles_available() else []
# 7, 11, 16, 20 and 70: a pass of fewer rows after full ones (1, 5, 4, 2 and 4 after the AVX2
# path's 6-row register tiles); 70 and 100: past its 64-row slab; 300: past the AVX-512 path's
# 256-row panel.
ROWS = (1, 3, 7, 11, 16, 20, 64, 70, 100, 300)
# (in_features, out_features): in_features not a multiple of the tiles' 32 (int8), out_features
# past one 64-output block and not a multiple of it; even in_features take the integer loops on
# AVX2 (600: two 256-input x16 chunks and a part one, each in 64-input widened chunks).
INT8_SHAPES = [(70, 130), (96, 64), (515, 200), (600, 131)]
INT4_SHAPES = [(64, 70, 32), (256, 131, 64), (96, 5, 32), (512, 67, 256)]


def _check(got: torch.Tensor, x: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == x.dtype and got.shape == expected.shape
    scale = expected.abs().max().clamp_min(1.0)
    # bf16 outputs (and int4 weights rounded to bf16 on the tile path): within bf16's rounding
    tolerance = 1e-5 if x.dtype == torch.float32 else 1e-2
    assert ((got.float() - expected).abs().max() / scale).item() < tolerance


def _strided(rows: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """bf16 rows that are a column slice of a wider tensor (row stride != in_features)."""
    wide = torch.randn(rows, in_features + 9, generator=generator).to(torch.bfloat16)
    return wide[:, 3 : 3 + in_features]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("in_features, out_features", INT8_SHAPES)
def test_int8_matches_the_dequantized_linear(isa, rows, in_features, out_features) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    q = quantize_int8(torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16))
    x = _strided(rows, in_features, generator)
    b = torch.randn(out_features, generator=generator).to(torch.bfloat16)
    w = dequantize(q)
    _check(cpu_gemm_int8_linear(x, q.qweight, q.scales, b, isa=isa), x, F.linear(x.float(), w, b.float()))
    _check(cpu_gemm_int8_linear(x, q.qweight, q.scales, None, isa=isa), x, F.linear(x.float(), w))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("in_features, out_features, group_size", INT4_SHAPES)
def test_int4_matches_the_dequantized_linear(isa, rows, in_features, out_features, group_size) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=generator) + 0.5
    q = quantize_int4(w.to(torch.bfloat16), group_size)
    x = _strided(rows, in_features, generator)
    b = torch.randn(out_features, generator=generator).to(torch.bfloat16)
    # AVX2 from 8 rows: x rounded to int8 per 32 inputs; the reference rounds it the same way
    expected = gemm_int4_reference(x, q, isa) + b.float()
    _check(cpu_gemm_int4_linear(x, q.qweight, q.scales, q.zeros, group_size, b, isa=isa), x, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_other_activation_dtypes_take_the_gemv(dtype) -> None:
    # The tiles take bf16 only; the op still gives the linear for the others (on the GEMV's loops,
    # or on an AVX2-only CPU the dequantize-once path, which takes every activation dtype).
    x = torch.randn(20, 64).to(dtype)
    q = quantize_int8(torch.randn(70, 64).to(dtype))
    _check(cpu_gemm_int8_linear(x, q.qweight, q.scales), x, F.linear(x.float(), dequantize(q)))
    assert cpu_gemm_quantized_available(dtype) == many_rows_path_available()


def test_the_ops_agree_with_torchs_kernels_and_the_pass_swaps_them() -> None:
    x = torch.randn(2, 24, 128).to(torch.bfloat16)
    q8 = quantize_int8(torch.randn(96, 128).to(torch.bfloat16))
    q4 = quantize_int4(torch.randn(96, 128).to(torch.bfloat16), 32)
    # Both round their bf16 outputs: one bf16 step of the largest output apart at most.
    expected8 = int8_weight_linear(x, q8.qweight, q8.scales, None).float()
    _check(cpu_gemm_int8(x, q8.qweight, q8.scales, None), x, expected8)
    rounded = gemm_int4_rounds_x_to_int8(x, 32)  # AVX2: x in int8 (int8_x_reference), not torch's
    expected4 = (
        int8_x_reference(x, q4)
        if rounded
        else int4_weight_linear(x, q4.qweight, q4.scales, q4.zeros, 32, None).float()
    )
    _check(cpu_gemm_int4(x, q4.qweight, q4.scales, q4.zeros, 32, None), x, expected4)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q8, self.s8 = q8.qweight, q8.scales
            self.q4, self.s4, self.z4 = q4.qweight, q4.scales, q4.zeros

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = int8_weight_linear(x, self.q8, self.s8, None)
            return y + int4_weight_linear(x, self.q4, self.s4, self.z4, 32, None)

    gm = torch.fx.symbolic_trace(Model())
    expected = gm(x).float() if not rounded else expected8 + expected4
    result = CpuGemmQuantized()(gm)
    assert result.nodes_rewritten == 2
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert cpu_gemm_int8 in targets and cpu_gemm_int4 in targets
    _check(gm(x), x, expected.float())


def test_bad_arguments_are_refused() -> None:
    q = quantize_int8(torch.randn(70, 64))
    with pytest.raises(ValueError, match="features"):
        cpu_gemm_int8_linear(torch.randn(4, 65).to(torch.bfloat16), q.qweight, q.scales)
    if tiles_available():
        with pytest.raises(ValueError, match="bfloat16"):
            cpu_gemm_int8_linear(torch.randn(4, 64), q.qweight, q.scales, isa=ISA_AMX)
    else:
        with pytest.raises(ValueError, match="AMX"):
            cpu_gemm_int8_linear(torch.randn(4, 64).to(torch.bfloat16), q.qweight, q.scales, isa=ISA_AMX)


@pytest.mark.skipif(not avx512_many_rows_available(), reason="no AVX-512 BF16 widen-once path here")
def test_bf16_rows_default_to_the_avx512_path_where_there_are_no_tiles() -> None:
    if tiles_available():
        pytest.skip("the AMX tiles are the default here")
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(37, 320, generator=generator).to(torch.bfloat16)
    x[5] = 0  # a zero row: its int16 scale must not divide by zero
    x[9, 17] = 3000.0  # an outlier costs precision in its own 128-feature chunk only
    q8 = quantize_int8(torch.randn(150, 320, generator=generator).to(torch.bfloat16))
    q4 = quantize_int4(torch.randn(150, 320, generator=generator).to(torch.bfloat16), 64)
    forced = cpu_gemm_int8_linear(x, q8.qweight, q8.scales, isa=ISA_AVX512_BF16)
    assert torch.equal(cpu_gemm_int8_linear(x, q8.qweight, q8.scales), forced)
    expected = F.linear(x.float(), dequantize(q8))
    assert forced[5].abs().max().item() == 0
    for row in (0, 9):  # each row within bf16's rounding of its own largest output
        assert ((forced[row].float() - expected[row]).abs().max() / expected[row].abs().max()).item() < 1e-2
    forced4 = cpu_gemm_int4_linear(x, q4.qweight, q4.scales, q4.zeros, 64, isa=ISA_AVX512_BF16)
    assert torch.equal(cpu_gemm_int4_linear(x, q4.qweight, q4.scales, q4.zeros, 64), forced4)
    _check(forced4, x, F.linear(x.float(), dequantize(q4)))


def test_the_avx512_path_refuses_what_it_cannot_run() -> None:
    q = quantize_int8(torch.randn(70, 64))
    if not avx512_many_rows_available():
        x = torch.randn(4, 64).to(torch.bfloat16)
        with pytest.raises(ValueError, match="cannot run"):
            cpu_gemm_int8_linear(x, q.qweight, q.scales, isa=ISA_AVX512_BF16)
        return
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_gemm_int8_linear(torch.randn(4, 64), q.qweight, q.scales, isa=ISA_AVX512_BF16)


def test_without_the_avx512_path_the_ops_fall_back(monkeypatch) -> None:
    # A CPU (or build) without AVX-512 BF16 / VNNI: no many-rows path to time unless there are
    # tiles or AVX2 is the best path, and the ops still give the linear (on the GEMV's loops).
    from compiled_engine.kernels import cpu_gemv_quantized

    monkeypatch.setattr(cpu_gemv_quantized, "avx512_many_rows_available", lambda: False)
    expected_available = tiles_available() or many_rows_path_available()
    assert cpu_gemm_quantized_available(torch.bfloat16) == expected_available
    x = torch.randn(20, 96).to(torch.bfloat16)
    q = quantize_int8(torch.randn(70, 96).to(torch.bfloat16))
    _check(cpu_gemm_int8_linear(x, q.qweight, q.scales), x, F.linear(x.float(), dequantize(q)))
    with pytest.raises(ValueError, match="cannot run"):
        cpu_gemm_int8_linear(x, q.qweight, q.scales, isa=ISA_AVX512_BF16)
