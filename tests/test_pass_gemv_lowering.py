"""GemvLowering: few-row linears become multiply-sum; same values eagerly and under Inductor."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._inductor.compile_fx import compile_fx
from torch._inductor.utils import run_and_get_code

from compiled_engine.graphs.capture import capture_model
from compiled_engine.graphs.passes.fuse_linears import LINEAR_TARGETS
from compiled_engine.graphs.passes.gemv_lowering import GemvLowering
from tests.test_capture import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, PagedBatch, make_model


def count_linears(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in LINEAR_TARGETS)


class _FunctionalMlp(nn.Module):
    """Calls F.linear itself, as a Dynamo graph does (symbolic_trace keeps nn.Linear opaque)."""

    def __init__(self, mlp: nn.Sequential) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = self.mlp[0], self.mlp[2]
        return F.linear(F.silu(F.linear(x, up.weight, up.bias)), down.weight)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.SiLU(), nn.Linear(96, 32, bias=False)).eval()


def test_rewrites_with_rows_hint_and_keeps_values() -> None:
    gm = fx.symbolic_trace(_FunctionalMlp(_mlp()))  # no example values: the row count comes from the hint
    x = torch.randn(1, 2, 64)
    expected = gm(x)
    result = GemvLowering(max_rows=4, rows_hint=2)(gm)
    gm.recompile()
    assert result.nodes_rewritten == 2
    assert count_linears(gm) == 0
    sums = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "sum"]
    assert len(sums) == 2
    # The first linear's bias is added after the reduction; the second has none.
    assert sum(1 for n in gm.graph.nodes if n.target is operator.add) == 1
    torch.testing.assert_close(gm(x), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("max_rows", "rows_hint"), [(4, 8), (4, None)])
def test_leaves_linears_alone_when_rows_are_too_many_or_unknown(max_rows: int, rows_hint) -> None:
    gm = fx.symbolic_trace(_FunctionalMlp(_mlp()))
    result = GemvLowering(max_rows=max_rows, rows_hint=rows_hint)(gm)
    assert result.nodes_rewritten == 0
    assert count_linears(gm) == 2
    assert all(note.startswith("kept") for note in result.notes[1:])


def test_bad_parameters_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_rows must be at least 1"):
        GemvLowering(max_rows=0)
    with pytest.raises(ValueError, match="rows_hint"):
        GemvLowering(max_rows=4, rows_hint=0)


def test_captured_decode_graph_is_lowered_and_prefill_is_not() -> None:
    paged = PagedBatch()
    reference = capture_model(make_model("llama"), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
    results = []

    def lower(gm: fx.GraphModule, example_inputs):
        # No hint: only graphs whose row count Dynamo made static (one-token decode) qualify.
        results.append(GemvLowering(max_rows=1)(gm))
        gm.recompile()
        return gm.forward

    lowered = capture_model(
        make_model("llama"), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM), graph_compiler=lower
    )
    for chunks in ([(0, torch.arange(6), 0)], [(0, torch.tensor([3]), 6)]):
        expected = reference(paged.step(chunks))
        torch.testing.assert_close(lowered(paged.step(chunks)), expected, atol=1e-5, rtol=0)
    prefill, decode = results
    assert prefill.nodes_rewritten == 0  # T is symbolic there
    assert decode.nodes_rewritten == 7 * NUM_LAYERS + 1  # every linear, lm_head included


def test_inductor_compiles_it_as_a_reduction_not_a_gemm() -> None:
    # Inductor reads TORCHINDUCTOR_CACHE_DIR itself, so a shared cache dir set in the
    # environment is used as is.
    model = _mlp()
    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        expected = model(x)
    rewritten = []

    def backend(gm: fx.GraphModule, example_inputs):
        rewritten.append(GemvLowering(max_rows=1)(gm).nodes_rewritten)
        gm.recompile()
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        got, codes = run_and_get_code(compiled, x)
    assert rewritten == [2]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    code = "\n".join(codes)
    assert "extern_kernels.mm" not in code and "extern_kernels.addmm" not in code


def test_new_nodes_carry_example_values() -> None:
    # Later passes and graph dumps read example values; Dynamo records one on every node.
    annotated = []

    def backend(gm: fx.GraphModule, example_inputs):
        GemvLowering(max_rows=2)(gm)
        for node in gm.graph.nodes:
            if node.op in ("call_function", "call_method"):
                annotated.append((str(node.target), tuple(node.meta["example_value"].shape)))
        gm.recompile()
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(_FunctionalMlp(_mlp()), backend=backend, fullgraph=True, dynamic=False)(
            torch.randn(1, 2, 64)
        )
    # Per linear: unsqueeze, mul, sum (+ the bias for the first), shapes as eager torch gives them.
    assert annotated == [
        ("unsqueeze", (1, 2, 1, 64)),
        (str(operator.mul), (1, 2, 96, 64)),
        ("sum", (1, 2, 96)),
        (str(operator.add), (1, 2, 96)),
        (str(F.silu), (1, 2, 96)),
        ("unsqueeze", (1, 2, 1, 96)),
        (str(operator.mul), (1, 2, 32, 96)),
        ("sum", (1, 2, 32)),
    ]
