"""The one device interface: graph capture/replay, events and memory, for CUDA and for CPU.

Everything above this file (bucket graphs, the runner, later the async loop) talks to a
`DeviceRuntime`, so every control-flow path runs in CI through `CpuRuntime`:

- `capture(fn, pool)`: `fn` is a zero-argument closure that runs a compiled step on persistent
  buffers and returns its output tensor. The caller updates those buffers in place, then calls
  `replay()`, which computes on their current contents.
  CUDA: a CUDA graph recorded from `fn` after a warm-up; `replay()` relaunches it and returns
  the same static output tensor every time. CPU: there are no device graphs; the capture
  records the compiled callable's calls into a plan that C++ replays (graphs/cpu_step_plan.py),
  or, where the recording is refused, keeps the callable itself, and `replay()` calls it. A CPU
  capture costs no compile of its own, so graphs/decode_graphs.py captures a CPU bucket on
  demand, when a decode step first finds it compiled (`captures_on_demand`), not at start-up.
- `Event`: record / wait / query / synchronize. On CPU all work runs synchronously on the
  calling thread today, so an event is complete as soon as it is recorded; the async loop will
  give CPU a FIFO execution worker whose events really wait, behind this same interface.

Output lifetime (the contract callers must keep on both devices, though only CUDA enforces it
by overwriting): a replay's output is valid until the next replay of *any* graph captured into
the same pool. Graphs in one pool share their scratch memory, and a later capture may have
placed its output where an earlier graph keeps intermediates.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import cast

import torch

from compiled_engine.graphs.cpu_step_plan import CpuStepPlan, record_step_plan
from compiled_engine.kernels.source_version import source_version

logger = logging.getLogger(__name__)

# Goes into the compile-cache key with the other versions: a hash of this source.
DEVICE_RUNTIME_VERSION = source_version(__name__)

# Warm-up calls before a CUDA capture: the first call of a compiled artifact loads its kernels
# and creates cuBLAS handles/workspaces, none of which may happen inside a capture. torch's
# CUDA-graph docs warm up for a few iterations so that anything set up lazily on a later call
# settles too; two keeps start-up short.
CUDA_WARMUP_RUNS = 2

StepFn = Callable[[], torch.Tensor]
# An opaque memory-pool token: torch.cuda's pool handle on CUDA, None on CPU (nothing to pool).
GraphPool = object


class Event(ABC):
    """A marker in the device's work queue (a CUDA stream; on CPU, the calling thread for now)."""

    @abstractmethod
    def record(self) -> None:
        """Mark the point after all work queued so far."""

    @abstractmethod
    def wait(self) -> None:
        """Make work queued from now on start only after the recorded point (no host block)."""

    @abstractmethod
    def query(self) -> bool:
        """True when all work before the recorded point has finished."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the recorded point is reached."""


class CapturedGraph(ABC):
    """One bucket's replayable step; `memory_bytes` is device memory its capture added."""

    memory_bytes: int

    @abstractmethod
    def replay(self) -> torch.Tensor:
        """Run the step on the persistent buffers' current contents and return its output."""


class DeviceRuntime(ABC):
    """Graphs, events, memory and synchronisation for one device (streams come with the async loop)."""

    kind: str  # torch device type: "cpu" or "cuda"
    device: torch.device
    supports_graphs: bool  # True when capture records a device graph (replay skips Python)
    captures_on_demand: bool = False  # True when a capture is cheap enough to make mid-serving

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until all queued device work has finished."""

    @abstractmethod
    def memory_in_use(self) -> int:
        """Bytes this runtime's allocator holds on the device, graph pools included."""

    @abstractmethod
    def new_event(self) -> Event: ...

    @abstractmethod
    def new_graph_pool(self) -> GraphPool | None:
        """A memory pool that several captures can share."""

    @abstractmethod
    def capture(self, fn: StepFn, pool: GraphPool | None = None) -> CapturedGraph:
        """Warm `fn` up and make it replayable; `fn` is called at least once here."""


def _checked_output(output: object) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"a captured step must return one tensor, got {type(output).__name__}")
    return output


# -- CPU ---------------------------------------------------------------------------------------


class CpuEvent(Event):
    """Always complete: CPU work is synchronous on the calling thread (no worker yet)."""

    def record(self) -> None:
        pass  # nothing is queued: every op has already run when record is called

    def wait(self) -> None:
        pass  # everything queued before the record has already run

    def query(self) -> bool:
        # An unrecorded event is complete, as torch.cuda.Event.query() says for one never recorded.
        return True

    def synchronize(self) -> None:
        pass


