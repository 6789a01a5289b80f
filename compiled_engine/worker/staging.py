"""Host-side staging of one step's inputs, twice over, so the host can prepare step N+1 while the
device still reads step N.

A `StagingSlot` holds a host `StepBuffers` (worker/step_buffers.py: every buffer a step sends to
the device — token ids, positions, slot mapping, block tables, sequence lengths, query starts,
logits rows, sampling parameters and where the placeholder tokens go — pinned on CUDA, so the copy
to the device is truly asynchronous — plus the ones its results come back into: sampled tokens,
logprobs). The runner fills slot `n % 2` for step n. Its `consumed` event is recorded after the
step that read it: a slot is refilled only once that event has passed, so a slot is never
overwritten while a step reads it. Results are read back (`collect`) before the slot's next
fill, so the size-varying buffers may be reallocated at fill time.

Sampling parameters that need more than a step carries — penalties (the request's prompt and
the outputs the host knows), min_tokens (the model's EOS ids), prompt logprobs (the prompt) —
read the request's `TokenHistory` through the runner's `RequestState`s, passed to each `fill`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain, repeat
from operator import is_not, itemgetter
from typing import NamedTuple

import numpy as np
import torch

from compiled_engine.graphs.device import Event
from compiled_engine.records.request import TokenHistory
from compiled_engine.records.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from compiled_engine.worker.persistent_batch import PersistentBatch
from compiled_engine.worker.sampler import HostSamplingArrays, SamplingRow
from compiled_engine.worker.step_buffers import BufferSizes, StepBuffers


@dataclass(frozen=True)
class RequestState:
    """What the runner keeps for a request whose sampling needs its history: the history itself
    (read at staging, never copied) and the model's EOS ids.

    In one process the history is the scheduler's own record (engine/request.py), appended at each
    update, so with a step in flight its newest output is still missing here: that token is a
    placeholder on the device, and the device adds it (`_penalty_placeholders`). A
    tensor-parallel worker is another process: it holds a replica (the copy rank 0 sent with
    add_request), which the runner's record_outputs keeps current.
    """

    history: TokenHistory
    eos_token_ids: frozenset[int]


class PromptLogprobRows(NamedTuple):
    """A request's prompt-logprobs rows in one step: logits rows after the sampling rows."""

    request_id: str
    first_position: int  # prompt position of the first row's logits (it predicts the next token)
    num_rows: int
    num_top: int  # the request's prompt_logprobs


