"""What rank 0 tells its tensor-parallel workers: one frozen message per runner call that shapes a step.

`BroadcastingRunner` sends each over the group before running the call on rank 0's runner;
`worker_main.serve_runner` applies them, in the order sent, to the worker's own runner.
"""

from __future__ import annotations

from dataclasses import dataclass

from compiled_engine.records.request import TokenHistory
from compiled_engine.records.scheduler_output import SchedulerOutput
from compiled_engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    # Pickled on the way, so each worker receives a replica of the owner's history.
    history: TokenHistory
    params: SamplingParams
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class RecordOutputs:
    request_id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RemoveRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class LaunchStep:
    step: SchedulerOutput


@dataclass(frozen=True)
class CollectStep:
    """Collect the oldest step launched and not collected yet (every rank launches the same steps)."""


@dataclass(frozen=True)
class ResetAfterFailure:
    """A step failed: forget every launched step."""


@dataclass(frozen=True)
class ReportStageTimes:
    """Pipeline parallelism: every rank sends rank 0 its stage's step-graph times (a gather);
    `reset` starts them again from zero (graphs/pipeline_step_graph.py)."""

    reset: bool = False


@dataclass(frozen=True)
class Shutdown:
    """The engine closes: leave the serving loop."""


RunnerMessage = (
    AddRequest
    | RecordOutputs
    | RemoveRequests
    | LaunchStep
    | CollectStep
    | ResetAfterFailure
    | ReportStageTimes
    | Shutdown
)
