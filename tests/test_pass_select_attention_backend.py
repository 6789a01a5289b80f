"""select_attention_backend: the reference op's calls are retargeted to the chosen backend's op,
nothing else changes, and "torch" leaves the graph alone."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from compiled_engine.graphs.passes.select_attention_backend import SelectAttentionBackend
from compiled_engine.kernels.backends import resolve_attention_backend


def _graph_with_two_attention_calls() -> fx.GraphModule:
    graph = fx.Graph()
    args = [graph.placeholder(name) for name in ("q", "k", "v", "cache", "slots", "tables", "lens", "qsl")]
    op = torch.ops.compiled_engine.paged_attention.default
    first = graph.call_function(op, (*args, 0.25))
    second = graph.call_function(op, (first, *args[1:], 0.25))
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (first, second)))
    return fx.GraphModule(torch.nn.Module(), graph)


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_torch_backend_leaves_the_graph_alone():
    gm = _graph_with_two_attention_calls()
    before = _targets(gm)
    result = SelectAttentionBackend(resolve_attention_backend("torch", "cpu"))(gm)
    assert result.nodes_rewritten == 0 and _targets(gm) == before


def test_triton_backend_retargets_every_attention_call(monkeypatch):
    pytest.importorskip("triton", reason="the triton backend needs the triton package")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend = resolve_attention_backend("triton", "cpu")
    gm = _graph_with_two_attention_calls()
    graph_pass = SelectAttentionBackend(backend)
    result = graph_pass(gm)
    assert result.nodes_rewritten == 2
    triton_op = torch.ops.compiled_engine.paged_attention_triton.default
    assert _targets(gm) == [triton_op, triton_op, torch.ops.aten.add.Tensor]
    assert backend.version in graph_pass.version
    assert graph_pass.version != SelectAttentionBackend(resolve_attention_backend("torch", "cpu")).version
