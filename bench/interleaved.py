"""Passes timed side by side on a noisy machine: one of each a round, so all see the same moments.

`interleaved_medians(benchmark, passes, rounds)` runs every pass once a round, in the mapping's
order, for `rounds` rounds of pytest-benchmark's `pedantic` (which records the rounds' totals),
and returns each pass's median seconds, for the ratios the suites report.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any


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
