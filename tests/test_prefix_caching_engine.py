"""Prefix caching on a real engine: the same greedy outputs with the cache on and off, in the
synchronous and the async loop, under eviction and preemption, with hits reported in stats()."""

from __future__ import annotations

import random

import pytest

from compiled_engine import LLM, SamplingParams
from compiled_engine.entrypoints.cli import _build_parser

NUM_REQUESTS = 120
ENGINE_OPTIONS = dict(
    dtype="float32",
    max_model_len=96,
    block_size=4,
    num_kv_blocks=40,  # 160 tokens for up to 8 sequences of up to 76: eviction and preemption
    max_num_seqs=8,
    max_num_batched_tokens=32,  # longer prompts are chunked
    compile_buckets=(4, 16),
)
MODES = [(caching, async_) for caching in (False, True) for async_ in (False, True)]


def _workload(seed: int = 0):
    """Prompts built from a few shared "system prompts" plus a short suffix (sometimes none, so
    whole prompts repeat, as the n samples of one prompt do), arriving over time."""
    rng = random.Random(seed)
    system_prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(8, 40))] for _ in range(4)]
    # One block's tokens over and over: equal blocks at different positions must not be confused.
    system_prompts.append([rng.randrange(3, 384) for _ in range(4)] * 6)
    requests = []
    for i in range(NUM_REQUESTS):
        suffix = [rng.randrange(3, 384) for _ in range(rng.choice([0, 0, 1, 3, 7, 12]))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.5)
        requests.append((str(i), rng.choice(system_prompts) + suffix, params, rng.randrange(0, 60)))
    return requests


def _run(llm: LLM, workload) -> dict[str, tuple[tuple[int, ...], str]]:
    engine = llm.engine
    results: dict[str, tuple[tuple[int, ...], str]] = {}
    pending = sorted(workload, key=lambda r: r[3])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            request_id, prompt, params, _ = pending.pop(0)
            processed, checked = engine.validate([{"prompt_token_ids": prompt}], params)[0]
            engine.add_request(request_id, processed, checked)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = (tuple(out.outputs[0].token_ids), out.outputs[0].finish_reason)
        step += 1
        assert step < 20_000, "the workload did not finish"
    return results


# The same tests with the engines' weights quantized (docs/quantization.md): compiled four times
# more, so under -m slow; tests/test_quantization_engine.py runs a cheaper eager check by default.
@pytest.fixture(
    scope="module", params=[None, pytest.param("int4", marks=pytest.mark.slow)], ids=["unquantized", "int4"]
)
def engines(llama_dir, request):
    return {
        (caching, async_): LLM(
            llama_dir,
            enable_prefix_caching=caching,
            async_scheduling=async_,
            quantization=request.param,
            **ENGINE_OPTIONS,
        )
        for caching, async_ in MODES
    }


def test_greedy_outputs_do_not_depend_on_prefix_caching_or_the_loop(engines):
    workload = _workload()
    results = {mode: _run(engines[mode], workload) for mode in MODES}
    expected = results[(False, False)]
    assert len(expected) == NUM_REQUESTS
    for mode in MODES:
        assert results[mode] == expected, f"enable_prefix_caching={mode[0]} async_scheduling={mode[1]}"
    for (caching, _), llm in engines.items():
        stats = llm.stats()
        assert stats.prefix_caching == caching
        assert stats.num_preemptions > 0, "the workload was meant to force preemption"
        # Every block is free at the end; cached ones stay findable until evicted.
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
        assert stats.num_cached_kv_blocks == stats.num_evictable_kv_blocks
        if caching:
            assert stats.prefix_cache_hits > 0 and 0 < stats.prefix_cache_hit_rate < 1
            assert stats.prefix_cache_queries >= sum(len(prompt) for _, prompt, _, _ in workload)
            assert stats.num_cached_kv_blocks > 0
        else:
            assert (stats.prefix_cache_hits, stats.prefix_cache_queries, stats.num_cached_kv_blocks) == (
                0,
                0,
                0,
            )


def test_a_repeated_prompt_reuses_the_blocks_of_the_first(engines):
    prompt = {"prompt_token_ids": [(7 * i) % 300 + 3 for i in range(41)]}  # 10 full blocks of 4
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for caching, async_ in MODES:
        llm = engines[(caching, async_)]
        before = llm.stats().prefix_cache_hits
        # Four copies at once (what n=4 sends the core), then one more after they finished.
        first = llm.generate([prompt] * 4, params, use_tqdm=False)
        again = llm.generate(prompt, params, use_tqdm=False)
        assert {o.outputs[0].token_ids for o in first + again} == {again[0].outputs[0].token_ids}
        hits = llm.stats().prefix_cache_hits - before
        # Copies 2-4 wait a step and take the first one's 10 blocks; the last takes them too.
        assert hits == (4 * 40 if caching else 0), f"caching={caching} async={async_}"
        assert llm.stats().num_free_kv_blocks == llm.stats().num_kv_blocks


def test_prefix_caching_options_are_checked_and_the_cli_can_turn_it_off(llama_dir):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(llama_dir, enable_prefix_caching="no", enforce_eager=True)
    parser = _build_parser()
    assert not parser.parse_args(["generate", "hi", "--no-prefix-caching"]).enable_prefix_caching
    assert parser.parse_args(["warmup"]).enable_prefix_caching


@pytest.mark.parametrize(
    "kv_cache_dtype, modes, eager, num_requests",
    [
        # Cheap: prefix caching off with the synchronous loop against on with the async one (the
        # async loop's own test on a quantized cache is tests/test_async_engine.py's slow one).
        pytest.param("int8", [(False, False), (True, True)], True, 40, id="int8-eager"),
        pytest.param("fp8", MODES, False, NUM_REQUESTS, id="fp8-compiled", marks=pytest.mark.slow),
        pytest.param("int8", MODES, False, NUM_REQUESTS, id="int8-compiled", marks=pytest.mark.slow),
    ],
)
def test_a_quantized_kv_cache_keeps_outputs_independent_of_caching_and_the_loop(
    llama_dir, kv_cache_dtype, modes, eager, num_requests
):
    # Each token's codes and scales depend on that token's keys and values only, and live in its
    # block: a prefix hit reads the codes the first request wrote, a preempted request recomputes
    # the same ones, so every mode gives the same greedy tokens (those of the quantized engine).
    workload = _workload(seed=1)[:num_requests]
    results, engines = {}, {}
    for caching, async_ in modes:
        llm = LLM(
            llama_dir,
            enable_prefix_caching=caching,
            async_scheduling=async_,
            kv_cache_dtype=kv_cache_dtype,
            enforce_eager=eager,
            **ENGINE_OPTIONS,
        )
        engines[(caching, async_)], results[(caching, async_)] = llm, _run(llm, workload)
    expected = results[modes[0]]
    assert len(expected) == num_requests
    for mode in modes:
        assert results[mode] == expected, f"enable_prefix_caching={mode[0]} async_scheduling={mode[1]}"
        stats = engines[mode].stats()
        assert stats.num_preemptions > 0, "the workload was meant to force preemption"
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
        assert (stats.prefix_cache_hits > 0) == mode[0]
        engines[mode].close()
