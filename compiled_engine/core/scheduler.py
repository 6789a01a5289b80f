"""Continuous batching: which requests run each step, with how many tokens, in which KV blocks.

Policy, in one place:
- The step's token budget goes to RUNNING requests first, oldest first, then to WAITING ones in
  arrival order. A decoding request takes 1 token; one still prefilling (a long prompt, or a
  recompute after preemption) takes what remains of its known tokens, cut to the budget left,
  so long prompts are chunked across steps and mix with decodes.
- A running request that cannot get blocks preempts the NEWEST running request (possibly
  itself): its blocks are freed and it goes back to the HEAD of the queue to recompute
  prompt + outputs later. The oldest request can therefore always take the whole cache, and
  `add_request` rejects any request that could not finish alone in the whole cache, so some
  request always makes progress.
- Waiting requests are admitted only into free blocks (never by preempting), strictly FCFS.

`schedule()` and `update()` alternate: the scheduler needs the tokens sampled in one step to
feed the next.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from compiled_engine.core.engine_core_output import EngineCoreOutput
from compiled_engine.core.kv_cache_manager import KVCacheManager
from compiled_engine.core.scheduler_config import SchedulerConfig
from compiled_engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from compiled_engine.engine.request import Request, RequestStatus
from compiled_engine.errors import InvalidRequestError
from compiled_engine.worker.runner_output import ModelRunnerOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self._kv_cache_manager = KVCacheManager(config.num_kv_blocks, config.block_size)
        self._requests: dict[str, Request] = {}  # unfinished requests, waiting or running
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admission order, oldest first
        self._finished_since_last_schedule: list[str] = []
        # Requests of the step handed out by schedule() and not yet passed to update().
        self._in_flight: dict[str, Request] | None = None
        self.num_preemptions = 0  # over the scheduler's life, for stats and tests

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self._kv_cache_manager

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def add_request(self, request: Request) -> None:
        self._validate_new_request(request)
        self._requests[request.request_id] = request
        self._waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str] | str) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str] | str, status: RequestStatus) -> None:
        """End requests from outside (abort, stop string); unknown or finished ids are ignored."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.WAITING:
                self._waiting.remove(request)
            else:
                self._running.remove(request)
            self._finish(request, status)

    def cancel_step(self) -> None:
        """Forget the step handed out by schedule() when running it failed.

        Nothing was advanced for it, so its tokens are simply scheduled again (or the caller
        aborts the requests).
        """
        self._in_flight = None

    def schedule(self) -> SchedulerOutput:
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before update() consumed the previous step")
        budget = self._config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted_ids: list[str] = []

        index = 0
        while index < len(self._running) and budget > 0:
            request = self._running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new_tokens <= 0:
                raise RuntimeError(
                    f"running request {request.request_id!r} has no token to compute; "
                    "update() was not applied to its last step"
                )
            if not self._allocate_or_preempt(request, num_new_tokens, preempted_ids):
                break  # it was the newest running request, so nothing follows it
            scheduled.append(self._scheduled_request(request, num_new_tokens))
            budget -= num_new_tokens
            index += 1

        # A step that had to preempt is short of blocks: admitting new work now would only
        # take blocks the running requests need next step (and could re-admit the victim).
        if not preempted_ids:
            while self._waiting and len(self._running) < self._config.max_num_seqs and budget > 0:
                request = self._waiting[0]
                num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
                end = request.num_computed_tokens + num_new_tokens
                if not self._kv_cache_manager.allocate_slots(request.request_id, end):
                    break  # FCFS: later requests do not overtake the head of the queue
                self._waiting.popleft()
                request.status = RequestStatus.RUNNING
                self._running.append(request)
                scheduled.append(self._scheduled_request(request, num_new_tokens))
                budget -= num_new_tokens

        finished_ids = tuple(self._finished_since_last_schedule)
        self._finished_since_last_schedule.clear()
        if scheduled:
            self._in_flight = {s.request_id: self._requests[s.request_id] for s in scheduled}
        return SchedulerOutput(
            scheduled=tuple(scheduled),
            num_batched_tokens=self._config.max_num_batched_tokens - budget,
            preempted_request_ids=tuple(preempted_ids),
            finished_request_ids=finished_ids,
        )

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply a finished step: advance progress, append sampled tokens, run stop checks.

        Returns one record per request that got a token. Requests finished from outside while
        the step ran (abort, stop string) are skipped, their sampled token dropped.
        """
        in_flight = self._in_flight or {}
        scheduled_ids = {s.request_id for s in scheduler_output.scheduled}
        if scheduled_ids != in_flight.keys():
            raise ValueError("update() got a SchedulerOutput that is not the step last scheduled")
        sampling_ids = tuple(s.request_id for s in scheduler_output.scheduled if s.sample)
        if tuple(runner_output.request_ids) != sampling_ids or len(runner_output.sampled_token_ids) != len(
            sampling_ids
        ):
            raise ValueError(
                f"runner output must sample exactly the requests with sample=True, in order: "
                f"expected {sampling_ids}, got {tuple(runner_output.request_ids)} with "
                f"{len(runner_output.sampled_token_ids)} token(s)"
            )
        self._in_flight = None
        sampled = dict(zip(runner_output.request_ids, runner_output.sampled_token_ids, strict=True))

        outputs: list[EngineCoreOutput] = []
        finished_any = False
        for scheduled_request in scheduler_output.scheduled:
            request = in_flight[scheduled_request.request_id]
            if request.status.finished:
                continue
            request.num_computed_tokens += len(scheduled_request.token_ids)
            if not scheduled_request.sample:
                continue
            token_id = sampled[request.request_id]
            request.output_token_ids.append(token_id)
            status, stop_reason = self._stop_status(request, token_id)
            if status is not None:
                request.stop_reason = stop_reason
                self._finish(request, status)
                finished_any = True
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=(token_id,),
                    finished=status is not None,
                    finish_reason=status.finish_reason if status is not None else None,
                    stop_reason=stop_reason,
                )
            )
        if finished_any:
            self._running = [r for r in self._running if not r.status.finished]
        return outputs

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, preempted_ids: list[str]) -> bool:
        """Get blocks for `request`'s next tokens, preempting the newest running requests as
        needed. False when `request` itself had to be preempted."""
        end = request.num_computed_tokens + num_new_tokens
        while not self._kv_cache_manager.allocate_slots(request.request_id, end):
            victim = self._running.pop()
            self._preempt(victim)
            preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self._kv_cache_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and free its blocks; the caller removes it from waiting/running."""
        request.status = status
        self._kv_cache_manager.free(request.request_id)
        del self._requests[request.request_id]
        self._finished_since_last_schedule.append(request.request_id)

    def _scheduled_request(self, request: Request, num_new_tokens: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=_token_range(request, start, end),
            start_position=start,
            block_ids=self._kv_cache_manager.get_block_ids(request.request_id),
            sample=end == request.num_tokens,
            sampling_params=request.sampling_params,
            num_output_tokens=len(request.output_token_ids),
        )

    def _stop_status(self, request: Request, token_id: int) -> tuple[RequestStatus | None, int | None]:
        params = request.sampling_params
        if params.stop_token_ids and token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if len(request.output_token_ids) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        if request.num_tokens >= self._config.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def _validate_new_request(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise TypeError(f"add_request takes a Request, got {type(request).__name__}")
        request_id = request.request_id
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already queued or running")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens != 0:
            raise InvalidRequestError(
                f"request {request_id!r} must be new (WAITING, nothing computed), got "
                f"status {request.status.value} with {request.num_computed_tokens} computed token(s)"
            )
        if request.num_prompt_tokens == 0:
            raise InvalidRequestError(f"request {request_id!r} has an empty prompt")
        max_tokens = request.sampling_params.max_tokens
        max_model_len = self._config.max_model_len
        if request.num_tokens + max_tokens > max_model_len:
            raise InvalidRequestError(
                f"request {request_id!r}: {request.num_tokens} prompt token(s) + max_tokens "
                f"{max_tokens} exceeds max_model_len {max_model_len}"
            )
        # The last sampled token never enters the cache. A request that needs more than the
        # whole cache would preempt itself forever, so it is refused up front.
        peak_cached_tokens = request.num_tokens + max_tokens - 1
        if peak_cached_tokens > self._config.num_cache_tokens:
            raise InvalidRequestError(
                f"request {request_id!r} needs up to {peak_cached_tokens} tokens of KV cache "
                f"({request.num_tokens} prompt + max_tokens {max_tokens} - 1) but the whole cache "
                f"holds {self._config.num_cache_tokens} ({self._config.num_kv_blocks} blocks of "
                f"{self._config.block_size}); shorten the prompt or lower max_tokens"
            )


def _token_range(request: Request, start: int, end: int) -> tuple[int, ...]:
    """Tokens [start, end) of prompt + outputs, without building the concatenated list."""
    prompt = request.prompt_token_ids
    num_prompt = len(prompt)
    if end <= num_prompt:
        return tuple(prompt[start:end])
    outputs = request.output_token_ids
    if start >= num_prompt:
        return tuple(outputs[start - num_prompt : end - num_prompt])
    return tuple(prompt[start:]) + tuple(outputs[: end - num_prompt])
