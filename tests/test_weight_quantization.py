"""Weight-only quantization (kernels/weight_quantization.py) and torch's kernels behind our ops
(kernels/quantized_linear.py), against `F.linear` over the dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_engine.kernels.quantized_linear import (
    TORCH_INT4_WEIGHTS,
    int4_weight_linear,
    int8_weight_linear,
)
from compiled_engine.kernels.weight_quantization import (
    QuantizedWeight,
    check_quantization_runs,
    dequantize,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from compiled_engine.records.weight_quantization import WeightQuantization

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = expected.abs().max().clamp_min(1.0)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((got.float() - expected).abs().max() / scale).item() < tolerance


def test_int8_round_trip_is_within_half_a_step_per_channel() -> None:
    w = torch.randn(37, 51) * torch.linspace(0.1, 3, 37)[:, None]  # rows of different ranges
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (37, 51) and q.scales.shape == (37,)
    assert q.qweight.abs().amax(dim=1).eq(127).all()  # each row's largest magnitude uses the full range
    error = (dequantize(q) - w).abs()
    assert (error <= q.scales[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_round_trip_is_within_half_a_step_per_group(symmetric) -> None:
    w = torch.randn(20, 96) + torch.linspace(-2, 2, 96)  # groups with offsets: asymmetric helps
    q = quantize_int4(w, 32, symmetric=symmetric)
    assert q.qweight.dtype == torch.uint8 and q.qweight.shape == (20, 48)
    assert q.scales.shape == q.zeros.shape == (20, 3)
    values = unpack_int4(q.qweight)
    assert values.max() <= 15 and values.shape == (20, 96)
    if symmetric:
        assert q.zeros.eq(0).all()
    error = (dequantize(q) - w).abs()
    step = q.scales.repeat_interleave(32, dim=1)
    assert (error <= step / 2 + 1e-5).all()


def test_int4_nibble_order_is_even_k_low() -> None:
    q = quantize_int4(torch.arange(64.0).reshape(1, 64), 32)
    values = unpack_int4(q.qweight)[0]
    assert values[0] == (q.qweight[0, 0] & 0x0F) and values[1] == (q.qweight[0, 0] >> 4)
    assert values[:32].tolist() == sorted(values[:32].tolist())  # an increasing row stays increasing


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_op_matches_the_dequantized_linear(dtype, rows) -> None:
    generator = torch.Generator().manual_seed(rows)
    w = torch.randn(37, 51, generator=generator).to(dtype)  # odd sizes
    x = torch.randn(1, rows, 51, generator=generator).to(dtype)
    b = torch.randn(37, generator=generator).to(dtype)
    q = quantize_int8(w)
    expected = F.linear(x.float(), dequantize(q), b.float())
    got = int8_weight_linear(x, q.qweight, q.scales, b)
    assert got.shape == (1, rows, 37) and got.dtype == dtype
    _close(got, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, out_features, group_size", [(1, 37, 32), (6, 48, 64), (3, 130, 32)])
def test_int4_op_matches_the_dequantized_linear(dtype, rows, out_features, group_size) -> None:
    # out_features not a multiple of 16: torch's layout is padded, the extra outputs dropped.
    generator = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, 128, generator=generator).to(dtype)
    x = torch.randn(rows, 128, generator=generator).to(dtype)
    q = quantize_int4(w, group_size)
    expected = F.linear(x.float(), dequantize(q))
    got = int4_weight_linear(x, q.qweight, q.scales, q.zeros, group_size, None)
    assert got.shape == (rows, out_features)
    _close(got, expected, dtype)


def test_int4_op_repacks_a_weight_changed_in_place() -> None:
    w = torch.randn(32, 64)
    q = quantize_int4(w, 32)
    x = torch.randn(2, 64)
    first = int4_weight_linear(x, q.qweight, q.scales, q.zeros, 32, None)
    with torch.no_grad():
        q.scales.mul_(2)  # version counter moves: the cached torch layout must follow
    second = int4_weight_linear(x, q.qweight, q.scales, q.zeros, 32, None)
    expected = F.linear(x, dequantize(QuantizedWeight(q.qweight, q.scales, q.zeros, 32)))
    _close(second, expected, torch.float32)
    assert not torch.allclose(first, second)
    assert len(TORCH_INT4_WEIGHTS) >= 1


def test_the_schemes_refuse_what_they_cannot_run() -> None:
    int8 = WeightQuantization("int8")
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization_runs(int8, torch.bfloat16, torch.device("cuda"))
    with pytest.raises(ValueError, match="cannot run a torch.float64 model"):
        check_quantization_runs(int8, torch.float64, torch.device("cpu"))
    check_quantization_runs(int8, torch.bfloat16, torch.device("cpu"))


def test_the_record_refuses_bad_schemes_and_group_sizes() -> None:
    with pytest.raises(ValueError, match="unknown weight quantization scheme 'int3'"):
        WeightQuantization("int3")
    with pytest.raises(ValueError, match="int4 group size must be one of 32, 64, 128, 256"):
        WeightQuantization("int4", 48)
    with pytest.raises(ValueError, match="takes no group size"):
        WeightQuantization("int8", 32)
    assert WeightQuantization("int4", 64).label == "int4-g64"
    assert WeightQuantization("int4", 32, symmetric=True).label == "int4-g32-sym"
