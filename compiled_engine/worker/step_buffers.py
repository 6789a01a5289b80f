"""Every buffer a step uses, declared once: `StepBuffers`.

The runner holds this record three times: twice on the host (the two staging slots,
worker/staging.py; pinned on CUDA so the copy to the device is truly asynchronous) and once on the
device (worker/input_buffers.py, the persistent tensors the graph reads). Each field says its dtype
and its size rule; the host fills a slot's fields, the device side copies the same fields' fronts.

Sizes: T = max_num_batched_tokens, S = max_num_seqs, B = blocks per sequence (max_model_len over
block_size). A step uses the front of each buffer; the counts it uses are in its `StagedStep`.

Two kinds of buffer:
- fixed: allocated at full size once (the graph and captured CUDA graphs read the same storage);
- growable (`GrowableBuffer`): size-varying entries — penalty counts, logit_bias and min_tokens
  entries, prompt-logprobs targets, logprobs results — sized when a step is staged.
Fields only the host side uses are marked `host_only`: the results, which travel device → host
(the device computes them into fresh tensors and copies them into the slot), and the placeholder
count rows (copied straight into the device's penalty counts). On the device side they are never
filled: the fixed ones are allocated there anyway, a few hundred bytes, so both sides are one
record; the growable ones never grow there and hold nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch


class BufferSizes(NamedTuple):
    """The engine limits buffers are sized from."""

    max_num_batched_tokens: int  # T
    max_num_seqs: int  # S
    blocks_per_seq: int  # B

    @classmethod
    def of(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int):
        return cls(max_num_batched_tokens, max_num_seqs, math.ceil(max_model_len / block_size))


class GrowableBuffer:
    """A 1-D buffer of one dtype whose front a step uses, reallocated (doubling) when a step needs
    more. `take` grows it and is only called while no step reads it: on the host while its slot is
    free (being filled), on the device on the execution stream, behind every step that read the old
    one. `front` and `view` never grow it: the step's work reads those while the host may be
    filling the other slot."""

    __slots__ = ("dtype", "device", "pin_memory", "tensor")

    def __init__(self, dtype: torch.dtype, device: torch.device, pin_memory: bool) -> None:
        self.dtype = dtype
        self.device = device
        self.pin_memory = pin_memory
        self.tensor: torch.Tensor | None = None  # allocated on first use

    def take(self, size: int) -> torch.Tensor:
        """The first `size` elements, growing the buffer when it is short."""
        tensor = self.tensor
        if tensor is None or tensor.numel() < size:
            room = max(size, 2 * tensor.numel() if tensor is not None else 64)
            tensor = torch.zeros(room, dtype=self.dtype, device=self.device, pin_memory=self.pin_memory)
            self.tensor = tensor
        return tensor[:size]

    def front(self, size: int) -> torch.Tensor:
        """The first `size` elements, as the last `take` sized them."""
        if self.tensor is None:
            raise RuntimeError("a growable buffer was read before any step filled it")
        return self.tensor[:size]

    def view(self, rows: int, columns: int) -> torch.Tensor:
        """The front as a [rows, columns] matrix (contiguous, so an asynchronous copy lands
        directly in it)."""
        return self.front(rows * columns).view(rows, columns)


@dataclass(eq=False, slots=True)  # slots: assigning a misspelt field raises
class LogprobResults:
    """`token_logprobs` results of R rows with N top entries each, read back by `collect`."""

    top_ids: GrowableBuffer  # [R, N] int64
    top_values: GrowableBuffer  # [R, N] float32
    chosen: GrowableBuffer  # [R] float32: the logprob of the row's token
    ranks: GrowableBuffer  # [R] int64

    @classmethod
    def allocate(cls, device: torch.device, pin_memory: bool) -> LogprobResults:
        return cls(
            top_ids=GrowableBuffer(torch.int64, device, pin_memory),
            top_values=GrowableBuffer(torch.float32, device, pin_memory),
            chosen=GrowableBuffer(torch.float32, device, pin_memory),
            ranks=GrowableBuffer(torch.int64, device, pin_memory),
        )

    def size_for(self, rows: int, num_top: int) -> None:
        """Make room for a step's results (on the host, while its slot is free)."""
        self.top_ids.take(rows * num_top)
        self.top_values.take(rows * num_top)
        self.chosen.take(rows)
        self.ranks.take(rows)


class BufferSpec(NamedTuple):
    """How a `StepBuffers` field is allocated."""

    dtype: torch.dtype | None  # None: a LogprobResults (its own dtypes)
    shape: Callable[[BufferSizes], tuple[int, ...]] | None  # None: growable
    host_only: bool  # only the host side fills it (see the module docstring)


def _fixed(
    dtype: torch.dtype, shape: Callable[[BufferSizes], tuple[int, ...]], host_only: bool = False
) -> Any:
    return field(metadata={"spec": BufferSpec(dtype, shape, host_only)})


def _growable(dtype: torch.dtype) -> Any:
    return field(metadata={"spec": BufferSpec(dtype, None, False)})


def _logprob_results() -> Any:
    return field(metadata={"spec": BufferSpec(None, None, True)})


def _per_token(n: BufferSizes) -> tuple[int, ...]:
    return (n.max_num_batched_tokens,)


def _per_seq(n: BufferSizes) -> tuple[int, ...]:
    return (n.max_num_seqs,)


