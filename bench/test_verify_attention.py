"""A speculative verification step's attention on the cpu kernel: k + 1 rows of one sequence in one
walk over its keys, against the same rows attended one walk each (#22).

    python -m pytest bench/test_verify_attention.py -q -p no:cacheprovider \
        --benchmark-columns=median,min,rounds --benchmark-json=OUT.json

One layer's `compiled_engine::paged_attention_cpu` call (this step's KV write plus the attention
read) at the embedded model's attention shape (4 query heads, 2 KV heads of 64, blocks of 16, bf16),
one sequence at 640 tokens of context (a 512-token prompt well into its 128 new tokens):

- `one row`: a plain decode step, the row at position 639;
- `5 rows, one sequence`: a verification step with k = 4, rows at positions 635..639 of one
  sequence, which the kernel attends together (kernels/cpu_attention.cpp, `attend_rows`);
- `5 rows, 5 sequences`: the same five rows, keys, values and cache slots, but each row its own
  one-row sequence over the same block table (seq_lens 636..640): the kernel walks the keys once
  per row, as it did for a verification step before `attend_rows` (the baseline).

The three run interleaved, one call of each a round, so a drifting machine moves them alike;
extra_info has each one's median and the two 5-row layouts' ratio. Both 5-row layouts give the same
outputs (checked here: the same maths, only the walk differs). Smoke: 64 tokens, 3 rounds.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import compiled_engine.kernels  # noqa: F401  (registers the ops)
from compiled_engine.kernels import cpu_ops
from compiled_engine.kernels.cpu_attention_build import compiler

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 64, 16  # the embedded model's attention
DTYPE = torch.bfloat16
ROWS = 5  # k + 1 with k = 4 proposals
# (context tokens, rounds) per size profile.
SIZES = {"full": (640, 2000), "quick": (640, 500), "smoke": (64, 3)}

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler: the cpu kernel cannot be built")


def layouts(context: int, seed: int = 0) -> dict[str, tuple]:
    """The op's positional arguments for the three layouts (module docstring), on one cache."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-context // BLOCK_SIZE)
    cache = torch.randn(2, width + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    table = torch.randperm(width, generator=gen).to(torch.int32)[None]  # [1, W], blocks shuffled
    positions = torch.arange(context - ROWS, context)
    slots = table[0, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    query = torch.randn(ROWS, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    key = torch.randn(ROWS, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    value = torch.randn(ROWS, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    scale = HEAD_DIM**-0.5
    last = slice(ROWS - 1, ROWS)
    return {
        "one row": (
            query[last], key[last], value[last], cache, slots[last], table,
            torch.tensor([context], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), scale,
        ),
        "5 rows, one sequence": (
            query, key, value, cache, slots, table,
            torch.tensor([context], dtype=torch.int32), torch.tensor([0, ROWS], dtype=torch.int32), scale,
        ),
        "5 rows, 5 sequences": (
            query, key, value, cache, slots, table.expand(ROWS, -1).contiguous(),
            (positions + 1).to(torch.int32), torch.arange(ROWS + 1, dtype=torch.int32), scale,
        ),
    }  # fmt: skip


def test_verification_attention_interleaved(benchmark, request):
    context, rounds = SIZES[request.config._bench_sizes.profile]
    cpu_ops.use_native_ops()  # the op's C++ implementation, as the engine's graphs call it
    op = torch.ops.compiled_engine.paged_attention_cpu
    calls = layouts(context)
    together, apart = (op(*calls[name]) for name in ("5 rows, one sequence", "5 rows, 5 sequences"))
    torch.testing.assert_close(together, apart, atol=0, rtol=0)
    for args in calls.values():
        op(*args)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in calls}

    def one_round() -> None:
        for name, args in calls.items():
            started = time.perf_counter()
            op(*args)
            times[name].append(time.perf_counter() - started)

    benchmark.group = f"verification attention per layer, 1 sequence x {context} tokens, interleaved"
    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=0)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name, median in medians.items():
        benchmark.extra_info[f"{name} median_us"] = median * 1e6
    speedup = medians["5 rows, 5 sequences"] / medians["5 rows, one sequence"]
    benchmark.extra_info.update(one_walk_speedup=speedup, threads=torch.get_num_threads())
    print("\n" + ", ".join(f"{name} {median * 1e6:.1f} us" for name, median in medians.items()))
    print(f"5 rows in one walk: {speedup:.2f}x the five walks")
