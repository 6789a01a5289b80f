"""A tensor-parallel worker process (rank >= 1): build the engine's rank, then run rank 0's steps.

The worker builds its rank with the very constructor rank 0 runs (LLMEngine), so every
collective of start-up (warm-up steps, graph captures, KV sizing) happens in the same order on
every rank. Then it mirrors rank 0's runner: each call rank 0 makes that changes what a step
computes (a step's launch and collect, requests' sampling state) arrives over the group and
runs here; `None` means stop.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections import deque
from typing import TYPE_CHECKING, Any

from compiled_engine.distributed.process_group import RendezvousAddress

if TYPE_CHECKING:
    from compiled_engine.engine_args import EngineArgs

PARENT_POLL_S = 1.0


def _exit_if_orphaned(parent_pid: int) -> None:
    """Rank 0's process is gone (killed): leave too, even from inside a long compile."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def run_worker(
    rank: int, world_size: int, address: RendezvousAddress, engine_args: EngineArgs, reports: Any
) -> None:
    from compiled_engine.distributed.workers import _Report

    threading.Thread(target=_exit_if_orphaned, args=(os.getppid(),), daemon=True).start()
    engine = None
    try:
        import torch

        from compiled_engine.engine.llm_engine import LLMEngine

        if engine_args.resolve_device().type == "cpu":
            # The ranks share the host's cores.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        reports.put(_Report("joining", rank))
        engine = LLMEngine(engine_args, _tensor_parallel_rank=(rank, address))
        serve_runner(engine.core.runner, engine.tensor_parallel.group)
    except BaseException:
        reports.put(_Report("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if engine is not None and engine.tensor_parallel is not None:
            engine.tensor_parallel.group.close()


def serve_runner(runner: Any, group: Any) -> None:
    """Apply rank 0's runner calls to this rank's runner until rank 0 sends None."""
    launched: deque[Any] = deque()
    while True:
        message = group.broadcast()
        if message is None:
            return
        method, args = message
        if method == "launch":
            launched.append(runner.launch(*args))
        elif method == "collect":
            runner.collect(launched.popleft())
        elif method == "reset_after_failure":
            launched.clear()
            runner.reset_after_failure()
        else:
            getattr(runner, method)(*args)