@dataclass(eq=False, slots=True)  # slots: assigning a misspelt field raises
class StepBuffers:
    """One side's buffers for a step (see the module docstring for sizes and kinds)."""

    # --- the graph's inputs ----------------------------------------------------------------------
    input_ids: torch.Tensor = _fixed(torch.int64, lambda n: (1, n.max_num_batched_tokens))  # [1, T]
    positions: torch.Tensor = _fixed(torch.int64, lambda n: (1, n.max_num_batched_tokens))  # [1, T]
    slot_mapping: torch.Tensor = _fixed(torch.int64, _per_token)  # [T]
    block_tables: torch.Tensor = _fixed(torch.int32, lambda n: (n.max_num_seqs, n.blocks_per_seq))  # [S, B]
    seq_lens: torch.Tensor = _fixed(torch.int32, _per_seq)  # [S]
    query_start_loc: torch.Tensor = _fixed(torch.int32, lambda n: (n.max_num_seqs + 1,))  # [S + 1]
    # Sampling rows first, then prompt-logprobs rows (up to one per token): more than S rows only
    # when a step computes prompt logprobs (graphs/compiled_step.py runs those on the dynamic
    # graph unless the bucket graph has room).
    logits_indices: torch.Tensor = _fixed(
        torch.int64, lambda n: (max(n.max_num_seqs, n.max_num_batched_tokens),)
    )  # [max(S, T)]
    # Placeholder tokens (async loop): the token rows fed one, and where each one's token is in
    # the previous step's sampled tokens (the device fills them in, no host sync).
    placeholder_rows: torch.Tensor = _fixed(torch.int64, _per_seq)  # [S]
    placeholder_sources: torch.Tensor = _fixed(torch.int64, _per_seq)  # [S]

    # --- sampling parameters, one entry per sampling row (K <= S) --------------------------------
    temperature: torch.Tensor = _fixed(torch.float32, _per_seq)
    top_k: torch.Tensor = _fixed(torch.int64, _per_seq)
    top_p: torch.Tensor = _fixed(torch.float32, _per_seq)
    greedy: torch.Tensor = _fixed(torch.bool, _per_seq)
    min_p: torch.Tensor = _fixed(torch.float32, _per_seq)

    # --- penalties, one entry per penalised row (P <= K) -----------------------------------------
    penalty_rows: torch.Tensor = _fixed(torch.int64, _per_seq)
    presence_penalty: torch.Tensor = _fixed(torch.float32, _per_seq)
    frequency_penalty: torch.Tensor = _fixed(torch.float32, _per_seq)
    repetition_penalty: torch.Tensor = _fixed(torch.float32, _per_seq)
    # (count row, token) entries (sampler.PenaltyTensors): the host's are those it knows; the
    # device's add, after them, one per penalised row whose newest output is the previous step's
    # sample (its count row, and its index in that step's sampled tokens).
    penalty_count_rows: GrowableBuffer = _growable(torch.int64)
    penalty_token_ids: GrowableBuffer = _growable(torch.int64)
    penalty_placeholder_count_rows: torch.Tensor = _fixed(torch.int64, _per_seq, host_only=True)  # [<= P]
    penalty_placeholder_sources: torch.Tensor = _fixed(torch.int64, _per_seq)  # [<= P]

    # --- logit_bias and min_tokens entries, prompt-logprobs targets ------------------------------
    bias_rows: GrowableBuffer = _growable(torch.int64)
    bias_token_ids: GrowableBuffer = _growable(torch.int64)
    bias_values: GrowableBuffer = _growable(torch.float32)
    banned_rows: GrowableBuffer = _growable(torch.int64)  # min_tokens: (row, stop token) entries
    banned_token_ids: GrowableBuffer = _growable(torch.int64)
    # The prompt token each prompt-logprobs row predicts (also read back by collect).
    prompt_logprob_targets: GrowableBuffer = _growable(torch.int64)

    # --- results, device → host ------------------------------------------------------------------
    sampled_tokens: torch.Tensor = _fixed(torch.int64, _per_seq, host_only=True)  # [K]
    sample_logprobs: LogprobResults = _logprob_results()  # K rows, the step's largest logprobs=N
    # Speculative decoding, per proposal row (<= T): kept or not, the token drawn if it is the
    # first rejected one, and the logprobs of the token the row emits.
    proposal_accepted: torch.Tensor = _fixed(torch.bool, _per_token, host_only=True)  # [D]
    proposal_recovered: torch.Tensor = _fixed(torch.int64, _per_token, host_only=True)  # [D]
    proposal_logprobs: LogprobResults = _logprob_results()
    prompt_logprobs: LogprobResults = _logprob_results()  # the prompt-logprobs rows

    @classmethod
    def allocate(cls, sizes: BufferSizes, device: torch.device, *, host: bool) -> StepBuffers:
        """Every buffer, zeroed: on `device`, or (`host`) in host memory, pinned when the step runs
        on CUDA."""
        pin = host and device.type == "cuda"
        where = torch.device("cpu") if host else device
        values: dict[str, Any] = {}
        for name, spec in cls.specs().items():
            if spec.dtype is None:
                values[name] = LogprobResults.allocate(where, pin)
            elif spec.shape is None:
                values[name] = GrowableBuffer(spec.dtype, where, pin)
            else:
                values[name] = torch.zeros(spec.shape(sizes), dtype=spec.dtype, device=where, pin_memory=pin)
        return cls(**values)

    @classmethod
    def specs(cls) -> dict[str, BufferSpec]:
        """Every field's allocation rule, by name."""
        return {f.name: f.metadata["spec"] for f in dataclasses.fields(cls)}

    def arrays(self) -> dict[str, np.ndarray]:
        """numpy views of the fixed buffers, by name (buffers in host memory only): a write through
        one costs a fraction of a torch op's dispatch."""
        return {
            name: getattr(self, name).numpy()
            for name, spec in self.specs().items()
            if spec.dtype is not None and spec.shape is not None
        }
