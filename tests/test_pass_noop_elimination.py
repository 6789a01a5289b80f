"""NoopElimination: each rule removes what it should, keeps what it must, values unchanged."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import fx

from compiled_engine.graphs.capture import capture_model
from compiled_engine.graphs.pass_manager import PassManager
from compiled_engine.graphs.passes.check_lowering import CheckLowering
from compiled_engine.graphs.passes.dce import DeadCodeElimination
from compiled_engine.graphs.passes.lower_sdpa import LowerSdpa
from compiled_engine.graphs.passes.noop_elimination import NoopElimination
from tests.test_capture import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, PagedBatch, make_model


def _ops(gm: fx.GraphModule) -> list[str]:
    return [
        str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
        for n in gm.graph.nodes
        if n.op in ("call_method", "call_function")
    ]


def run_with_pass(
    fn: Callable, *args: torch.Tensor, dynamic: bool = False
) -> tuple[list[str], list[str], int]:
    """Dynamo-capture fn (so nodes carry example values), run the pass, check values.

    Returns the ops before and after the pass and the number of nodes it removed.
    """
    seen: dict = {}

    def backend(gm: fx.GraphModule, example_inputs):
        seen["before"] = _ops(gm)
        seen["removed"] = NoopElimination()(gm).nodes_rewritten
        gm.graph.lint()
        gm.recompile()
        seen["after"] = _ops(gm)
        return gm.forward

    torch._dynamo.reset()
    expected = fn(*[a.clone() for a in args])
    got = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*[a.clone() for a in args])
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    return seen["before"], seen["after"], seen["removed"]


X = torch.randn(4, 6)


@pytest.mark.parametrize(
    ("fn", "removed_op"),
    [
        (lambda x: (x + 1).contiguous().sin(), "contiguous"),
        (lambda x: x.to(torch.float32).sin(), "to"),
        (lambda x: x.to(dtype=torch.float32, device="cpu").sin(), "to"),
        (lambda x: x.float().sin(), "float"),
        (lambda x: x.type_as(x).sin(), "type_as"),
        (lambda x: x.view(4, 6).sin(), "view"),
        (lambda x: x.reshape(4, -1).sin(), "reshape"),
        (lambda x: (x.sin() * 1.0).cos(), "mul"),
        (lambda x: (1 * x.sin()).cos(), "mul"),
        (lambda x: (x.sin() / 1).cos(), "truediv"),
        (lambda x: (x.sin() - 0).cos(), "sub"),
        (lambda x: x.sin().clone().cos(), "clone"),
    ],
)
def test_each_rule_removes_its_noop(fn: Callable, removed_op: str) -> None:
    before, after, removed = run_with_pass(fn, X)
    assert removed == 1
    assert removed_op in before and removed_op not in after


def test_integer_add_zero_is_removed() -> None:
    before, after, removed = run_with_pass(lambda x: (x.long() * 3 + 0).sum(), X)
    assert removed == 1 and "add" in before and "add" not in after


def test_same_symbolic_shape_view_is_removed() -> None:
    fn = lambda x: x.view(x.shape[0], x.shape[1]).sin()  # noqa: E731
    before, after, removed = run_with_pass(fn, torch.randn(5, 7), dynamic=True)
    assert removed == 1 and "view" not in after


@pytest.mark.parametrize(
    "fn",
    [
        pytest.param(lambda x: x.t().contiguous().sin(), id="contiguous-of-transpose"),
        pytest.param(lambda x: x.to(torch.float64).sin(), id="real-cast"),
        pytest.param(lambda x: x.view(6, 4).sin(), id="view-other-shape"),
        pytest.param(lambda x: (x.sin() + 0).cos(), id="float-add-zero"),  # -0.0 + 0 == +0.0
        pytest.param(lambda x: (x.long() * 1.0).sin(), id="mul-promotes-dtype"),
        pytest.param(lambda x: (x.sin() * 2).cos(), id="mul-not-one"),
        pytest.param(lambda x: x[:, ::2].clone().sin(), id="clone-changes-strides"),
        pytest.param(lambda x: x.sin() * 1, id="result-is-graph-output"),
    ],
)
def test_non_noops_are_kept(fn: Callable) -> None:
    _, _, removed = run_with_pass(fn, X)
    assert removed == 0


def _clone_then_mutate_copy(x: torch.Tensor) -> torch.Tensor:
    base = x.sin()
    copy = base.clone()
    copy.add_(1)  # removing the clone would write into `base`
    return base + copy


def _copy_then_mutate_source(x: torch.Tensor) -> torch.Tensor:
    base = x.sin()
    copy = base * 1
    base.mul_(2)  # removing `* 1` would let `copy` see this write
    return base + copy


def _view_with_in_place_metadata_change(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    same = y.view(4, 6)
    same.t_()  # a metadata change on the view alone
    return y + same.t()


@pytest.mark.parametrize(
    "fn", [_clone_then_mutate_copy, _copy_then_mutate_source, _view_with_in_place_metadata_change]
)
def test_copies_and_views_whose_memory_is_written_are_kept(fn: Callable) -> None:
    _, _, removed = run_with_pass(fn, X)
    assert removed == 0


def test_nodes_without_example_values_are_left_alone() -> None:
    gm = fx.symbolic_trace(lambda x: x.to(torch.float32).contiguous() * 1)
    assert NoopElimination()(gm).nodes_rewritten == 0


def test_captured_llama_loses_its_noops_and_keeps_its_logits() -> None:
    paged = PagedBatch()
    # The default pipeline runs NoopElimination; the reference is the same pipeline without it.
    without = [LowerSdpa(), DeadCodeElimination(), CheckLowering("LlamaForCausalLM", NUM_LAYERS)]
    reference = capture_model(make_model("llama"), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
    reference.pass_manager = PassManager(without)  # read by the backend when a graph is traced
    cleaned = capture_model(make_model("llama"), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
    for chunks in ([(0, torch.arange(6), 0)], [(0, torch.tensor([3]), 6)]):
        torch.testing.assert_close(cleaned(paged.step(chunks)), reference(paged.step(chunks)), atol=0, rtol=0)
    assert len(cleaned.graphs) == 2
    assert [r.pass_name for r in reference.pass_log[0].results] == ["lower_sdpa", "dce", "check_lowering"]
    for report in cleaned.pass_log:
        # fp32 RMSNorm casts, rotary `cos * 1.0` / `sin * 1.0`, attention output `.contiguous()`.
        assert {"cast: 13", "arithmetic: 2", "contiguous: 2"} <= set(report.result("noop_elimination").notes)
