"""Where a step's device work runs: in order, with events the host can wait on.

The async loop submits step N+1's work while step N may still be running, and needs to know when a
step has read its staging slot and when its sampled tokens are on the host. One interface, three
implementations:

- `InlineStream`: runs the work at once on the calling thread (the synchronous loop). On CUDA the
  kernels still queue on the current stream; events are the device runtime's.
- `CpuWorkerStream`: a worker thread that runs submitted work first in, first out — a CPU
  "stream". Its events are set when the worker reaches them, so the same loop runs in CI.
- `CudaSideStream`: the host enqueues the work's kernels on a dedicated CUDA stream (the Python
  runs at once; the GPU runs the kernels later, in order); events are CUDA events on it.

Every event is an `Event` of graphs/device.py; `stream.record(event)` marks the point after all
work submitted so far and `event.synchronize()` blocks the host until it is passed. A failure
inside worker work is re-raised by the next `synchronize()` or `submit()` on the host; `reset()`
drops the rest of the queue so the engine can go on.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from compiled_engine.graphs.device import DeviceRuntime, Event

Work = Callable[[], None]

# How often a host waiting on the CPU worker checks whether the worker failed.
_ERROR_POLL_S = 0.05


class StepFailedError(RuntimeError):
    """Work on the execution stream raised; the original exception is the cause."""


class ExecutionStream(ABC):
    kind: str

    @abstractmethod
    def submit(self, work: Work) -> None:
        """Queue `work` after everything submitted before it."""

    @abstractmethod
    def new_event(self) -> Event: ...

    def record(self, event: Event) -> None:
        """Mark `event` at the end of the work submitted so far."""
        event.record()

    @abstractmethod
    def synchronize(self) -> None:
        """Block until all submitted work has run (raising its failure, if any)."""

    def reset(self) -> None:  # noqa: B027 - only the worker has queued work to drop
        """After a failure: forget queued work and the error, so new work can be submitted."""

    def close(self) -> None:  # noqa: B027 - only the worker holds a thread
        """Stop accepting work and release threads (idempotent)."""


class InlineStream(ExecutionStream):
    kind = "inline"

    def __init__(self, runtime: DeviceRuntime) -> None:
        self._runtime = runtime

    def submit(self, work: Work) -> None:
        work()

    def new_event(self) -> Event:
        return self._runtime.new_event()

    def synchronize(self) -> None:
        self._runtime.synchronize()


class _WorkerEvent(Event):
    """Set when the worker reaches the point it was recorded at."""

    def __init__(self, stream: CpuWorkerStream) -> None:
        self._stream = stream
        self._reached = threading.Event()
        self._reached.set()  # never recorded: complete, as a fresh CUDA event is

    def record(self) -> None:
        self._reached.clear()
        self._stream.put_marker(self._reached)

    def wait(self) -> None:
        pass  # one worker runs everything in order: later work already starts after this point

    def query(self) -> bool:
        return self._reached.is_set()

    def synchronize(self) -> None:
        while not self._reached.wait(_ERROR_POLL_S):
            self._stream.raise_if_failed()
        self._stream.raise_if_failed()


class CpuWorkerStream(ExecutionStream):
    kind = "cpu-worker"

    def __init__(self, name: str = "execution-stream") -> None:
        # (generation, work) or (generation, marker); None stops the worker.
        self._queue: queue.SimpleQueue[tuple[int, Work | threading.Event] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._generation = 0  # bumped by reset(): work queued before it is skipped
        self._closed = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # Inference mode is per thread: the worker's tensors must not record autograd history.
        with torch.inference_mode():
            while True:
                item = self._queue.get()
                if item is None:
                    return
                generation, work = item
                if isinstance(work, threading.Event):
                    work.set()  # markers always run, so no waiter sleeps through a failure or reset
                elif generation == self._generation and self._error is None:
                    try:
                        work()
                    except BaseException as exc:  # noqa: BLE001 - handed to the host thread
                        self._error = exc

    def submit(self, work: Work) -> None:
        if self._closed:
            raise RuntimeError("the execution stream is closed")
        self.raise_if_failed()
        self._queue.put((self._generation, work))

    def put_marker(self, reached: threading.Event) -> None:
        self._queue.put((self._generation, reached))

    def new_event(self) -> _WorkerEvent:
        return _WorkerEvent(self)

    def synchronize(self) -> None:
        event = self.new_event()
        event.record()
        event.synchronize()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise StepFailedError(f"a step failed on the execution worker: {self._error!r}") from self._error

    def reset(self) -> None:
        self._generation += 1
        self._error = None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self.thread.join(timeout=5)


class CudaSideStream(ExecutionStream):
    kind = "cuda-stream"

    def __init__(self, runtime: DeviceRuntime) -> None:
        if runtime.kind != "cuda":
            raise ValueError(f"CudaSideStream needs a CUDA runtime, got {runtime.kind}")
        self._runtime = runtime
        self._stream = torch.cuda.Stream(runtime.device)
        # Buffers and caches were written on the default stream before the loop started.
        self._stream.wait_stream(torch.cuda.current_stream(runtime.device))

    def submit(self, work: Work) -> None:
        with torch.cuda.stream(self._stream):
            work()

    def new_event(self) -> Event:
        return self._runtime.new_event()

    def record(self, event: Event) -> None:
        with torch.cuda.stream(self._stream):
            event.record()  # records on the current stream, this one

    def synchronize(self) -> None:
        self._stream.synchronize()


def stream_for(runtime: DeviceRuntime, async_scheduling: bool) -> ExecutionStream:
    if not async_scheduling:
        return InlineStream(runtime)
    if runtime.kind == "cuda":
        return CudaSideStream(runtime)
    return CpuWorkerStream()
