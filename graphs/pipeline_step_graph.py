"""A pipeline stage's step graph: each step runs as micro-batches, so the stages overlap.

Under pipeline parallelism every rank runs every step (distributed/pipeline_stages.py). Run
whole, a step keeps one stage busy at a time: stage 1 waits for stage 0's hidden states, then
stage 0 waits for the logits. `PipelineStepGraph` splits the step into `num_microbatches`
groups of whole sequences (contiguous, about equal in tokens; the same split on every rank, as
it depends on the step only) and runs the stage's graph on each in turn. A stage hands a
micro-batch on without waiting for it to arrive (kernels/pipeline_transfer.py), so stage 0 runs
micro-batch i+1 while stage 1 runs micro-batch i.

`start(inputs)` runs the stage's part of a step and returns without waiting for the logits: a
`PendingLogits` holding the step's own posted transfers, whose `wait()` completes them and puts
the logits back in the step's row order, so the runner sees one step as before. Between the two
the first stage can run the next step (the engine core keeps up to P steps in flight:
core/engine_core.py), so the stages overlap across steps too, not only within one.
`__call__` is both at once.

Each micro-batch is staged at the front of the runner's persistent buffers, where the step
graph expects its inputs (graphs/buckets.py `pad_step`); the step's own inputs are put back
afterwards, as the runner reads them again after the graph (proposal rows, logprob targets).

It also keeps the stage's timeline: time in the graph busy computing vs waiting for another
stage (`StageTimes`), which `bench/test_pipeline_timeline.py` reads from every stage.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from compiled_engine.graphs.cpu_step_plan import CpuStepPlan
from compiled_engine.graphs.step_inputs import StepInputs, front_of
from compiled_engine.kernels.pipeline_transfer import PostedTransfers, TransferClock, take_transfers

if TYPE_CHECKING:
    from compiled_engine.graphs.step_graph import StepGraph

# Overrides the micro-batch count (default: one per stage), for measuring the overlap it buys.
MICROBATCHES_ENV = "COMPILED_ENGINE_PP_MICROBATCHES"
# Overrides the steps the engine core keeps in flight (default: one per stage; 1: a step at a
# time, as before cross-step pipelining), for measuring the overlap it buys. Read on rank 0.
STEPS_IN_FLIGHT_ENV = "COMPILED_ENGINE_PP_STEPS_IN_FLIGHT"


@dataclass(frozen=True)
class StageTimes:
    """One stage's step-graph time since it was last reset: computing vs waiting for other stages."""

    stage: int
    num_steps: int
    num_microbatches: int
    busy_s: float
    wait_s: float


def microbatch_count(num_stages: int) -> int:
    value = os.environ.get(MICROBATCHES_ENV, "").strip()
    if not value:
        return num_stages
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{MICROBATCHES_ENV} must be a positive int, got {value!r}")
    return int(value)


def steps_in_flight(num_stages: int) -> int:
    value = os.environ.get(STEPS_IN_FLIGHT_ENV, "").strip()
    if not value:
        return num_stages
    if not value.isdigit() or not 1 <= int(value) <= num_stages:
        raise ValueError(
            f"{STEPS_IN_FLIGHT_ENV} must be an int from 1 to the {num_stages} pipeline stages, got {value!r}"
        )
    return int(value)


def split_sequences(query_start_loc: list[int], num_groups: int) -> list[tuple[int, int]]:
    """[first, end) sequence ranges: at most `num_groups`, none empty, about equal in tokens."""
    num_seqs = len(query_start_loc) - 1
    groups = max(1, min(num_groups, num_seqs))
    total = query_start_loc[-1]
    bounds, start = [], 0
    for g in range(1, groups):
        target = total * g / groups
        end = start + 1  # at least one sequence each
        while end < num_seqs - (groups - g) and query_start_loc[end] < target:
            end += 1
        bounds.append((start, end))
        start = end
    bounds.append((start, num_seqs))
    return bounds


