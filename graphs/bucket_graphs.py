"""One captured step per decode bucket, all in one shared memory pool.

`BucketGraphs(runtime, buckets).capture_all(make_fn)` asks `make_fn(bucket)` for the bucket's
zero-argument step closure (the compiled artifact called on the persistent buffers, padded to
the bucket) and captures it with `runtime.capture` (graphs/device.py). Afterwards the caller
writes a step's inputs into those buffers in place and calls `replay(bucket)`.

Largest bucket first: graphs captured into one pool reuse the memory earlier captures freed,
so the largest graph sizes the pool's scratch memory and each smaller one fits its
intermediates in what it left; the set costs about the largest graph plus the smaller graphs'
live outputs. Smallest first would grow the pool at nearly every capture.

`capture_seconds` and `graph_memory` (bytes each capture added to the device's reserved
memory; 0 on CPU) are recorded per bucket; `memory_bytes`, their sum, is what the KV-cache
sizing must leave free.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from compiled_engine.graphs.device import CapturedGraph, DeviceRuntime, StepFn
from compiled_engine.kernels.source_version import source_version

# Goes into the compile-cache key: a hash of this source (capture order, pooling).
BUCKET_GRAPHS_VERSION = source_version(__name__)


class BucketGraphs:
    def __init__(self, runtime: DeviceRuntime, buckets: Sequence[int]) -> None:
        for bucket in buckets:
            if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
                raise ValueError(f"buckets must be positive ints, got {bucket!r}")
        if not buckets or len(set(buckets)) != len(buckets):
            raise ValueError(f"buckets must be non-empty and distinct, got {list(buckets)}")
        self.runtime = runtime
        self.buckets = tuple(sorted(buckets))
        self._graphs: dict[int, CapturedGraph] = {}
        # Both keyed by bucket, in capture order (largest first).
        self.capture_seconds: dict[int, float] = {}
        self.graph_memory: dict[int, int] = {}

    def capture_all(self, make_fn: Callable[[int], StepFn]) -> None:
        if self._graphs:
            raise RuntimeError(f"buckets {self.captured_buckets} are already captured")
        pool = self.runtime.new_graph_pool()
        for bucket in sorted(self.buckets, reverse=True):
            self._capture(bucket, make_fn(bucket), pool)

    def capture(self, bucket: int, fn: StepFn) -> None:
        """Capture one more bucket, outside any pool: a runtime whose captures hold no pooled
        memory (`captures_on_demand`, the CPU's) captures a bucket when a step first needs it."""
        if not self.runtime.captures_on_demand:
            raise RuntimeError(f"the {self.runtime.kind} runtime captures its graphs together (capture_all)")
        if bucket not in self.buckets:
            raise LookupError(f"{bucket} is not one of the graph buckets {self.buckets}")
        if bucket in self._graphs:
            raise RuntimeError(f"bucket {bucket} is already captured")
        self._capture(bucket, fn, None)

    def _capture(self, bucket: int, fn: StepFn, pool: object) -> None:
        started = time.perf_counter()
        graph = self.runtime.capture(fn, pool)
        self.capture_seconds[bucket] = time.perf_counter() - started
        self.graph_memory[bucket] = graph.memory_bytes
        self._graphs[bucket] = graph

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(self._graphs)

    @property
    def memory_bytes(self) -> int:
        return sum(self.graph_memory.values())

    def has(self, bucket: int) -> bool:
        return bucket in self._graphs

    def graph(self, bucket: int) -> CapturedGraph | None:
        """The bucket's captured graph (None: not captured), for profiles that look inside it."""
        return self._graphs.get(bucket)

    def replay(self, bucket: int) -> torch.Tensor:
        """Run `bucket`'s step on the buffers' current contents.

        The output is valid until the next replay of any bucket (graphs/device.py says why).
        """
        graph = self._graphs.get(bucket)
        if graph is None:
            if bucket in self.buckets:
                raise LookupError(f"bucket {bucket} is not captured yet: call capture_all() or capture()")
            raise LookupError(f"{bucket} is not one of the graph buckets {self.buckets}")
        return graph.replay()
