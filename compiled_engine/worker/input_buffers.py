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

from compiled_engine.core.scheduler_output import SchedulerOutput
from compiled_engine.graphs.device import Event
from compiled_engine.graphs.step_inputs import StepInputs
from compiled_engine.worker.staging import StagedStep, StagingSlot


@dataclass(frozen=True)
class PreparedStep:
    inputs: StepInputs
    # Scheduling-order indices of the requests whose last token is sampled this step.
    sampled_rows: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class DeviceSamplingParams:
    """This step's per-row sampling settings: views of the persistent device buffers."""

    temperature: torch.Tensor  # [K] float32
    top_k: torch.Tensor  # [K] int64
    top_p: torch.Tensor  # [K] float32
    greedy: torch.Tensor  # [K] bool


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
        self.logits_indices = buf(s, dtype=torch.int64)
        self.temperature = buf(s, dtype=torch.float32)
        self.top_k = buf(s, dtype=torch.int64)
        self.top_p = buf(s, dtype=torch.float32)
        self.greedy = buf(s, dtype=torch.bool)
        self.placeholder_rows = buf(s, dtype=torch.int64)
        self.placeholder_sources = buf(s, dtype=torch.int64)
        self._own_slot: StagingSlot | None = None

    def new_slot(self, consumed: Event | None = None) -> StagingSlot:
        """A host staging slot shaped like these buffers."""
        return StagingSlot(*self._slot_shape, self.device, consumed)

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
        self.logits_indices[:k].copy_(slot.logits_indices[:k], non_blocking=True)
        self.temperature[:k].copy_(slot.temperature[:k], non_blocking=True)
        self.top_k[:k].copy_(slot.top_k[:k], non_blocking=True)
        self.top_p[:k].copy_(slot.top_p[:k], non_blocking=True)
        self.greedy[:k].copy_(slot.greedy[:k], non_blocking=True)
        if m:
            if previous_samples is None:
                raise ValueError("the step has placeholder tokens but no previous samples were given")
            rows = self.placeholder_rows[:m].copy_(slot.placeholder_rows[:m], non_blocking=True)
            sources = self.placeholder_sources[:m].copy_(slot.placeholder_sources[:m], non_blocking=True)
            self.input_ids[0].index_copy_(0, rows, previous_samples.index_select(0, sources))
        return StepInputs(
            input_ids=self.input_ids[:, :n],
            positions=self.positions[:, :n],
            slot_mapping=self.slot_mapping[:n],
            block_tables=self.block_tables[:s, :w],
            seq_lens=self.seq_lens[:s],
            query_start_loc=self.query_start_loc[: s + 1],
            logits_indices=self.logits_indices[:k],
        )

    def sampling_params(self, num_rows: int) -> DeviceSamplingParams:
        """Views of the sampling buffers for the step just loaded."""
        return DeviceSamplingParams(
            self.temperature[:num_rows], self.top_k[:num_rows], self.top_p[:num_rows], self.greedy[:num_rows]
        )
