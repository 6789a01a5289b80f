"""graphs/background_builds.py's loader thread: a graph loads with a short GIL switch interval (so
the step thread gets the GIL back quickly), and the interval is restored whatever the load did."""

from __future__ import annotations

import sys
import threading

import pytest

from compiled_engine.graphs.background_builds import (
    FAILED,
    LOADING,
    LOADING_SWITCH_INTERVAL_S,
    READY,
    BackgroundBuilds,
    short_switch_interval,
)


def test_the_interval_is_lowered_for_the_block_and_restored():
    before = sys.getswitchinterval()
    with short_switch_interval(0.0001):
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    assert sys.getswitchinterval() == before
    with pytest.raises(RuntimeError), short_switch_interval(0.0001):
        raise RuntimeError("a load failed")
    assert sys.getswitchinterval() == before


def test_a_longer_interval_never_raises_the_current_one():
    before = sys.getswitchinterval()
    with short_switch_interval(before * 10):
        assert sys.getswitchinterval() == before


def _builds_without_a_compiler(load) -> BackgroundBuilds:
    """The loader's half of BackgroundBuilds (what `_load_one` reads), with no compiler process."""
    builds = object.__new__(BackgroundBuilds)
    builds._load = load
    builds._lock = threading.Lock()
    builds._states = {8: LOADING, 16: LOADING}
    builds._ready = []
    return builds


def test_a_graph_loads_under_the_short_interval_and_failures_restore_it():
    before = sys.getswitchinterval()
    seen = {}

    def load(bucket):
        seen[bucket] = sys.getswitchinterval()
        if bucket == 16:
            raise OSError("a corrupt artifact")
        return lambda *args: args

    builds = _builds_without_a_compiler(load)
    builds._load_one(8)
    builds._load_one(16)
    short = pytest.approx(min(before, LOADING_SWITCH_INTERVAL_S))
    assert seen == {8: short, 16: short}
    assert sys.getswitchinterval() == before
    assert builds.state(8) == READY and builds.state(16) == FAILED
    assert [bucket for bucket, _ in builds.take_ready()] == [8]
