"""Persistent step-input buffers owned by the model runner.

Every step writes its flat inputs into the front of these tensors and hands the graph views of
them, so the graph always reads the same storage (the CUDA-graph issue replays these addresses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from compiled_engine.core.scheduler_output import SchedulerOutput
from compiled_engine.graphs.step_inputs import StepInputs


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
        """Fill the buffers from the scheduler's record; return views sized to this step."""
        reqs = step.scheduled
        num_seqs = len(reqs)
        q_lens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((r.start_position for r in reqs), dtype=np.int64, count=num_seqs)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        token_ids = np.fromiter((t for r in reqs for t in r.token_ids), dtype=np.int64, count=num_tokens)
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
        logits_indices = query_start_loc[1:][list(sampled_rows)] - 1

        n, s, k = num_tokens, num_seqs, len(sampled_rows)
        self.input_ids[0, :n].copy_(torch.from_numpy(token_ids))
        self.positions[0, :n].copy_(torch.from_numpy(positions))
        self.slot_mapping[:n].copy_(torch.from_numpy(slots))
        self.block_tables[:s, :width].copy_(torch.from_numpy(table))
        self.seq_lens[:s].copy_(torch.from_numpy(starts + q_lens))
        self.query_start_loc[: s + 1].copy_(torch.from_numpy(query_start_loc))
        self.logits_indices[:k].copy_(torch.from_numpy(np.asarray(logits_indices, dtype=np.int64)))
        inputs = StepInputs(
            input_ids=self.input_ids[:, :n],
            positions=self.positions[:, :n],
            slot_mapping=self.slot_mapping[:n],
            block_tables=self.block_tables[:s, :width],
            seq_lens=self.seq_lens[:s],
            query_start_loc=self.query_start_loc[: s + 1],
            logits_indices=self.logits_indices[:k],
        )
        return PreparedStep(inputs=inputs, sampled_rows=sampled_rows)
