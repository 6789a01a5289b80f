"""Graph dumps: one readable file per stage, changed where a pass rewrote the graph.

Also the engine's own pipeline: with COMPILED_ENGINE_DUMP_GRAPHS set, every captured graph is
dumped after each pass of default_pass_manager.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

from compiled_engine import LLM, SamplingParams
from compiled_engine.graphs.bucket_compiler import bucket_graph
from compiled_engine.graphs.capture import default_pass_manager
from compiled_engine.graphs.gemv_policy import GemvDecision
from compiled_engine.graphs.graph_dump import (
    DUMP_DIR_ENV,
    REPORT_FILE,
    DumpingPassManager,
    dump_dir_from_env,
    dump_graph,
    graph_id,
)
from compiled_engine.graphs.pass_manager import BucketTarget, PassManager, PassResult
from compiled_engine.graphs.passes.dce import DeadCodeElimination
from compiled_engine.graphs.traced_step import TracedStep
from tests.test_capture import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, PagedBatch, make_model


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


EAGER_PASSES = ["lower_sdpa", "noop_elimination", "dce", "check_lowering"]


def _stage_files(passes: list[str]) -> list[str]:
    return ["00-captured.py"] + [f"{i:02d}-after-{name}.py" for i, name in enumerate(passes, start=1)]


def test_engine_dumps_every_captured_graph_at_every_stage(llama_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path))
    llm = LLM(llama_dir, dtype="float32", max_model_len=64, enforce_eager=True)
    llm.generate("def add(a, b):", SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)

    captured = llm.engine.model_runner.step_graph.captured
    # Any backend but torch adds the pass that points attention at its op (auto: cpu on CPU).
    passes = EAGER_PASSES
    if llm.engine.model_runner.attention_backend.name != "torch":
        passes = EAGER_PASSES + ["select_attention_backend"]
    graph_dirs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(graph_dirs) == len(captured.graphs) >= 2  # at least prefill and decode
    assert [r.pass_name for r in captured.pass_log[0].results] == passes
    for graph_dir in graph_dirs:
        assert sorted(p.name for p in graph_dir.iterdir()) == _stage_files(passes)
        first, last = (graph_dir / n for n in ("00-captured.py", "04-after-check_lowering.py"))
        assert "def forward" in first.read_text() and "paged_attention" in last.read_text()
        # The RMSNorm casts to float32 are no-ops on an fp32 model, and are gone after that pass.
        before, after = (
            graph_dir / f"0{i}-after-{n}.py" for i, n in ((1, "lower_sdpa"), (2, "noop_elimination"))
        )
        assert before.read_text().count("torch.float32") > after.read_text().count("torch.float32")
    # Dumping names the files only: the graphs run as without it.
    assert llm.engine.num_free_kv_blocks() == llm.engine.num_kv_blocks


def test_compiled_path_dumps_its_fused_graph(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path))
    paged = PagedBatch()
    traced = TracedStep(make_model("llama"), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
    passes = ["freeze_parameters", "lower_sdpa", "fuse_linears", "noop_elimination", "dce", "check_lowering"]
    # freeze_parameters is the pipeline's first pass: the dump after it reads frozen weights.
    assert [r.pass_name for r in traced.pass_log[0].results] == passes
    (graph_dir,) = tmp_path.iterdir()
    assert sorted(p.name for p in graph_dir.iterdir()) == _stage_files(passes)
    assert "frozen_" not in (graph_dir / "00-captured.py").read_text()
    assert "frozen_" in (graph_dir / "01-after-freeze_parameters.py").read_text()
    assert "fused_" in (graph_dir / "03-after-fuse_linears.py").read_text()

    # A bucket's graph is dumped under the traced graph's folder, after each per-bucket pass.
    lowered_and_inlined = BucketTarget(1, 4, "cpu", "torch", GemvDecision(lowered_rows=(1,)))
    _, report = bucket_graph(traced, lowered_and_inlined)
    assert [r.pass_name for r in report.results] == ["gemv_lowering", "inline_attention"]
    bucket_dir = graph_dir / "bucket-1"
    names = ["00-traced.py", "01-after-gemv_lowering.py", "02-after-inline_attention.py"]
    assert sorted(p.name for p in bucket_dir.iterdir()) == [*names, REPORT_FILE]
    assert "paged_attention_inline" not in (bucket_dir / names[1]).read_text()
    assert "paged_attention_inline" in (bucket_dir / names[2]).read_text()
    # And the bucket's pass report, with what each pass did.
    assert (bucket_dir / REPORT_FILE).read_text() == report.summary()
    assert f"gemv_lowering: {report.result('gemv_lowering').nodes_rewritten}" in report.summary()
    # The traced graph's own dumps are untouched.
    assert sorted(p.name for p in graph_dir.iterdir() if p.is_file()) == _stage_files(passes)


def test_no_dumps_without_the_variable(monkeypatch) -> None:
    monkeypatch.delenv(DUMP_DIR_ENV, raising=False)
    manager = default_pass_manager("AnyModel", 2)
    assert isinstance(manager, DumpingPassManager) and manager.dump_dir is None
