"""Step timeline of the engine loop, synchronous vs async (`async_scheduling`), side by side.

Each round: N requests of `decode_prompt_len` tokens, `decode_output_len` greedy tokens each,
through `LLM.generate`. From `LLM.stats()` before and after the round, per step: host time
(schedule + prepare + update), execute time (the step's work on the execution stream), the host's
wait for tokens, and wall time; device idle = 1 - execute / wall. On CPU "execute" is the compute
itself; on CUDA it is only the host's launch of it (bench/gpu_check.py times the GPU side).
"""

from __future__ import annotations

import pytest

from bench.conftest import measured, record
from bench.runners import run_engine_generate
from bench.workloads import fixed_requests

WARMUP_ROUNDS = 1
LOOPS = ("sync", "async")
TIMELINE_MODEL = "bench-small"


@pytest.mark.parametrize("loop", LOOPS)
def test_step_timeline(benchmark, bench_session, sizes, model_name, system, concurrency, loop):
    if system != "ours" or model_name != TIMELINE_MODEL:
        pytest.skip("the step timeline is ours, on bench-small")
    vocab = bench_session.vocab_size(model_name)
    requests = fixed_requests(
        concurrency, sizes.decode_prompt_len, sizes.decode_output_len, vocab, seed=concurrency
    )
    llm = bench_session.engine(model_name, async_scheduling=loop == "async")
    assert llm.engine.async_scheduling == (loop == "async")
    timelines = []

    def run():
        before = llm.stats()
        result = run_engine_generate(llm, requests)
        timelines.append(_per_step(before, llm.stats()))
        return result

    results = []
    benchmark.group = f"step-timeline {model_name} concurrency={concurrency}"
    benchmark.pedantic(
        lambda: results.append(run()), rounds=sizes.decode_rounds, iterations=1, warmup_rounds=WARMUP_ROUNDS
    )
    results = measured(results, WARMUP_ROUNDS)
    timelines = measured(timelines, WARMUP_ROUNDS)
    assert all(r.tokens_generated == concurrency * sizes.decode_output_len for r in results)
    record(
        benchmark,
        workload="step-timeline",
        model=model_name,
        system=f"ours-{loop}",
        param=concurrency,
        results=results,
        timelines=timelines,
    )


def _per_step(before, after) -> dict:
    steps = after.num_steps - before.num_steps
    delta = {
        name: (getattr(after, name) - getattr(before, name)) / steps
        for name in ("schedule_s", "prepare_s", "execute_s", "wait_s", "update_s", "step_wall_s")
    }
    delta["steps"] = steps
    delta["discarded_tokens"] = after.num_discarded_tokens - before.num_discarded_tokens
    delta["device_idle"] = max(0.0, 1 - delta["execute_s"] / delta["step_wall_s"])
    return delta
