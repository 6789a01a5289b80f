"""Rank 0's runner under tensor parallelism: every call that shapes a step goes to all ranks.

The engine core drives this as any `Runner` (records/runner.py). A call that changes what the
next step computes is broadcast first as a typed message (distributed/runner_messages.py; the
workers apply it to their own runner: worker_main.serve_runner), then run here with the same
values. If a worker dies, the group's next collective fails at once and the error names the
worker; the engine stays down.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

from compiled_engine.distributed.process_group import TensorParallelGroup
from compiled_engine.distributed.runner_messages import (
    AddRequest,
    CollectStep,
    LaunchStep,
    RecordOutputs,
    RemoveRequests,
    ReportStageTimes,
    ResetAfterFailure,
    RunnerMessage,
)
from compiled_engine.distributed.workers import TensorParallelWorkerError, Workers
from compiled_engine.records.request import TokenHistory
from compiled_engine.records.runner import LaunchedT, Runner, RunnerTimeline
from compiled_engine.records.runner_output import ModelRunnerOutput
from compiled_engine.records.scheduler_output import SchedulerOutput
from compiled_engine.sampling_params import SamplingParams

T = TypeVar("T")


class StatefulRunner(Runner[LaunchedT], Protocol[LaunchedT]):
    """A runner that shows which requests it keeps sampling state for (ModelRunner does)."""

    @property
    def request_states(self) -> Mapping[str, object]: ...


class BroadcastingRunner(Generic[LaunchedT]):
    def __init__(
        self, runner: StatefulRunner[LaunchedT], group: TensorParallelGroup, workers: Workers
    ) -> None:
        self._runner = runner
        self._group = group
        self._workers = workers
        self._dead: str | None = None

    @property
    def timeline(self) -> RunnerTimeline:
        return self._runner.timeline  # rank 0's: every rank runs the same steps

    def add_request(
        self,
        request_id: str,
        history: TokenHistory,
        params: SamplingParams,
        eos_token_ids: Collection[int] = (),
    ) -> bool:
        message = AddRequest(request_id, history, params, frozenset(eos_token_ids))
        # Rank 0 keeps the owner's history itself; the workers unpickle replicas of it.
        return self._on_every_rank(
            message, lambda: self._runner.add_request(request_id, history, params, message.eos_token_ids)
        )

    # Only requests with sampling state (penalties, min_tokens, prompt logprobs) are affected by
    # these two, and every rank holds the same states (add_request reaches every rank): the others
    # need no broadcast, which would otherwise be one per request per step.
    def record_outputs(self, request_id: str, token_ids: Sequence[int]) -> None:
        if request_id in self._runner.request_states:
            message = RecordOutputs(request_id, tuple(token_ids))
            self._on_every_rank(
                message, lambda: self._runner.record_outputs(message.request_id, message.token_ids)
            )

    def remove_requests(self, request_ids: Collection[str]) -> None:
        with_state = tuple(r for r in request_ids if r in self._runner.request_states)
        if with_state:
            message = RemoveRequests(with_state)
            self._on_every_rank(message, lambda: self._runner.remove_requests(message.request_ids))

    def launch(self, step: SchedulerOutput) -> LaunchedT:
        return self._on_every_rank(LaunchStep(step), lambda: self._runner.launch(step))

    def collect(self, launched: LaunchedT) -> ModelRunnerOutput:
        return self._on_every_rank(CollectStep(), lambda: self._runner.collect(launched))

    def stage_times(self, reset: bool = False) -> list[Any]:
        """Pipeline parallelism: every rank's stage times (graphs/pipeline_step_graph.py), by rank."""
        step_graph: Any = getattr(self._runner, "step_graph", None)
        gathered = self._on_every_rank(
            ReportStageTimes(reset), lambda: self._group.gather(step_graph.stage_times(reset))
        )
        assert gathered is not None  # rank 0 gathers
        return gathered

    def reset_after_failure(self) -> None:
        self._on_every_rank(ResetAfterFailure(), self._runner.reset_after_failure)

    def _on_every_rank(self, message: RunnerMessage, run_here: Callable[[], T]) -> T:
        """Send `message` to the workers, then run its call on rank 0's runner."""
        if self._dead is not None:
            raise TensorParallelWorkerError(self._dead)
        try:
            self._group.broadcast(message)
            return run_here()
        except Exception as exc:
            failure = self._workers.wait_for_failure()
            if failure is None:
                raise
            self._dead = f"{failure}\nthe engine cannot run steps any more; start a new one"
            raise TensorParallelWorkerError(self._dead) from exc
