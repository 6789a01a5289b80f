"""The C++ CPU kernel on a quantized KV cache (int8 / fp8 e4m3 rows with per-token, per-head scales):
against the reference op on the same quantized cache (codes written identical, outputs as close as
on a float cache) and against the unquantized reference (within the quantization's error)."""

from __future__ import annotations

import pytest
import torch

import compiled_engine.kernels  # noqa: F401  (registers the ops)
from compiled_engine.kernels import cpu_attention_build, kv_quant
from compiled_engine.kernels.reference import paged_attention_reference
from tests.attention_batches import Batch, make_attention_batch, quantized_cache

if cpu_attention_build.compiler() is None:
    pytest.skip("no C++ compiler on this machine: the cpu backend cannot be built", allow_module_level=True)

QUANTIZED = [pytest.param(torch.int8, id="int8"), pytest.param(torch.float8_e4m3fn, id="fp8")]
QUERY_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# Both sides dequantize the same codes in float32; only summation order differs.
SAME_CODES_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
# Against the unquantized reference (tests/test_kv_quant.py explains the bounds), plus bf16 rounding.
UNQUANTIZED_ATOL = {torch.int8: 0.06, torch.float8_e4m3fn: 0.3}

CASES = {
    # 64 and 128: the kernel's head-dim specialisations; the others its generic loop.
    "decode_gqa_d64_bs16": ([(37, 1), (130, 1), (0, 1), (15, 1)], dict(head_dim=64, block_size=16), {}),
    "prefill_g8_d128_window": (
        [(0, 30), (12, 5)],
        dict(num_q_heads=16, num_kv_heads=2, head_dim=128, block_size=16),
        dict(sliding_window=9),
    ),
    "odd_heads_d20_bs5_softcap_padding": (
        [(10, 7), (3, 1), (0, 0)],
        dict(num_q_heads=9, num_kv_heads=3, head_dim=20, block_size=5, num_pad_rows=1),
        dict(softcap=0.5),
    ),
    "mqa_d7_bs3": ([(8, 2), (0, 3)], dict(num_q_heads=3, num_kv_heads=1, head_dim=7, block_size=3), {}),
    # The int8-key VNNI loop (bf16 queries, head dims 64 and 128) takes keys in pairs and 16 at a
    # time: blocks of odd sizes (a pair's second key past the block), of more than 16 keys, partial
    # last blocks, groups of 1 and 4.
    "gqa4_d64_bs7_odd_blocks": (
        [(40, 1), (6, 3), (13, 1), (0, 1)],
        dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=7),
        {},
    ),
    "mha_d128_bs32_partial": (
        [(45, 1), (31, 2), (64, 1)],
        dict(num_q_heads=2, num_kv_heads=2, head_dim=128, block_size=32),
        {},
    ),
    # Blocks of 128 keys: a span's int32 sums would not stay exact, so int8 values take the float
    # loop (the integer value loops serve blocks of up to 127).
    "gqa2_d64_bs128_float_values": (
        [(300, 1), (130, 2)],
        dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=128),
        {},
    ),
}


def run_both(batch: Batch, cache: torch.Tensor, scale: float, **options) -> tuple[torch.Tensor, ...]:
    kernel_cache, reference_cache = cache.clone(), cache.clone()
    sliding_window, softcap = options.get("sliding_window", -1), options.get("softcap", 0.0)
    out = torch.ops.compiled_engine.paged_attention_cpu(
        *batch.args(kernel_cache), scale, sliding_window, softcap
    )
    expected = paged_attention_reference(*batch.args(reference_cache), scale, sliding_window, softcap)
    return out, expected, kernel_cache, reference_cache


def assert_same_codes(batch: Batch, kernel_cache: torch.Tensor, reference_cache: torch.Tensor) -> None:
    """Every byte equal (codes, padding, scales): the kernel quantizes with the reference's maths."""
    compared = (
        slice(None) if batch.num_pad_rows <= 1 else slice(0, -1)
    )  # the scratch block's last write is free
    a, b = kernel_cache[:, compared].view(torch.uint8), reference_cache[:, compared].view(torch.uint8)
    assert torch.equal(a, b), f"{(a != b).sum().item()} cache bytes differ"


