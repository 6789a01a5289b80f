"""The step loop: schedule → execute → update. Knows nothing of text."""

from __future__ import annotations

from compiled_engine.core.engine_core_output import EngineCoreOutput
from compiled_engine.core.scheduler import Scheduler
from compiled_engine.engine.request import Request, RequestStatus
from compiled_engine.worker.model_runner import ModelRunner
from compiled_engine.worker.runner_output import ModelRunnerOutput


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def finish_requests(self, request_ids: list[str]) -> None:
        """Stop requests the output side ended (a stop string matched in the text)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            # Nothing to run, but update() still consumes the step (the scheduler insists that
            # schedule and update alternate).
            runner_output = ModelRunnerOutput(request_ids=(), sampled_token_ids=())
        else:
            try:
                runner_output = self.runner.execute(scheduled)
            except BaseException:
                self.scheduler.cancel_step()
                raise
        return self.scheduler.update(scheduled, runner_output)
