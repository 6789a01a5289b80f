"""PackLinearWeights and the oneDNN linear op: same logits, packed copies kept and refreshed."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch._inductor.compile_fx import compile_fx

from compiled_engine.graphs.capture import capture_model
from compiled_engine.graphs.passes.freeze_parameters import (
    FreezeParameters,
    frozen_callable,
    kept_example_inputs,
)
from compiled_engine.graphs.passes.fuse_linears import (
    LINEAR_TARGETS,
    FusedWeightCache,
    FuseLinears,
    constant_tensor,
)
from compiled_engine.graphs.passes.onednn_linear import PackLinearWeights
from compiled_engine.kernels.onednn_linear import (
    PackedWeights,
    onednn_linear,
    onednn_linear_available,
    pack_linear_weight,
)
from tests.test_capture import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, PagedBatch, make_model
from tests.test_pass_fuse_linears import STEPS

pytestmark = pytest.mark.skipif(
    not onednn_linear_available(torch.float32), reason="this torch has no oneDNN (mkldnn) on CPU"
)


def _count(gm: fx.GraphModule, targets) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


class PackingCompiler:
    """Freeze, fuse and pack, then hand Dynamo the graph (run eagerly, or compiled by Inductor)."""

    def __init__(self, inductor: bool) -> None:
        self.inductor = inductor
        self.graphs: list[fx.GraphModule] = []
        self.results = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        freeze = FreezeParameters(example_inputs)
        freeze(gm)
        FuseLinears(FusedWeightCache())(gm)
        self.results.append(PackLinearWeights()(gm))
        gm.graph.lint()
        gm.recompile()
        self.graphs.append(gm)
        kept = freeze.kept_input_indices
        run = compile_fx(gm, kept_example_inputs(example_inputs, kept)) if self.inductor else gm
        return frozen_callable(run, kept, len(example_inputs))


@pytest.mark.parametrize("inductor", [False, True], ids=["eager", "inductor"])
def test_packed_capture_matches_the_plain_one(inductor: bool) -> None:
    paged = PagedBatch()
    reference = capture_model(make_model("qwen2"), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
    compiler = PackingCompiler(inductor)
    packed = capture_model(
        make_model("qwen2"), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM), graph_compiler=compiler
    )
    for chunks in STEPS[:2]:
        expected = reference(paged.step(chunks))
        torch.testing.assert_close(packed(paged.step(chunks)), expected, atol=2e-5, rtol=0)
    gm = compiler.graphs[0]
    # Every fused linear (q/k/v with biases, o, gate/up, down per layer; the LM head) was rewritten.
    assert _count(gm, LINEAR_TARGETS) == 0
    assert _count(gm, (onednn_linear,)) == 4 * NUM_LAYERS + 1
    assert compiler.results[0].nodes_rewritten == 4 * NUM_LAYERS + 1
    # Dynamo's example values were carried over, as later passes and Inductor read them.
    for node in gm.graph.nodes:
        if node.target is onednn_linear:
            value = node.meta["example_value"]
            weight = constant_tensor(gm, node.args[1])
            assert isinstance(value, torch.Tensor) and value.dtype == torch.float32
            assert value.shape[-1] == weight.shape[0]


def _graph(weight_dtype: torch.dtype) -> fx.GraphModule:
    """x -> linear(x, W, b) (constants), linear(x, w_in) with a weight that is a graph input."""
    root = torch.nn.Module()
    root.register_buffer("w", torch.randn(24, 16, dtype=weight_dtype))
    root.register_buffer("b", torch.randn(24, dtype=weight_dtype))
    graph = fx.Graph()
    x, w_in = graph.placeholder("x"), graph.placeholder("w_in")
    constant = graph.call_function(F.linear, (x, graph.get_attr("w"), graph.get_attr("b")))
    from_input = graph.call_function(F.linear, (x, w_in))
    graph.output((constant, from_input))
    return fx.GraphModule(root, graph)


def test_only_constant_weights_oneDNN_can_pack_are_rewritten() -> None:
    gm = _graph(torch.float32)
    x, w_in = torch.randn(5, 16), torch.randn(8, 16)
    expected = gm(x, w_in)
    result = PackLinearWeights()(gm)
    gm.recompile()
    assert result.nodes_rewritten == 1
    assert any("not a 2-D graph constant" in note for note in result.notes)
    assert _count(gm, (onednn_linear,)) == 1 and _count(gm, (F.linear,)) == 1
    for got, want in zip(gm(x, w_in), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    half = _graph(torch.float16)
    result = PackLinearWeights()(half)
    assert result.nodes_rewritten == 0
    assert any("oneDNN cannot pack a torch.float16 weight" in note for note in result.notes)


@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 0.1)], ids=["float32", "bfloat16"]
)
@pytest.mark.parametrize("shape", [(7, 64), (1, 5, 64), (1, 0, 64)])
def test_the_op_is_a_linear(dtype: torch.dtype, atol: float, shape: tuple[int, ...]) -> None:
    if not onednn_linear_available(dtype):
        pytest.skip(f"oneDNN has no {dtype} support on this CPU")
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    x = torch.randn(*shape, dtype=dtype)
    for b in (None, bias):
        out = onednn_linear(x, weight, b)
        assert out.shape == (*shape[:-1], 96) and out.dtype == dtype
        torch.testing.assert_close(out.float(), F.linear(x, weight, b).float(), atol=atol, rtol=0.02)
    # A strided (non-contiguous) input.
    strided = torch.randn(5, 128, dtype=dtype)[:, ::2]
    torch.testing.assert_close(
        onednn_linear(strided, weight, bias).float(),
        F.linear(strided, weight, bias).float(),
        atol=atol,
        rtol=0.02,
    )


def test_packed_copies_follow_their_weight() -> None:
    packed = PackedWeights()
    weight = torch.randn(32, 16)
    first = packed.get(weight)
    assert first.is_mkldnn and tuple(first.shape) == (32, 16)
    assert packed.get(weight) is first and len(packed) == 1  # packed once
    with torch.no_grad():
        weight.mul_(2)  # an in-place update: the copy is stale and is packed again
    refreshed = packed.get(weight)
    assert refreshed is not first
    x = torch.randn(3, 16)
    torch.testing.assert_close(
        torch.ops.mkldnn._linear_pointwise(x, refreshed, None, "none", [], ""),
        x @ weight.T,
        atol=1e-5,
        rtol=0,
    )
    # The op reads the process-wide copies: a changed weight gives the new result.
    with torch.no_grad():
        before = onednn_linear(x, weight, None)
        weight.add_(1)
        torch.testing.assert_close(onednn_linear(x, weight, None), F.linear(x, weight), atol=1e-5, rtol=0)
        assert not torch.allclose(before, onednn_linear(x, weight, None))
    # A copy lives no longer than its weight.
    del weight
    gc.collect()
    assert len(packed) == 0


def test_pack_refuses_what_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match="2-D"):
        pack_linear_weight(torch.randn(4))
    with pytest.raises(ValueError, match="float16"):
        pack_linear_weight(torch.randn(4, 4, dtype=torch.float16))
