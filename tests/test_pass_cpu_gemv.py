"""CpuGemvLinears: a captured model's linears on the C++ GEMV, compiled by Inductor, same logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch._inductor.compile_fx import compile_fx

from compiled_engine.graphs.capture import capture_model
from compiled_engine.graphs.passes.cpu_gemv import CpuGemvLinears
from compiled_engine.graphs.passes.freeze_parameters import (
    FreezeParameters,
    frozen_callable,
    kept_example_inputs,
)
from compiled_engine.graphs.passes.fuse_linears import LINEAR_TARGETS, FusedWeightCache, FuseLinears
from compiled_engine.kernels.cpu_gemv import cpu_gemv, cpu_gemv_available
from tests.test_capture import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, PagedBatch, make_model
from tests.test_pass_fuse_linears import STEPS

pytestmark = pytest.mark.skipif(not cpu_gemv_available(torch.float32), reason="no C++ compiler")


def _count(gm: fx.GraphModule, targets) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


class GemvCompiler:
    """Freeze, fuse and rewrite the linears, then compile with Inductor."""

    def __init__(self) -> None:
        self.graphs: list[fx.GraphModule] = []
        self.results = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        freeze = FreezeParameters(example_inputs)
        freeze(gm)
        FuseLinears(FusedWeightCache())(gm)
        self.results.append(CpuGemvLinears()(gm))
        gm.graph.lint()
        gm.recompile()
        self.graphs.append(gm)
        kept = freeze.kept_input_indices
        return frozen_callable(
            compile_fx(gm, kept_example_inputs(example_inputs, kept)), kept, len(example_inputs)
        )


def test_a_captured_model_on_the_kernel_matches_the_plain_one() -> None:
    # qwen2: q/k/v carry biases, so the kernel's bias path runs too.
    paged = PagedBatch()
    reference = capture_model(make_model("qwen2"), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
    compiler = GemvCompiler()
    rewritten = capture_model(
        make_model("qwen2"), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM), graph_compiler=compiler
    )
    for chunks in STEPS[:2]:
        expected = reference(paged.step(chunks))
        torch.testing.assert_close(rewritten(paged.step(chunks)), expected, atol=2e-5, rtol=0)
    gm = compiler.graphs[0]
    assert _count(gm, LINEAR_TARGETS) == 0
    assert _count(gm, (cpu_gemv,)) == 4 * NUM_LAYERS + 1 == compiler.results[0].nodes_rewritten


def test_only_constant_weights_are_rewritten() -> None:
    root = torch.nn.Module()
    root.register_buffer("w", torch.randn(24, 16))
    root.register_buffer("b", torch.randn(24))
    graph = fx.Graph()
    x, w_in = graph.placeholder("x"), graph.placeholder("w_in")
    constant = graph.call_function(F.linear, (x, graph.get_attr("w"), graph.get_attr("b")))
    graph.output((constant, graph.call_function(F.linear, (x, w_in))))
    gm = fx.GraphModule(root, graph)
    x, w_in = torch.randn(3, 16), torch.randn(8, 16)
    expected = gm(x, w_in)
    result = CpuGemvLinears()(gm)
    gm.recompile()
    assert result.nodes_rewritten == 1 and any("not a 2-D graph constant" in n for n in result.notes)
    for got, want in zip(gm(x, w_in), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
