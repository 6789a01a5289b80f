"""The seam between the engine core and whatever runs its steps.

The core drives a `Runner`: the local `worker.model_runner.ModelRunner`, or under tensor
parallelism `distributed.broadcasting_runner.BroadcastingRunner`, which sends each call that
shapes a step to every rank first. Both satisfy this protocol structurally; neither imports the
core, and the core imports neither.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from compiled_engine.records.graph_status import GraphCall, GraphWait
from compiled_engine.records.request import TokenHistory
from compiled_engine.records.runner_output import ModelRunnerOutput
from compiled_engine.records.scheduler_output import SchedulerOutput
from compiled_engine.sampling_params import SamplingParams


@dataclass
class RunnerTimeline:
    """Seconds spent per phase over the runner's life (the async loop's step timeline)."""

    num_steps: int = 0
    prepare_s: float = 0.0  # host: staging a step (numpy, copies into the slot, generators)
    execute_s: float = 0.0  # the step's work: input copy, graph, sampling (on CUDA: launching it)
    wait_s: float = 0.0  # host blocked waiting for a step's tokens
    # Steps that waited on the request path for their graph to compile or load (a stall), and
    # steps that ran a fallback graph because theirs was still compiling in the background.
    graph_waits: list[GraphWait] = field(default_factory=list)
    num_fallback_steps: int = 0

    def record_graph_call(self, step: int, call: GraphCall | None) -> None:
        """What the step graph said about one step (`StepGraph.last_call`)."""
        if call is None:
            return
        if call.waited is not None:
            self.graph_waits.append(GraphWait(step, call.wanted, call.waited, call.wait_s))
        if call.fell_back:
            self.num_fallback_steps += 1


class Launched(Protocol):
    """What the core reads of a step a runner launched; the runner keeps the rest in its own record."""

    @property
    def step(self) -> SchedulerOutput: ...


# The runner's own record of a launched step: `launch` returns one, `collect` takes it back.
LaunchedT = TypeVar("LaunchedT", bound=Launched)


class Runner(Protocol[LaunchedT]):
    """Every call the engine core (and the engine's stats) make on a runner."""

    @property
    def timeline(self) -> RunnerTimeline: ...

    def add_request(
        self,
        request_id: str,
        history: TokenHistory,
        params: SamplingParams,
        eos_token_ids: Collection[int] = (),
    ) -> bool:
        """A new request: keep what its sampling needs beyond a step's tokens, if anything (its
        history is the scheduler's record, read, never copied, in this process). True when it
        keeps such state: only then has `record_outputs` anything to do for the request."""
        ...

    def record_outputs(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Output tokens the scheduler accepted for a request (after a step's update)."""
        ...

    def remove_requests(self, request_ids: Collection[str]) -> None:
        """Requests that ended: forget their sampling state."""
        ...

    def launch(self, step: SchedulerOutput) -> LaunchedT:
        """Stage the step and queue its work; may return before the work is done."""
        ...

    def collect(self, launched: LaunchedT) -> ModelRunnerOutput:
        """Wait for the oldest launched step not collected yet and return its tokens."""
        ...

    def reset_after_failure(self) -> None:
        """Forget every launched step after one failed, so new steps can run."""
        ...
