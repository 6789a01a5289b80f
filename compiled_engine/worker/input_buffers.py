"""Persistent step-input buffers owned by the model runner, on the device.

Every step's flat inputs are copied from a host staging slot (worker/staging.py) into the front of
these tensors — a device `StepBuffers` (worker/step_buffers.py), the record the slot holds on the
host — and the graph gets views of them, so it always reads the same storage (captured CUDA graphs
replay these addresses). The copies are queued on the stream the step runs on, so
step N+1's copy cannot overwrite what step N still reads. On the CPU they are plain memory copies
made through numpy views of both sides: each torch copy (two slices and a `copy_`) cost a few
microseconds of dispatch for a few bytes, a dozen times a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from compiled_engine.graphs.device import Event
from compiled_engine.graphs.step_inputs import FrontViews, StepInputs
from compiled_engine.records.scheduler_output import SchedulerOutput
from compiled_engine.worker.sampler import PenaltyTensors, SamplingTensors, TokenEntries
from compiled_engine.worker.staging import StagedStep, StagingSlot
from compiled_engine.worker.step_buffers import BufferSizes, GrowableBuffer, StepBuffers


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
        self.device = device
        self.sizes = BufferSizes.of(max_num_batched_tokens, max_num_seqs, max_model_len, block_size)
        self.max_blocks_per_seq = self.sizes.blocks_per_seq
        # The step's buffers on the device; growable ones grow on the execution stream.
        self.device_buffers = StepBuffers.allocate(self.sizes, device, host=False)
        # On the CPU: numpy views of the fixed device buffers, which `load` copies through.
        self._device_arrays: dict[str, np.ndarray] | None = None
        if device.type == "cpu":
            self._device_arrays = self.device_buffers.arrays()
        self._own_slot: StagingSlot | None = None
        self._front = FrontViews(self.whole())

    @property
    def max_num_seqs(self) -> int:
        return self.sizes.max_num_seqs

    def new_slot(self, consumed: Event | None = None) -> StagingSlot:
        """A host staging slot shaped like these buffers."""
        return StagingSlot(self.sizes, self.block_size, self.device, consumed)

    def whole(self) -> StepInputs:
        """The whole persistent tensors: the room a compiled step pads into behind each step's views."""
        d = self.device_buffers
        return StepInputs(
            input_ids=d.input_ids,
            positions=d.positions,
            slot_mapping=d.slot_mapping,
            block_tables=d.block_tables,
            seq_lens=d.seq_lens,
            query_start_loc=d.query_start_loc,
            logits_indices=d.logits_indices,
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
        e = staged.num_logits
        p = staged.num_penalised
        # (buffer, index) of the fixed buffers this step uses.
        fixed: list[tuple[str, Any]] = [
            ("input_ids", (slice(None), slice(n))),
            ("positions", (slice(None), slice(n))),
            ("slot_mapping", slice(n)),
            ("block_tables", (slice(s), slice(w))),
            ("seq_lens", slice(s)),
            ("query_start_loc", slice(s + 1)),
            ("logits_indices", slice(e)),
        ]
        if k and not staged.all_greedy:  # an all-greedy step's sampler reads none of them
            fixed += [(name, slice(k)) for name in ("temperature", "top_k", "top_p", "greedy", "min_p")]
        if p:
            names = ("penalty_rows", "presence_penalty", "frequency_penalty", "repetition_penalty")
            fixed += [(name, slice(p)) for name in names]
        d, h = self.device_buffers, slot.buffers
        if self._device_arrays is not None:
            arrays, host = self._device_arrays, slot.host
            for name, index in fixed:
                arrays[name][index] = host[name][index]
        else:
            # Each copy is a torch op with its dispatch cost: the ones a step does not use are skipped.
            for name, index in fixed:
                getattr(d, name)[index].copy_(getattr(h, name)[index], non_blocking=True)
        for device_buffer, host_buffer, size in (
            (d.bias_rows, h.bias_rows, staged.num_bias),
            (d.bias_token_ids, h.bias_token_ids, staged.num_bias),
            (d.bias_values, h.bias_values, staged.num_bias),
            (d.banned_rows, h.banned_rows, staged.num_banned),
            (d.banned_token_ids, h.banned_token_ids, staged.num_banned),
            (d.prompt_logprob_targets, h.prompt_logprob_targets, staged.num_prompt_logprob_rows),
        ):
            if size:
                _load_growable(device_buffer, host_buffer, size)
        if m:
            if previous_samples is None:
                raise ValueError("the step has placeholder tokens but no previous samples were given")
            rows = d.placeholder_rows[:m].copy_(h.placeholder_rows[:m], non_blocking=True)
            sources = d.placeholder_sources[:m].copy_(h.placeholder_sources[:m], non_blocking=True)
            d.input_ids[0].index_copy_(0, rows, previous_samples.index_select(0, sources))
        if staged.num_penalised:
            self._load_penalty_counts(h, staged, previous_samples)
        return self._front(n, s, e, w)

    def _load_penalty_counts(
        self, h: StepBuffers, staged: StagedStep, previous_samples: torch.Tensor | None
    ) -> None:
        """Every (count row, token) entry of the penalised rows: those the host knows, then the
        newest outputs it does not know yet, read from the previous step's samples here."""
        d = self.device_buffers
        known, pending = staged.num_penalty_tokens, staged.num_penalty_placeholders
        count_rows = d.penalty_count_rows.take(known + pending)
        token_ids = d.penalty_token_ids.take(known + pending)
        count_rows[:known].copy_(h.penalty_count_rows.front(known), non_blocking=True)
        token_ids[:known].copy_(h.penalty_token_ids.front(known), non_blocking=True)
        if pending:
            if previous_samples is None:
                raise ValueError("penalties need the previous step's samples, but none were given")
            count_rows[known:].copy_(h.penalty_placeholder_count_rows[:pending], non_blocking=True)
            sources = d.penalty_placeholder_sources[:pending]
            sources.copy_(h.penalty_placeholder_sources[:pending], non_blocking=True)
            token_ids[known:] = previous_samples.index_select(0, sources)

    def sampling_tensors(
        self,
        staged: StagedStep,
        generators: tuple[torch.Generator | None, ...],
        default_generator: torch.Generator | None,
    ) -> SamplingTensors:
        """The step just loaded's sampling settings: views of the device buffers, plus its flags."""
        d = self.device_buffers
        k, p = staged.num_sampled, staged.num_penalised
        penalties = None
        if p:
            size = staged.num_penalty_tokens + staged.num_penalty_placeholders
            penalties = PenaltyTensors(
                rows=d.penalty_rows[:p],
                presence=d.presence_penalty[:p],
                frequency=d.frequency_penalty[:p],
                repetition=d.repetition_penalty[:p],
                count_rows=d.penalty_count_rows.front(size),
                token_ids=d.penalty_token_ids.front(size),
            )
        bias = banned = None
        if staged.num_bias:
            b = staged.num_bias
            bias = TokenEntries(d.bias_rows.front(b), d.bias_token_ids.front(b), d.bias_values.front(b))
        if staged.num_banned:
            b = staged.num_banned
            banned = TokenEntries(d.banned_rows.front(b), d.banned_token_ids.front(b))
        return SamplingTensors(
            temperature=d.temperature[:k],
            top_k=d.top_k[:k],
            top_p=d.top_p[:k],
            greedy=d.greedy[:k],
            generators=generators,
            default_generator=default_generator,
            all_greedy=staged.all_greedy,
            needs_top_k=staged.needs_top_k,
            needs_top_p=staged.needs_top_p,
            min_p=d.min_p[:k] if staged.needs_min_p else None,
            penalties=penalties,
            logit_bias=bias,
            min_tokens_banned=banned,
        )

    def prompt_logprob_targets(self, num_rows: int) -> torch.Tensor:
        """The prompt token each prompt-logprobs row predicts (for the step just loaded)."""
        return self.device_buffers.prompt_logprob_targets.front(num_rows)


def _load_growable(device_buffer: GrowableBuffer, host_buffer: GrowableBuffer, size: int) -> None:
    """Copy the front of a host growable buffer; the device one grows here, on the execution stream."""
    device_buffer.take(size).copy_(host_buffer.front(size), non_blocking=True)
