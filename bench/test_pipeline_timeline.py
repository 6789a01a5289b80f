"""Pipeline parallelism's step timeline on CPU: PP=1 vs PP=2, steps whole, in micro-batches, and
with steps in flight across the stages.

Each round: `concurrency` requests of `decode_prompt_len` tokens, `decode_output_len` greedy tokens
each, through `LLM.generate`, on bench-small (6 decoder layers: 3 per stage). Per stage, over the
round's wall time: busy = time in the stage's step graph computing, idle = 1 - busy / wall (the
rest: waiting for another stage's hand-off, and the host's own work between steps — scheduling,
sampling, the step broadcast). PP=1's busy is the runner's execute time (its graph plus sampling).

Layouts (micro-batches per step, steps in flight):
- "pp1": one process;
- "pp2-seq" (1, 1): two stages, each step whole, one step at a time: one stage runs at a time;
- "pp2-instep" (2, 1): each step as two micro-batches, stage 0 runs micro-batch 2 while stage 1
  runs micro-batch 1 (graphs/pipeline_step_graph.py); the stages still idle at each step's fill
  and drain;
- "pp2-xstep" (1, 2): each step whole, two steps in flight with different requests: stage 0 runs
  step N+1 while stage 1 runs step N (core/engine_core.py's pipelined loop);
- "pp2" (2, 2): the default, both.
Stage idle falls from pp2-seq by the overlap. On a CPU the stages share the cores, so this shows
the schedule, not a speed-up.
"""

from __future__ import annotations

import time

import pytest

from bench.conftest import measured, record
from bench.runners import load_engine, run_engine_generate
from bench.workloads import fixed_requests
from compiled_engine.graphs.pipeline_step_graph import MICROBATCHES_ENV, STEPS_IN_FLIGHT_ENV

WARMUP_ROUNDS = 1
TIMELINE_MODEL = "bench-small"
# layout: (stages, micro-batches per step, steps in flight); None: the default.
LAYOUTS = {
    "pp1": (1, None, None),
    "pp2-seq": (2, "1", "1"),
    "pp2-instep": (2, "2", "1"),
    "pp2-xstep": (2, "1", "2"),
    "pp2": (2, None, None),
}
MAX_CONCURRENCY = 16


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_timeline(benchmark, bench_session, sizes, model_name, system, layout, monkeypatch):
    if system != "ours" or model_name != TIMELINE_MODEL:
        pytest.skip("the pipeline timeline is ours, on bench-small")
    stages, microbatches, in_flight = LAYOUTS[layout]
    concurrency = min(max(sizes.decode_concurrency), MAX_CONCURRENCY)
    vocab = bench_session.vocab_size(model_name)
    requests = fixed_requests(concurrency, sizes.decode_prompt_len, sizes.decode_output_len, vocab, seed=7)
    if microbatches is not None:
        monkeypatch.setenv(MICROBATCHES_ENV, microbatches)  # read by every rank as it builds
    if in_flight is not None:
        monkeypatch.setenv(STEPS_IN_FLIGHT_ENV, in_flight)  # read by rank 0's engine core
    llm = load_engine(
        bench_session.model_dir(model_name),
        bench_session.settings(model_name),
        bench_session.dtype,
        pipeline_parallel_size=stages,
        enable_prefix_caching=False,
    )
    try:
        run_engine_generate(llm, requests[:2])  # first-call costs off the clock
        timelines, results = [], []

        def run():
            before = llm.stats()
            if stages > 1:
                llm.engine.pipeline_stage_times(reset=True)
            started = time.perf_counter()
            result = run_engine_generate(llm, requests)
            wall = time.perf_counter() - started
            if stages > 1:
                busy = _busy_per_stage(llm.engine.pipeline_stage_times())
            else:
                busy = [llm.stats().execute_s - before.execute_s]
            timelines.append(
                {
                    "wall_s": wall,
                    "steps": llm.stats().num_steps - before.num_steps,
                    "max_steps_in_flight": llm.engine.core.max_steps_in_flight,
                    "stage_busy_s": busy,
                    "stage_idle": [max(0.0, 1 - b / wall) for b in busy],
                }
            )
            return result

        benchmark.group = f"pipeline-timeline {model_name} concurrency={concurrency}"
        benchmark.pedantic(
            lambda: results.append(run()),
            rounds=sizes.decode_rounds,
            iterations=1,
            warmup_rounds=WARMUP_ROUNDS,
        )
        results = measured(results, WARMUP_ROUNDS)
        timelines = measured(timelines, WARMUP_ROUNDS)
        assert all(r.tokens_generated == concurrency * sizes.decode_output_len for r in results)
        assert all(len(t["stage_idle"]) == stages for t in timelines)
        record(
            benchmark,
            workload="pipeline-timeline",
            model=model_name,
            system=f"ours-{layout}",
            param=concurrency,
            results=results,
            timelines=timelines,
        )
    finally:
        llm.close()


def _busy_per_stage(times) -> list[float]:
    """Busy seconds per stage (a stage's TP ranks run the same graphs: its rank 0's)."""
    per_stage: dict[int, float] = {}
    for t in times:
        per_stage.setdefault(t.stage, t.busy_s)
    return [per_stage[s] for s in sorted(per_stage)]
