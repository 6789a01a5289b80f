"""FuseLinears: q/k/v and gate/up become one GEMM each; logits unchanged; odd cases left alone."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch._inductor.compile_fx import compile_fx

from compiled_engine.graphs.capture import capture_model
from compiled_engine.graphs.pass_manager import PassManager
from compiled_engine.graphs.passes.freeze_parameters import (
    FreezeParameters,
    frozen_callable,
    kept_example_inputs,
)
from compiled_engine.graphs.passes.fuse_linears import LINEAR_TARGETS, FusedWeightCache, FuseLinears
from tests.test_capture import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, PagedBatch, make_model

STEPS = (
    [(0, torch.arange(6), 0)],
    [(0, torch.arange(6), 0), (1, torch.arange(4), 0)],
    [(0, torch.tensor([9]), 6)],
)


def count_linears(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in LINEAR_TARGETS)


class FusingCompiler:
    def __init__(self) -> None:
        self.cache = FusedWeightCache()
        self.linears_before: list[int] = []
        self.graphs: list[fx.GraphModule] = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        freeze = FreezeParameters(example_inputs)
        freeze(gm)
        self.linears_before.append(count_linears(gm))
        FuseLinears(self.cache)(gm)
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
        self.graphs.append(gm)
        return frozen_callable(gm, freeze.kept_input_indices, len(example_inputs))


# Slow: llama's q,k,v,o,gate,up,down groups are fused the same way in qwen3 (which adds q/k norms
# between them) and qwen2 (which adds q/k/v biases), both in the default run.
@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.slow), "qwen2", "qwen3"])
def test_fused_capture_matches_unfused(arch: str) -> None:
    model = make_model(arch)
    paged = PagedBatch()
    reference = capture_model(make_model(arch), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
    compiler = FusingCompiler()
    fused = capture_model(model, paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM), graph_compiler=compiler)
    for chunks in STEPS:
        expected = reference(paged.step(chunks))
        torch.testing.assert_close(fused(paged.step(chunks)), expected, atol=1e-5, rtol=0)

    assert len(compiler.graphs) == 3
    # Per layer q,k,v,o,gate,up,down = 7 linears become qkv,o,gate_up,down = 4; plus lm_head.
    assert compiler.linears_before == [7 * NUM_LAYERS + 1] * 3
    assert [count_linears(gm) for gm in compiler.graphs] == [4 * NUM_LAYERS + 1] * 3
    # One concatenated copy per (layer, group), shared by all three graphs.
    assert len(compiler.cache) == 2 * NUM_LAYERS
    if arch == "qwen2":  # q/k/v carry biases: fused too
        bias_attrs = [n for n in compiler.graphs[0].graph.nodes if n.op == "get_attr" and "bias" in n.name]
        assert any(n.name.startswith("fused_") for n in bias_attrs)
    # The pass never touches the model's own weights.
    fresh = dict(make_model(arch).named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, fresh[name]), name


def _constant_graph(dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]) -> tuple[fx.GraphModule, dict]:
    """x -> linear(x, W1, b1) [8 out], linear(x, W2) [4 out], linear(x, W3, b3) [6 out],
    plus linear(x, w_in) whose weight is a graph input; output = all four, concatenated."""
    generator = torch.Generator().manual_seed(0)
    root = torch.nn.Module()
    tensors = {
        "w1": torch.randn(8, 16, generator=generator).to(dtypes[0]),
        "b1": torch.randn(8, generator=generator).to(dtypes[0]),
        "w2": torch.randn(4, 16, generator=generator).to(dtypes[1]),
        "w3": torch.randn(6, 16, generator=generator).to(dtypes[2]),
        "b3": torch.randn(6, generator=generator).to(dtypes[2]),
    }
    for name, tensor in tensors.items():
        root.register_buffer(name, tensor)
    graph = fx.Graph()
    x = graph.placeholder("x")
    w_in = graph.placeholder("w_in")
    get = {name: graph.get_attr(name) for name in tensors}
    outs = [
        graph.call_function(F.linear, (x, get["w1"], get["b1"])),
        graph.call_function(F.linear, (x, get["w2"])),
        graph.call_function(F.linear, (x,), {"weight": get["w3"], "bias": get["b3"]}),
        graph.call_function(F.linear, (x, w_in)),
    ]
    graph.output(graph.call_function(torch.cat, (outs,), {"dim": -1}))
    return fx.GraphModule(root, graph), tensors


def test_siblings_of_different_sizes_with_and_without_bias() -> None:
    gm, tensors = _constant_graph((torch.float32,) * 3)
    x, w_in = torch.randn(2, 3, 16), torch.randn(5, 16)
    expected = gm(x, w_in)
    result = FuseLinears()(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert result.nodes_rewritten == 3
    assert any("not a constant" in note for note in result.notes)  # the w_in linear
    assert count_linears(gm) == 2  # the fused one and the graph-input one
    splits = [n for n in gm.graph.nodes if n.target is torch.split]
    assert len(splits) == 1 and splits[0].args[1] == [8, 4, 6]
    assert sum(1 for n in gm.graph.nodes if n.target is operator.getitem) == 3
    torch.testing.assert_close(gm(x, w_in), expected, atol=1e-5, rtol=1e-6)
    fused_bias = next(
        getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr" and "bias" in n.name
    )
    # The middle linear had no bias: zeros stand in for it.
    assert torch.equal(fused_bias, torch.cat([tensors["b1"], torch.zeros(4), tensors["b3"]]))


def test_different_dtypes_are_not_fused() -> None:
    gm, _ = _constant_graph((torch.float32, torch.float64, torch.bfloat16))
    result = FuseLinears()(gm)
    assert result.nodes_rewritten == 0
    assert count_linears(gm) == 4


def test_same_weights_in_two_graphs_share_one_copy() -> None:
    cache = FusedWeightCache()
    first, _ = _constant_graph((torch.float32,) * 3)
    second = fx.GraphModule(first, first.graph.__deepcopy__())  # same root tensors, new graph
    FuseLinears(cache)(first)
    FuseLinears(cache)(second)
    assert len(cache) == 1

    def fused_weight(gm: fx.GraphModule) -> torch.Tensor:
        node = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.name.startswith("fused_"))
        return getattr(gm, node.target)

    assert fused_weight(first) is fused_weight(second)


def test_frozen_and_fused_graph_compiles_with_inductor() -> None:
    # AOTAutograd needs a Dynamo source for every parameter/buffer of the graph, the fused
    # ones included; without it compile_fx fails before generating any code.
    paged = PagedBatch()
    reference = capture_model(make_model("qwen2"), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
    cache = FusedWeightCache()

    def compile_frozen(gm: fx.GraphModule, example_inputs):
        freeze = FreezeParameters(example_inputs)
        PassManager([freeze, FuseLinears(cache)])(gm)
        compiled = compile_fx(gm, kept_example_inputs(example_inputs, freeze.kept_input_indices))
        return frozen_callable(compiled, freeze.kept_input_indices, len(example_inputs))

    compiled = capture_model(
        make_model("qwen2"),
        paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM),
        graph_compiler=compile_frozen,
    )
    step = paged.step([(0, torch.arange(4), 0), (1, torch.arange(3), 0)])
    torch.testing.assert_close(compiled(step), reference(step), atol=1e-5, rtol=0)
    assert len(cache) == 2 * NUM_LAYERS
