"""bench/null_model.py's `--phases`: each stage of a step is timed once per step, and the engine's
own methods are back in place afterwards."""

from __future__ import annotations

from bench.null_model import PHASES, null_engine, start_decoding, stop_all, timed_phases


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
