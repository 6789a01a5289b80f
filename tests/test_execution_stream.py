"""Execution streams: the CPU worker runs work in order, its events wait for real, failures reach
the host and reset() lets new work run; the inline stream runs work at once."""

from __future__ import annotations

import threading
import time

import pytest

from compiled_engine.graphs.device import CpuRuntime
from compiled_engine.worker.execution_stream import (
    CpuWorkerStream,
    InlineStream,
    StepFailedError,
    stream_for,
)


@pytest.fixture
def worker():
    stream = CpuWorkerStream()
    yield stream
    stream.close()


def test_worker_runs_work_in_submission_order_off_the_calling_thread(worker):
    seen: list[tuple[int, str]] = []
    for i in range(20):
        worker.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
    worker.synchronize()
    assert [i for i, _ in seen] == list(range(20))
    assert {name for _, name in seen} == {worker.thread.name}


def test_worker_event_waits_for_the_work_before_it(worker):
    gate = threading.Event()
    worker.submit(gate.wait)
    event = worker.new_event()
    assert event.query()  # never recorded: complete
    worker.record(event)
    assert not event.query()
    threading.Timer(0.1, gate.set).start()
    started = time.perf_counter()
    event.synchronize()
    assert time.perf_counter() - started >= 0.05
    assert event.query()


def test_worker_failure_reaches_the_host_and_reset_recovers(worker):
    ran: list[int] = []

    def boom():
        raise ValueError("kernel exploded")

    worker.submit(boom)
    worker.submit(lambda: ran.append(1))  # after a failure, queued work is skipped
    event = worker.new_event()
    worker.record(event)
    with pytest.raises(StepFailedError, match="kernel exploded") as info:
        event.synchronize()
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(StepFailedError):
        worker.submit(lambda: ran.append(2))
    assert ran == []
    worker.reset()
    worker.submit(lambda: ran.append(3))
    worker.synchronize()
    assert ran == [3]


def test_closed_worker_refuses_work():
    stream = CpuWorkerStream()
    stream.close()
    stream.close()  # idempotent
    assert not stream.thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        stream.submit(lambda: None)


def test_inline_stream_runs_work_at_once():
    stream = InlineStream(CpuRuntime())
    seen = []
    stream.submit(lambda: seen.append(threading.current_thread()))
    assert seen == [threading.current_thread()]
    event = stream.new_event()
    stream.record(event)
    assert event.query()


def test_stream_for_picks_by_mode_and_device():
    runtime = CpuRuntime()
    assert isinstance(stream_for(runtime, async_scheduling=False), InlineStream)
    stream = stream_for(runtime, async_scheduling=True)
    try:
        assert isinstance(stream, CpuWorkerStream)
    finally:
        stream.close()
