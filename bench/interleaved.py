"""Passes timed side by side on a noisy machine: one of each a round, so all see the same moments.

`interleaved_medians(benchmark, passes, rounds)` runs every pass once a round, in the mapping's
order, for `rounds` rounds of pytest-benchmark's `pedantic` (which records the rounds' totals),
and returns each pass's median seconds, for the ratios the suites report.
`interleaved_results(benchmark, runs, rounds, warmup_rounds)` does the same with runs that time
themselves (bench/runners.py's `RunResult`: TPOT and all), and returns each run's results of the
timed rounds; `interleaved_decode` runs the decode workload so on several of our engines.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from bench.conftest import measured
from bench.runners import run_engine_decode


def interleaved_medians(
    benchmark: Any, passes: Mapping[str, Callable[[], object]], rounds: int, **pedantic: Any
) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in passes}

    def one_round() -> None:
        for name, run in passes.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)

    benchmark.pedantic(one_round, rounds=rounds, iterations=1, **pedantic)
    return {name: statistics.median(ts) for name, ts in times.items()}


def interleaved_results(
    benchmark: Any, runs: Mapping[str, Callable[[], Any]], rounds: int, warmup_rounds: int
) -> dict[str, list[Any]]:
    results: dict[str, list[Any]] = {name: [] for name in runs}

    def one_round() -> None:
        for name, run in runs.items():
            results[name].append(run())

    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=warmup_rounds)
    return {name: measured(rs, warmup_rounds) for name, rs in results.items()}


def interleaved_decode(
    benchmark: Any,
    engines: Mapping[str, Any],
    requests: list,
    rounds: int,
    warmup_rounds: int,
    temperature: float = 0.0,
) -> tuple[dict[str, list[Any]], dict[str, list[float]]]:
    """`interleaved_results` of bench/runners.py's `run_engine_decode` on each of `engines`, the
    same requests (greedy, or drawn at `temperature`): each side's results and TPOTs (seconds) of
    the timed rounds."""
    decode = functools.partial(run_engine_decode, requests=requests, temperature=temperature)
    runs = {side: functools.partial(decode, llm) for side, llm in engines.items()}
    results = interleaved_results(benchmark, runs, rounds, warmup_rounds)
    return results, {side: [r.tpot_s for r in rs] for side, rs in results.items()}
