"""Decode steps replayed from captured graphs: one per decode bucket, on the persistent buffers.

A decode step (every sequence brings exactly one token, so T == S) with at most the largest
graph bucket's tokens runs by writing its inputs into the persistent buffers, padding them
to the bucket, and replaying that bucket's captured graph (graphs/bucket_graphs.py). Every
other step (prefill, mixed, or larger) runs the compiled bucket graph directly, uncaptured.

Graph buckets are the compiled buckets up to max_num_seqs: a bucket graph is compiled for
S = min(bucket, max_num_seqs) sequences, so only those can hold a full decode batch.

Static arguments: each captured graph reads the buffers at fixed addresses, so its arguments
are built once, at capture, from views of the buffers at the bucket's shape and the widest
block table the buffers hold (a graph cannot change its width per step; the paged-attention
op masks every column past a sequence's length, so the stale tail is never read).

On CUDA that is a real CUDA graph per bucket in one shared pool, all captured at start-up
(`capture`). On CPU a capture records the compiled callable's calls into a plan replayed from
C++ (graphs/cpu_step_plan.py), and costs no compile, so once `capture_on_demand` is set a
decode step captures its bucket itself the first time it finds the bucket's graph compiled
(`ready(bucket)`), up to `max_tokens` (EngineArgs.max_cpu_plan_tokens, default 16): a plan
holds every intermediate of its step for good (~0.65 MB a token for the 24-layer 0.5B shape),
and past a few rows the Python wrapper it saves is a small part of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from compiled_engine.graphs.bucket_graphs import BucketGraphs
from compiled_engine.graphs.buckets import bucket_for, bucket_shape, pad_step
from compiled_engine.graphs.device import DeviceRuntime, StepFn
from compiled_engine.graphs.step_inputs import FrontViews, StepInputs, front_of

# A bucket's compiled callable, and the compiled graphs' arguments for views of the buffers
# (graphs/compiled_step.py's `artifact` and `step_args`).
Artifacts = Callable[[int], Callable[..., Any]]
StepArgs = Callable[[StepInputs], list[Any]]
# A bucket's compiled callable if it is ready now (loaded, not compiling), else None.
ReadyArtifact = Callable[[int], Callable[..., Any] | None]

# The largest bucket a CPU decode step captures on demand unless told otherwise (the docstring).
DEFAULT_MAX_PLAN_TOKENS = 16


class DecodeGraphs:
    """The captured decode graphs of one compiled step: `buffers` are its persistent step
    buffers, `buckets` its compiled buckets (those <= max_num_seqs get a graph)."""

    def __init__(
        self, runtime: DeviceRuntime, buffers: StepInputs, buckets: Sequence[int], max_num_seqs: int
    ) -> None:
        self.runtime = runtime
        self.buffers = buffers
        self.max_num_seqs = max_num_seqs
        self.all_buckets = tuple(buckets)
        self.buckets = tuple(b for b in buckets if b <= max_num_seqs)
        self.graphs: BucketGraphs | None = None
        self._views = FrontViews(buffers)  # a replayed step pads through cached (numpy) views
        self._on_demand: tuple[ReadyArtifact, StepArgs] | None = None
        self.max_on_demand_tokens = 0

    @property
    def width(self) -> int:
        return self.buffers.block_tables.shape[1]

    def capture(self, artifact: Artifacts, step_args: StepArgs) -> BucketGraphs:
        """Capture every graph bucket (`artifact(bucket)` compiles or loads it first if needed)."""
        self.release()
        if not self.buckets:
            raise ValueError(f"no bucket of {self.all_buckets} is <= max_num_seqs={self.max_num_seqs}")
        graphs = BucketGraphs(self.runtime, self.buckets)
        for bucket in self.buckets:
            artifact(bucket)
        with torch.inference_mode():
            graphs.capture_all(lambda bucket: self._step_fn(bucket, artifact(bucket), step_args))
        self.graphs = graphs
        return graphs

    def capture_on_demand(
        self, ready: ReadyArtifact, step_args: StepArgs, max_tokens: int = DEFAULT_MAX_PLAN_TOKENS
    ) -> None:
        """Let decode steps of up to `max_tokens` capture their bucket when `ready(bucket)` has
        its graph (on a runtime that `captures_on_demand`: the CPU's; 0: never)."""
        if self.runtime.captures_on_demand and max_tokens > 0:
            self._on_demand = (ready, step_args)
            self.max_on_demand_tokens = max_tokens

    def release(self) -> None:
        """Drop the captured graphs (their memory returns to the device allocator)."""
        self.graphs = None

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The logits of `inputs` from a replayed graph, or None when no graph serves this step."""
        graphs = self.graphs
        num_tokens = inputs.slot_mapping.shape[0]
        if (graphs is None and self._on_demand is None) or num_tokens != inputs.seq_lens.shape[0]:
            return None
        bucket = bucket_for(num_tokens, self.buckets)
        if bucket is None:
            return None
        artifact = None
        if graphs is None or not graphs.has(bucket):
            artifact = self._ready_to_capture(bucket)
            if artifact is None:
                return None
        shape = bucket_shape(bucket, self.max_num_seqs)
        width = self.width
        pad_step(
            self.buffers, inputs, shape.num_tokens, shape.num_seqs, shape.num_seqs, width, views=self._views
        )
        if artifact is not None:  # this step's inputs are in the buffers: its capture runs it
            graphs = self.graphs = self.graphs or BucketGraphs(self.runtime, self.buckets)
            assert self._on_demand is not None
            graphs.capture(bucket, self._bound_fn(bucket, artifact, self._on_demand[1]))
        assert graphs is not None
        return graphs.replay(bucket)[: inputs.logits_indices.shape[0]]

    def _ready_to_capture(self, bucket: int) -> Callable[..., Any] | None:
        if self._on_demand is None or bucket > self.max_on_demand_tokens:
            return None
        return self._on_demand[0](bucket)

    def _step_fn(self, bucket: int, artifact: Callable[..., Any], step_args: StepArgs) -> StepFn:
        """The bucket's compiled artifact bound to static views of the buffers, set to padding."""
        shape = bucket_shape(bucket, self.max_num_seqs)
        b = self.buffers
        # Pad an empty step to the bucket: capture and its warm-up write only the scratch block.
        b.query_start_loc[0] = 0
        empty = StepInputs(
            input_ids=b.input_ids[:, :0],
            positions=b.positions[:, :0],
            slot_mapping=b.slot_mapping[:0],
            block_tables=b.block_tables[:0, :0],
            seq_lens=b.seq_lens[:0],
            query_start_loc=b.query_start_loc[:1],
            logits_indices=b.logits_indices[:0],
        )
        pad_step(b, empty, shape.num_tokens, shape.num_seqs, shape.num_seqs, self.width)
        return self._bound_fn(bucket, artifact, step_args)

    def _bound_fn(self, bucket: int, artifact: Callable[..., Any], step_args: StepArgs) -> StepFn:
        """The bucket's artifact bound to static views of the buffers (not written here)."""
        shape = bucket_shape(bucket, self.max_num_seqs)
        views = front_of(self.buffers, shape.num_tokens, shape.num_seqs, shape.num_seqs, self.width)
        args = step_args(views)

        def run_bucket() -> torch.Tensor:
            return artifact(*args)[0]

        return run_bucket
