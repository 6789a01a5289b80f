"""The device interface (graphs/device.py) and per-bucket capture (graphs/bucket_graphs.py).

CPU tests run everywhere; CUDA tests run only where a GPU is present and check that a replay
computes on the buffers' current contents, as the engine relies on.
"""

from __future__ import annotations

import pytest
import torch

from compiled_engine.graphs.bucket_graphs import BucketGraphs
from compiled_engine.graphs.device import (
    CpuGraph,
    CpuRuntime,
    DeviceRuntime,
    GraphPool,
    StepFn,
    runtime_for,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


class CountingStep:
    """`buffer * weight + bucket`, counting calls; reads `buffer` at call time, like a compiled step."""

    def __init__(self, buffer: torch.Tensor, bucket: int = 0) -> None:
        self.buffer = buffer
        self.bucket = bucket
        self.weight = torch.arange(1.0, buffer.shape[-1] + 1, device=buffer.device)
        self.calls = 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return self.buffer * self.weight + self.bucket

    def expected(self) -> torch.Tensor:
        return self.buffer * self.weight + self.bucket


# -- CPU runtime -------------------------------------------------------------------------------


def test_runtime_for_cpu():
    runtime = runtime_for("cpu")
    assert isinstance(runtime, CpuRuntime)
    assert isinstance(runtime_for(torch.device("cpu")), CpuRuntime)
    assert (runtime.kind, runtime.device, runtime.supports_graphs) == ("cpu", torch.device("cpu"), False)
    assert runtime.memory_in_use() == 0
    assert runtime.new_graph_pool() is None
    runtime.synchronize()


def test_runtime_for_rejects_other_devices():
    with pytest.raises(ValueError, match="no device runtime for 'meta'"):
        runtime_for("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_runtime_for_cuda_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="torch.cuda is not available"):
        runtime_for("cuda")


def test_cpu_replay_reads_buffer_updated_in_place():
    buffer = torch.zeros(2, 3)
    step = CountingStep(buffer)
    graph = CpuRuntime().capture(step)
    assert isinstance(graph, CpuGraph)
    assert step.calls == 1  # warmed up once at capture
    assert graph.memory_bytes == 0
    for value in (1.5, -2.0):
        buffer.copy_(torch.full((2, 3), value))
        out = graph.replay()
        torch.testing.assert_close(out, torch.full((2, 3), value) * torch.tensor([1.0, 2.0, 3.0]))
    assert step.calls == 3


def test_capture_rejects_a_step_that_returns_no_tensor():
    with pytest.raises(TypeError, match="must return one tensor, got tuple"):
        CpuRuntime().capture(lambda: (torch.zeros(1),))


def test_cpu_events_are_complete_once_recorded():
    runtime = CpuRuntime()
    event = runtime.new_event()
    assert event.query()  # never recorded: complete, as a CUDA event is
    torch.ones(4).sum()
    event.record()
    assert event.query()
    event.wait()
    event.synchronize()


# -- BucketGraphs (CPU) ------------------------------------------------------------------------


def _make_fn_recording(buffer: torch.Tensor, steps: dict[int, CountingStep], order: list[int]):
    def make_fn(bucket: int) -> StepFn:
        order.append(bucket)
        steps[bucket] = CountingStep(buffer[:bucket], bucket)  # a view at the buffer's front
        return steps[bucket]

    return make_fn


def test_bucket_graphs_capture_largest_first_and_replay_each_bucket():
    buckets = [4, 1, 16, 2]
    buffer = torch.zeros(16, 4)
    steps: dict[int, CountingStep] = {}
    order: list[int] = []
    graphs = BucketGraphs(CpuRuntime(), buckets)
    assert graphs.buckets == (1, 2, 4, 16)
    assert not graphs.has(4)
    graphs.capture_all(_make_fn_recording(buffer, steps, order))
    assert order == [16, 4, 2, 1]
    assert graphs.captured_buckets == (16, 4, 2, 1)
    assert all(graphs.has(b) for b in buckets)
    assert list(graphs.capture_seconds) == [16, 4, 2, 1]
    assert all(isinstance(s, float) and s >= 0 for s in graphs.capture_seconds.values())
    assert graphs.graph_memory == {16: 0, 4: 0, 2: 0, 1: 0}
    assert graphs.memory_bytes == 0

    for round_value in (3.0, 7.0):
        buffer.copy_(torch.randn(16, 4) + round_value)
        for bucket in buckets:
            out = graphs.replay(bucket)
            assert out.shape == (bucket, 4)
            torch.testing.assert_close(out, steps[bucket].expected())
            torch.testing.assert_close(out, buffer[:bucket] * torch.arange(1.0, 5.0) + bucket)


class _MemoryRuntime(CpuRuntime):
    """CPU runtime whose captures report growing memory, to check the per-bucket bookkeeping."""

    def __init__(self) -> None:
        super().__init__()
        self.pools: list[object] = []
        self.captures = 0

    def new_graph_pool(self) -> GraphPool:
        pool = object()
        self.pools.append(pool)
        return pool

    def capture(self, fn: StepFn, pool: GraphPool | None = None) -> CpuGraph:
        assert pool is self.pools[-1], "every capture must get the one shared pool"
        self.captures += 1
        graph = super().capture(fn, pool)
        graph.memory_bytes = 1000 * self.captures
        return graph


def test_bucket_graphs_share_one_pool_and_sum_memory():
    runtime = _MemoryRuntime()
    graphs = BucketGraphs(runtime, [1, 8, 2])
    graphs.capture_all(lambda bucket: CountingStep(torch.zeros(bucket, 2), bucket))
    assert len(runtime.pools) == 1
    assert graphs.graph_memory == {8: 1000, 2: 2000, 1: 3000}
    assert graphs.memory_bytes == 6000


def test_bucket_graphs_errors():
    graphs = BucketGraphs(CpuRuntime(), [1, 4])
    with pytest.raises(LookupError, match="bucket 4 is not captured yet"):
        graphs.replay(4)
    graphs.capture_all(lambda bucket: CountingStep(torch.zeros(bucket, 2), bucket))
    with pytest.raises(LookupError, match=r"3 is not one of the graph buckets \(1, 4\)"):
        graphs.replay(3)
    with pytest.raises(RuntimeError, match="already captured"):
        graphs.capture_all(lambda bucket: CountingStep(torch.zeros(bucket, 2), bucket))
    for bad in ([], [2, 2], [0, 1], [True], [1.0]):
        with pytest.raises(ValueError):
            BucketGraphs(CpuRuntime(), bad)


def test_capture_errors_propagate_from_bucket_graphs():
    def make_fn(bucket: int) -> StepFn:
        if bucket == 2:
            raise RuntimeError("no artifact for bucket 2")
        return CountingStep(torch.zeros(bucket, 2), bucket)

    graphs = BucketGraphs(CpuRuntime(), [1, 2, 4])
    with pytest.raises(RuntimeError, match="no artifact for bucket 2"):
        graphs.capture_all(make_fn)
    assert graphs.captured_buckets == (4,)


# -- CUDA --------------------------------------------------------------------------------------


@needs_cuda
def test_cuda_replay_reads_buffers_updated_in_place():
    from compiled_engine.graphs.device import CUDA_WARMUP_RUNS, CudaGraph, CudaRuntime

    runtime = runtime_for("cuda")
    assert isinstance(runtime, CudaRuntime) and runtime.supports_graphs
    device = runtime.device
    buffer = torch.zeros(8, 64, device=device)
    weight = torch.randn(64, 64, device=device)
    calls = 0

    def step() -> torch.Tensor:
        nonlocal calls
        calls += 1
        return torch.relu(buffer @ weight) + 1.0

    graph = runtime.capture(step, runtime.new_graph_pool())
    assert isinstance(graph, CudaGraph)
    assert calls == CUDA_WARMUP_RUNS + 1  # warm-up, then the captured call
    assert graph.memory_bytes > 0  # the pool's first segment holds at least the static output
    outputs = []
    for seed in (1, 2):
        buffer.copy_(torch.randn(8, 64, generator=torch.Generator().manual_seed(seed)).to(device))
        out = graph.replay()
        runtime.synchronize()
        torch.testing.assert_close(out, torch.relu(buffer @ weight) + 1.0)
        outputs.append(out)
    assert calls == CUDA_WARMUP_RUNS + 1  # replays run no Python
    assert outputs[0] is outputs[1]  # one static output, rewritten in place


@needs_cuda
def test_cuda_bucket_graphs_share_a_pool_and_replay_correctly():
    runtime = runtime_for("cuda")
    buffer = torch.zeros(16, 4, device=runtime.device)
    steps: dict[int, CountingStep] = {}
    order: list[int] = []
    graphs = BucketGraphs(runtime, [1, 2, 8, 16])
    graphs.capture_all(_make_fn_recording(buffer, steps, order))
    assert order == [16, 8, 2, 1]
    assert graphs.graph_memory[16] > 0
    assert graphs.memory_bytes == sum(graphs.graph_memory.values())
    for seed in (1, 2):
        buffer.copy_(torch.randn(16, 4, generator=torch.Generator().manual_seed(seed)).to(runtime.device))
        for bucket in (16, 8, 2, 1):
            out = graphs.replay(bucket)
            runtime.synchronize()
            torch.testing.assert_close(out, steps[bucket].expected())


@needs_cuda
def test_cuda_graph_of_an_inductor_compiled_step():
    runtime = runtime_for("cuda")
    ids = torch.zeros(4, dtype=torch.int64, device=runtime.device)
    cache = torch.zeros(32, 16, device=runtime.device)
    emb = torch.randn(100, 16, device=runtime.device)

    def step(ids: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, ids, emb[ids])  # in-place write into a persistent buffer
        return cache.sum(0) @ emb.T

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    graph = runtime.capture(lambda: compiled(ids, cache), runtime.new_graph_pool())
    for seed in (1, 2):
        ids.copy_(torch.randperm(32, generator=torch.Generator().manual_seed(seed))[:4].to(runtime.device))
        cache.zero_()
        out = graph.replay()
        expected_cache = torch.zeros_like(cache)
        expected_cache[ids] = emb[ids]
        runtime.synchronize()
        torch.testing.assert_close(cache, expected_cache)
        torch.testing.assert_close(out, expected_cache.sum(0) @ emb.T)


@needs_cuda
def test_cuda_events_order_streams():
    runtime = runtime_for("cuda")
    assert isinstance(runtime, DeviceRuntime)
    side = torch.cuda.Stream(runtime.device)
    x = torch.randn(2048, 2048, device=runtime.device)
    event = runtime.new_event()
    side.wait_stream(torch.cuda.current_stream())  # x was made on the default stream
    with torch.cuda.stream(side):
        y = x @ x
        event.record()  # on the side stream: the current stream inside this block
    event.wait()  # the default stream now waits for the matmul
    z = y.sum()
    event.synchronize()
    assert event.query()
    torch.testing.assert_close(z, (x @ x).sum())
