"""FreezeParameters: weights become get_attr constants (same tensors), step inputs stay inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx

from compiled_engine.graphs.capture import capture_model
from compiled_engine.graphs.passes.freeze_parameters import (
    FreezeParameters,
    frozen_callable,
    kept_example_inputs,
)
from tests.test_capture import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, PagedBatch, make_model

# prefill of one sequence, two packed prefills, one-token decode: Dynamo's three graphs.
STEPS = (
    [(0, torch.arange(5), 0)],
    [(0, torch.arange(5), 0), (1, torch.arange(3), 0)],
    [(0, torch.tensor([7]), 5)],
)


class FreezingCompiler:
    """A capture_model graph_compiler that freezes each graph (optionally a copy of it)."""

    def __init__(self, on_copy: bool = False) -> None:
        self.on_copy = on_copy
        self.graphs: list[fx.GraphModule] = []
        self.passes: list[FreezeParameters] = []
        self.calls_with: list[int] = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        if self.on_copy:
            gm = copy.deepcopy(gm)
        freeze = FreezeParameters(example_inputs)
        freeze(gm)
        gm.graph.lint()
        gm.recompile()
        self.graphs.append(gm)
        self.passes.append(freeze)
        kept = kept_example_inputs(example_inputs, freeze.kept_input_indices)
        assert len(kept) == sum(1 for n in gm.graph.nodes if n.op == "placeholder")

        def run(*args):
            self.calls_with.append(len(args))
            return gm(*args)

        return frozen_callable(run, freeze.kept_input_indices, len(example_inputs))


@pytest.mark.parametrize("on_copy", [False, True], ids=["dynamo-graph", "copied-graph"])
def test_frozen_capture_matches_unfrozen(on_copy: bool) -> None:
    model = make_model("llama")
    paged = PagedBatch()
    reference = capture_model(make_model("llama"), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
    compiler = FreezingCompiler(on_copy)
    frozen = capture_model(
        model, paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM), graph_compiler=compiler
    )
    for chunks in STEPS:
        expected = reference(paged.step(chunks))
        torch.testing.assert_close(frozen(paged.step(chunks)), expected, atol=0, rtol=0)
    assert len(compiler.graphs) == 3

    state = {id(t): name for name, t in [*model.named_parameters(), *model.named_buffers()]}
    for gm in compiler.graphs:
        kept = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # Every remaining input is a step input, a KV cache or a size: no weight is left.
        assert all(n.name.startswith(("l_inputs_", "l_kv_caches_", "s")) for n in kept), kept
        assert any(isinstance(n.meta["example_value"], torch.SymInt) for n in kept)
        assert {"l_kv_caches_0_", "l_kv_caches_1_", "l_inputs_slot_mapping"} <= {n.name for n in kept}
        constants = [getattr(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"]
        # The model's own tensors, not copies: rotary inv_freq buffer and every weight read.
        assert all(id(t) in state for t in constants)
        assert "model.rotary_emb.inv_freq" in {state[id(t)] for t in constants}
        assert "lm_head.weight" in {state[id(t)] for t in constants}
    # Dynamo passes only the kept inputs when the pass ran on its own graph; all otherwise,
    # and the wrapper picks them out.
    kept_counts = [len(p.kept_input_indices) for p in compiler.passes]
    assert compiler.calls_with == kept_counts


def test_in_place_update_of_a_weight_is_seen() -> None:
    model = make_model("llama")
    paged = PagedBatch()
    frozen = capture_model(
        model, paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM), graph_compiler=FreezingCompiler()
    )
    before = frozen(paged.step(STEPS[0]))
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    after = frozen(paged.step(STEPS[0]))
    torch.testing.assert_close(after, before * 2, atol=1e-5, rtol=1e-5)


class _ScaleAndBump(torch.nn.Module):
    def forward(self, x, scale, counter):
        counter.add_(1)  # a "weight" the graph writes: must stay an input
        return x * scale + counter


def test_mutated_weights_and_plain_inputs_stay_inputs() -> None:
    gm = fx.symbolic_trace(_ScaleAndBump())
    x = torch.randn(3)
    scale = torch.nn.Parameter(torch.full((3,), 2.0), requires_grad=False)
    counter = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    freeze = FreezeParameters([x, scale, counter])
    result = freeze(gm)
    gm.recompile()
    assert result.nodes_rewritten == 1
    assert freeze.kept_input_indices == (0, 2)
    assert any("counter" in note and "mutated" in note for note in result.notes)
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x", "counter"]
    frozen_scale = [getattr(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"]
    assert len(frozen_scale) == 1 and frozen_scale[0] is scale
    call = frozen_callable(gm, freeze.kept_input_indices, 3)
    torch.testing.assert_close(call(x, scale, counter), x * 2 + 1)  # all inputs, as Dynamo may pass
    torch.testing.assert_close(call(x, counter), x * 2 + 2)  # only the kept ones


def test_example_inputs_must_match_the_placeholders() -> None:
    gm = fx.symbolic_trace(_ScaleAndBump())
    with pytest.raises(ValueError, match="3 placeholders but 2 example inputs"):
        FreezeParameters([torch.zeros(3), torch.zeros(3)])(gm)
