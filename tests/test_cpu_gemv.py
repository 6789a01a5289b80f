"""The C++ GEMV (kernels/cpu_gemv.py) against `F.linear`, on every path this CPU can run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_engine.kernels import cpu_gemv as gemv
from compiled_engine.kernels.cpu_gemv import (
    ISA_AMX_TILES,
    ISA_AVX2,
    ISA_AVX512,
    ISA_AVX512_BF16,
    ISA_PORTABLE,
    PACKED_GEMV_WEIGHTS,
    cpu_gemv,
    cpu_gemv_available,
    cpu_gemv_linear,
    gemv_isa,
    isa_for_flags,
    pack_gemv_weight,
)

pytestmark = pytest.mark.skipif(not cpu_gemv_available(torch.float32), reason="no C++ compiler")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Every path this CPU runs; forcing the lower ones is how a CPU without them is covered.
ISAS = [
    isa for isa in (ISA_PORTABLE, ISA_AVX2, ISA_AVX512, ISA_AVX512_BF16, ISA_AMX_TILES) if isa <= gemv_isa()
]
# (rows, in_features, out_features): odd sizes, none a multiple of 16 or 32, past one 64-feature
# block and past the kernel's 4 rows per pass; from 8 rows the AVX2 path's register tiles of 6
# rows, with 2, 1 and 4 rows left over and odd or tiny K.
SHAPES = [(1, 33, 70), (2, 129, 200), (3, 7, 5), (5, 515, 131), (6, 64, 64)]
SHAPES += [(8, 33, 70), (13, 129, 131), (20, 7, 200), (64, 515, 65)]


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    # The reference in float32 from the same (rounded) inputs; the kernel also sums in float32,
    # then rounds once to the output dtype.
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == x.dtype and got.shape == expected.shape
    scale = expected.abs().max().clamp_min(1.0)
    assert ((got.float() - expected).abs().max() / scale).item() < _tolerance(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows, in_features, out_features", SHAPES)
def test_matches_f_linear(dtype, isa, rows, in_features, out_features) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    w = torch.randn(out_features, in_features, generator=generator).to(dtype)
    b = torch.randn(out_features, generator=generator).to(dtype)
    _check(cpu_gemv_linear(x, w, b, isa=isa), x, w, b)
    _check(cpu_gemv_linear(x, w, None, isa=isa), x, w, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("isa", ISAS)
def test_strided_and_batched_inputs(dtype, isa) -> None:
    w = torch.randn(77, 45).to(dtype)
    wide = torch.randn(3, 100).to(dtype)
    _check(cpu_gemv_linear(wide[:, 5:50], w, isa=isa), wide[:, 5:50], w, None)  # row stride 100
    every_other = torch.randn(2, 90).to(dtype)[:, ::2]  # column stride 2: copied first
    _check(cpu_gemv_linear(every_other, w, isa=isa), every_other, w, None)
    batched = torch.randn(1, 3, 45).to(dtype)  # [batch, tokens, features], as the graphs call it
    got = cpu_gemv_linear(batched, w, isa=isa)
    assert got.shape == (1, 3, 77)
    _check(got[0], batched[0], w, None)
    empty = torch.randn(1, 0, 45).to(dtype)  # no rows at all
    assert cpu_gemv(empty, w, None).shape == (1, 0, 77)
    transposed = torch.randn(45, 4).to(dtype).t()  # rows of stride 1: copied first
    _check(cpu_gemv_linear(transposed, w, isa=isa), transposed, w, None)


def test_the_bf16_paths_agree_with_each_other() -> None:
    x = torch.randn(2, 301).to(torch.bfloat16)
    w = torch.randn(99, 301).to(torch.bfloat16)
    results = [cpu_gemv_linear(x, w, isa=isa).float() for isa in ISAS]
    for result in results[1:]:
        torch.testing.assert_close(result, results[0], rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(gemv_isa() < ISA_AMX_TILES, reason="no AMX tiles here")
@pytest.mark.parametrize("in_features", [64, 96, 256])
def test_the_amx_tile_path_from_4_rows(in_features) -> None:
    """bf16 from 4 rows with inputs in whole steps of 32 runs on tiles (fewer rows and other widths
    keep the dot path): one A tile up to 16 rows, then 32 rows at a time with a last 16 or fewer
    (17, 31 to 33, 47, 48, 64 and 70 rows take each mix), against F.linear and the dot path."""
    generator = torch.Generator().manual_seed(in_features)
    w = torch.randn(200, in_features, generator=generator).to(torch.bfloat16)  # a partial last block
    b = torch.randn(200, generator=generator).to(torch.bfloat16)
    for rows in [*range(1, 18), 31, 32, 33, 47, 48, 64, 70]:
        x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
        tiles = cpu_gemv_linear(x, w, b, isa=ISA_AMX_TILES)
        _check(tiles, x, w, b)
        dot = cpu_gemv_linear(x, w, b, isa=ISA_AVX512_BF16)
        torch.testing.assert_close(tiles.float(), dot.float(), rtol=1e-2, atol=2e-2)


def test_isa_follows_the_cpu_flags() -> None:
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "f16c", "fma"}
    assert isa_for_flags(frozenset(avx512 | {"avx512_bf16"})) == ISA_AVX512_BF16
    assert isa_for_flags(frozenset(avx512)) == ISA_AVX512  # no AVX-512 BF16: the widening path
    assert isa_for_flags(frozenset({"avx2", "fma", "f16c"})) == ISA_AVX2  # no AVX-512: the AVX2 path
    assert isa_for_flags(frozenset({"avx2", "fma"})) == ISA_PORTABLE  # no F16C
    assert isa_for_flags(frozenset()) == ISA_PORTABLE


def test_packed_layout() -> None:
    w = torch.arange(3 * 5, dtype=torch.float32).view(3, 5)
    packed = pack_gemv_weight(w)
    assert packed.shape == (1, 6, 64)  # [block, k (rounded up to even), feature]
    assert torch.equal(packed[0, :5, :3], w.t()) and not packed[0, :, 3:].any() and not packed[0, 5].any()
    bf16 = pack_gemv_weight(w.to(torch.bfloat16))
    assert bf16.shape == (1, 3, 64, 2)  # [block, k / 2, feature, pair], the odd k padded with zero
    assert torch.equal(bf16[0, 1, 2], w[2, 2:4].to(torch.bfloat16)) and bf16[0, 2, :, 1].eq(0).all()


def test_a_weight_changed_in_place_is_packed_again() -> None:
    # The Python implementation's copies (tests/test_cpu_ops.py covers the C++ one's).
    w = torch.randn(40, 24)
    x = torch.randn(1, 24)
    _check(gemv._cpu_gemv(x, w, None), x, w, None)
    assert PACKED_GEMV_WEIGHTS.get(w).version == w._version
    with torch.no_grad():
        w.mul_(-2.0)
    _check(gemv._cpu_gemv(x, w, None), x, w, None)
    assert PACKED_GEMV_WEIGHTS.get(w).version == w._version


def test_the_op_traces_and_compiles() -> None:
    w = torch.randn(70, 33).to(torch.bfloat16)
    b = torch.randn(70).to(torch.bfloat16)
    x = torch.randn(1, 2, 33).to(torch.bfloat16)
    torch.library.opcheck(cpu_gemv, (x, w, b), test_utils=("test_schema", "test_faketensor"))

    def step(hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.compiled_engine.cpu_gemv(F.rms_norm(hidden, (33,)), w, b) * 2

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), step(x))


@pytest.mark.parametrize(
    ("x", "w", "b", "message"),
    [
        (torch.randn(1, 8), torch.randn(4, 8).to(torch.bfloat16), None, "one dtype"),
        (torch.randn(1, 8), torch.randn(4, 8), torch.randn(4).to(torch.float16), "one dtype"),
        (torch.randn(1, 9), torch.randn(4, 8), None, "9 features"),
        (torch.randn(1, 8), torch.randn(2, 4, 8), None, "2-D"),
        (torch.randn(1, 8).to(torch.float64), torch.randn(4, 8).to(torch.float64), None, "float32, bfloat16"),
    ],
)
def test_bad_inputs_are_refused(x, w, b, message) -> None:
    with pytest.raises(ValueError, match=message):
        cpu_gemv_linear(x, w, b)


def test_a_path_the_cpu_lacks_is_refused() -> None:
    if gemv_isa() == ISA_AMX_TILES:
        pytest.skip("this CPU runs every path")
    with pytest.raises(ValueError, match="cannot run"):
        cpu_gemv_linear(torch.randn(1, 8), torch.randn(4, 8), isa=gemv_isa() + 1)
    assert gemv.ISA_NAMES[gemv_isa()]


def test_a_packed_copy_lives_as_long_as_its_weight() -> None:
    import gc

    copies = gemv.PackedGemvWeights()
    w = torch.randn(8, 8)
    first = copies.get(w)
    assert copies.get(w) is first and len(copies) == 1  # the same tensor: the same copy
    del w
    gc.collect()
    assert len(copies) == 0
