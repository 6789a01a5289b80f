"""The async engine loop (async_scheduling=True) against the synchronous one on a real engine.

A randomized workload of 300+ requests — random prompt lengths and max_tokens, stop tokens, a KV
cache small enough to force preemption, a token budget that chunks prefills, aborts while steps are
in flight — must give identical greedy outputs in both loops, with every block free at the end.
"""

from __future__ import annotations

import random

import pytest

from compiled_engine import LLM, SamplingParams
from compiled_engine.errors import InvalidRequestError

NUM_REQUESTS = 320
ENGINE_OPTIONS = dict(
    dtype="float32",
    max_model_len=96,
    block_size=4,
    num_kv_blocks=40,  # 160 tokens for up to 8 sequences of up to 96: preemption is certain
    max_num_seqs=8,
    max_num_batched_tokens=32,  # prompts of up to 40 tokens are chunked
    compile_buckets=(4, 16),
)


def _workload(seed: int = 0):
    rng = random.Random(seed)
    requests = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, 384) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(1, 24),
            # Common token ids, so a fair share of requests stop early on them.
            stop_token_ids=[rng.randrange(3, 40) for _ in range(rng.randint(0, 12))] or None,
            ignore_eos=rng.random() < 0.5,
        )
        arrival = rng.randrange(0, 120)  # step index at which the request is added
        abort_after = rng.choice([None] * 6 + [1, 2, 5])  # tokens seen before aborting it
        requests.append((str(i), prompt, params, arrival, abort_after))
    return requests


def _run(llm: LLM, workload) -> dict[str, tuple[list[int], str | None]]:
    engine = llm.engine
    results: dict[str, tuple[list[int], str | None]] = {}
    seen: dict[str, list[int]] = {}
    pending = sorted(workload, key=lambda r: r[3])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            request_id, prompt, params, _, abort_after = pending.pop(0)
            processed, checked = engine.validate([{"prompt_token_ids": prompt}], params)[0]
            engine.add_request(request_id, processed, checked)
            seen[request_id] = []
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
            seen[out.request_id] = tokens
            if out.finished:
                results[out.request_id] = (tokens, out.outputs[0].finish_reason)
        for request_id, _, _, _, abort_after in workload:
            tokens = seen.get(request_id)
            if abort_after is not None and tokens is not None and request_id not in results:
                if len(tokens) >= abort_after:
                    engine.abort_request([request_id])
                    results[request_id] = (tokens, "abort")
        step += 1
        assert step < 20_000, "the workload did not finish"
    return results


@pytest.fixture(scope="module")
def engines(llama_dir):
    sync = LLM(llama_dir, async_scheduling=False, **ENGINE_OPTIONS)
    async_ = LLM(llama_dir, async_scheduling=True, **ENGINE_OPTIONS)
    return sync, async_


def test_async_and_sync_loops_give_identical_greedy_outputs(engines):
    sync, async_ = engines
    workload = _workload()
    expected = _run(sync, workload)
    got = _run(async_, workload)
    assert len(expected) == NUM_REQUESTS
    assert got == expected
    for llm in engines:
        stats = llm.stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
        assert stats.num_preemptions > 0, "the workload was meant to force preemption"
    assert sync.stats().num_discarded_tokens == 0
    # The async loop ran the step after a stop (or an abort) for some requests and threw it away.
    assert async_.stats().num_discarded_tokens > 0
    reasons = {reason for _, reason in expected.values()}
    assert {"stop", "length", "abort"} <= reasons


def test_async_engine_reports_its_mode_and_timeline(engines):
    sync, async_ = engines
    assert (sync.engine.async_scheduling, async_.engine.async_scheduling) == (False, True)
    stats = async_.stats()
    assert stats.num_steps > 0 and stats.execute_s > 0 and stats.step_wall_s > 0
    assert 0.0 <= stats.device_idle_fraction <= 1.0


def test_bad_request_keeps_the_async_engine_serving(engines):
    _, async_ = engines
    with pytest.raises(InvalidRequestError):
        async_.generate([{"prompt_token_ids": [5] * 200}], SamplingParams(max_tokens=4))
    out = async_.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 3
    assert async_.stats().num_free_kv_blocks == async_.stats().num_kv_blocks


def test_async_scheduling_must_be_a_bool_or_none(llama_dir):
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(llama_dir, async_scheduling="yes", enforce_eager=True)


@pytest.mark.parametrize(
    "kv_cache_dtype, num_requests, eager",
    [
        # The default run's check is tests/test_prefix_caching_engine.py's int8 one (async + cache).
        pytest.param("int8", 80, True, id="int8-eager", marks=pytest.mark.slow),
        pytest.param("fp8", NUM_REQUESTS, False, id="fp8-compiled", marks=pytest.mark.slow),
    ],
)
def test_async_and_sync_loops_agree_on_a_quantized_kv_cache(llama_dir, kv_cache_dtype, num_requests, eager):
    workload = _workload(seed=2)[:num_requests]
    outputs = []
    for async_ in (False, True):
        llm = LLM(
            llama_dir,
            async_scheduling=async_,
            kv_cache_dtype=kv_cache_dtype,
            enforce_eager=eager,
            **ENGINE_OPTIONS,
        )
        outputs.append(_run(llm, workload))
        stats = llm.stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_preemptions > 0
        llm.close()
    assert len(outputs[0]) == num_requests and outputs[1] == outputs[0]
