"""Continuous batching: which requests run each step, with how many tokens, in which KV blocks.

Policy, in one place:
- The step's token budget goes to RUNNING requests first, oldest first, then to WAITING ones in
  arrival order. A decoding request takes 1 token; one still prefilling (a long prompt, or a
  recompute after preemption) takes what remains of its known tokens, cut to the budget left
  (and to `long_prefill_token_threshold` when set), so long prompts are chunked across steps and
  mix with decodes. While any running request decodes, the threshold also caps the prompt tokens
  of the whole step (vLLM caps each request only): several prompts arriving together then cannot
  stack into one long step that every decoding stream waits for. With the runner's buckets
  given (`step_token_buckets`), that cap comes down to fill the step to the largest bucket within
  it (decodes + prompt tokens), so the step does not pay for padding it would not use.
- A running request that cannot get blocks preempts the NEWEST running request (possibly
  itself): its blocks are freed and it goes back to the HEAD of the queue to recompute
  prompt + outputs later. The oldest request can therefore always take the whole cache, and
  `add_request` rejects any request that could not finish alone in the whole cache, so some
  request always makes progress.
- Waiting requests are admitted only into free blocks (never by preempting), strictly FCFS —
  except that one whose grammar (structured outputs) is still compiling lets the others pass.
- A constrained request's sampling step carries its grammar's next-token mask, computed from its
  history; so with a step in flight sampling for it, it is not scheduled until that token lands.

Steps in flight: `schedule()` hands out a step, `update()` applies its result, oldest first. With
`max_in_flight_steps=2` (the async loop) step N+1 is scheduled before step N is updated:
- a request that samples in step N owes a token the host does not know yet; step N+1 feeds it as
  `PLACEHOLDER_TOKEN_ID` and the runner takes the real one from step N's output on the device;
- a request whose owed tokens bring it to max_tokens (or max_model_len) is not scheduled again:
  it ends when they land, and no step is spent on it;
- a request that ends at step N (stop token, EOS, abort, stop string) while step N+1 computes for
  it has that token discarded (`num_discarded_tokens`);
- blocks of a request that ends while a step in flight reads them go back to the pool only once
  that step is updated, so no later step writes into them meanwhile;
- preemption waits for the steps in flight: a step that would need it comes back empty with
  `waiting_for_in_flight`, the caller updates the in-flight steps and schedules again.
With one step in flight (the synchronous loop) none of this arises: `schedule()` and `update()`
alternate.

Pipeline parallelism (`pipeline_depth=P > 1`, the engine core's pipelined loop) keeps up to P steps
in flight as well, but stage 0 starts step N+1 before the last stage has produced step N's
logits, so there is no placeholder to feed: a request whose token a step in flight is sampling is
skipped until that step is updated (a prompt chunk that samples nothing can follow the one before
it at once: every stage runs the steps in order). Each step takes at most ceil(requests / P)
sequences, so the steps in flight hold about equal, different sets of requests. The rest (blocks
deferred while a step in flight reads them, preemption waiting for the steps in flight) is as above.

Prefix caching (`enable_prefix_caching`, core/kv_cache_manager.py):
- a waiting request is admitted with the cached blocks of its longest known prefix (never its
  last token, whose logits it needs), shared by reference count, and computes only the rest; a
  preempted request recomputing finds its own blocks this way while they are not evicted;
- a full block is registered in `update()`, once `num_computed_tokens` has passed its end: never
  while a step in flight still computes it, never with a placeholder in it. Shared blocks are
  only read: every write lands past the writer's computed tokens, so past any registered block;
- the free-block counts admission and preemption use include evictable cached blocks, and a
  block a step in flight reads keeps a reference (its owner's or the step's deferred list), so it
  is never in the free queue, never evicted;
- a waiting request whose next uncached block is being computed right now (by a step in flight,
  or by a request scheduled earlier in this step, e.g. the first of n samples of one prompt)
  waits, FCFS, until that step is updated, and then shares the block instead of computing it
  again. Sharing within one step would mean reading a block registered before it is computed.

Speculative decoding (`speculative`, docs/speculative_decoding.md), while at most
`disable_by_batch_size` requests run:
- a decoding request that can speculate (no penalties, logit_bias or pending min_tokens; a
  grammar masks each proposed position, and drops those it forbids) gets up to k proposed
  tokens (core/ngram_proposer.py, or a draft model through records/draft_proposer.py) after its
  newest token, in one step: fewer if the budget, max_tokens or max_model_len leave no room, none
  if blocks for them are short (proposals never preempt anyone); a draft model writes its own
  cache in the same blocks, so they are allocated before it proposes;
- its proposals need its newest token, so with a step in flight sampling for it, it waits;
- `update()` appends the accepted proposals and the sampled token one by one, with the stop checks
  after each (nothing after a stop is emitted), and counts only the accepted tokens as computed:
  the rejected ones' slots are rolled back, overwritten by the next tokens. Their lookahead blocks
  stay with the request (a block list only grows while its request runs, which the runner's
  block tables rely on) and are freed with the rest when it ends or is preempted.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import compress
from operator import itemgetter

import numpy as np

from compiled_engine.core.kv_cache_manager import KVCacheManager, token_range
from compiled_engine.core.ngram_proposer import NgramProposer
from compiled_engine.core.scheduler_config import SchedulerConfig
from compiled_engine.errors import InvalidRequestError
from compiled_engine.records.draft_proposer import DraftProposal, DraftProposer, DraftSampling
from compiled_engine.records.engine_core_output import EngineCoreOutput
from compiled_engine.records.request import FINISHED_STATUSES, Request, RequestStatus
from compiled_engine.records.runner_output import ModelRunnerOutput
from compiled_engine.records.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput

RUNNING = RequestStatus.RUNNING
_NO_PROPOSAL = DraftProposal(())
# A ScheduledRequest's fields by position: itemgetter reads a tuple slot in C, where the field's
# property costs a Python-level descriptor call.
_REQUEST_ID = itemgetter(ScheduledRequest._fields.index("request_id"))
_SAMPLES = itemgetter(ScheduledRequest._fields.index("sample"))
_TOKEN_IDS = itemgetter(ScheduledRequest._fields.index("token_ids"))


@dataclass
class _InFlightStep:
    output: SchedulerOutput
    # The step's requests in scheduling order (aligned with output.scheduled): update walks these.
    ordered: list[Request] = field(default_factory=list)
    # Blocks of requests that ended while this step still read them: freed when it is updated.
    deferred_blocks: list[int] = field(default_factory=list)
    # Keys of the full blocks this step completes (prefix caching): registered when it is updated.
    computing_block_hashes: list[bytes] = field(default_factory=list)
    _request_ids: frozenset[str] | None = None

    def reads(self, request_id: str) -> bool:
        """Whether the step computes for this request. The id set is built on the first question:
        most steps are never asked (in the synchronous loop a request ends with no step in
        flight), and building it cost a dict entry per request every step."""
        if self._request_ids is None:
            self._request_ids = frozenset(request.request_id for request in self.ordered)
        return request_id in self._request_ids


class Scheduler:
    def __init__(self, config: SchedulerConfig, draft_proposer: DraftProposer | None = None) -> None:
        """`draft_proposer`: the draft model, for speculative decoding's "draft_model" method."""
        self._config = config
        self._kv_cache_manager = KVCacheManager(
            config.num_kv_blocks, config.block_size, enable_caching=config.enable_prefix_caching
        )
        self._requests: dict[str, Request] = {}  # unfinished requests, waiting or running
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admission order, oldest first
        self._finished_since_last_schedule: list[str] = []
        # Preempted by a step that scheduled nothing: the runner hears of departures only with a
        # step it runs, so they go out again with the next step that schedules something.
        self._preempted_unsent: list[str] = []
        # Steps handed out by schedule() and not yet passed to update(), oldest first.
        self._in_flight: deque[_InFlightStep] = deque()
        # Keys of the blocks the steps in flight are computing (with multiplicity).
        self._computing_block_hashes: Counter[bytes] = Counter()
        # Over the scheduler's life, for stats and tests:
        self.num_preemptions = 0
        self.num_discarded_tokens = 0  # sampled for a request that had already ended
        # Prefix cache: known tokens of admitted requests, and how many of those came from the cache.
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0
        # Speculative decoding: the proposer (None: off), and over the scheduler's life the
        # request-steps that verified proposals, the proposals, and the accepted ones.
        spec = config.speculative
        self._proposer = (
            NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
            if spec is not None and spec.method == "ngram"
            else None
        )
        if (spec is not None and spec.method == "draft_model") != (draft_proposer is not None):
            raise ValueError("a draft proposer goes with speculative method 'draft_model', and only with it")
        self._draft = draft_proposer
        self.num_spec_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0

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

    @property
    def num_in_flight_steps(self) -> int:
        return len(self._in_flight)

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
        """Forget the newest step handed out by schedule() when running it failed.

        Nothing was advanced for it, so its tokens are simply scheduled again (or the caller
        aborts the requests).
        """
        if not self._in_flight:
            return
        step = self._in_flight.pop()
        _return_in_flight(step.output.scheduled, step.ordered)
        self._forget_computing(step)
        self._release_after_in_flight(step.deferred_blocks)

    @property
    def _prefill_cap(self) -> int:
        """Most tokens one request computes this step: the long-prefill threshold, when set."""
        threshold = self._config.long_prefill_token_threshold
        return threshold if threshold > 0 else self._config.max_num_batched_tokens

    def _prefill_room(self) -> int:
        """Most prompt (or recompute) tokens the whole step may take: while running requests
        decode, the long-prefill threshold, so their next token waits for at most that many,
        brought down to fill the step to a bucket (`_aligned_room`); else the step budget."""
        threshold = self._config.long_prefill_token_threshold
        if threshold <= 0:
            return self._config.max_num_batched_tokens
        decoding = 0
        for request in self._running:
            start = request.num_computed_tokens + request.num_in_flight_tokens
            if request.history.num_tokens + request.num_pending_outputs - start <= 1:
                decoding += 1
        if not decoding:
            return self._config.max_num_batched_tokens
        return self._aligned_room(decoding, threshold)

    def _aligned_room(self, decoding: int, threshold: int) -> int:
        """Prompt tokens for a step with `decoding` one-token rows: up to the largest bucket
        within `decoding + threshold`, when that keeps at least half the threshold; else the
        threshold. A 3-decode step under a threshold of 16 takes 13 prompt tokens and runs at
        bucket 16, where 16 would make 19 tokens, padded to 24: on the CPU's eager fallback the
        24-token step cost ~1.27x the 16-token one (docs/performance.md, "Session 9")."""
        buckets = self._config.step_token_buckets
        below = bisect.bisect_right(buckets, decoding + threshold)
        if below:
            room = buckets[below - 1] - decoding
            if room >= max(1, threshold // 2):
                return room
        return threshold

    def schedule(self) -> SchedulerOutput:
        if len(self._in_flight) >= self._config.max_in_flight_steps:
            raise RuntimeError(
                f"schedule() called with {len(self._in_flight)} step(s) not yet passed to update() "
                f"(max_in_flight_steps={self._config.max_in_flight_steps})"
            )
        budget = self._config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        scheduled_requests: list[Request] = []  # aligned with `scheduled`
        preempted_ids: list[str] = []
        computing: list[bytes] = []  # keys of the full blocks this step completes
        # Hoisted out of the loop below, which runs once per running request every step.
        prefill_cap = self._prefill_cap
        blocks_for = self._kv_cache_manager.blocks_for
        caching = self._config.enable_prefix_caching
        block_size = self._config.block_size
        running = self._running
        speculating = self._speculating()
        depth = self._config.pipeline_depth
        # Pipelined steps: each takes its share of the requests (see SchedulerConfig.pipeline_depth).
        max_seqs_this_step = self._config.max_num_seqs
        if depth > 1:
            num_requests = min(len(running) + len(self._waiting), self._config.max_num_seqs)
            max_seqs_this_step = max(1, -(-num_requests // depth))

        index, budget = self._schedule_decodes(
            budget, max_seqs_this_step, speculating, scheduled, scheduled_requests, computing
        )
        # Only prompt chunks and admissions need it, and it is a loop over the running requests
        # (the decode rows just scheduled count the same: their tokens and owed outputs grew alike).
        prefill_room = self._prefill_room() if index < len(running) or self._waiting else 0
        while index < len(running) and budget > 0:
            request = running[index]
            pending = request.num_pending_outputs
            history = request.history
            if pending and self._waits_for_owed_tokens(request, pending, speculating):
                index += 1
                continue
            if depth > 1 and max_seqs_this_step <= len(scheduled):
                index += 1  # this step has its share
                continue
            can_speculate = speculating and self._can_speculate(request)
            start = request.num_computed_tokens + request.num_in_flight_tokens
            num_known = history.num_tokens + pending - start
            if num_known <= 0:
                raise RuntimeError(
                    f"running request {request.request_id!r} has no token to compute; "
                    "update() was not applied to its last step"
                )
            if num_known > 1:  # a prompt (or recompute) chunk
                if prefill_room <= 0:
                    index += 1
                    continue
                num_new_tokens = min(num_known, budget, prefill_cap, prefill_room)
                prefill_room -= num_new_tokens
            else:
                num_new_tokens = 1
            proposal = _NO_PROPOSAL
            drafts: tuple[int, ...] = ()
            if can_speculate and start == request.history.num_tokens - 1:
                proposal = self._propose(request, start, budget)
                drafts = proposal.token_ids
            blocks = None if drafts else blocks_for(request.request_id, start + num_new_tokens)
            sample = True
            if drafts:
                # A grammar may keep fewer of the proposals (their blocks stay allocated).
                scheduled.append(self._speculative_request(request, start, proposal))
                num_new_tokens = len(scheduled[-1].token_ids)
                if scheduled[-1].num_draft_tokens:  # a grammar may have kept none
                    request.has_proposals_in_flight = True
            elif blocks is None:
                if self._in_flight:
                    _return_in_flight(scheduled, scheduled_requests)
                    return SchedulerOutput((), 0, (), (), waiting_for_in_flight=True)
                if not self._allocate_or_preempt(request, num_new_tokens, preempted_ids):
                    break  # it was the newest running request, so nothing follows it
                scheduled.append(self._scheduled_request(request, num_new_tokens))
                sample = scheduled[-1].sample
            else:
                scheduled.append(self._scheduled_request(request, num_new_tokens))
                sample = scheduled[-1].sample
            scheduled_requests.append(request)
            if caching and (start + num_new_tokens) // block_size > start // block_size:
                computing += self._completed_block_hashes(request, num_new_tokens)
            # In flight from here: what later rows of this step and the steps after it see.
            request.num_in_flight_tokens += num_new_tokens
            request.num_pending_outputs += sample
            budget -= num_new_tokens
            index += 1

        # A step that had to preempt is short of blocks: admitting new work now would only
        # take blocks the running requests need next step (and could re-admit the victim).
        if not preempted_ids:
            while (
                self._waiting
                and len(self._running) < self._config.max_num_seqs
                and len(scheduled) < max_seqs_this_step
                and min(budget, prefill_room) > 0
            ):
                admissible = self._next_admissible()  # nothing computed, nothing in flight
                if admissible is None:
                    break  # the waiting ones' grammars are still compiling
                request = admissible
                cached_blocks = self._kv_cache_manager.find_cached_prefix(request)
                if self._next_block_is_being_computed(request, len(cached_blocks), computing):
                    break  # FCFS: later requests do not overtake the head of the queue
                num_cached_tokens = len(cached_blocks) * self._config.block_size
                num_uncached = request.num_tokens - num_cached_tokens
                num_new_tokens = min(num_uncached, budget, prefill_cap, prefill_room)
                end = num_cached_tokens + num_new_tokens
                if not self._kv_cache_manager.allocate_slots(request.request_id, end, cached_blocks):
                    break
                self._waiting.remove(request)
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_cached_tokens
                if self._config.enable_prefix_caching:
                    self.num_prefix_cache_queries += request.num_tokens
                    self.num_prefix_cache_hits += num_cached_tokens
                self._running.append(request)
                scheduled.append(self._scheduled_request(request, num_new_tokens))
                scheduled_requests.append(request)
                computing += self._completed_block_hashes(request, num_new_tokens)
                request.num_in_flight_tokens += num_new_tokens
                request.num_pending_outputs += scheduled[-1].sample
                budget -= num_new_tokens
                prefill_room -= num_new_tokens

        if self._config.num_scheduler_steps > 1 and scheduled and not self._waiting and not preempted_ids:
            self._run_steps(scheduled, scheduled_requests)

        finished_ids = tuple(self._finished_since_last_schedule)
        self._finished_since_last_schedule.clear()
        output = SchedulerOutput(
            scheduled=tuple(scheduled),
            num_batched_tokens=self._config.max_num_batched_tokens - budget,
            preempted_request_ids=(*self._preempted_unsent, *preempted_ids),
            finished_request_ids=finished_ids,
        )
        if not scheduled:
            # The engine runs no step for an empty output, so the runner never sees these
            # preemptions; a victim's row would keep its old block table when it comes back
            # (a finished request's row is only reclaimed late, which is harmless).
            self._preempted_unsent += preempted_ids
            if depth > 1:
                # Pipelined, most schedule() calls find every request in flight: the finished
                # ones go with the next step instead, so their rows do not pile up.
                self._finished_since_last_schedule[:0] = finished_ids
            return output
        self._preempted_unsent.clear()
        self._in_flight.append(_InFlightStep(output, scheduled_requests, computing_block_hashes=computing))
        if computing:
            self._computing_block_hashes.update(computing)
        return output

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply the oldest step in flight: advance progress, append sampled tokens, run stop checks.

        Returns one record per request that got a token. Requests that ended while the step ran
        (abort, stop string, a stop in the step before) are skipped, their sampled token dropped.
        """
        step = self._in_flight[0] if self._in_flight else None
        if scheduler_output.is_empty and step is None:
            return []  # an empty step was never in flight
        if step is None or step.output is not scheduler_output:
            raise ValueError("update() got a SchedulerOutput that is not the oldest step in flight")
        scheduled = scheduler_output.scheduled
        # Mapped in C (no Python frame per row): the request ids of the rows that sample.
        sampling_ids = tuple(compress(map(_REQUEST_ID, scheduled), map(_SAMPLES, scheduled)))
        if tuple(runner_output.request_ids) != sampling_ids or len(runner_output.sampled_token_ids) != len(
            sampling_ids
        ):
            raise ValueError(
                f"runner output must sample exactly the requests with sample=True, in order: "
                f"expected {sampling_ids}, got {tuple(runner_output.request_ids)} with "
                f"{len(runner_output.sampled_token_ids)} token(s)"
            )
        self._in_flight.popleft()
        # The runner's tokens are in the order of the sampling rows (checked above).
        sampled_tokens = iter(runner_output.sampled_token_ids)
        accepted_counts = None
        if runner_output.num_accepted_drafts is not None:
            accepted_counts = iter(runner_output.num_accepted_drafts)
        elif self._config.speculative is not None and any(
            s.num_draft_tokens for s in scheduler_output.scheduled
        ):
            raise ValueError("the step verified proposals but the runner output has no num_accepted_drafts")
        if runner_output.step_token_ids is not None:
            if len(runner_output.step_token_ids) != len(scheduled):
                raise ValueError(
                    f"runner output has {len(runner_output.step_token_ids)} multi-step runs for "
                    f"{len(scheduled)} scheduled requests"
                )
            outputs, finished_any = self._update_runs(step, runner_output.step_token_ids)
        elif scheduled and scheduled[0].num_steps > 1:
            raise ValueError("the step was a multi-step run but the runner output has no step_token_ids")
        elif accepted_counts is None and scheduler_output.num_batched_tokens == len(sampling_ids) == len(
            scheduled
        ):
            outputs, finished_any = self._update_decodes(step.ordered, runner_output.sampled_token_ids)
        else:
            outputs, finished_any = self._update_rows(step, sampled_tokens, accepted_counts)
        self._forget_computing(step)
        if step.deferred_blocks:  # most steps have none (free builds a Counter even of nothing)
            self._kv_cache_manager.block_pool.free(step.deferred_blocks)
        if finished_any:
            self._running = [r for r in self._running if not r.status.finished]
        return outputs

    def _update_decodes(
        self, requests: list[Request], token_ids: Sequence[int]
    ) -> tuple[list[EngineCoreOutput], bool]:
        """`_update_rows` for a step whose every row computed one token and sampled one (no
        proposals): most steps. A loop of its own for the reason `_schedule_decodes` has one.
        Returns the outputs and whether any request ended."""
        cache_computed_blocks = self._kv_cache_manager.cache_computed_blocks
        caching = self._config.enable_prefix_caching
        block_size = self._config.block_size
        new_output = tuple.__new__
        outputs: list[EngineCoreOutput] = []
        finished_any = False
        for request, token_id in zip(requests, token_ids, strict=True):
            request.num_in_flight_tokens -= 1
            request.num_pending_outputs -= 1
            current = request.status
            if current is not RUNNING and current in FINISHED_STATUSES:
                self.num_discarded_tokens += 1
                continue
            computed = request.num_computed_tokens + 1
            request.num_computed_tokens = computed
            if caching and computed % block_size == 0:
                cache_computed_blocks(request)
            history = request.history
            history.append(token_id)
            if token_id in request.stopping_token_ids or history.num_tokens >= request.max_num_tokens:
                stopped = self._stopped_output(request, token_id)
                if stopped is not None:
                    finished_any = True
                    outputs.append(stopped)
                    continue
            # tuple.__new__: the NamedTuple without its Python constructor (every request, every step).
            outputs.append(
                new_output(EngineCoreOutput, (request.request_id, (token_id,), False, None, None, None, None))
            )
        return outputs, finished_any

    def _stopped_output(self, request: Request, token_id: int) -> EngineCoreOutput | None:
        """End the request if its newest token (`token_id`, just appended) stops it; its output
        then. None: it goes on."""
        status, stop_reason = self._stop_status(request, token_id)
        if status is None:
            return None
        request.stop_reason = stop_reason
        self._finish(request, status)
        return EngineCoreOutput(request.request_id, (token_id,), True, status.finish_reason, stop_reason)

    def _update_rows(
        self, step: _InFlightStep, sampled_tokens: Iterator[int], accepted_counts: Iterator[int] | None
    ) -> tuple[list[EngineCoreOutput], bool]:
        """`update` for a step of any rows (prompt chunks, rows that do not sample, proposals)."""
        scheduled = step.output.scheduled
        cache_computed_blocks = self._kv_cache_manager.cache_computed_blocks
        caching = self._config.enable_prefix_caching
        block_size = self._config.block_size

        outputs: list[EngineCoreOutput] = []
        finished_any = False
        rows = zip(scheduled, map(_TOKEN_IDS, scheduled), map(_SAMPLES, scheduled), step.ordered, strict=True)
        for scheduled_request, token_ids, sample, request in rows:
            num_tokens = len(token_ids)
            request.num_in_flight_tokens -= num_tokens
            request.num_pending_outputs -= sample
            token_id = next(sampled_tokens) if sample else None
            num_accepted = 0
            verified = False  # the row had proposals (only in a step whose output counts them)
            if accepted_counts is not None and sample:
                num_accepted = next(accepted_counts)
                verified = scheduled_request.num_draft_tokens > 0
                request.has_proposals_in_flight = False
            current = request.status
            if current is not RUNNING and current in FINISHED_STATUSES:
                self.num_discarded_tokens += sample + num_accepted
                continue
            if verified:
                assert token_id is not None  # a row with proposals always samples
                out = self._update_speculative(request, scheduled_request, token_id, num_accepted)
                finished_any = finished_any or out.finished
                outputs.append(out)
                continue
            request.num_computed_tokens += num_tokens
            # Every full block below the computed tokens was settled by the update before, so a
            # one-token step completes one only when it fills its last slot.
            if caching and (num_tokens > 1 or request.num_computed_tokens % block_size == 0):
                cache_computed_blocks(request)
            if token_id is None:
                continue
            history = request.history
            history.append(token_id)
            # Most tokens end nothing: two cheap tests before the full check (max_num_tokens is
            # at most max_model_len: add_request refuses a request that could pass it).
            if token_id in request.stopping_token_ids or history.num_tokens >= request.max_num_tokens:
                stopped = self._stopped_output(request, token_id)
                if stopped is not None:
                    finished_any = True
                    outputs.append(stopped)
                    continue
            outputs.append(EngineCoreOutput(request.request_id, (token_id,), False, None, None))
        return outputs, finished_any

    def _schedule_decodes(
        self,
        budget: int,
        max_seqs: int,
        speculating: bool,
        scheduled: list[ScheduledRequest],
        scheduled_requests: list[Request],
        computing: list[bytes],
    ) -> tuple[int, int]:
        """The first part of `schedule`'s running loop, for its commonest rows: from the oldest
        running request, while each one decodes (one token, no grammar, no proposals) or is
        skipped (see the general loop). Returns where it stopped in the running list and the
        budget left; the general loop goes on from there, with the same rules.

        A loop of its own because at 256 running requests it is most of a step's scheduling: each
        check it leaves out (prompt chunks, proposals, preemption) was a branch per row; the row
        is built inline rather than by a method call, and its blocks are read from the cache
        manager's `owned_blocks`, with a `blocks_for` call only when the next token needs a new
        block (every 16th step of a request at block size 16)."""
        blocks_for = self._kv_cache_manager.blocks_for
        owned_blocks = self._kv_cache_manager.owned_blocks
        caching = self._config.enable_prefix_caching
        block_size = self._config.block_size
        pipelined = self._config.pipeline_depth > 1
        new_row = tuple.__new__
        index = 0
        for request in self._running:
            if budget <= 0:
                break
            pending = request.num_pending_outputs
            history = request.history
            num_tokens = history.num_tokens
            if pending:
                if self._waits_for_owed_tokens(request, pending, speculating):
                    index += 1
                    continue
            elif pipelined and max_seqs <= len(scheduled):
                index += 1  # this step has its share
                continue
            start = request.num_computed_tokens + request.num_in_flight_tokens
            if num_tokens + pending - start != 1 or request.grammar is not None:
                break  # a prompt chunk, or a grammar's mask: the general loop's rows
            if not pending and speculating and self._can_speculate(request):
                break  # it proposes tokens
            request_id = request.request_id
            blocks = owned_blocks.get(request_id)
            if blocks is None or len(blocks) * block_size <= start:  # its next token needs a block
                blocks = blocks_for(request_id, start + 1)
                if blocks is None:
                    break  # short of blocks: the general loop preempts (or waits for the steps in flight)
            # The decode row (`_scheduled_request(request, 1)`), built in C: tuple.__new__ skips
            # the NamedTuple's Python constructor.
            scheduled.append(
                new_row(
                    ScheduledRequest,
                    (
                        request_id,
                        # Its newest token; while a step in flight samples it, a placeholder.
                        (PLACEHOLDER_TOKEN_ID if pending else history.newest_token_id,),
                        start,
                        blocks,
                        True,  # it samples
                        request.sampling_params,
                        num_tokens - history.num_prompt_tokens + pending,  # outputs, owed ones too
                        None,  # grammar_bitmask
                        0,  # num_draft_tokens
                        None,  # proposal_bitmasks
                        None,  # draft_probs
                        1,  # num_steps (a multi-step run sets it once the step is built)
                    ),
                )
            )
            scheduled_requests.append(request)
            if caching and (start + 1) % block_size == 0:
                computing += self._completed_block_hashes(request, 1)
            # In flight from here: what later rows of this step and the steps after it see.
            request.num_in_flight_tokens += 1
            request.num_pending_outputs = pending + 1
            budget -= 1
            index += 1
        return index, budget

    def _run_steps(self, scheduled: list[ScheduledRequest], requests: list[Request]) -> None:
        """Multi-step scheduling: make the step a run of up to `num_scheduler_steps` decode steps
        (each row's `num_steps`, its blocks allocated for all of them) when every row decodes one
        token of a request that samples (greedily or not) with nothing that reads the logits (penalties,
        bias, min_tokens still owed, logprobs, a grammar) and no request waits: a run delays any
        new request by its length. As long as the request with the fewest tokens left allows, so
        no row passes max_tokens or the model length. Rows are left as they are otherwise."""
        config = self._config
        steps = config.num_scheduler_steps
        for row, request in zip(scheduled, requests, strict=True):
            params = request.sampling_params
            history = request.history
            plain = (
                len(row.token_ids) == 1
                and row.sample
                and row.grammar_bitmask is None
                and not row.num_draft_tokens
                and not params.has_penalties
                and not params.logit_bias
                and params.logprobs is None
                and len(history.output_token_ids) >= params.min_tokens
            )
            if not plain:
                return
            left = min(request.max_num_tokens, config.max_model_len) - history.num_tokens
            steps = min(steps, left)
            if steps < 2:
                return
        blocks = []
        for row in scheduled:
            # Blocks a run reaches are the request's from here (as speculation's lookahead blocks):
            # its next tokens fill them, and they go back with all its blocks.
            owned = self._kv_cache_manager.blocks_for(row.request_id, row.start_position + steps)
            if owned is None:
                return  # short of blocks: one step, which may preempt next time as usual
            blocks.append(owned)
        for i, (row, request, owned) in enumerate(zip(scheduled, requests, blocks, strict=True)):
            scheduled[i] = row._replace(block_ids=owned, num_steps=steps)
            # The run's other tokens are in flight too (update takes them all off).
            request.num_in_flight_tokens += steps - 1
            request.num_pending_outputs += steps - 1

    def _update_runs(
        self, step: _InFlightStep, runs: Sequence[Sequence[int]]
    ) -> tuple[list[EngineCoreOutput], bool]:
        """`update` for a multi-step run: each row's tokens appended one by one with the stop
        checks, what follows a stop dropped. A row's KV now holds its tokens up to the newest
        one appended (the run fed each token to the next step)."""
        caching = self._config.enable_prefix_caching
        outputs: list[EngineCoreOutput] = []
        finished_any = False
        for row, request, tokens in zip(step.output.scheduled, step.ordered, runs, strict=True):
            num_steps = row.num_steps
            if len(tokens) != num_steps:
                raise ValueError(
                    f"request {row.request_id!r} ran {num_steps} steps but the runner returned "
                    f"{len(tokens)} token(s)"
                )
            request.num_in_flight_tokens -= num_steps
            request.num_pending_outputs -= num_steps
            current = request.status
            if current is not RUNNING and current in FINISHED_STATUSES:
                self.num_discarded_tokens += num_steps
                continue
            history = request.history
            emitted: list[int] = []
            status = None
            for token_id in tokens:
                history.append(token_id)
                emitted.append(token_id)
                if token_id in request.stopping_token_ids or history.num_tokens >= request.max_num_tokens:
                    status, stop_reason = self._stop_status(request, token_id)
                    if status is not None:
                        break
            request.num_computed_tokens += len(emitted)
            if status is not None:
                request.stop_reason = stop_reason
                self._finish(request, status)
                finished_any = True
                outputs.append(
                    EngineCoreOutput(
                        request.request_id, tuple(emitted), True, status.finish_reason, stop_reason
                    )
                )
                continue
            if caching:
                self._kv_cache_manager.cache_computed_blocks(request)
            outputs.append(EngineCoreOutput(request.request_id, tuple(emitted), False, None, None))
        return outputs, finished_any

    def _waits_for_owed_tokens(self, request: Request, pending: int, speculating: bool) -> bool:
        """Whether a running request that owes `pending` tokens (sampled by steps in flight) is
        skipped until they land. The one rule both running loops of `schedule` apply."""
        return (
            self._config.pipeline_depth > 1  # pipelined: its token lands with a step in flight
            # Ends by length once its owed tokens land: no step is spent on it (max_num_tokens is
            # prompt + max_tokens, at most max_model_len: see update).
            or request.history.num_tokens + pending >= request.max_num_tokens
            or request.grammar is not None  # its next grammar mask needs the owed token
            # A step in flight verifies its proposals: how many tokens it keeps is not known yet.
            or request.has_proposals_in_flight
            or (speculating and self._can_speculate(request))  # its proposals need the owed token
        )

    def _speculating(self) -> bool:
        """Whether this step proposes tokens at all: speculation is on and few enough requests run
        for verifying extra tokens to pay (`disable_by_batch_size`).

        """
        spec = self._config.speculative
        return spec is not None and len(self._running) <= spec.disable_by_batch_size

    @staticmethod
    def _can_speculate(request: Request) -> bool:
        """Whether a request's next tokens can be verified in a run: its sampling distribution must
        not depend on the tokens before it in the run — which penalties and a pending min_tokens do
        (logit_bias is left to the plain path too: the verifier applies none). A grammar's mask
        does too, but it is computed per proposed position (`_speculative_request`)."""
        params = request.sampling_params
        return (
            not params.has_penalties
            and not params.logit_bias
            and len(request.history.output_token_ids) + request.num_pending_outputs >= params.min_tokens
        )

    def _propose(self, request: Request, start: int, budget: int) -> DraftProposal:
        """Proposed tokens after the request's newest one (at `start`), as many as k, the step's
        budget, its max_tokens and max_model_len allow (the token verified after them is emitted
        too), with blocks for them allocated; () when there is no proposal or no free block for
        one (lookahead blocks come only from free ones: proposals never preempt anyone)."""
        spec = self._config.speculative
        assert spec is not None
        history = request.history
        room = min(
            spec.num_speculative_tokens,
            budget - 1,
            request.sampling_params.max_tokens - len(history.output_token_ids) - 1,
            self._config.max_model_len - history.num_tokens - 1,
        )
        if room < 1:
            return _NO_PROPOSAL
        outputs = np.asarray(history.output_token_ids, dtype=np.int64)
        tokens = np.concatenate((history.prompt_array, outputs)) if len(outputs) else history.prompt_array
        allocate_slots = self._kv_cache_manager.allocate_slots
        if self._draft is not None:
            # The draft writes its cache in the request's blocks, lookahead included: allocate first.
            if not allocate_slots(request.request_id, start + 1 + room):
                return _NO_PROPOSAL
            block_ids = self._kv_cache_manager.get_block_ids(request.request_id)
            params = request.sampling_params
            # A constrained request's proposals stay the draft's argmax: its grammar may cut the
            # run short after a proposal, and min(1, p/q) needs every draw from q verified.
            sampling = DraftSampling(
                0.0 if params.greedy or request.grammar is not None else params.temperature,
                params.seed,
                len(history.output_token_ids),
            )
            return self._draft.propose(request.request_id, tokens, block_ids, room, sampling)
        assert self._proposer is not None
        drafts = self._proposer.propose(tokens, room)
        if drafts and allocate_slots(request.request_id, start + 1 + len(drafts)):
            return DraftProposal(drafts)
        return _NO_PROPOSAL

    def _speculative_request(self, request: Request, start: int, proposal: DraftProposal) -> ScheduledRequest:
        """A step with proposals: the request's newest token (at `start`, past what steps in flight
        compute: the last chunk of a prompt may follow one still in flight), then them."""
        history = request.history
        outputs = history.output_token_ids
        newest = outputs[-1] if outputs else history.prompt_token_ids[-1]
        drafts = proposal.token_ids
        final_mask = proposal_masks = None
        if request.grammar is not None:
            # Structured outputs: a mask per proposed position; proposals the grammar forbids go.
            masks = request.grammar.proposal_bitmasks(outputs, drafts)
            drafts, final_mask = drafts[: len(masks) - 1], masks[-1]
            proposal_masks = tuple(masks[:-1])
        scheduled = ScheduledRequest(
            request.request_id,
            (newest, *drafts),
            start,
            self._kv_cache_manager.get_block_ids(request.request_id),
            True,
            request.sampling_params,
            len(outputs),
            final_mask,
            len(drafts),
            proposal_masks if drafts else None,
            proposal.probs if request.grammar is None else None,
        )
        return scheduled

    def _update_speculative(
        self, request: Request, scheduled: ScheduledRequest, token_id: int, num_accepted: int
    ) -> EngineCoreOutput:
        """Apply a verified run: the accepted proposals and the sampled token, stop-checked one by
        one (what follows a stop is dropped)."""
        num_drafts = scheduled.num_draft_tokens
        self.num_spec_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_draft_tokens += num_accepted
        # The newest token and the accepted proposals are in the cache now; the rejected ones'
        # slots hold k/v that the next tokens overwrite.
        request.num_computed_tokens += 1 + num_accepted
        emitted: list[int] = []
        for token in (*scheduled.token_ids[1 : 1 + num_accepted], token_id):
            request.history.append(token)
            emitted.append(token)
            status, stop_reason = self._stop_status(request, token)
            if status is not None:
                request.stop_reason = stop_reason
                self._finish(request, status)
                return EngineCoreOutput(
                    request.request_id, tuple(emitted), True, status.finish_reason, stop_reason
                )
        # The lookahead blocks stay with the request (lists only grow, so the runner's block
        # tables stay valid): its next tokens fill them, and they go back with all its blocks.
        if self._config.enable_prefix_caching:
            self._kv_cache_manager.cache_computed_blocks(request)
        return EngineCoreOutput(request.request_id, tuple(emitted), False, None, None)

    def _next_admissible(self) -> Request | None:
        """The first waiting request that can start: any whose grammar (structured outputs) is
        compiled — one still compiling lets the others pass."""
        for request in self._waiting:
            if request.grammar is None or request.grammar.is_ready():
                return request
        head = self._waiting[0].grammar
        if head is not None and not self._running and not self._in_flight:
            head.wait(timeout=0.05)  # nothing else to run: wait for it rather than spin
            if head.is_ready():
                return self._waiting[0]
        return None

    def _completed_block_hashes(self, request: Request, num_new_tokens: int) -> list[bytes]:
        """Keys of the request's full blocks that its next `num_new_tokens` tokens complete; blocks
        still waiting on a placeholder have no key yet and are left out."""
        if not self._config.enable_prefix_caching:
            return []
        size = self._config.block_size
        start = request.num_computed_tokens + request.num_in_flight_tokens
        end = min(start + num_new_tokens, request.num_tokens)
        if end // size <= start // size:
            return []
        return self._kv_cache_manager.block_hashes(request)[start // size : end // size]

    def _next_block_is_being_computed(
        self, request: Request, num_cached_blocks: int, computing_now: list[bytes]
    ) -> bool:
        """Whether the first block a waiting request would compute is being computed already (by a
        step in flight, or earlier in the step being built): it had better wait and share it."""
        if not self._config.enable_prefix_caching:
            return False
        if num_cached_blocks >= (request.num_tokens - 1) // self._config.block_size:
            return False  # nothing more it could take from the cache
        next_hash = request.block_hashes[num_cached_blocks]
        return next_hash in self._computing_block_hashes or next_hash in computing_now

    def _forget_computing(self, step: _InFlightStep) -> None:
        for block_hash in step.computing_block_hashes:
            self._computing_block_hashes[block_hash] -= 1
            if self._computing_block_hashes[block_hash] == 0:
                del self._computing_block_hashes[block_hash]

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
        if self._draft is not None:
            self._draft.forget((request.request_id,))
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and free its blocks (once no step in flight reads them); the caller
        removes it from waiting/running."""
        request.status = status
        blocks = self._kv_cache_manager.release(request.request_id)
        if self._draft is not None:
            self._draft.forget((request.request_id,))
        readers = [step for step in self._in_flight if step.reads(request.request_id)]
        if readers:
            readers[-1].deferred_blocks.extend(blocks)
        else:
            self._kv_cache_manager.block_pool.free(blocks)
        del self._requests[request.request_id]
        self._finished_since_last_schedule.append(request.request_id)

    def _release_after_in_flight(self, blocks: list[int]) -> None:
        """Blocks a cancelled step held back: the step before it (if any) still reads them."""
        if self._in_flight:
            self._in_flight[-1].deferred_blocks.extend(blocks)
        else:
            self._kv_cache_manager.block_pool.free(blocks)

    def _scheduled_request(self, request: Request, num_new_tokens: int) -> ScheduledRequest:
        start = request.num_computed_tokens + request.num_in_flight_tokens
        end = start + num_new_tokens
        known = request.history.num_tokens
        history = request.history
        outputs = history.output_token_ids
        if start == known - 1 and end == known:  # a decode step: the newest known token
            token_ids: tuple[int, ...] = (outputs[-1] if outputs else history.prompt_token_ids[-1],)
        else:
            token_ids = token_range(request, start, min(end, known))
            if end > known:  # tokens steps in flight are sampling right now
                token_ids += (PLACEHOLDER_TOKEN_ID,) * (end - max(start, known))
        pending = request.num_pending_outputs
        sample = end == known + pending
        grammar_bitmask = None
        if sample and request.grammar is not None:
            grammar_bitmask = request.grammar.next_token_bitmask(outputs)
        return ScheduledRequest(  # by position: the keyword form costs more, once per request a step
            request.request_id,
            token_ids,
            start,
            self._kv_cache_manager.get_block_ids(request.request_id),
            sample,
            request.sampling_params,
            len(outputs) + pending,
            grammar_bitmask,
        )

    def _stop_status(self, request: Request, token_id: int) -> tuple[RequestStatus | None, int | None]:
        params = request.sampling_params
        if params.stop_token_ids and token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        history = request.history
        if len(history.output_token_ids) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        if history.num_tokens >= self._config.max_model_len:
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
        if request.cache_salt is not None and not isinstance(request.cache_salt, str):
            raise InvalidRequestError(
                f"request {request_id!r}: cache_salt must be a str or None, got {request.cache_salt!r}"
            )
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


def _return_in_flight(scheduled: Iterable[ScheduledRequest], requests: Iterable[Request]) -> None:
    """Undo what scheduling rows put in flight (a step cancelled, or one given up while built)."""
    for row, request in zip(scheduled, requests, strict=True):
        request.num_in_flight_tokens -= len(row.token_ids)
        request.num_pending_outputs -= row.sample
        request.has_proposals_in_flight = False  # a step with proposals has no other in flight
