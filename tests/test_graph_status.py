"""The records of how steps ran on compiled graphs, the background compile order, and the
compile cache's fallback when its directory cannot be written."""

from __future__ import annotations

import logging

from compiled_engine.graphs.compile_cache import CompileCache, usable_compile_cache
from compiled_engine.graphs.compiled_step import background_order
from compiled_engine.records.graph_status import EAGER, GraphCall, GraphStatus, GraphWait
from compiled_engine.records.runner import RunnerTimeline


def test_the_graph_that_serves_every_step_compiles_first_then_small_buckets():
    assert background_order([16, None, 1, 4]) == [None, 1, 4, 16]
    assert background_order([16, 1, 4]) == [16, 1, 4]  # no dynamic graph: the largest bucket serves all
    assert background_order([8]) == [8]


def test_the_timeline_keeps_waits_and_counts_fallbacks():
    timeline = RunnerTimeline()
    timeline.record_graph_call(0, GraphCall("4", "4"))
    timeline.record_graph_call(1, GraphCall("4", "16"))
    timeline.record_graph_call(2, GraphCall("1", EAGER))
    timeline.record_graph_call(3, GraphCall("dynamic", "dynamic", "compile", 9.5))
    timeline.record_graph_call(4, None)  # a step graph that says nothing
    assert timeline.graph_waits == [GraphWait(3, "dynamic", "compile", 9.5)]
    assert timeline.num_fallback_steps == 2


def test_all_built_means_nothing_left_to_build():
    assert GraphStatus(total=4, ready=3, failed=1).all_built
    assert not GraphStatus(total=4, ready=3, compiled=1).all_built  # built, not loaded yet
    assert not GraphStatus(total=4, ready=3, on_demand=1).all_built
    assert GraphStatus(total=2, ready=1, queued=1, policy="background").to_json() == {
        "policy": "background", "total": 2, "ready": 1, "compiled": 0, "compiling": 0, "queued": 1,
        "failed": 0, "on_demand": 0, "all_built": False,
    }  # fmt: skip


def test_an_unwritable_cache_dir_falls_back_to_a_temporary_one(tmp_path, caplog):
    assert usable_compile_cache(tmp_path / "ok").root == tmp_path / "ok"
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING, logger="compiled_engine.graphs.compile_cache"):
        cache = usable_compile_cache(blocker / "cache")
    assert isinstance(cache, CompileCache) and cache.root != blocker / "cache"
    assert cache.root.is_dir()
    assert f"compile cache {blocker / 'cache'} is not writable" in caplog.text