@pytest.mark.parametrize("query_dtype", QUERY_DTYPES)
@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference_on_the_same_quantized_cache(case, dtype, query_dtype):
    spans, batch_options, attention_options = CASES[case]
    batch = make_attention_batch(spans, dtype=query_dtype, **batch_options)
    scale = batch.query.shape[2] ** -0.5
    out, expected, kernel_cache, reference_cache = run_both(
        batch, quantized_cache(batch.kv_cache, dtype), scale, **attention_options
    )
    assert out.dtype == query_dtype and out.shape == batch.query.shape
    assert not out.isnan().any(), "a never-written row (NaN scale) reached an output"
    torch.testing.assert_close(out, expected, **SAME_CODES_TOL[query_dtype])
    assert_same_codes(batch, kernel_cache, reference_cache)
    # And within the quantization's error of attention over the float cache.
    unquantized = paged_attention_reference(*batch.args(batch.kv_cache.clone()), scale, **attention_options)
    torch.testing.assert_close(out.float(), unquantized.float(), atol=UNQUANTIZED_ATOL[dtype], rtol=0.02)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_writes_the_references_codes_for_ties_subnormals_and_extremes(dtype):
    # Keys and values whose rows' amax is exactly QMAX (scale 1), so the codes are the values
    # themselves rounded: every e4m3 value, the midpoints between neighbours (ties to even), and
    # for int8 half-integers (ties) and tiny values; a zero row (the FLT_MIN scale floor).
    qmax = kv_quant.QMAX[dtype]
    if dtype == torch.float8_e4m3fn:
        finite = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        finite = finite[finite.isfinite()].unique()
        values = torch.cat([finite, (finite[1:] + finite[:-1]) / 2])
    else:
        values = torch.cat(
            [torch.arange(-127, 127) + 0.5, torch.linspace(-3, 3, 97), torch.tensor([1e-30, -2.5])]
        )
    head_dim = 15
    rows = -(-values.numel() // (head_dim - 1))
    values = torch.cat([values, torch.zeros(rows * (head_dim - 1) - values.numel())]).view(rows, head_dim - 1)
    values = torch.cat([values, torch.full((rows, 1), qmax)], dim=1)  # each row's amax: QMAX
    values[-1] = 0.0
    batch = make_attention_batch([(0, rows)], num_q_heads=1, num_kv_heads=1, head_dim=head_dim, block_size=4)
    batch.key, batch.value = values[:, None].clone(), -values[:, None].clone()
    _, _, kernel_cache, reference_cache = run_both(batch, quantized_cache(batch.kv_cache, dtype), 0.1)
    assert_same_codes(batch, kernel_cache, reference_cache)


def test_int8_values_sums_are_exact_at_the_largest_block_the_integer_loop_takes():
    # The integer value loops (span_values_vnni; span_values_madd on AVX2) sum a span's 16-bit
    # weights times codes in int32: at blocks of 127 keys a span is 4 x 127 keys, and a flat
    # softmax (a zero query: every weight the span's largest, 32767) over values whose codes are
    # all 127 gives 508 * 32767 * 127, just under 2^31. Any overflow would show as a wrong sign or
    # size; the output must be the value itself.
    batch = make_attention_batch(
        [(4 * 127 * 2 + 5, 1)],
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=64,
        block_size=127,
        dtype=torch.bfloat16,
    )
    batch.query = torch.zeros_like(batch.query)
    written = torch.isfinite(batch.kv_cache[1])
    batch.kv_cache[1] = torch.where(written, torch.tensor(0.75, dtype=torch.bfloat16), batch.kv_cache[1])
    batch.value = torch.full_like(batch.value, 0.75)
    out, expected, _, _ = run_both(batch, quantized_cache(batch.kv_cache, torch.int8), 0.125)
    torch.testing.assert_close(out, expected, **SAME_CODES_TOL[torch.bfloat16])
    torch.testing.assert_close(out.float(), torch.full(out.shape, 0.75), atol=1e-3, rtol=0)


@pytest.mark.parametrize("poison", ["infinite_value_scale", "nan_query"])
def test_int8_values_with_a_non_finite_weight_come_out_as_the_float_loop_gives_them(poison):
    # The integer values loop rounds weights to 16 bits of the span's largest scale, which has no
    # room for a NaN or an infinity: a span holding one goes through the float loop instead, so the
    # output is what the reference gives (inf / NaN where it has them), not garbage.
    shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    batch = make_attention_batch([(70, 1), (33, 1)], dtype=torch.bfloat16, **shape)
    cache = quantized_cache(batch.kv_cache, torch.int8)
    if poison == "infinite_value_scale":
        block = int(batch.block_tables[0, 1])  # sequence 0's keys 16-31: visible, written
        _, scales = kv_quant.split_rows(cache[1, block, 3], 64)
        scales[1] = float("inf")  # KV head 1's value row
    else:
        batch.query[1, 2] = float("nan")  # sequence 1's query head 2 (KV head 1)
    out, expected, _, _ = run_both(batch, cache, 0.125)
    assert not torch.isfinite(expected).all(), "the poison did not reach the reference's output"
    torch.testing.assert_close(out, expected, **SAME_CODES_TOL[torch.bfloat16], equal_nan=True)


def test_one_thread_and_many_agree_on_a_quantized_cache():
    gen = torch.Generator().manual_seed(4)
    spans = [(int(torch.randint(0, 70, (1,), generator=gen)), 1) for _ in range(7)]
    batch = make_attention_batch(spans, head_dim=64, block_size=16, seed=9)
    cache = quantized_cache(batch.kv_cache, torch.int8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_both(batch, cache, 0.125)[0]
    finally:
        torch.set_num_threads(threads)
    many = run_both(batch, cache, 0.125)[0]
    assert torch.equal(one, many)


AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as info:
            return next(
                (frozenset(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")),
                frozenset(),
            )
    except OSError:
        return frozenset()


@pytest.mark.slow  # a second build of the kernel: ~15 s of g++
@pytest.mark.parametrize("target", ["portable", "avx2"])
def test_a_build_for_another_target_writes_and_reads_the_same(target, monkeypatch, tmp_path):
    # The kernel is plain loops the compiler vectorises for the build machine (-march=native), plus
    # SIMD block loops for AVX-512 or AVX2. Built for baseline x86-64 (or the machine's generic
    # target elsewhere) instead, the int8 widening and the fp8 decode through float16 take the
    # scalar/SSE paths; built for x86-64-v3, the AVX2 block loops (head dims of 8s: the cases at
    # 64 and 128, on float caches too); each must agree with the reference.
    import platform

    x86 = platform.machine() in ("x86_64", "AMD64")
    if target == "avx2" and not (x86 and AVX2_FLAGS <= cpu_flags()):
        pytest.skip("this CPU cannot run an AVX2 + FMA + F16C build")
    portable = "-march=x86-64" if x86 else "-mtune=generic"
    march = "-march=x86-64-v3" if target == "avx2" else portable
    flags = tuple(march if f == "-march=native" else f for f in cpu_attention_build.FLAGS)
    monkeypatch.setattr(cpu_attention_build, "FLAGS", flags)
    monkeypatch.setattr(cpu_attention_build, "_loaded", None)  # restored afterwards: the native build
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    if target == "avx2":
        assert cpu_attention_build.load().ce_cpu_attention_simd_bits() == 256
        # ... and the integer value loop's pairs (odd blocks, blocks of 32, its float fallback).
        cases = [
            "decode_gqa_d64_bs16",
            "prefill_g8_d128_window",
            "gqa4_d64_bs7_odd_blocks",
            "mha_d128_bs32_partial",
            "gqa2_d64_bs128_float_values",
        ]
    else:
        cases = ["odd_heads_d20_bs5_softcap_padding"]
    for case in cases:
        spans, batch_options, attention_options = CASES[case]
        for dtype in (torch.int8, torch.float8_e4m3fn):
            batch = make_attention_batch(spans, dtype=torch.bfloat16, **batch_options)
            scale = batch.query.shape[2] ** -0.5
            out, expected, kernel_cache, reference_cache = run_both(
                batch, quantized_cache(batch.kv_cache, dtype), scale, **attention_options
            )
            torch.testing.assert_close(out, expected, **SAME_CODES_TOL[torch.bfloat16])
            assert_same_codes(batch, kernel_cache, reference_cache)
        for dtype in (torch.float32, torch.float16):  # float caches hold the query's dtype
            batch = make_attention_batch(spans, dtype=dtype, **batch_options)
            out, expected, _, _ = run_both(batch, batch.kv_cache, 0.3, **attention_options)
            torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
    assert list(tmp_path.rglob("cpu_attention-*.so")), "the library was not built"
