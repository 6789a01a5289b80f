"""The calling convention read off a Dynamo graph rebuilds the graph's arguments without Dynamo."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import fx

from compiled_engine.graphs.calling_convention import CallingConvention
from compiled_engine.graphs.step_inputs import StepInputs


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(4.0), requires_grad=False)


def _inputs(num_tokens: int) -> StepInputs:
    t = torch.arange(num_tokens)
    return StepInputs(
        input_ids=t[None],
        positions=t[None],
        slot_mapping=t,
        block_tables=torch.zeros(2, 3, dtype=torch.int32),
        seq_lens=torch.ones(2, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, num_tokens], dtype=torch.int32),
        logits_indices=torch.tensor([num_tokens - 1]),
    )


def _capture(model: torch.nn.Module, inputs: StepInputs, caches: list[torch.Tensor]):
    """Trace a small step function with Dynamo; return (graph, convention, Dynamo's own args)."""
    recorded = []

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        recorded.append((gm, CallingConvention.from_graph(gm)))

        def run(*args):
            recorded.append(args)
            return gm.forward(*args)

        return run

    def step(inputs: StepInputs, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        x = inputs.input_ids.float() * inputs.slot_mapping.shape[0] + kv_caches[1].sum()
        return x[0, :4] * model.weight + inputs.block_tables.sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
    expected = compiled(inputs, caches)
    (gm, convention), dynamo_args = recorded
    return gm, convention, dynamo_args, expected


def test_sources_name_step_locals_and_bound_args_match_dynamo():
    model = _Scale()
    caches = [torch.zeros(2, 2), torch.full((2, 2), 3.0)]
    inputs = _inputs(6)
    gm, convention, dynamo_args, expected = _capture(model, inputs, caches)

    assert "L['inputs'].input_ids" in convention.sources
    assert "L['kv_caches'][1]" in convention.sources
    assert "L['model']._parameters['weight']" in convention.sources
    assert "L['inputs'].input_ids.size()[1]" in convention.sources
    weight_index = convention.sources.index("L['model']._parameters['weight']")
    assert convention.is_constant(weight_index)
    assert not convention.is_constant(convention.sources.index("L['kv_caches'][1]"))

    build = convention.bind(model)
    args = build(inputs, caches)
    assert len(args) == len(dynamo_args)
    for ours, theirs in zip(args, dynamo_args, strict=True):
        if isinstance(theirs, torch.Tensor):
            assert ours is theirs or torch.equal(ours, theirs)
        else:
            assert ours == theirs
    assert args[weight_index] is model.weight
    torch.testing.assert_close(gm(*args)[0], expected)

    # Duck shaping ties T to input_ids.size()[1]. Another step size: the size arguments follow the
    # new inputs, the weight is the same object.
    other = _inputs(9)
    args = build(other, caches)
    assert args[convention.sources.index("L['inputs'].input_ids.size()[1]")] == 9
    assert args[weight_index] is model.weight
    expected = (other.input_ids[0, :4].float() * 9 + caches[1].sum()) * model.weight
    torch.testing.assert_close(gm(*args)[0], expected)


def test_convention_needs_dynamo_sources():
    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="inside the Dynamo backend"):
        CallingConvention.from_graph(gm)


@pytest.mark.parametrize(
    "source, message",
    [("G['x']", "does not start from a step local"), ("L['other'].x", "reads 'other'")],
)
def test_convention_rejects_unknown_sources(source, message):
    with pytest.raises(ValueError, match=message):
        CallingConvention(("L['inputs'].input_ids", source))
