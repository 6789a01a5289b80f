"""A tensor-parallel worker process (rank >= 1): build the engine's rank, then run rank 0's steps.

The engine hands the runtime `serve_rank`, which builds the worker's rank with the very
constructor rank 0 runs (engine/llm_engine.py: serve_tensor_parallel_rank), so every collective
of start-up (warm-up steps, graph captures, KV sizing) happens in the same order on every rank,
and then serves it here: each call rank 0 makes that changes what a step computes (a step's launch
and collect, requests' sampling state) arrives over the group as a message
(distributed/runner_messages.py) and runs on this rank's runner, until `Shutdown`.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

from compiled_engine.distributed.process_group import RendezvousAddress, TensorParallelGroup
from compiled_engine.distributed.runner_messages import (
    AddRequest,
    CollectStep,
    LaunchStep,
    RecordOutputs,
    RemoveRequests,
    ReportStageTimes,
    ResetAfterFailure,
    Shutdown,
)
from compiled_engine.records.runner import Runner

# Builds this process's rank of the engine and serves it until rank 0 says stop; spawned into
# the worker, so it must pickle (a module-level function, or a functools.partial of one).
ServeRank = Callable[[int, RendezvousAddress], None]

PARENT_POLL_S = 1.0


def _exit_if_orphaned(parent_pid: int) -> None:
    """Rank 0's process is gone (killed): leave too, even from inside a long compile."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def run_worker(rank: int, address: RendezvousAddress, serve_rank: ServeRank, reports: Any) -> None:
    from compiled_engine.distributed.workers import _Report

    threading.Thread(target=_exit_if_orphaned, args=(os.getppid(),), daemon=True).start()
    try:
        reports.put(_Report("joining", rank))
        serve_rank(rank, address)
    except BaseException:
        reports.put(_Report("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None


def serve_runner(runner: Runner[Any], group: TensorParallelGroup) -> None:
    """Apply rank 0's runner calls to this rank's runner until rank 0 sends Shutdown."""
    launched: deque[Any] = deque()  # this rank's own records of the steps in flight, oldest first
    while True:
        message = group.broadcast()
        match message:
            case LaunchStep(step=step):
                launched.append(runner.launch(step))
            case CollectStep():
                runner.collect(launched.popleft())
            case AddRequest(request_id=request_id, history=history, params=params, eos_token_ids=eos):
                runner.add_request(request_id, history, params, eos)
            case RecordOutputs(request_id=request_id, token_ids=token_ids):
                runner.record_outputs(request_id, token_ids)
            case RemoveRequests(request_ids=request_ids):
                runner.remove_requests(request_ids)
            case ResetAfterFailure():
                launched.clear()
                runner.reset_after_failure()
            case ReportStageTimes(reset=reset):
                group.gather(runner.step_graph.stage_times(reset))  # type: ignore[attr-defined]
            case Shutdown():
                return
            case _:
                raise TypeError(f"rank 0 sent {message!r}, which is no runner message")
