"""The step loop: schedule → launch → collect → update. Knows nothing of text.

Synchronous: each `step()` runs one step to completion. Async (`async_scheduling=True`): `step()`
schedules and launches step N+1 first, then collects and updates step N, so the host's work on
step N's results (and on the step after) overlaps step N+1 on the device. Its first call returns
no outputs (nothing has finished yet) and the loop ends by collecting the last step in flight;
`has_unfinished_requests()` stays true until then.

Pipelined (a scheduler with `pipeline_depth=P > 1`: pipeline parallelism's P stages): `step()`
schedules and launches steps until P are in flight or nothing more can be scheduled, then
collects and updates the oldest. The runner's launch returns once stage 0 has run its part of a
step (its logits arrive from the last stage later: graphs/pipeline_step_graph.py), so stage 0
runs step N+1 while stage 1 runs step N, and no stage idles at every step's fill and drain. The
scheduler keeps the steps in flight disjoint in the requests that sample (core/scheduler.py).

The runner is any `Runner` (records/runner.py): the local model runner, or under tensor
parallelism rank 0's broadcaster; the core imports neither.

Sampling state: the runner reads, for requests that need it (penalties, min_tokens, prompt
logprobs), the request's token history — the scheduler's own record, appended at each update —
which the core registers and drops when the request ends; after each update the core passes the
accepted tokens to `runner.record_outputs` for the requests whose `add_request` said it keeps
such state (only tensor-parallel workers' replicas of those histories need them).
Logprobs come back with the runner's output and are attached to the update's records here
(joined by request id, so tokens the update dropped carry none); prompt logprobs arrive chunk by
chunk with the prefill and are attached to the request's first token.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Generic

from compiled_engine.core.scheduler import Scheduler
from compiled_engine.records.engine_core_output import EngineCoreOutput
from compiled_engine.records.request import Request, RequestStatus
from compiled_engine.records.runner import LaunchedT, Runner
from compiled_engine.records.runner_output import ModelRunnerOutput, TokenLogprobs
from compiled_engine.records.scheduler_output import SchedulerOutput


@dataclass
class CoreTimeline:
    """Host seconds per phase over the core's life (the runner keeps the device side)."""

    schedule_s: float = 0.0
    update_s: float = 0.0
    step_wall_s: float = 0.0  # inside step(), all phases


