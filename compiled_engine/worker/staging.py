"""Host-side staging of one step's inputs, twice over, so the host can prepare step N+1 while the
device still reads step N.

A `StagingSlot` holds everything a step sends to the device — token ids, positions, slot mapping,
block tables, sequence lengths, query starts, logits rows, sampling parameters and where the
placeholder tokens go — in host tensors (pinned on CUDA, so the copy to the device is truly
asynchronous), plus the host tensor the step's sampled tokens come back into. The runner fills
slot `n % 2` for step n. Its `consumed` event is recorded after the step that read it: a slot is
refilled only once that event has passed, so a slot is never overwritten while a step reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from compiled_engine.core.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from compiled_engine.graphs.device import Event


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


class StagingSlot:
    def __init__(
        self,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        consumed: Event | None = None,
    ) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        t, s = max_num_batched_tokens, max_num_seqs
        pin = device.type == "cuda"

        def buf(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

        self.input_ids = buf(t, dtype=torch.int64)
        self.positions = buf(t, dtype=torch.int64)
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
        self.sampled_tokens = buf(s, dtype=torch.int64)  # device → host: this step's tokens
        self.consumed = consumed

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
        if len(placeholder_rows):
            if previous_sample_index is None:
                raise ValueError("the step feeds placeholder tokens but no previous step sampled them")
            seq_of_row = np.searchsorted(query_start_loc, placeholder_rows, side="right") - 1
            placeholder_sources[:] = [previous_sample_index[reqs[i].request_id] for i in seq_of_row]
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
        logits_indices = query_start_loc[1:][list(sampled_rows)] - 1
        params = [reqs[i].sampling_params for i in sampled_rows]
        greedy = [p.greedy for p in params]
        # Greedy rows keep temperature 1 (dividing by it is harmless) and never force top-k/top-p.
        temperature = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy, strict=True)]
        top_k = [p.top_k for p in params]
        top_p = [float(p.top_p) for p in params]

        n, s, k, m = num_tokens, num_seqs, len(sampled_rows), len(placeholder_rows)
        self.input_ids[:n] = torch.from_numpy(token_ids)
        self.positions[:n] = torch.from_numpy(positions)
        self.slot_mapping[:n] = torch.from_numpy(slots)
        self.block_tables[:s, :width] = torch.from_numpy(table)
        self.seq_lens[:s] = torch.from_numpy(starts + q_lens)
        self.query_start_loc[: s + 1] = torch.from_numpy(query_start_loc)
        self.logits_indices[:k] = torch.from_numpy(np.asarray(logits_indices, dtype=np.int64))
        self.temperature[:k] = torch.tensor(temperature, dtype=torch.float32)
        self.top_k[:k] = torch.tensor(top_k, dtype=torch.int64)
        self.top_p[:k] = torch.tensor(top_p, dtype=torch.float32)
        self.greedy[:k] = torch.tensor(greedy, dtype=torch.bool)
        self.placeholder_rows[:m] = torch.from_numpy(placeholder_rows.astype(np.int64))
        self.placeholder_sources[:m] = torch.from_numpy(placeholder_sources)
        sampled = [not g for g in greedy]
        return StagedStep(
            num_tokens=n,
            num_seqs=s,
            width=width,
            sampled_rows=sampled_rows,
            num_placeholders=m,
            all_greedy=all(greedy),
            needs_top_k=any(x and t != -1 for x, t in zip(sampled, top_k, strict=True)),
            needs_top_p=any(x and p < 1.0 for x, p in zip(sampled, top_p, strict=True)),
        )