@dataclass(frozen=True)
class StagedStep:
    """Sizes and host-only facts of the step staged in a slot."""

    num_tokens: int
    num_seqs: int
    width: int  # block-table columns this step uses
    # Scheduling-order indices of the requests whose last token is sampled this step.
    sampled_rows: tuple[int, ...]
    # Placeholder tokens: staged at `placeholder_rows`, taken from the previous step's samples.
    num_placeholders: int
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool = False
    # Penalties: rows penalised, (count row, token) entries the host knows, and entries the
    # device adds from the previous step's samples (outputs the host does not know yet).
    num_penalised: int = 0
    num_penalty_tokens: int = 0
    num_penalty_placeholders: int = 0
    num_bias: int = 0  # logit_bias entries
    num_banned: int = 0  # min_tokens: (row, stop token) entries masked this step
    # logprobs=N per sampling row (None: not asked). The step computes the largest N for all rows.
    logprobs: tuple[int | None, ...] = ()
    # Prompt-logprobs rows: logits rows after the sampling rows, in this order.
    prompt_logprobs: tuple[PromptLogprobRows, ...] = ()
    # Sampling rows (indices into sampled_rows) whose params need more than the batch's arrays
    # (a seed, penalties, ...): the only ones the runner looks at one by one.
    special_sampled: tuple[int, ...] = ()
    # Speculative decoding: sampling rows (indices into sampled_rows) with proposals and how many
    # each has; then per proposal row (logits rows after the prompt-logprobs rows, in that order)
    # the sampling row it belongs to and the token it verifies.
    spec_rows: tuple[int, ...] = ()
    num_proposed: tuple[int, ...] = ()
    proposal_sample_rows: tuple[int, ...] = ()
    proposed_token_ids: tuple[int, ...] = ()
    proposals_all_greedy: bool = True
    # The sampling rows' request ids, and their grammar bitmasks (None: no row has one).
    sampled_request_ids: tuple[str, ...] = ()
    grammar_bitmasks: tuple[np.ndarray | None, ...] | None = None
    # Multi-step scheduling: the decode steps every row runs (ScheduledRequest.num_steps); 1: one.
    num_steps: int = 1

    @property
    def num_sampled(self) -> int:
        return len(self.sampled_rows)

    @property
    def num_top_logprobs(self) -> int | None:
        """How many top logprobs the step computes per sampling row; None: none asked."""
        asked = [n for n in self.logprobs if n is not None]
        return max(asked) if asked else None

    @property
    def num_prompt_logprob_rows(self) -> int:
        return sum(chunk.num_rows for chunk in self.prompt_logprobs)

    @property
    def num_top_prompt_logprobs(self) -> int:
        return max((chunk.num_top for chunk in self.prompt_logprobs), default=0)

    @property
    def num_proposal_rows(self) -> int:
        return len(self.proposal_sample_rows)

    @property
    def num_logits(self) -> int:
        return self.num_sampled + self.num_prompt_logprob_rows + self.num_proposal_rows


class _SpecialRows(NamedTuple):
    """What staging computes for the sampling rows that need their params one by one."""

    host: HostSamplingArrays  # penalties, logit_bias, min_tokens entries (rows of the whole step)
    penalty_placeholder_count_rows: list[int]
    penalty_placeholder_sources: list[int]
    logprobs: tuple[int | None, ...]  # logprobs=N per sampling row; () when no row asks


_NO_SPECIAL_ROWS = _SpecialRows(HostSamplingArrays.build([]), [], [], ())


class _ProposalRows(NamedTuple):
    """Speculative decoding's rows of a step (see StagedStep)."""

    logits_rows: np.ndarray  # token rows whose logits verify a proposal
    spec_rows: tuple[int, ...]
    num_proposed: tuple[int, ...]
    sample_rows: tuple[int, ...]
    token_ids: tuple[int, ...]
    all_greedy: bool


_NO_PROPOSALS = _ProposalRows(np.zeros(0, dtype=np.int64), (), (), (), (), True)


def _proposal_rows(
    reqs: tuple[ScheduledRequest, ...],
    draft_counts: tuple[int, ...],
    query_start_loc: np.ndarray,
    sampled_index: np.ndarray,
    greedy: np.ndarray,
) -> _ProposalRows:
    """A request with k proposals feeds (newest token, d_1..d_k): its first k token rows' logits
    verify d_1..d_k, its last row is its usual sampling row."""
    counts = np.fromiter(draft_counts, dtype=np.int64, count=len(draft_counts))
    seqs = counts.nonzero()[0]
    num = counts[seqs]
    spec_rows = np.searchsorted(sampled_index, seqs)  # a request with proposals always samples
    firsts = np.repeat(query_start_loc[seqs], num)
    offsets = np.arange(int(num.sum())) - np.repeat(np.cumsum(num) - num, num)
    token_ids = tuple(t for i in seqs.tolist() for t in reqs[i].token_ids[1:])
    return _ProposalRows(
        logits_rows=firsts + offsets,
        spec_rows=tuple(spec_rows.tolist()),
        num_proposed=tuple(num.tolist()),
        sample_rows=tuple(np.repeat(spec_rows, num).tolist()),
        token_ids=token_ids,
        all_greedy=bool(greedy[spec_rows].all()),
    )