class EngineCore(Generic[LaunchedT]):
    def __init__(
        self, scheduler: Scheduler, runner: Runner[LaunchedT], async_scheduling: bool = False
    ) -> None:
        if async_scheduling and scheduler.config.max_in_flight_steps < 2:
            raise ValueError("async scheduling needs a scheduler with max_in_flight_steps >= 2")
        if async_scheduling and scheduler.config.pipeline_depth > 1:
            raise ValueError("async scheduling and a pipelined scheduler (pipeline_depth > 1) do not mix")
        self.scheduler = scheduler
        self.runner: Runner[LaunchedT] = runner
        self.async_scheduling = async_scheduling
        self.pipeline_depth = scheduler.config.pipeline_depth
        # Over the core's life: the most steps that were in flight at once (pipelined loop).
        self.max_steps_in_flight = 0
        self._launched: deque[LaunchedT] = deque()
        # Prompt logprobs of requests still prefilling: one slot per prompt token after the first.
        self._prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
        # Requests the runner keeps state for that follows their outputs (runner.record_outputs).
        self._recorded: set[str] = set()
        self.timeline = CoreTimeline()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        params = request.sampling_params
        if self.runner.add_request(request.request_id, request.history, params, request.eos_token_ids):
            self._recorded.add(request.request_id)
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request.request_id] = [None] * (request.num_prompt_tokens - 1)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        self._forget(request_ids)

    def finish_requests(self, request_ids: list[str]) -> None:
        """Stop requests the output side ended (a stop string matched in the text)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)
        self._forget(request_ids)

    def _forget(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        self.runner.remove_requests(request_ids)
        for request_id in request_ids:
            self._prompt_logprobs.pop(request_id, None)
            self._recorded.discard(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._launched)

    def step(self) -> list[EngineCoreOutput]:
        started = time.perf_counter()
        try:
            if self.pipeline_depth > 1:
                return self._step_pipelined()
            return self._step_async() if self.async_scheduling else self._step_sync()
        finally:
            self.timeline.step_wall_s += time.perf_counter() - started

    def drain(self) -> list[EngineCoreOutput]:
        """Collect and apply every step in flight."""
        outputs: list[EngineCoreOutput] = []
        while self._launched:
            outputs += self._finish_oldest()
        return outputs

    def _step_sync(self) -> list[EngineCoreOutput]:
        scheduled = self._schedule()
        if scheduled.is_empty:
            return []
        self._launch(scheduled)
        return self._finish_oldest()

    def _step_async(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        scheduled = self._schedule()
        if scheduled.waiting_for_in_flight:
            # Preemption needs blocks a step in flight still reads: let it finish first.
            outputs = self._finish_oldest()
            scheduled = self._schedule()
        if not scheduled.is_empty:
            self._launch(scheduled)
        if not outputs and (len(self._launched) > 1 or (scheduled.is_empty and self._launched)):
            outputs = self._finish_oldest()
        return outputs

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        while len(self._launched) < self.pipeline_depth:
            scheduled = self._schedule()
            if scheduled.is_empty:  # every request is in flight, or one waits for blocks they hold
                break
            self._launch(scheduled)
            self.max_steps_in_flight = max(self.max_steps_in_flight, len(self._launched))
        return self._finish_oldest() if self._launched else []

    def _schedule(self) -> SchedulerOutput:
        started = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self.timeline.schedule_s += time.perf_counter() - started
        return scheduled

    def _launch(self, scheduled: SchedulerOutput) -> None:
        try:
            self._launched.append(self.runner.launch(scheduled))
        except BaseException:
            self.scheduler.cancel_step()
            if self._launched:  # the step before may have failed on the worker: start clean
                self._cancel_all()
            raise

    def _finish_oldest(self) -> list[EngineCoreOutput]:
        launched = self._launched[0]
        try:
            runner_output = self.runner.collect(launched)
        except BaseException:
            self._cancel_all()
            raise
        self._launched.popleft()
        started = time.perf_counter()
        outputs = self.scheduler.update(launched.step, runner_output)
        outputs = self._after_update(outputs, runner_output)
        self.timeline.update_s += time.perf_counter() - started
        return outputs

    def _after_update(
        self, outputs: list[EngineCoreOutput], runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Keep replicas of the histories current (runner.record_outputs) and attach the step's logprobs."""
        for request_id, chunk in (runner_output.prompt_logprobs or {}).items():
            slots = self._prompt_logprobs.get(request_id)  # None: the request ended meanwhile
            if slots is not None:
                first = chunk.first_position
                slots[first : first + len(chunk.entries)] = chunk.entries
        record_outputs = self.runner.record_outputs
        logprobs = None
        if runner_output.logprobs is not None:
            logprobs = dict(zip(runner_output.request_ids, runner_output.logprobs, strict=True))
        # Speculative decoding: a row that emitted a run has a record per token of it; the update
        # may have cut the run at a stop, so only the first len(new_token_ids) are attached.
        run_logprobs = runner_output.draft_logprobs or {}
        recorded = self._recorded
        if logprobs is None and not self._prompt_logprobs:  # most steps: nothing to attach
            if recorded:
                for out in outputs:
                    if out.request_id in recorded:
                        record_outputs(out.request_id, out.new_token_ids)
            finished = [out.request_id for out in outputs if out.finished]
            if finished:
                self._forget(finished)
            return outputs
        attached = []
        for out in outputs:
            if out.request_id in recorded:
                record_outputs(out.request_id, out.new_token_ids)
            token_logprobs = logprobs.get(out.request_id) if logprobs is not None else None
            run = run_logprobs.get(out.request_id)
            if run is not None:
                out = out._replace(new_logprobs=run[: len(out.new_token_ids)])
            elif token_logprobs is not None:
                out = out._replace(new_logprobs=(token_logprobs,))
            if out.request_id in self._prompt_logprobs:
                out = out._replace(prompt_logprobs=self._complete_prompt_logprobs(out.request_id))
            if out.finished:
                self._forget(out.request_id)
            attached.append(out)
        return attached

    def _complete_prompt_logprobs(self, request_id: str) -> tuple[TokenLogprobs | None, ...]:
        slots = self._prompt_logprobs.pop(request_id)
        missing = [i + 1 for i, entry in enumerate(slots) if entry is None]
        if missing:
            # Only if the prefill skipped positions, e.g. a prefix-cache hit: those logits were
            # never computed, and the request must not read cached blocks.
            raise RuntimeError(
                f"request {request_id!r}: prompt logprobs of prompt positions {missing[:8]} were never "
                "computed (was its prompt read from the prefix cache?)"
            )
        return (None, *slots)

    def _cancel_all(self) -> None:
        """A step failed: forget every step in flight (newest first); their tokens run again."""
        for _ in self._launched:
            self.scheduler.cancel_step()
        self._launched.clear()
        self.runner.reset_after_failure()
