"""Graph dumps: one readable file per stage, changed where a pass rewrote the graph."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from compiled_engine.graphs.graph_dump import (
    DUMP_DIR_ENV,
    DumpingPassManager,
    dump_dir_from_env,
    dump_graph,
    graph_id,
)
from compiled_engine.graphs.pass_manager import PassManager, PassResult
from compiled_engine.graphs.passes.dce import DeadCodeElimination


class _WithDeadCode(torch.nn.Module):
    def forward(self, x):
        unused = x.cos()  # dead: DCE removes it
        del unused
        return x.sin()


class _CountNodes:
    """A pass that changes nothing."""

    name = "count_nodes"
    version = "1"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        return PassResult(self.name, len(gm.graph.nodes))


class _Explodes:
    name = "explodes"
    version = "1"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        raise RuntimeError("boom")


def test_dumps_before_and_after_each_pass(tmp_path) -> None:
    gm = fx.symbolic_trace(_WithDeadCode())
    manager = DumpingPassManager([DeadCodeElimination(), _CountNodes()], tmp_path)
    report = manager(gm)
    assert report.result("dce").nodes_rewritten == 1
    graph_dir = tmp_path / graph_id(gm)
    names = sorted(p.name for p in graph_dir.iterdir())
    assert names == ["00-captured.py", "01-after-dce.py", "02-after-count_nodes.py"]
    captured, after_dce, after_count = (graph_dir / n for n in names)
    assert "cos" in captured.read_text() and "cos" not in after_dce.read_text()
    assert after_dce.read_text() == after_count.read_text()  # the second pass changed nothing
    assert torch.equal(gm(torch.ones(2)), torch.ones(2).sin())  # recompiled like PassManager does


def test_same_cache_identity_as_a_plain_pass_manager(tmp_path) -> None:
    passes = [DeadCodeElimination(), _CountNodes()]
    assert DumpingPassManager(passes, tmp_path).uuid() == PassManager(passes).uuid()


def test_without_a_directory_nothing_is_written(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    gm = fx.symbolic_trace(_WithDeadCode())
    DumpingPassManager([DeadCodeElimination()], None)(gm)
    assert list(tmp_path.iterdir()) == []


def test_a_failing_pass_leaves_its_graph_and_its_error(tmp_path) -> None:
    gm = fx.symbolic_trace(_WithDeadCode())
    with pytest.raises(RuntimeError, match="boom"):
        DumpingPassManager([DeadCodeElimination(), _Explodes()], tmp_path)(gm)
    names = sorted(p.name for p in (tmp_path / graph_id(gm)).iterdir())
    assert names == ["00-captured.py", "01-after-dce.py", "02-failed-in-explodes.py"]


def test_graphs_get_their_own_directories_named_by_dynamo_backend_id(tmp_path) -> None:
    first, second = fx.symbolic_trace(_WithDeadCode()), fx.symbolic_trace(_WithDeadCode())
    first.meta["backend_id"] = "__compiled_fn_1_abc"
    assert dump_graph(first, "x", tmp_path) == tmp_path / "__compiled_fn_1_abc" / "00-x.py"
    assert dump_graph(first, "y", tmp_path).name == "01-y.py"
    assert dump_graph(second, "x", tmp_path).parent != tmp_path / "__compiled_fn_1_abc"
    with pytest.raises(ValueError, match="path separators"):
        dump_graph(first, "a/b", tmp_path)


def test_dump_dir_comes_from_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(DUMP_DIR_ENV, raising=False)
    assert dump_dir_from_env() is None
    monkeypatch.setenv(DUMP_DIR_ENV, "  ")
    assert dump_dir_from_env() is None
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path))
    assert dump_dir_from_env() == tmp_path
