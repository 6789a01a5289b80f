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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from compiled_engine.graphs.device import Event
from compiled_engine.records.request import TokenHistory
from compiled_engine.records.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
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
    def num_logits(self) -> int:
        return self.num_sampled + self.num_prompt_logprob_rows


class StagingSlot:
    """One step's host buffers, their `consumed` event, and how a `SchedulerOutput` fills them."""

    def __init__(
        self, sizes: BufferSizes, block_size: int, device: torch.device, consumed: Event | None = None
    ):
        self.block_size = block_size
        # Pinned when the step runs on CUDA (an asynchronous copy needs page-locked memory).
        self.buffers = StepBuffers.allocate(sizes, device, host=True)
        self.consumed = consumed

    def fill(
        self,
        step: SchedulerOutput,
        previous_sample_index: dict[str, int] | None = None,
        request_states: Mapping[str, RequestState] | None = None,
    ) -> StagedStep:
        """Write the step into the slot. `previous_sample_index` maps a request id to its row in
        the previous step's sampled tokens (needed when the step has placeholders);
        `request_states` holds the histories of requests whose sampling needs them."""
        states = request_states if request_states is not None else {}
        reqs = step.scheduled
        num_seqs = len(reqs)
        q_lens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((r.start_position for r in reqs), dtype=np.int64, count=num_seqs)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        token_ids = np.fromiter((t for r in reqs for t in r.token_ids), dtype=np.int64, count=num_tokens)
        placeholder_rows = np.flatnonzero(token_ids == PLACEHOLDER_TOKEN_ID)
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
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        positions = starts[seq_of_token] + (np.arange(num_tokens) - query_start_loc[:-1][seq_of_token])

        width = max(len(r.block_ids) for r in reqs)
        table = np.zeros((num_seqs, width), dtype=np.int64)
        for i, r in enumerate(reqs):
            table[i, : len(r.block_ids)] = r.block_ids
        bs = self.block_size
        slots = table[seq_of_token, positions // bs] * bs + positions % bs

        sampled_rows = tuple(i for i, r in enumerate(reqs) if r.sample)
        sampled = [reqs[i] for i in sampled_rows]
        rows = [self._sampling_row(r, states) for r in sampled]
        host = HostSamplingArrays.build(rows)
        count_rows, sources = self._penalty_placeholders(host, rows, sampled, sampled_rows, source_of_seq)
        prompt_rows, prompt_targets, prompt_chunks = self._prompt_logprob_rows(reqs, query_start_loc, states)
        logits_indices = np.concatenate([query_start_loc[1:][list(sampled_rows)] - 1, prompt_rows])

        n, s, k, m = num_tokens, num_seqs, len(sampled_rows), len(placeholder_rows)
        b = self.buffers
        b.input_ids[:, :n].copy_(torch.from_numpy(token_ids))
        b.positions[:, :n].copy_(torch.from_numpy(positions))
        b.slot_mapping[:n] = torch.from_numpy(slots)
        b.block_tables[:s, :width] = torch.from_numpy(table)
        b.seq_lens[:s] = torch.from_numpy(starts + q_lens)
        b.query_start_loc[: s + 1] = torch.from_numpy(query_start_loc)
        b.logits_indices[: len(logits_indices)] = torch.from_numpy(logits_indices.astype(np.int64))
        b.placeholder_rows[:m] = torch.from_numpy(placeholder_rows.astype(np.int64))
        b.placeholder_sources[:m] = torch.from_numpy(placeholder_sources)
        b.temperature[:k] = torch.from_numpy(host.temperature)
        b.top_k[:k] = torch.from_numpy(host.top_k)
        b.top_p[:k] = torch.from_numpy(host.top_p)
        b.greedy[:k] = torch.from_numpy(host.greedy)
        b.min_p[:k] = torch.from_numpy(host.min_p)
        p = len(host.penalty_rows)
        b.penalty_rows[:p] = torch.from_numpy(host.penalty_rows)
        b.presence_penalty[:p] = torch.from_numpy(host.presence)
        b.frequency_penalty[:p] = torch.from_numpy(host.frequency)
        b.repetition_penalty[:p] = torch.from_numpy(host.repetition)
        b.penalty_placeholder_count_rows[: len(count_rows)] = torch.tensor(count_rows, dtype=torch.int64)
        b.penalty_placeholder_sources[: len(sources)] = torch.tensor(sources, dtype=torch.int64)
        for buffer, values in (
            (b.penalty_count_rows, host.penalty_count_rows),
            (b.penalty_token_ids, host.penalty_token_ids),
            (b.bias_rows, host.bias_rows),
            (b.bias_token_ids, host.bias_token_ids),
            (b.bias_values, host.bias_values),
            (b.banned_rows, host.banned_rows),
            (b.banned_token_ids, host.banned_token_ids),
            (b.prompt_logprob_targets, prompt_targets),
        ):
            buffer.take(len(values))[:] = torch.from_numpy(values)

        staged = StagedStep(
            num_tokens=n,
            num_seqs=s,
            width=width,
            sampled_rows=sampled_rows,
            num_placeholders=m,
            all_greedy=host.all_greedy,
            needs_top_k=host.needs_top_k,
            needs_top_p=host.needs_top_p,
            needs_min_p=host.needs_min_p,
            num_penalised=p,
            num_penalty_tokens=len(host.penalty_token_ids),
            num_penalty_placeholders=len(count_rows),
            num_bias=len(host.bias_rows),
            num_banned=len(host.banned_rows),
            logprobs=tuple(r.sampling_params.logprobs for r in sampled),
            prompt_logprobs=prompt_chunks,
        )
        self._size_results(staged)
        return staged

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
    ) -> tuple[np.ndarray, np.ndarray, tuple[PromptLogprobRows, ...]]:
        """Token rows whose logits give prompt logprobs this step, the prompt token each predicts,
        and the per-request chunks. Only while a request has sampled nothing yet: prompt logprobs
        are reported once, with its first token (a recompute after preemption skips them)."""
        rows, targets, chunks = [], [], []
        for i, request in enumerate(reqs):
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
        if staged.num_prompt_logprob_rows:
            self.buffers.prompt_logprobs.size_for(
                staged.num_prompt_logprob_rows, staged.num_top_prompt_logprobs
            )
