"""The Triton paged-attention op against the pure-torch reference.

Without a GPU the kernels run under the Triton interpreter. triton reads TRITON_INTERPRET=1 when
it is imported (its standard library is jitted then), so the flag has to be in the environment
before anything imports triton: tests/conftest.py sets it on machines without CUDA, or export it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the Triton attention backend needs the triton package (Linux x86_64)")

import compiled_engine.kernels  # noqa: E402, F401  (registers the ops)
from compiled_engine.kernels import triton_attention  # noqa: E402
from compiled_engine.kernels.reference import paged_attention_reference  # noqa: E402
from tests.attention_batches import Batch, check_op_under_torch_compile, make_attention_batch  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

FP32_TOL = dict(atol=1e-5, rtol=1e-5)
# Probabilities go through half precision for the p @ v dot, as in any flash-attention kernel.
HALF_TOL = dict(atol=2e-3, rtol=2e-3)

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(
        torch.bfloat16,
        id="bf16",
        marks=pytest.mark.skipif(
            not ON_GPU,
            reason="the Triton interpreter computes bfloat16 wrong; bfloat16 is checked on GPU only",
        ),
    ),
]


if not ON_GPU and not triton_attention.KERNELS_INTERPRETED:
    pytest.skip(
        "no GPU and triton was imported without TRITON_INTERPRET=1: set it before triton is imported "
        "(tests/conftest.py or the shell) to run the kernels under the interpreter",
        allow_module_level=True,
    )


@pytest.fixture
def paths(monkeypatch) -> list[str]:
    """Records which attention kernel each call dispatched to."""
    seen = []
    for name in ("_split_kv_decode", "_extend"):
        real = getattr(triton_attention, name)

        def spy(*args, _real=real, _name=name):
            seen.append(_name.lstrip("_"))
            return _real(*args)

        monkeypatch.setattr(triton_attention, name, spy)
    return seen


def make_batch(spans, **options) -> Batch:
    return make_attention_batch(spans, device=DEVICE, **options)


def check_against_reference(batch: Batch, scale: float, sliding_window: int = -1, softcap: float = 0.0):
    """Run both implementations from identical caches; compare outputs and resulting caches."""
    triton_cache, reference_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    out = torch.ops.compiled_engine.paged_attention_triton(
        *batch.args(triton_cache), scale, sliding_window, softcap
    )
    expected = paged_attention_reference(*batch.args(reference_cache), scale, sliding_window, softcap)

    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    tol = FP32_TOL if batch.query.dtype == torch.float32 else HALF_TOL
    torch.testing.assert_close(out, expected, **tol)
    if batch.num_pad_rows:
        padding = out[out.shape[0] - batch.num_pad_rows :]
        assert torch.equal(padding, torch.zeros_like(padding)), "padding rows must come back as zeros"

    # Real blocks must match bit for bit. Several padding rows all land on one scratch slot, in
    # an order a GPU does not fix, so the scratch block is compared only when one row wrote it.
    compared = slice(None) if batch.num_pad_rows <= 1 else slice(0, -1)
    torch.testing.assert_close(
        triton_cache[:, compared], reference_cache[:, compared], atol=0, rtol=0, equal_nan=True
    )
    return out


# (spans, batch options, attention options, kernel expected) — small shapes: the interpreter is slow.
CASES = {
    "prefill_gqa_d64_bs16": ([(0, 9), (0, 14), (0, 1)], dict(head_dim=64, block_size=16), {}, "extend"),
    "mixed_mqa_window_padding_d32_bs8": (
        [(5, 6), (20, 1), (0, 5), (9, 0), (0, 0)],
        dict(num_kv_heads=1, head_dim=32, block_size=8, num_pad_rows=3),
        dict(sliding_window=6),
        "extend",
    ),
    "extend_softcap_d48_bs5": (
        [(10, 7), (3, 1), (17, 4)],
        dict(head_dim=48, block_size=5),
        dict(softcap=0.5),
        "extend",
    ),
    "tiny_model_d16_bs4_one_padding_row": ([(6, 3), (2, 1)], dict(num_pad_rows=1), {}, "extend"),
    # More query rows than one 64-row tile, so a sequence spans several programs.
    "long_prefill_two_tiles_d80_window": (
        [(0, 70), (12, 5)],
        dict(head_dim=80, block_size=16),
        dict(sliding_window=24, softcap=2.0),
        "extend",
    ),
    # T == S picks the split-KV kernel even though the rows are not one per sequence.
    "rows_equal_seqs_but_not_one_each": (
        [(3, 3), (5, 1), (7, 0), (0, 0)],
        dict(head_dim=16),
        dict(sliding_window=4),
        "split_kv_decode",
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, dtype, paths):
    spans, batch_options, attention_options, expected_path = CASES[case]
    batch = make_batch(spans, dtype=dtype, **batch_options)
    check_against_reference(batch, batch.query.shape[2] ** -0.5, **attention_options)
    assert paths == [expected_path]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "attention_options", [{}, dict(sliding_window=600, softcap=1.0)], ids=["full", "window_softcap"]
)
def test_decode_batch_splits_long_contexts(dtype, attention_options, paths):
    # One query per sequence; the longest context needs three partitions, the window leaves the
    # first of them empty for that sequence, and the short sequence leaves two empty.
    spans = [(1500, 1), (700, 1), (40, 1)]
    batch = make_batch(spans, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    context_len = batch.block_tables.shape[1] * batch.kv_cache.shape[2]
    assert context_len > 2 * triton_attention.DECODE_PARTITION_SIZE, "the scenario must need 3+ partitions"
    check_against_reference(batch, 0.125, **attention_options)
    assert paths == ["split_kv_decode"]


def test_short_decode_uses_one_partition_and_no_reduce(paths, monkeypatch):
    reduce_launches = []

    class CountingLauncher:
        def __getitem__(self, grid):
            reduce_launches.append(grid)
            return real_reduce[grid]

    real_reduce = triton_attention._split_kv_reduce_kernel
    monkeypatch.setattr(triton_attention, "_split_kv_reduce_kernel", CountingLauncher())
    check_against_reference(make_batch([(8, 1), (3, 1), (0, 1)], num_kv_heads=1, head_dim=32), 0.2)
    assert paths == ["split_kv_decode"] and reduce_launches == []
    # The same spy does see the reduce when the context needs several partitions.
    monkeypatch.setattr(triton_attention, "DECODE_PARTITION_SIZE", 16)
    check_against_reference(make_batch([(40, 1), (3, 1)], num_kv_heads=1, head_dim=32), 0.2)
    assert reduce_launches == [(2, 4)]


def test_query_and_cache_dtypes_may_differ():
    batch = make_batch([(5, 4), (2, 1)], dtype=torch.float32)
    batch.kv_cache = batch.kv_cache.half()  # the k/v written are cast to the cache's dtype
    out = check_against_reference(batch, 0.25)
    assert out.dtype == torch.float32


def test_two_calls_extend_what_the_first_cached():
    # Call 1 prefills two sequences; call 2 decodes the first and extends the second over what
    # call 1 cached, into a block it did not have before.
    batch = make_batch([(0, 6), (0, 9)], head_dim=32, block_size=4)
    triton_cache, reference_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    torch.ops.compiled_engine.paged_attention_triton(*batch.args(triton_cache), 0.3)
    paged_attention_reference(*batch.args(reference_cache), 0.3)
    torch.testing.assert_close(triton_cache, reference_cache, atol=0, rtol=0, equal_nan=True)

    tables = batch.block_tables.clone()
    num_usable = batch.kv_cache.shape[1] - 1
    tables[1, 3] = min(set(range(num_usable)) - set(tables.flatten().tolist()))
    slots = [
        int(tables[row, pos // 4]) * 4 + pos % 4 for row, pos in [(0, 6), (1, 9), (1, 10), (1, 11), (1, 12)]
    ]
    gen = torch.Generator().manual_seed(7)
    second = Batch(
        query=torch.randn(5, 4, 32, generator=gen).to(DEVICE),
        key=torch.randn(5, 2, 32, generator=gen).to(DEVICE),
        value=torch.randn(5, 2, 32, generator=gen).to(DEVICE),
        kv_cache=triton_cache,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_tables=tables,
        seq_lens=torch.tensor([7, 13], dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor([0, 1, 5], dtype=torch.int32, device=DEVICE),
        num_pad_rows=0,
    )
    check_against_reference(second, 0.3)


def test_op_under_torch_compile():
    check_op_under_torch_compile(torch.ops.compiled_engine.paged_attention_triton, DEVICE)


def test_head_dim_above_256_is_refused():
    batch = make_batch([(0, 2)], num_kv_heads=1, num_q_heads=1, head_dim=272)
    with pytest.raises(ValueError, match="head dims up to 256"):
        triton_attention.paged_attention_triton(*batch.args(batch.kv_cache), 1.0)


@pytest.mark.skipif(ON_GPU, reason="checks the CPU refusal")
def test_cpu_tensors_without_interpreted_kernels_are_refused(monkeypatch):
    monkeypatch.setattr(triton_attention, "KERNELS_INTERPRETED", False)
    batch = make_batch([(0, 2)])
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_attention.paged_attention_triton(*batch.args(batch.kv_cache), 1.0)


# Runs in a fresh process without the interpreter: records the launches the dispatcher makes for a
# few configurations, then compiles each kernel for sm_90 with triton's offline compiler (bundled
# ptxas), no GPU needed. Catches what the interpreter lets through (types, constexprs, shared memory).
_COMPILE_FOR_SM90 = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from compiled_engine.kernels import triton_attention as ta

kernel_names = [name for name in vars(ta) if name.endswith("_kernel")]
real = {name: getattr(ta, name) for name in kernel_names}
launches = []
for name in kernel_names:
    setattr(ta, name, type("Recorder", (), {"__getitem__": lambda self, grid, name=name:
        lambda *args, **constexprs: launches.append((name, args, constexprs))})())
ta.KERNELS_INTERPRETED = True  # let CPU tensors through the dispatcher; nothing is launched

for dtype, cache_dtype, tokens, seqs, width, head_dim, hq, hkv, window, softcap in [
    (torch.float16, torch.float16, 8, 8, 96, 128, 32, 8, -1, 0.0),  # decode, 3 partitions
    (torch.bfloat16, torch.bfloat16, 200, 3, 8, 256, 8, 1, 64, 30.0),  # extend, window, softcap
    (torch.float32, torch.float16, 4, 4, 4, 80, 4, 2, -1, 0.0),  # single partition, upcast
    (torch.float32, torch.float32, 100, 2, 8, 256, 4, 4, 5, 1.0),  # fp32 extend at the largest head dim
    (torch.float32, torch.float32, 6, 6, 80, 256, 8, 2, -1, 0.0),  # fp32 decode at the largest head dim
]:
    query = torch.zeros(tokens, hq, head_dim, dtype=dtype)
    key = torch.zeros(tokens, hkv, head_dim, dtype=dtype)
    ta.paged_attention_triton(
        query, key, key, torch.zeros(2, 4, 16, hkv, head_dim, dtype=cache_dtype),
        torch.zeros(tokens, dtype=torch.int64), torch.zeros(seqs, width, dtype=torch.int32),
        torch.zeros(seqs, dtype=torch.int32), torch.zeros(seqs + 1, dtype=torch.int32), 0.1, window, softcap)

largest = 0
for name, args, constexprs in launches:
    fn = real[name]
    runtime_names = [arg for arg in fn.arg_names if arg not in constexprs]
    signature = {arg: mangle_type(value) for arg, value in zip(runtime_names, args, strict=True)}
    signature.update({arg: "constexpr" for arg in constexprs})
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    largest = max(largest, compiled.metadata.shared)
print(f"compiled {len(launches)} launches, largest shared memory {largest} bytes")
assert largest < 100 * 1024, "over the ~99 KiB of shared memory most GPUs give one block"
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiled 12 launches" in result.stdout, result.stdout
