"""Persistent step-input buffers owned by the model runner, on the device.

Every step's flat inputs are copied from a host staging slot (worker/staging.py) into the front of
these tensors, and the graph gets views of them, so it always reads the same storage (captured
CUDA graphs replay these addresses). The copies are queued on the stream the step runs on, so
step N+1's copy cannot overwrite what step N still reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from compiled_engine.graphs.device import Event
from compiled_engine.graphs.step_inputs import StepInputs
from compiled_engine.records.scheduler_output import SchedulerOutput
from compiled_engine.worker.sampler import PenaltyTensors, SamplingTensors, TokenEntries
from compiled_engine.worker.staging import (
    PENALTY_ROW_FIELDS,
    SAMPLING_ROW_FIELDS,
    RequestState,
    StagedStep,
    StagingSlot,
)


@dataclass(frozen=True)
class PreparedStep:
    inputs: StepInputs
    # Scheduling-order indices of the requests whose last token is sampled this step.
    sampled_rows: tuple[int, ...]


class InputBuffers:
    def __init__(
        self,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.device = device
        self._slot_shape = (max_num_batched_tokens, max_num_seqs, max_model_len, block_size)
        t, s = max_num_batched_tokens, max_num_seqs

        def buf(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = buf(1, t, dtype=torch.int64)
        self.positions = buf(1, t, dtype=torch.int64)
        self.slot_mapping = buf(t, dtype=torch.int64)
        self.block_tables = buf(s, self.max_blocks_per_seq, dtype=torch.int32)
        self.seq_lens = buf(s, dtype=torch.int32)
        self.query_start_loc = buf(s + 1, dtype=torch.int32)
        # Sampling rows, then prompt-logprobs rows (up to one per token): more than S rows only
        # when a step computes prompt logprobs (graphs/compiled_step.py runs those on the
        # dynamic graph unless the bucket graph has room).
        self.logits_indices = buf(max(s, t), dtype=torch.int64)
        for name, dtype in (SAMPLING_ROW_FIELDS | PENALTY_ROW_FIELDS).items():
            setattr(self, name, buf(s, dtype=dtype))
        self.placeholder_rows = buf(s, dtype=torch.int64)
        self.placeholder_sources = buf(s, dtype=torch.int64)
        # Size-varying inputs (penalty counts, logit_bias and min_tokens entries, prompt-logprobs
        # targets): grown on the execution stream when a step needs more (`_device_buffer`).
        self._growable: dict[str, torch.Tensor] = {}
        self._own_slot: StagingSlot | None = None

    def new_slot(
        self, consumed: Event | None = None, request_states: dict[str, RequestState] | None = None
    ) -> StagingSlot:
        """A host staging slot shaped like these buffers."""
        return StagingSlot(*self._slot_shape, self.device, consumed, request_states)

    def whole(self) -> StepInputs:
        """The whole persistent tensors: the room a compiled step pads into behind each step's views."""
        return StepInputs(
            input_ids=self.input_ids,
            positions=self.positions,
            slot_mapping=self.slot_mapping,
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            query_start_loc=self.query_start_loc,
            logits_indices=self.logits_indices,
        )

    def prepare(self, step: SchedulerOutput) -> PreparedStep:
        """Stage the step and load it at once (the synchronous path); return views sized to it."""
        if self._own_slot is None:
            self._own_slot = self.new_slot()
        staged = self._own_slot.fill(step)
        return PreparedStep(self.load(self._own_slot, staged), staged.sampled_rows)

    def load(
        self, slot: StagingSlot, staged: StagedStep, previous_samples: torch.Tensor | None = None
    ) -> StepInputs:
        """Copy a staged step into the persistent buffers (queued on the current stream) and
        return views sized to it. Placeholder tokens are taken from `previous_samples`, the
        previous step's sampled tokens, without a trip through the host."""
        n, s, w, k, m = (
            staged.num_tokens,
            staged.num_seqs,
            staged.width,
            len(staged.sampled_rows),
            staged.num_placeholders,
        )
        self.input_ids[0, :n].copy_(slot.input_ids[:n], non_blocking=True)
        self.positions[0, :n].copy_(slot.positions[:n], non_blocking=True)
        self.slot_mapping[:n].copy_(slot.slot_mapping[:n], non_blocking=True)
        self.block_tables[:s, :w].copy_(slot.block_tables[:s, :w], non_blocking=True)
        self.seq_lens[:s].copy_(slot.seq_lens[:s], non_blocking=True)
        self.query_start_loc[: s + 1].copy_(slot.query_start_loc[: s + 1], non_blocking=True)
        e = staged.num_logits
        self.logits_indices[:e].copy_(slot.logits_indices[:e], non_blocking=True)
        for name in SAMPLING_ROW_FIELDS:
            getattr(self, name)[:k].copy_(getattr(slot, name)[:k], non_blocking=True)
        p = staged.num_penalised
        for name in PENALTY_ROW_FIELDS:
            getattr(self, name)[:p].copy_(getattr(slot, name)[:p], non_blocking=True)
        for name, size in (
            ("bias_rows", staged.num_bias),
            ("bias_token_ids", staged.num_bias),
            ("bias_values", staged.num_bias),
            ("banned_rows", staged.num_banned),
            ("banned_token_ids", staged.num_banned),
            ("prompt_logprob_targets", staged.num_prompt_logprob_rows),
        ):
            self._load_growable(slot, name, size)
        if m:
            if previous_samples is None:
                raise ValueError("the step has placeholder tokens but no previous samples were given")
            rows = self.placeholder_rows[:m].copy_(slot.placeholder_rows[:m], non_blocking=True)
            sources = self.placeholder_sources[:m].copy_(slot.placeholder_sources[:m], non_blocking=True)
            self.input_ids[0].index_copy_(0, rows, previous_samples.index_select(0, sources))
        self._load_penalty_counts(slot, staged, previous_samples)
        return StepInputs(
            input_ids=self.input_ids[:, :n],
            positions=self.positions[:, :n],
            slot_mapping=self.slot_mapping[:n],
            block_tables=self.block_tables[:s, :w],
            seq_lens=self.seq_lens[:s],
            query_start_loc=self.query_start_loc[: s + 1],
            logits_indices=self.logits_indices[:e],
        )

    def _device_buffer(self, name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `size` elements of the growable device buffer `name`. Grown (doubling) on the
        execution stream, behind every earlier step that read the old one."""
        buffer = self._growable.get(name)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype:
            room = max(size, 2 * buffer.numel() if buffer is not None else 64)
            buffer = torch.zeros(room, dtype=dtype, device=self.device)
            self._growable[name] = buffer
        return buffer[:size]

    def _load_growable(self, slot: StagingSlot, name: str, size: int) -> torch.Tensor:
        source = slot.staged(name, size)
        return self._device_buffer(name, size, source.dtype).copy_(source, non_blocking=True)

    def _load_penalty_counts(
        self, slot: StagingSlot, staged: StagedStep, previous_samples: torch.Tensor | None
    ) -> None:
        """Every (count row, token) entry of the penalised rows: those the host knows, then the
        newest outputs it does not know yet, read from the previous step's samples here."""
        known, pending = staged.num_penalty_tokens, staged.num_penalty_placeholders
        count_rows = self._device_buffer("penalty_count_rows", known + pending, torch.int64)
        token_ids = self._device_buffer("penalty_token_ids", known + pending, torch.int64)
        count_rows[:known].copy_(slot.staged("penalty_count_rows", known), non_blocking=True)
        token_ids[:known].copy_(slot.staged("penalty_token_ids", known), non_blocking=True)
        if pending:
            if previous_samples is None:
                raise ValueError("penalties need the previous step's samples, but none were given")
            count_rows[known:].copy_(slot.penalty_placeholder_count_rows[:pending], non_blocking=True)
            sources = self._device_buffer("penalty_placeholder_sources", pending, torch.int64)
            sources.copy_(slot.penalty_placeholder_sources[:pending], non_blocking=True)
            token_ids[known:] = previous_samples.index_select(0, sources)

    def sampling_tensors(
        self,
        staged: StagedStep,
        generators: tuple[torch.Generator | None, ...],
        default_generator: torch.Generator | None,
    ) -> SamplingTensors:
        """The step just loaded's sampling settings: views of the device buffers, plus its flags."""
        k, p = staged.num_sampled, staged.num_penalised
        penalties = None
        if p:
            size = staged.num_penalty_tokens + staged.num_penalty_placeholders
            penalties = PenaltyTensors(
                rows=self.penalty_rows[:p],
                presence=self.presence_penalty[:p],
                frequency=self.frequency_penalty[:p],
                repetition=self.repetition_penalty[:p],
                count_rows=self._growable["penalty_count_rows"][:size],
                token_ids=self._growable["penalty_token_ids"][:size],
            )
        bias = banned = None
        if staged.num_bias:
            b = staged.num_bias
            g = self._growable
            bias = TokenEntries(g["bias_rows"][:b], g["bias_token_ids"][:b], g["bias_values"][:b])
        if staged.num_banned:
            b = staged.num_banned
            banned = TokenEntries(self._growable["banned_rows"][:b], self._growable["banned_token_ids"][:b])
        return SamplingTensors(
            temperature=self.temperature[:k],
            top_k=self.top_k[:k],
            top_p=self.top_p[:k],
            greedy=self.greedy[:k],
            generators=generators,
            default_generator=default_generator,
            all_greedy=staged.all_greedy,
            needs_top_k=staged.needs_top_k,
            needs_top_p=staged.needs_top_p,
            min_p=self.min_p[:k] if staged.needs_min_p else None,
            penalties=penalties,
            logit_bias=bias,
            min_tokens_banned=banned,
        )

    def prompt_logprob_targets(self, num_rows: int) -> torch.Tensor:
        """The prompt token each prompt-logprobs row predicts (for the step just loaded)."""
        return self._growable["prompt_logprob_targets"][:num_rows]
