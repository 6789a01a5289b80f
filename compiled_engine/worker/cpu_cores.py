"""How a CPU engine shares this process's cores: step threads on some, everything else on the rest.

`cpu_reserved_cores` (engine_args.py) leaves cores to the API server and its clients; the
background graph compiler (worker/graph_compiler_process.py) is pinned to those same cores
(graphs/background_builds.py), so its start-up (imports, model load, trace) and its Inductor
compiles never take a step thread's core, where every op of a step would wait for the
preempted thread.
"""

from __future__ import annotations

import os
from typing import NamedTuple


class CoreSplit(NamedTuple):
    step: tuple[int, ...]  # the cores step threads may use (their count is torch's thread count)
    other: tuple[int, ...]  # the reserved cores: API server, clients, background compiler


def split_cores(reserved: int, available: set[int] | None = None) -> CoreSplit:
    """Split `available` (default: the cores this process may run on) into step cores (the
    lowest-numbered ones) and `reserved` others; at least one core always runs steps."""
    cores = sorted(os.sched_getaffinity(0) if available is None else available)
    keep = max(1, len(cores) - max(0, reserved))
    return CoreSplit(step=tuple(cores[:keep]), other=tuple(cores[keep:]))