class StagingSlot:
    """One step's host buffers, their `consumed` event, and how a `SchedulerOutput` fills them."""

    def __init__(
        self, sizes: BufferSizes, block_size: int, device: torch.device, consumed: Event | None = None
    ):
        self.block_size = block_size
        # Pinned when the step runs on CUDA (an asynchronous copy needs page-locked memory).
        self.buffers = StepBuffers.allocate(sizes, device, host=True)
        # numpy views of the fixed buffers: staging writes through them.
        self.host: dict[str, np.ndarray] = self.buffers.arrays()
        self.consumed = consumed
        # 0, 1, 2, ...: read-only, sliced for the decode-only steps' offsets and rows.
        self._counting = np.arange(self.buffers.block_tables.shape[0] + 1, dtype=np.int64)
        self._counting.flags.writeable = False

    def fill(
        self,
        step: SchedulerOutput,
        previous_sample_index: Mapping[str, int] | None = None,
        request_states: Mapping[str, RequestState] | None = None,
        batch: PersistentBatch | None = None,
    ) -> StagedStep:
        """Write the step into the slot. `previous_sample_index` maps a request id to its row in
        the previous step's sampled tokens (needed when the step has placeholders);
        `request_states` holds the histories of requests whose sampling needs them; `batch` is
        the runner's persistent batch (worker/persistent_batch.py), updated here with the step's
        requests (None: a batch of this step alone)."""
        states = request_states if request_states is not None else {}
        if batch is None:
            batch = PersistentBatch(*self.buffers.block_tables.shape)
        reqs = step.scheduled
        num_seqs = len(reqs)
        # Columns of the records (ScheduledRequest's fields in order), transposed in C (one pass)
        # rather than read field by field.
        columns = tuple(zip(*reqs, strict=True))
        request_ids, token_lists, start_positions, block_lists, samples = columns[:5]
        bitmasks, draft_counts = columns[7:9]
        counts = columns[11]  # each row's num_steps
        num_steps = counts[0]
        if num_steps != 1 and (
            step.num_batched_tokens != num_seqs or not all(samples) or counts.count(num_steps) != num_seqs
        ):
            raise ValueError(
                f"a multi-step run needs every row to decode one token, sample and run as many steps: "
                f"got num_steps {counts} over {step.num_batched_tokens} tokens"
            )
        rows = batch.update(step, (request_ids, block_lists))
        starts = np.fromiter(start_positions, dtype=np.int64, count=num_seqs)
        num_tokens = step.num_batched_tokens  # the tokens of every row
        decode_only = num_tokens == num_seqs  # one token per request: most steps
        # Most steps take the decode-only shortcuts below: each numpy call they skip costs about
        # a microsecond, which at one request is most of what staging costs.
        counting = self._counting
        if decode_only:
            q_lens: int | np.ndarray = 1
            query_start_loc = counting[: num_seqs + 1]
            token_ids = np.fromiter(map(itemgetter(0), token_lists), dtype=np.int64, count=num_tokens)
        else:
            q_lens = np.fromiter(map(len, token_lists), dtype=np.int64, count=num_seqs)
            query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(q_lens, out=query_start_loc[1:])
            token_ids = np.fromiter(chain.from_iterable(token_lists), dtype=np.int64, count=num_tokens)
        placeholder_rows = (token_ids == PLACEHOLDER_TOKEN_ID).nonzero()[0]
        placeholder_sources = np.zeros(len(placeholder_rows), dtype=np.int64)
        # Sequence index -> where its placeholder's token is in the previous step's samples.
        source_of_seq: dict[int, int] = {}
        if len(placeholder_rows):
            if previous_sample_index is None:
                raise ValueError("the step feeds placeholder tokens but no previous step sampled them")
            seq_of_row = np.searchsorted(query_start_loc, placeholder_rows, side="right") - 1
            placeholder_sources[:] = [previous_sample_index[reqs[i].request_id] for i in seq_of_row]
            source_of_seq = dict(zip(seq_of_row.tolist(), placeholder_sources.tolist(), strict=True))
            token_ids[placeholder_rows] = 0  # any valid id until the device writes the real one
        # Position of every token: its request's start plus its offset inside the chunk.
        if decode_only:
            seq_of_token = counting[:num_seqs]
            positions = starts
        else:
            seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
            positions = starts[seq_of_token] + (np.arange(num_tokens) - query_start_loc[:-1][seq_of_token])

        width = int(batch.num_blocks[rows].max())
        table = batch.block_table[rows, :width]
        bs = self.block_size
        slots = table[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs

        if all(samples):  # every request samples: most steps
            sampled_index = counting[:num_seqs]
            sampled_rows = tuple(range(num_seqs))
            batch_rows = rows
        else:
            sample = np.fromiter(samples, dtype=bool, count=num_seqs)
            sampled_index = sample.nonzero()[0]  # 1-D: np.flatnonzero without its Python wrappers
            sampled_rows = tuple(sampled_index.tolist())
            request_ids = tuple(request_ids[i] for i in sampled_rows)
            bitmasks = tuple(bitmasks[i] for i in sampled_rows)
            batch_rows = rows[sampled_index]
        greedy = batch.greedy[batch_rows]
        all_greedy = bool(greedy.all())
        # Rows whose sampling needs their params one by one (penalties, bias, min_tokens, seeds,
        # logprobs): usually none.
        special = batch.special[batch_rows].nonzero()[0].tolist()
        extra = self._special_rows(reqs, sampled_rows, special, states, source_of_seq)
        # prompt_logprobs is special too
        prompt_candidates = special if batch_rows is rows else batch.special[rows].nonzero()[0].tolist()
        prompt_rows, prompt_targets, prompt_chunks = self._prompt_logprob_rows(
            reqs, query_start_loc, states, prompt_candidates
        )
        if decode_only and batch_rows is rows:
            logits_indices = counting[:num_seqs]  # row i's one token is row i
        else:
            logits_indices = query_start_loc[1:][sampled_index] - 1
        if len(prompt_rows):
            logits_indices = np.concatenate([logits_indices, prompt_rows])
        proposals = _NO_PROPOSALS
        if any(draft_counts):
            proposals = _proposal_rows(reqs, draft_counts, query_start_loc, sampled_index, greedy)
            logits_indices = np.concatenate([logits_indices, proposals.logits_rows])

        n, s, k, m = num_tokens, num_seqs, len(sampled_rows), len(placeholder_rows)
        b = self.host
        b["input_ids"][0, :n] = token_ids
        b["positions"][0, :n] = positions
        b["slot_mapping"][:n] = slots
        b["block_tables"][:s, :width] = table
        b["seq_lens"][:s] = starts + q_lens
        b["query_start_loc"][: s + 1] = query_start_loc
        b["logits_indices"][: len(logits_indices)] = logits_indices
        if m:
            b["placeholder_rows"][:m] = placeholder_rows
            b["placeholder_sources"][:m] = placeholder_sources
        needs_top_k = needs_top_p = needs_min_p = False
        if not all_greedy:  # an all-greedy step's sampler reads none of these (nor does the load)
            top_k, top_p, min_p = batch.top_k[batch_rows], batch.top_p[batch_rows], batch.min_p[batch_rows]
            b["temperature"][:k] = batch.temperature[batch_rows]
            b["top_k"][:k] = top_k
            b["top_p"][:k] = top_p
            b["greedy"][:k] = greedy
            b["min_p"][:k] = min_p
            not_greedy = ~greedy
            needs_top_k = bool((not_greedy & (top_k != -1)).any())
            needs_top_p = bool((not_greedy & (top_p < 1.0)).any())
            needs_min_p = bool((not_greedy & (min_p > 0.0)).any())
        host = extra.host
        p = len(host.penalty_rows)
        if p:
            b["penalty_rows"][:p] = host.penalty_rows
            b["presence_penalty"][:p] = host.presence
            b["frequency_penalty"][:p] = host.frequency
            b["repetition_penalty"][:p] = host.repetition
        count_rows, sources = extra.penalty_placeholder_count_rows, extra.penalty_placeholder_sources
        if count_rows:
            b["penalty_placeholder_count_rows"][: len(count_rows)] = count_rows
            b["penalty_placeholder_sources"][: len(sources)] = sources
        tb = self.buffers
        for buffer, values in (
            (tb.penalty_count_rows, host.penalty_count_rows),
            (tb.penalty_token_ids, host.penalty_token_ids),
            (tb.bias_rows, host.bias_rows),
            (tb.bias_token_ids, host.bias_token_ids),
            (tb.bias_values, host.bias_values),
            (tb.banned_rows, host.banned_rows),
            (tb.banned_token_ids, host.banned_token_ids),
            (tb.prompt_logprob_targets, prompt_targets),
        ):
            if len(values):
                buffer.take(len(values))[:] = torch.from_numpy(values)

        staged = StagedStep(
            num_tokens=n,
            num_seqs=s,
            width=width,
            sampled_rows=sampled_rows,
            num_placeholders=m,
            all_greedy=all_greedy,
            needs_top_k=needs_top_k,
            needs_top_p=needs_top_p,
            needs_min_p=needs_min_p,
            num_penalised=p,
            num_penalty_tokens=len(host.penalty_token_ids),
            num_penalty_placeholders=len(count_rows),
            num_bias=len(host.bias_rows),
            num_banned=len(host.banned_rows),
            logprobs=extra.logprobs,
            prompt_logprobs=prompt_chunks,
            special_sampled=tuple(special),
            spec_rows=proposals.spec_rows,
            num_proposed=proposals.num_proposed,
            proposal_sample_rows=proposals.sample_rows,
            proposed_token_ids=proposals.token_ids,
            proposals_all_greedy=proposals.all_greedy,
            sampled_request_ids=request_ids,
            # (`is not`, mapped in C: a mask is an array, which `==` with None would not answer.)
            grammar_bitmasks=bitmasks if any(map(is_not, bitmasks, repeat(None))) else None,
            num_steps=num_steps,
        )
        self._size_results(staged)
        return staged

    def _special_rows(
        self,
        reqs: tuple[ScheduledRequest, ...],
        sampled_rows: tuple[int, ...],
        special: list[int],
        states: Mapping[str, RequestState],
        source_of_seq: dict[int, int],
    ) -> _SpecialRows:
        """Penalties, logit_bias and min_tokens entries of the sampling rows that use them (their
        row numbers among the step's sampling rows), and the rows' logprobs=N."""
        if not special:
            return _NO_SPECIAL_ROWS
        sampled = [reqs[sampled_rows[i]] for i in special]
        rows = [self._sampling_row(r, states) for r in sampled]
        host = HostSamplingArrays.build(rows)
        count_rows, sources = self._penalty_placeholders(
            host, rows, sampled, tuple(sampled_rows[i] for i in special), source_of_seq
        )
        # Entries name rows of the special subset: renumber them as rows of the whole step.
        renumber = np.asarray(special, dtype=np.int64)
        host = dataclasses.replace(
            host,
            penalty_rows=renumber[host.penalty_rows],
            bias_rows=renumber[host.bias_rows],
            banned_rows=renumber[host.banned_rows],
        )
        logprobs: tuple[int | None, ...] = ()
        if any(r.sampling_params.logprobs is not None for r in sampled):
            logprobs = tuple(reqs[i].sampling_params.logprobs for i in sampled_rows)
        return _SpecialRows(host, count_rows, sources, logprobs)

    @staticmethod
    def _state(request: ScheduledRequest, states: Mapping[str, RequestState]) -> RequestState:
        state = states.get(request.request_id)
        if state is None:
            raise RuntimeError(
                f"request {request.request_id!r} uses penalties, min_tokens or prompt_logprobs, which "
                "need ModelRunner.add_request() before it is scheduled"
            )
        return state

    def _sampling_row(self, request: ScheduledRequest, states: Mapping[str, RequestState]) -> SamplingRow:
        params = request.sampling_params
        penalised = params.has_penalties
        if not penalised and request.num_output_tokens >= params.min_tokens:
            return SamplingRow(params, request.num_output_tokens)
        state = self._state(request, states)
        return SamplingRow(
            params,
            request.num_output_tokens,
            state.history.prompt_array if penalised else (),
            state.history.output_token_ids if penalised else (),
            state.eos_token_ids,
        )

    @staticmethod
    def _penalty_placeholders(
        host: HostSamplingArrays,
        rows: list[SamplingRow],
        sampled: list[ScheduledRequest],
        sampled_rows: tuple[int, ...],
        source_of_seq: dict[int, int],
    ) -> tuple[list[int], list[int]]:
        """Count entries the device must add: for each penalised row whose newest output the host
        does not know yet, (its output count row, its index in the previous step's samples)."""
        num_penalised = len(host.penalty_rows)
        count_rows, sources = [], []
        for local, row in enumerate(host.penalty_rows.tolist()):
            request = sampled[row]
            unknown = request.num_output_tokens - len(rows[row].output_token_ids)
            source = source_of_seq.get(sampled_rows[row])
            if unknown == 1 and source is not None:
                count_rows.append(num_penalised + local)
                sources.append(source)
            elif unknown != 0:
                raise RuntimeError(
                    f"request {request.request_id!r}: {unknown} output token(s) unknown to the host "
                    f"{'with' if source is not None else 'without'} a placeholder this step; its "
                    "penalties would miss them"
                )
        return count_rows, sources

    def _prompt_logprob_rows(
        self,
        reqs: tuple[ScheduledRequest, ...],
        query_start_loc: np.ndarray,
        states: Mapping[str, RequestState],
        candidates: list[int],
    ) -> tuple[np.ndarray, np.ndarray, tuple[PromptLogprobRows, ...]]:
        """Token rows whose logits give prompt logprobs this step, the prompt token each predicts,
        and the per-request chunks. Only while a request has sampled nothing yet: prompt logprobs
        are reported once, with its first token (a recompute after preemption skips them)."""
        rows, targets, chunks = [], [], []
        for i in candidates:  # the requests whose params may ask (the others cannot)
            request = reqs[i]
            num_top = request.sampling_params.prompt_logprobs
            if num_top is None or request.num_output_tokens > 0:
                continue
            prompt = self._state(request, states).history.prompt_array
            # Position j's logits predict prompt token j + 1: rows up to the second-to-last prompt
            # token (the last one's logits are the sampling row).
            first = request.start_position
            end = min(first + len(request.token_ids), len(prompt) - 1)
            if end <= first:
                continue
            rows.append(query_start_loc[i] + np.arange(end - first))
            targets.append(prompt[first + 1 : end + 1])
            chunks.append(PromptLogprobRows(request.request_id, first, end - first, num_top))
        if not chunks:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, ()
        return np.concatenate(rows), np.concatenate(targets).astype(np.int64), tuple(chunks)

    def _size_results(self, staged: StagedStep) -> None:
        """Make room for the step's logprobs results (read back by collect before the next fill)."""
        if staged.num_top_logprobs is not None:
            self.buffers.sample_logprobs.size_for(staged.num_sampled, staged.num_top_logprobs)
        if staged.num_proposal_rows and staged.num_top_logprobs is not None:
            self.buffers.proposal_logprobs.size_for(staged.num_proposal_rows, staged.num_top_logprobs)
        if staged.num_prompt_logprob_rows:
            self.buffers.prompt_logprobs.size_for(
                staged.num_prompt_logprob_rows, staged.num_top_prompt_logprobs
            )
