"""Rank 0's handle on the worker processes (ranks 1..N-1): start, watch, stop.

Workers are spawned (a fresh interpreter: no CUDA context or threads inherited) and report
through a queue: "joining" once imported, or their traceback if they fail. A worker that dies
is noticed at once by the process group (its sockets close); `failure()` then names it.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from compiled_engine.distributed.process_group import RendezvousAddress
from compiled_engine.distributed.worker_main import ServeRank, run_worker

# Importing torch and transformers in a fresh interpreter takes a few seconds; more means stuck.
JOIN_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
FAILURE_GRACE_S = 3.0


class TensorParallelWorkerError(RuntimeError):
    """A tensor-parallel worker process failed or died; the engine cannot run steps any more."""


@dataclass
class _Report:
    kind: str  # "joining" or "error"
    rank: int
    text: str = ""


def poll_failure(failure: Callable[[], str | None], timeout_s: float) -> str | None:
    """`failure()` until it names one or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while (found := failure()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


class Workers(Protocol):
    """Rank 0's handle on ranks 1..N-1: spawned processes here, Ray actors in ray_workers.py."""

    def wait_joining(self, timeout_s: float = ...) -> None: ...

    def failure(self) -> str | None: ...

    def wait_for_failure(self, timeout_s: float = ...) -> str | None: ...

    def kill(self) -> None: ...

    def stop(self) -> None: ...


class WorkerProcesses:
    def __init__(self, world_size: int, address: RendezvousAddress, serve_rank: ServeRank) -> None:
        context = mp.get_context("spawn")
        self._reports: Any = context.Queue()
        self._errors: dict[int, str] = {}
        self._joining: set[int] = set()
        self.processes = [
            context.Process(
                target=run_worker,
                args=(rank, address, serve_rank, self._reports),
                name=f"compiled-engine-tp-rank{rank}",
                daemon=True,  # ended with the user's process, even if it never calls close()
            )
            for rank in range(1, world_size)
        ]
        for process in self.processes:
            process.start()

    def wait_joining(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Return once every worker is about to join the group; raise if one fails first."""
        deadline = time.monotonic() + timeout_s
        while len(self._joining) < len(self.processes):
            failure = self.failure()
            if failure is not None:
                raise TensorParallelWorkerError(failure)
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, len(self.processes) + 1)) - self._joining)
                raise TensorParallelWorkerError(
                    f"tensor-parallel workers {missing} did not start within {timeout_s:.0f} s"
                )
            time.sleep(0.05)

    def _drain(self) -> None:
        """Read every report the workers have sent so far."""
        while True:
            try:
                report: _Report = self._reports.get_nowait()
            except (queue.Empty, OSError, ValueError):
                return
            if report.kind == "error":
                self._errors[report.rank] = report.text
            else:
                self._joining.add(report.rank)

    def failure(self) -> str | None:
        """What went wrong with the workers, if anything: who died, how, and their error."""
        self._drain()
        problems = []
        for rank, process in enumerate(self.processes, start=1):
            code = process.exitcode
            if code is None and rank not in self._errors:
                continue
            how = "is failing" if code is None else f"exited with code {code}"
            if code is not None and code < 0:
                how += f" ({signal.Signals(-code).name})"
            problem = f"tensor-parallel worker rank {rank} (pid {process.pid}) {how}"
            if rank in self._errors:
                problem += f":\n{self._errors[rank].rstrip()}"
            problems.append(problem)
        return "\n".join(problems) or None

    def wait_for_failure(self, timeout_s: float = FAILURE_GRACE_S) -> str | None:
        """failure(), given a dying worker a moment to be reaped (its sockets close first)."""
        return poll_failure(self.failure, timeout_s)

    def kill(self) -> None:
        for process in self.processes:
            process.kill()

    def stop(self) -> None:
        """Wait for the workers to leave (after the group told them to), then make sure they have."""
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(STOP_TIMEOUT_S)
        self._reports.close()
        self._reports.join_thread()
