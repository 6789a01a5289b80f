"""Decode in multi-step runs and one step a schedule, rounds interleaved (#19).

Two engines of the same model in one session: `num_scheduler_steps=1` (the default: the host
schedules, stages, samples, updates and hands out outputs around every decode step) and
`num_scheduler_steps=RUN` (decode steps back to back, each fed the tokens the one before picked,
the host's work paid once a run: docs/performance.md). The requests pick greedily, or draw at
temperature 0.8 (`t0.8`: the runs' C++ draw). Each timed round decodes the
decode workload's requests on one engine, then on the other, so both see the same moments of a
noisy machine. TPOT as bench/test_decode.py measures it (counted in tokens: a run adds several a
step).

    python -m pytest bench/test_multi_step.py -q -s -p no:cacheprovider -k "ours-1-greedy" \\
        [--bench-model qwen2.5-0.5b-shape] [--bench-dtype bfloat16]      # or -k "ours-1-t0.8"

Printed and in extra_info: each side's TPOT per round, their medians, and the single / runs
ratio of each round (above 1: runs faster).
"""

from __future__ import annotations

import statistics

import pytest

from bench.conftest import record
from bench.interleaved import interleaved_decode

WARMUP_ROUNDS = 1
RUN = 8  # num_scheduler_steps of the runs side


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "t0.8"])
def test_multi_step(benchmark, bench_session, sizes, model_name, system, concurrency, temperature):
    if system != "ours":
        pytest.skip("multi-step scheduling is ours")
    requests = bench_session.decode_requests(model_name, concurrency)
    engines = {
        "runs": bench_session.engine(model_name, num_scheduler_steps=RUN),
        "single": bench_session.engine(model_name, num_scheduler_steps=1),
    }
    benchmark.group = f"multi-step {model_name} concurrency={concurrency} temperature={temperature}"
    results, tpots = interleaved_decode(
        benchmark, engines, requests, 2 * sizes.decode_rounds, WARMUP_ROUNDS, temperature
    )
    ratios = [s / r for s, r in zip(tpots["single"], tpots["runs"], strict=True)]
    record(
        benchmark,
        workload="multi-step",
        model=model_name,
        system="ours",
        param=concurrency,
        results=results["runs"],
        num_scheduler_steps=RUN,
        temperature=temperature,
        runs_tpot_s=tpots["runs"],
        single_tpot_s=tpots["single"],
        single_over_runs=ratios,
    )
    print(
        f"\n{model_name} {bench_session.dtype} x{concurrency} temperature {temperature}: TPOT median "
        f"runs of {RUN} "
        f"{1e3 * statistics.median(tpots['runs']):.3f} ms, single steps "
        f"{1e3 * statistics.median(tpots['single']):.3f} ms; single / runs per round "
        f"{', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})"
    )
