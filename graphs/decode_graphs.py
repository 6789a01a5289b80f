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

On CUDA that is a real CUDA graph per bucket in one shared pool; on CPU the runtime's
"capture" is the compiled callable itself (graphs/device.py), which makes the same control
flow — capture order, in-place buffer updates, replay, dispatch — run in CI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from compiled_engine.graphs.bucket_graphs import BucketGraphs
from compiled_engine.graphs.buckets import bucket_for, bucket_shape, pad_step
from compiled_engine.graphs.device import DeviceRuntime, StepFn
from compiled_engine.graphs.step_inputs import StepInputs

if TYPE_CHECKING:
    from compiled_engine.graphs.compiled_step import CompiledStep


class DecodeGraphs:
    def __init__(self, step: CompiledStep, runtime: DeviceRuntime) -> None:
        self.step = step
        self.runtime = runtime
        self.buckets = tuple(b for b in step.buckets if b <= step.max_num_seqs)
        self.graphs: BucketGraphs | None = None

    @property
    def width(self) -> int:
        return self.step.buffers.block_tables.shape[1]

    def capture(self) -> BucketGraphs:
        """Capture every graph bucket (compiling or loading its artifact first if needed)."""
        self.release()
        if not self.buckets:
            raise ValueError(f"no bucket of {self.step.buckets} is <= max_num_seqs={self.step.max_num_seqs}")
        graphs = BucketGraphs(self.runtime, self.buckets)
        self.step.compile_buckets(list(self.buckets))
        with torch.inference_mode():
            graphs.capture_all(self._step_fn)
        self.graphs = graphs
        return graphs

    def release(self) -> None:
        """Drop the captured graphs (their memory returns to the device allocator)."""
        self.graphs = None

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The logits of `inputs` from a replayed graph, or None when no graph serves this step."""
        graphs = self.graphs
        num_tokens = inputs.slot_mapping.shape[0]
        if graphs is None or num_tokens != inputs.seq_lens.shape[0]:
            return None
        bucket = bucket_for(num_tokens, self.buckets)
        if bucket is None or not graphs.has(bucket):
            return None
        shape = bucket_shape(bucket, self.step.max_num_seqs)
        pad_step(self.step.buffers, inputs, shape.num_tokens, shape.num_seqs, shape.num_seqs, self.width)
        return graphs.replay(bucket)[: inputs.logits_indices.shape[0]]

    def _step_fn(self, bucket: int) -> StepFn:
        """The bucket's compiled artifact bound to static views of the buffers, set to padding."""
        step = self.step
        shape = bucket_shape(bucket, step.max_num_seqs)
        b = step.buffers
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
        views = pad_step(b, empty, shape.num_tokens, shape.num_seqs, shape.num_seqs, self.width)
        args = step.step_args(views)
        artifact = step.artifact(bucket)

        def run_bucket() -> torch.Tensor:
            return artifact(*args)[0]

        return run_bucket
