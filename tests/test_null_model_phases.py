"""bench/null_model.py's `--phases`: each stage of a step is timed once per step, and the engine's
own methods are back in place afterwards; `--stream-mb`: the read happens every step and stays out
of the times."""

from __future__ import annotations

import time

import pytest

from bench.null_model import PHASES, main, null_engine, start_decoding, stop_all, time_steps, timed_phases


def test_timed_phases_time_each_stage_once_a_step_and_restore_the_methods():
    engine = null_engine(2)
    try:
        request_ids = start_decoding(engine, 2)
        with timed_phases(engine) as phases:
            for _ in range(3):
                engine.step()
        assert set(phases) == {name for _, name in PHASES}
        assert {name: len(calls) for name, calls in phases.items()} == {name: 3 for _, name in PHASES}
        assert all(seconds > 0 for calls in phases.values() for seconds in calls)
        owners = (engine.core.scheduler, engine.model_runner, engine.output_processor)
        assert not any(name in vars(owner) for owner in owners for _, name in PHASES)
        engine.step()  # through the engine's own methods again: nothing is recorded
        assert all(len(calls) == 3 for calls in phases.values())
        stop_all(engine, request_ids)
    finally:
        engine.close()


def test_the_stream_is_read_once_a_step_and_left_out_of_the_step_times():
    # --stream-mb: the null graph reads its tensor in every step's launch, and neither the step
    # times nor the launch phase count that read (they would exceed the elapsed time if they did).
    engine = null_engine(2, stream_bytes=8 * 1024 * 1024)
    try:
        request_ids = start_decoding(engine, 2)
        graph = engine.model_runner.step_graph
        reads, read_s = graph.num_streams, graph.stream_s
        started = time.perf_counter()
        with timed_phases(engine) as phases:
            wall, cpu = time_steps(engine, 4)
        elapsed = time.perf_counter() - started
        read_s = graph.stream_s - read_s
        assert graph.num_streams - reads == 4 and read_s > 0
        assert len(wall) == len(cpu) == 4 and all(seconds > 0 for seconds in wall)
        assert sum(wall) + read_s <= elapsed
        assert sum(phases["launch"]) + read_s <= elapsed
        stop_all(engine, request_ids)
    finally:
        engine.close()


def test_no_stream_by_default():
    engine = null_engine(1)
    try:
        request_ids = start_decoding(engine, 1)
        time_steps(engine, 2)
        assert engine.model_runner.step_graph.num_streams == 0
        stop_all(engine, request_ids)
    finally:
        engine.close()


def test_a_negative_stream_is_refused():
    with pytest.raises(SystemExit):
        main(["--stream-mb", "-1", "--running", "1", "--steps", "1"])
