"""The background graph compiler: a spawned process that compiles the engine's missing buckets.

It rebuilds what the serving process built — the model from the same folder and dtype, a
runner with the same options on a small KV cache of the same layout (the block count is not
part of the compile-cache key) — checks that this lands on the very compile-cache entry the
engine reads, then compiles each bucket it was given, in order, into that entry, reporting
each one on its pipe (graphs/background_builds.py reads the reports and hands the graphs to
the serving process through the cache).

It runs at the lowest CPU priority (Linux's idle scheduling class, nice 19) from its first
instruction (the engine lowers it as it spawns it, graphs/background_builds.py), so on a busy
machine the OS schedules serving first: the compiler takes what serving leaves
(docs/performance.md measures what it costs the foreground).
With cores reserved (`cpu_reserved_cores`), it is pinned to those, off the step threads' cores.
It holds a second copy of the weights while it runs, and exits when every bucket is built.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from compiled_engine.config import EngineConfig
from compiled_engine.graphs.background_builds import (
    Bucket,
    abort_message,
    compiled_message,
    compiling_message,
    failed_message,
)

if TYPE_CHECKING:
    from compiled_engine.graphs.step_graph import StepGraph

# Nice value of the compiler process: the lowest priority Linux has.
COMPILER_NICENESS = 19
# Blocks of the compiler's own KV cache: enough for the traced step (graphs/traced_step.py).
COMPILER_KV_BLOCKS = 4


@dataclass(frozen=True)
class CompileJob:
    """What the compiler process needs to rebuild the serving process's step graph (pickled)."""

    config: EngineConfig  # cache_dir: the cache root the engine actually uses
    kv_cache_shapes: tuple[tuple[int, ...], ...]  # per layer; dim 1 (blocks) is replaced


def compile_missing_buckets(job: CompileJob, buckets: list[Bucket], entry_dir: str, conn: Connection) -> None:
    """The compiler process's main: compile `buckets` in order into the compile-cache entry
    `entry_dir` (the engine's), reporting each on `conn`."""
    logging.basicConfig(level=logging.WARNING)
    try:
        step = _build_step_graph(job)
    except Exception as exc:  # noqa: BLE001 - reported to the engine, which keeps serving
        conn.send(abort_message(f"rebuilding the model failed: {exc!r}"))
        return
    entry = step.cache_entry
    if entry is None or str(entry.dir) != entry_dir:
        conn.send(
            abort_message(
                f"it built compile-cache entry {entry.dir if entry else None}, not the engine's {entry_dir}"
            )
        )
        return
    for bucket in buckets:
        conn.send(compiling_message(bucket))
        started = time.perf_counter()
        try:
            step.compile_buckets([bucket])
        except Exception as exc:  # noqa: BLE001 - one bucket's failure is reported, the rest go on
            conn.send(failed_message(bucket, repr(exc)))
            continue
        if not step.builds[bucket].saved:
            conn.send(failed_message(bucket, "its graph could not be saved to the compile cache"))
            continue
        conn.send(compiled_message(bucket, time.perf_counter() - started))
    conn.close()


def _build_step_graph(job: CompileJob) -> StepGraph:
    import torch

    from compiled_engine.model_loader.loader import load_model
    from compiled_engine.worker.model_runner import ModelRunner

    config = job.config
    loaded = load_model(
        config.model_dir, dtype=str(config.dtype).removeprefix("torch."), device=config.device
    )
    from compiled_engine.kernels import kv_quant

    # The serving process's layout: its shapes (packed rows when quantized) and storage dtype.
    kv_dtype = kv_quant.storage_dtype(config.kv_cache_dtype, config.dtype)
    caches = [
        torch.zeros((shape[0], COMPILER_KV_BLOCKS, *shape[2:]), dtype=kv_dtype, device=config.device)
        for shape in job.kv_cache_shapes
    ]
    # Compile on demand (compile_buckets), on the synchronous path: no compiler of its own.
    runner = ModelRunner(
        loaded.model,
        caches,
        dataclasses.replace(config, compile_policy="blocking", async_scheduling=False),
    )
    return runner.step_graph


def main(argv: list[str]) -> None:
    """`python -m compiled_engine.worker.graph_compiler_process <fd>`: the job comes pickled on
    stdin, the reports go to a Connection over file descriptor `fd` (graphs/background_builds.py)."""
    conn = Connection(int(argv[0]), readable=False)
    job, buckets, entry_dir = pickle.load(sys.stdin.buffer)
    try:
        compile_missing_buckets(job, buckets, entry_dir, conn)
    except (BrokenPipeError, ConnectionResetError):  # the engine is gone: nothing left to do
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
