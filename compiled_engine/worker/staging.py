"""Host-side staging of one step's inputs, twice over, so the host can prepare step N+1 while the
device still reads step N.

A `StagingSlot` holds everything a step sends to the device — token ids, positions, slot mapping,
block tables, sequence lengths, query starts, logits rows, sampling parameters and where the
placeholder tokens go — in host tensors (pinned on CUDA, so the copy to the device is truly
asynchronous), plus the host tensors the step's results come back into (sampled tokens,
logprobs). The runner fills slot `n % 2` for step n. Its `consumed` event is recorded after the
step that read it: a slot is refilled only once that event has passed, so a slot is never
overwritten while a step reads it. Results are read back (`collect`) before the slot's next
fill, so the size-varying buffers may be reallocated at fill time.

Sampling parameters that need more than a step carries — penalties (the request's prompt and
the outputs the host knows), min_tokens (the model's EOS ids), prompt logprobs (the prompt) —
read the runner's `RequestState`s, which the engine core keeps up to date.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from compiled_engine.graphs.device import Event
from compiled_engine.records.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from compiled_engine.worker.sampler import HostSamplingArrays, SamplingRow


@dataclass
class RequestState:
    """What the runner keeps between steps for a request whose sampling needs its history."""

    prompt_token_ids: np.ndarray  # int64
    eos_token_ids: frozenset[int]
    # Outputs the host knows: the engine core appends each step's tokens after its update, so
    # with a step in flight the newest output is still missing here (it is a placeholder on
    # the device, and the device adds it).
    output_token_ids: list[int] = field(default_factory=list)


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


# One entry per sampling row (K rows a step), then per penalised row: named alike in the host slot
# and in the device buffers (worker/input_buffers.py), which are declared and copied from these.
SAMPLING_ROW_FIELDS = {
    "temperature": torch.float32,
    "top_k": torch.int64,
    "top_p": torch.float32,
    "greedy": torch.bool,
    "min_p": torch.float32,
}
PENALTY_ROW_FIELDS = {
    "penalty_rows": torch.int64,
    "presence_penalty": torch.float32,
    "frequency_penalty": torch.float32,
    "repetition_penalty": torch.float32,
}


class StagingSlot:
    def __init__(
        self,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        consumed: Event | None = None,
        request_states: dict[str, RequestState] | None = None,
    ) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        t, s = max_num_batched_tokens, max_num_seqs
        self._pin = device.type == "cuda"

        def buf(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, pin_memory=self._pin)

        self.input_ids = buf(t, dtype=torch.int64)
        self.positions = buf(t, dtype=torch.int64)
        self.slot_mapping = buf(t, dtype=torch.int64)
        self.block_tables = buf(s, self.max_blocks_per_seq, dtype=torch.int32)
        self.seq_lens = buf(s, dtype=torch.int32)
        self.query_start_loc = buf(s + 1, dtype=torch.int32)
        # Sampling rows first, then prompt-logprobs rows: up to one per token.
        self.logits_indices = buf(max(s, t), dtype=torch.int64)
        for name, dtype in (SAMPLING_ROW_FIELDS | PENALTY_ROW_FIELDS).items():
            setattr(self, name, buf(s, dtype=dtype))
        # Penalised rows whose newest output is the previous step's sample: its count row, and its
        # index in that step's sampled tokens.
        self.penalty_placeholder_count_rows = buf(s, dtype=torch.int64)
        self.penalty_placeholder_sources = buf(s, dtype=torch.int64)
        self.placeholder_rows = buf(s, dtype=torch.int64)
        self.placeholder_sources = buf(s, dtype=torch.int64)
        self.sampled_tokens = buf(s, dtype=torch.int64)  # device → host: this step's tokens
        # Size-varying buffers (token counts for penalties, logit_bias and min_tokens entries,
        # prompt-logprobs targets, logprobs results) grow on demand: see `host_buffer`.
        self._growable: dict[str, torch.Tensor] = {}
        self.consumed = consumed
        self.request_states = request_states if request_states is not None else {}

    def host_buffer(self, name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `size` elements of the growable 1-D buffer `name`, reallocated (doubling) when
        short. Only called while the slot is free (filling it), so no step reads the old one."""
        buffer = self._growable.get(name)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype:
            room = max(size, 2 * buffer.numel() if buffer is not None else 64)
            buffer = torch.zeros(room, dtype=dtype, pin_memory=self._pin)
            self._growable[name] = buffer
        return buffer[:size]

    def staged(self, name: str, size: int) -> torch.Tensor:
        """The first `size` elements `fill` wrote into the growable buffer `name` (never grows it:
        the step's work reads this while the host may be filling the other slot)."""
        return self._growable[name][:size]

    def result_view(self, name: str, *shape: int) -> torch.Tensor:
        """A contiguous view of a result buffer that `fill` sized (contiguous, so an asynchronous
        device-to-host copy lands directly in it)."""
        return self._growable[name][: math.prod(shape)].view(*shape)

    def fill(self, step: SchedulerOutput, previous_sample_index: dict[str, int] | None = None) -> StagedStep:
        """Write the step into the slot. `previous_sample_index` maps a request id to its row in
        the previous step's sampled tokens (needed when the step has placeholders)."""
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
        rows = [self._sampling_row(r) for r in sampled]
        host = HostSamplingArrays.build(rows)
        count_rows, sources = self._penalty_placeholders(host, rows, sampled, sampled_rows, source_of_seq)
        prompt_rows, prompt_targets, prompt_chunks = self._prompt_logprob_rows(reqs, query_start_loc)
        logits_indices = np.concatenate([query_start_loc[1:][list(sampled_rows)] - 1, prompt_rows])

        n, s, k, m = num_tokens, num_seqs, len(sampled_rows), len(placeholder_rows)
        self.input_ids[:n] = torch.from_numpy(token_ids)
        self.positions[:n] = torch.from_numpy(positions)
        self.slot_mapping[:n] = torch.from_numpy(slots)
        self.block_tables[:s, :width] = torch.from_numpy(table)
        self.seq_lens[:s] = torch.from_numpy(starts + q_lens)
        self.query_start_loc[: s + 1] = torch.from_numpy(query_start_loc)
        self.logits_indices[: len(logits_indices)] = torch.from_numpy(logits_indices.astype(np.int64))
        self.placeholder_rows[:m] = torch.from_numpy(placeholder_rows.astype(np.int64))
        self.placeholder_sources[:m] = torch.from_numpy(placeholder_sources)
        for name in SAMPLING_ROW_FIELDS:
            getattr(self, name)[:k] = torch.from_numpy(getattr(host, name))
        p = len(host.penalty_rows)
        self.penalty_rows[:p] = torch.from_numpy(host.penalty_rows)
        self.presence_penalty[:p] = torch.from_numpy(host.presence)
        self.frequency_penalty[:p] = torch.from_numpy(host.frequency)
        self.repetition_penalty[:p] = torch.from_numpy(host.repetition)
        self.penalty_placeholder_count_rows[: len(count_rows)] = torch.tensor(count_rows, dtype=torch.int64)
        self.penalty_placeholder_sources[: len(sources)] = torch.tensor(sources, dtype=torch.int64)
        for name, values in (
            ("penalty_count_rows", host.penalty_count_rows),
            ("penalty_token_ids", host.penalty_token_ids),
            ("bias_rows", host.bias_rows),
            ("bias_token_ids", host.bias_token_ids),
            ("bias_values", host.bias_values),
            ("banned_rows", host.banned_rows),
            ("banned_token_ids", host.banned_token_ids),
            ("prompt_logprob_targets", prompt_targets),
        ):
            self.host_buffer(name, len(values), _TORCH_DTYPE[values.dtype])[:] = torch.from_numpy(values)

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

    def _state(self, request: ScheduledRequest) -> RequestState:
        state = self.request_states.get(request.request_id)
        if state is None:
            raise RuntimeError(
                f"request {request.request_id!r} uses penalties, min_tokens or prompt_logprobs, which "
                "need ModelRunner.add_request() before it is scheduled"
            )
        return state

    def _sampling_row(self, request: ScheduledRequest) -> SamplingRow:
        params = request.sampling_params
        penalised = params.has_penalties
        if not penalised and request.num_output_tokens >= params.min_tokens:
            return SamplingRow(params, request.num_output_tokens)
        state = self._state(request)
        return SamplingRow(
            params,
            request.num_output_tokens,
            state.prompt_token_ids if penalised else (),
            state.output_token_ids if penalised else (),
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
        self, reqs: tuple[ScheduledRequest, ...], query_start_loc: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, tuple[PromptLogprobRows, ...]]:
        """Token rows whose logits give prompt logprobs this step, the prompt token each predicts,
        and the per-request chunks. Only while a request has sampled nothing yet: prompt logprobs
        are reported once, with its first token (a recompute after preemption skips them)."""
        rows, targets, chunks = [], [], []
        for i, request in enumerate(reqs):
            num_top = request.sampling_params.prompt_logprobs
            if num_top is None or request.num_output_tokens > 0:
                continue
            prompt = self._state(request).prompt_token_ids
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
        k, top = staged.num_sampled, staged.num_top_logprobs
        if top is not None:
            self.host_buffer("logprob_top_ids", k * top, torch.int64)
            self.host_buffer("logprob_top_values", k * top, torch.float32)
            self.host_buffer("logprob_chosen", k, torch.float32)
            self.host_buffer("logprob_ranks", k, torch.int64)
        e, top = staged.num_prompt_logprob_rows, staged.num_top_prompt_logprobs
        if e:
            self.host_buffer("prompt_top_ids", e * top, torch.int64)
            self.host_buffer("prompt_top_values", e * top, torch.float32)
            self.host_buffer("prompt_chosen", e, torch.float32)
            self.host_buffer("prompt_ranks", e, torch.int64)


_TORCH_DTYPE = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32}