class CpuGraph(CapturedGraph):
    """One bucket's step: its recorded plan when there is one (replayed from C++, the same output
    tensor each time), else the shape-specialised compiled callable, called."""

    def __init__(self, fn: StepFn, plan: CpuStepPlan | None = None, refused: str | None = None) -> None:
        self._fn = fn
        self.plan = plan
        self.refused = refused  # why there is no plan, if none
        # Host memory, which the KV-cache sizing does not budget against (memory_in_use below).
        self.memory_bytes = 0

    def replay(self) -> torch.Tensor:
        if self.plan is not None:
            return self.plan.replay()
        return _checked_output(self._fn())


class CpuRuntime(DeviceRuntime):
    kind = "cpu"
    # No start-up capture (it would compile every decode bucket before the first request); the
    # decode graphs capture a bucket when a step first finds it compiled.
    supports_graphs = False
    captures_on_demand = True

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def synchronize(self) -> None:
        pass  # CPU ops return when done

    def memory_in_use(self) -> int:
        # No device allocator on CPU: tensors live in the process heap, which the KV-cache sizing
        # does not budget against, and a CPU capture pins nothing. Process RSS would only add
        # allocator noise to every graph-memory delta.
        return 0

    def new_event(self) -> CpuEvent:
        return CpuEvent()

    def new_graph_pool(self) -> None:
        return None

    def capture(self, fn: StepFn, pool: GraphPool | None = None) -> CpuGraph:
        output, plan, refused = record_step_plan(fn)
        _checked_output(output)
        if refused is not None:
            logger.info("a CPU step graph runs its Python wrapper, not a recorded plan: %s", refused)
        return CpuGraph(fn, plan, refused)


# -- CUDA --------------------------------------------------------------------------------------


class CudaEvent(Event):
    def __init__(self, device_index: int) -> None:
        self._device_index = device_index
        self._event = torch.cuda.Event()

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self._device_index))

    def wait(self) -> None:
        self._event.wait(torch.cuda.current_stream(self._device_index))

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()


class CudaGraph(CapturedGraph):
    def __init__(self, graph: torch.cuda.CUDAGraph, output: torch.Tensor, memory_bytes: int) -> None:
        self._graph = graph
        # Allocated inside the capture (in the graph's pool); every replay rewrites it in place.
        self.output = output
        self.memory_bytes = memory_bytes

    def replay(self) -> torch.Tensor:
        # Launches on the current stream, so buffer updates queued before it are seen.
        self._graph.replay()
        return self.output


class CudaRuntime(DeviceRuntime):
    kind = "cuda"
    supports_graphs = True

    def __init__(self, device: torch.device, warmup_runs: int = CUDA_WARMUP_RUNS) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaRuntime needs a cuda device, got {device}")
        if not torch.cuda.is_available():
            raise RuntimeError(f"{device} requested but torch.cuda is not available in this build/machine")
        if warmup_runs < 1:
            raise ValueError(f"warmup_runs must be >= 1, got {warmup_runs}")
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)
        self.warmup_runs = warmup_runs
        # One stream for every warm-up and capture: captures that share a pool must use the same
        # stream to reuse its memory (torch.cuda.graph's note), and warming up on that stream
        # creates its per-stream cuBLAS workspace outside the capture.
        self._capture_stream = torch.cuda.Stream(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def memory_in_use(self) -> int:
        # Reserved, not allocated: a graph's private pool keeps its segments after capture even
        # though the intermediates in them are freed, and no other allocation can use them.
        return torch.cuda.memory_reserved(self.index)

    def new_event(self) -> CudaEvent:
        return CudaEvent(self.index)

    def new_graph_pool(self) -> GraphPool:
        with torch.cuda.device(self.index):
            return torch.cuda.graph_pool_handle()

    def capture(self, fn: StepFn, pool: GraphPool | None = None) -> CudaGraph:
        stream = self._capture_stream
        with torch.cuda.device(self.index):
            # The buffers were written on the current stream; the warm-up must see them.
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(self.warmup_runs):
                    _checked_output(fn())
            torch.cuda.current_stream().wait_stream(stream)
            self.synchronize()
            # torch.cuda.graph empties the cache on entry anyway; doing it first makes `before`
            # count only live memory, so the difference is exactly what the capture added.
            torch.cuda.empty_cache()
            before = self.memory_in_use()
            graph = torch.cuda.CUDAGraph()
            # Pools given here come from new_graph_pool above: torch.cuda's handles.
            with torch.cuda.graph(graph, pool=cast("torch.cuda._POOL_HANDLE | None", pool), stream=stream):
                output = _checked_output(fn())
            self.synchronize()
            added = self.memory_in_use() - before
        # Capture records kernels without running them: `output` holds garbage until a replay.
        return CudaGraph(graph, output, added)


def runtime_for(device: torch.device | str) -> DeviceRuntime:
    device = torch.device(device)
    if device.type == "cpu":
        return CpuRuntime()
    if device.type == "cuda":
        return CudaRuntime(device)
    raise ValueError(f"no device runtime for {device.type!r} (supported: cpu, cuda)")
