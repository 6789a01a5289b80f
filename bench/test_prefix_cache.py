"""Time to first token with a prefix-cache hit vs a miss (ours only: HF `generate` has no prefix cache).

Each round, untimed: a primer request runs a fresh random 512-token prompt (max_tokens=1). Timed:
a request whose 512-token prompt shares the primer's first 496 tokens (31 blocks of 16) and ends
differently. With prefix caching the engine takes those 31 blocks from the cache and computes the
last 16 tokens; with it disabled (the same engine options otherwise) it computes all 512.
"""

from __future__ import annotations

import random

import pytest

from bench.conftest import measured, record
from bench.runners import run_engine_generate
from bench.workloads import BenchRequest, random_prompt

WARMUP_ROUNDS = 1
PREFIX_MODEL = "bench-small"
PROMPT_LEN = 512
SHARED_PREFIX_LEN = 496


@pytest.mark.parametrize("cache", ["hit", "miss"])
def test_prefix_cache_ttft(benchmark, bench_session, sizes, model_name, system, cache):
    if system != "ours" or model_name != PREFIX_MODEL:
        pytest.skip("the prefix-cache TTFT is ours, on bench-small (HF generate has no prefix cache)")
    max_model_len = bench_session.settings(model_name).max_model_len
    if PROMPT_LEN + 1 > max_model_len:
        pytest.skip(
            f"{model_name} holds {max_model_len} tokens here: no room for a {PROMPT_LEN}-token prompt"
        )
    llm = bench_session.engine(model_name, enable_prefix_caching=cache == "hit")
    vocab = bench_session.vocab_size(model_name)
    rng = random.Random(PROMPT_LEN)
    results = []
    # The engine's prefix-cache hit counter just before and just after each timed request, read
    # outside the timed call.
    hits_before: list[int] = []
    hits_after: list[int] = []

    def setup():
        if len(hits_after) < len(hits_before):  # the previous round's timed request has run
            hits_after.append(llm.stats().prefix_cache_hits)
        prefix = random_prompt(SHARED_PREFIX_LEN, vocab, rng)
        primer = BenchRequest(prefix + random_prompt(PROMPT_LEN - SHARED_PREFIX_LEN, vocab, rng), 1)
        run_engine_generate(llm, [primer])
        timed = BenchRequest(prefix + random_prompt(PROMPT_LEN - SHARED_PREFIX_LEN, vocab, rng), 1)
        hits_before.append(llm.stats().prefix_cache_hits)
        return (timed,), {}

    def run(timed: BenchRequest) -> None:
        results.append(run_engine_generate(llm, [timed]))

    benchmark.group = f"prefix-ttft {model_name} prompt={PROMPT_LEN} shared={SHARED_PREFIX_LEN}"
    benchmark.pedantic(run, setup=setup, rounds=sizes.ttft_rounds, iterations=1, warmup_rounds=WARMUP_ROUNDS)
    hits_after.append(llm.stats().prefix_cache_hits)
    hits_per_round = [after - before for before, after in zip(hits_before, hits_after, strict=True)]
    results = measured(results, WARMUP_ROUNDS)
    hits_per_round = measured(hits_per_round, WARMUP_ROUNDS)
    assert all(r.tokens_generated == 1 for r in results)
    expected_hits = SHARED_PREFIX_LEN if cache == "hit" else 0
    assert hits_per_round == [expected_hits] * len(results), hits_per_round
    record(
        benchmark,
        workload="prefix-ttft",
        model=model_name,
        system=f"ours-{cache}",
        param=PROMPT_LEN,
        results=results,
        shared_prefix_len=SHARED_PREFIX_LEN,
        prefix_cache_hit_tokens=hits_per_round,
    )
