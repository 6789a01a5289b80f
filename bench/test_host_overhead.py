"""Host work per engine step at 1, 64 and 256 running requests, with a null model.

The real engine (scheduler with prefix caching, the runner's staging and buffer loads, sampling
bookkeeping, update, output processing with the embedded tokenizer's detokenizer) around a step
graph and a sampler that do nothing (bench/null_model.py): every request decodes one token a
step, and each round is one `LLMEngine.step()`, so a round's time is the host's work per step.

    python -m pytest bench/test_host_overhead.py -q --benchmark-columns=median,min,rounds

Targets (#19): at most 0.25 ms per step at 64 running requests, 0.6 ms at 256.
"""

from __future__ import annotations

import pytest

from bench.null_model import null_engine, start_decoding, stop_all

RUNNING = (1, 64, 256)
# Rounds per size profile; the smoke run only checks the path works.
ROUNDS = {"full": 300, "quick": 100, "smoke": 3}


@pytest.fixture(scope="module")
def engine():
    engine = null_engine(max(RUNNING))
    yield engine
    engine.close()


@pytest.mark.parametrize("num_running", RUNNING)
def test_host_work_per_step(benchmark, request, engine, num_running):
    rounds = ROUNDS[request.config._bench_sizes.profile]
    request_ids = start_decoding(engine, num_running)
    try:
        before = engine.stats()
        benchmark.group = "host work per step, null model"
        benchmark.pedantic(engine.step, rounds=rounds, iterations=1, warmup_rounds=min(rounds, 10))
        after = engine.stats()
        scheduler = engine.core.scheduler
        # Every request decoded through every round: the figure is for exactly num_running.
        assert scheduler.num_running == num_running and scheduler.num_waiting == 0
        steps = after.num_steps - before.num_steps  # --benchmark-disable runs one
        benchmark.extra_info.update(
            running=num_running,
            # Per step, over the timed and warm-up rounds (the engine's own timeline, seconds).
            schedule_s=(after.schedule_s - before.schedule_s) / steps,
            prepare_s=(after.prepare_s - before.prepare_s) / steps,
            execute_s=(after.execute_s - before.execute_s) / steps,
            update_s=(after.update_s - before.update_s) / steps,
            core_step_s=(after.step_wall_s - before.step_wall_s) / steps,
        )
    finally:
        stop_all(engine, request_ids)