class PipelineStepGraph:
    """Wraps a stage's `StepGraph` (the StepGraph protocol: everything but `__call__` is the
    wrapped graph's)."""

    def __init__(
        self, inner: StepGraph, buffers: StepInputs, stage: int, num_stages: int, num_microbatches: int
    ) -> None:
        self.inner = inner
        self._buffers = buffers
        self.stage = stage
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self._times = StageTimes(stage, 0, 0, 0.0, 0.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def last_call(self) -> Any:
        return self.inner.last_call

    # No decode-graph capture for a stage: its hand-offs post sends and receives from Python
    # (kernels/pipeline_transfer.py), which a replayed CUDA graph would not repeat. Its bucket
    # graphs run uncaptured.
    supports_graphs = False

    def capture_graphs(self) -> int:
        return 0

    def release_graphs(self) -> None:
        pass

    def decode_plan(self, num_tokens: int) -> CpuStepPlan | None:
        return None  # a stage runs one step a schedule

    def stage_times(self, reset: bool = False) -> StageTimes:
        times = self._times
        if reset:
            self._times = StageTimes(self.stage, 0, 0, 0.0, 0.0)
        return times

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        return self.start(inputs).wait()

    def start(self, inputs: StepInputs) -> PendingLogits:
        """Run the stage's part of the step, posting its hand-offs; the logits come with `wait()`."""
        started = time.perf_counter()
        TransferClock.take()
        groups = split_sequences(inputs.query_start_loc.tolist(), self.num_microbatches)
        try:
            if len(groups) == 1:
                parts: list[tuple[torch.Tensor | None, torch.Tensor]] = [(None, self.inner(inputs))]
            else:
                parts = self._run_microbatches(inputs, groups)
        finally:
            transfers = take_transfers()  # a failed step's, too: the next step must not wait for them
        wall = time.perf_counter() - started
        waited = TransferClock.take()  # receives inside the graph: the previous stage's hidden states
        self._add_times(1, len(groups), wall - waited, waited)
        return PendingLogits(self, transfers, parts, inputs.logits_indices.shape[0])

    def _add_times(self, num_steps: int, num_microbatches: int, busy_s: float, wait_s: float) -> None:
        t = self._times
        self._times = StageTimes(
            self.stage,
            t.num_steps + num_steps,
            t.num_microbatches + num_microbatches,
            t.busy_s + busy_s,
            t.wait_s + wait_s,
        )

    def _run_microbatches(
        self, inputs: StepInputs, groups: list[tuple[int, int]]
    ) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
        step = StepInputs(*(t.clone() for t in inputs))  # the front of the buffers is reused below
        starts = step.query_start_loc.tolist()
        parts: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        try:
            for first, end in groups:
                sub, rows = self._stage_microbatch(step, starts, first, end)
                parts.append((rows, self.inner(sub)))
        finally:
            self._restore(step)
        return parts

    def _stage_microbatch(
        self, step: StepInputs, starts: list[int], first: int, end: int
    ) -> tuple[StepInputs, torch.Tensor]:
        """Sequences [first, end) of `step` at the front of the buffers; and which of the step's
        logits rows they own."""
        b = self._buffers
        q0, q1 = starts[first], starts[end]
        n, s, width = q1 - q0, end - first, step.block_tables.shape[1]
        b.input_ids[:, :n] = step.input_ids[:, q0:q1]
        b.positions[:, :n] = step.positions[:, q0:q1]
        b.slot_mapping[:n] = step.slot_mapping[q0:q1]
        b.block_tables[:s, :width] = step.block_tables[first:end]
        b.seq_lens[:s] = step.seq_lens[first:end]
        b.query_start_loc[: s + 1] = step.query_start_loc[first : end + 1] - q0
        indices = step.logits_indices
        rows = ((indices >= q0) & (indices < q1)).nonzero().squeeze(1)
        k = rows.shape[0]
        b.logits_indices[:k] = indices[rows] - q0
        return front_of(b, n, s, k, width), rows

    def _restore(self, step: StepInputs) -> None:
        b = self._buffers
        n, s, k = step.slot_mapping.shape[0], step.seq_lens.shape[0], step.logits_indices.shape[0]
        b.input_ids[:, :n] = step.input_ids
        b.positions[:, :n] = step.positions
        b.slot_mapping[:n] = step.slot_mapping
        b.block_tables[:s, : step.block_tables.shape[1]] = step.block_tables
        b.seq_lens[:s] = step.seq_lens
        b.query_start_loc[: s + 1] = step.query_start_loc
        b.logits_indices[:k] = step.logits_indices


class PendingLogits:
    """A step a stage started: its posted transfers, and its logits by micro-batch (on the first
    stage, being received into until the transfers complete)."""

    def __init__(
        self,
        graph: PipelineStepGraph,
        transfers: PostedTransfers,
        parts: list[tuple[torch.Tensor | None, torch.Tensor]],
        num_rows: int,
    ) -> None:
        self._graph = graph
        self._transfers = transfers
        self._parts = parts
        self._num_rows = num_rows

    def wait(self) -> torch.Tensor:
        """Complete the step's transfers (the wait counts as the stage's idle time) and return its
        logits in the step's row order."""
        self._graph._add_times(0, 0, 0.0, self._transfers.wait())
        parts = self._parts
        if len(parts) == 1 and parts[0][0] is None:
            return parts[0][1]
        vocab = parts[0][1].shape[-1]
        logits = parts[0][1].new_empty((self._num_rows, vocab))
        for rows, part in parts:
            logits[rows] = part
        return logits
