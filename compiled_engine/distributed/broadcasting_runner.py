"""Rank 0's runner under tensor parallelism: every call that shapes a step goes to all ranks.

The engine core talks to this as to a ModelRunner. A call that changes what the next step
computes is broadcast first (workers apply it to their own runner: worker_main.serve_runner),
then run here; everything else is read from rank 0's runner. If a worker dies, the group's
next collective fails at once and the error names the worker; the engine stays down.
"""

from __future__ import annotations

from typing import Any

from compiled_engine.distributed.process_group import TensorParallelGroup
from compiled_engine.distributed.workers import TensorParallelWorkerError, WorkerProcesses

MIRRORED = ("add_request", "launch", "reset_after_failure")


class BroadcastingRunner:
    def __init__(self, runner: Any, group: TensorParallelGroup, workers: WorkerProcesses) -> None:
        self._runner = runner
        self._group = group
        self._workers = workers
        self._dead: str | None = None

    def __getattr__(self, name: str) -> Any:
        if name in MIRRORED:
            return lambda *args: self._mirrored(name, args)
        return getattr(self._runner, name)

    # Only requests with sampling state (penalties, min_tokens, prompt logprobs) are affected by
    # these two, and every rank holds the same states (add_request is mirrored): the others need
    # no broadcast, which would otherwise be one per request per step.
    def record_outputs(self, request_id: str, token_ids: Any) -> None:
        if request_id in self._runner.request_states:
            self._mirrored("record_outputs", (request_id, token_ids))

    def remove_requests(self, request_ids: Any) -> None:
        with_state = tuple(r for r in request_ids if r in self._runner.request_states)
        if with_state:
            self._mirrored("remove_requests", (with_state,))

    def collect(self, launched: Any) -> Any:
        return self._mirrored("collect", (), lambda: self._runner.collect(launched))

    def _mirrored(self, method: str, args: tuple, local=None) -> Any:
        if self._dead is not None:
            raise TensorParallelWorkerError(self._dead)
        try:
            self._group.broadcast((method, args))
            return local() if local is not None else getattr(self._runner, method)(*args)
        except Exception as exc:
            failure = self._workers.wait_for_failure()
            if failure is None:
                raise
            self._dead = f"{failure}\nthe engine cannot run steps any more; start a new one"
            raise TensorParallelWorkerError(self._dead) from exc
