"""`prefill_attention` (pooling steps' attention, no KV cache) against the paged op, its `_rows`
variant, and the pooling graphs' rewrites onto them (compiled_engine/pooling/prefill_attention_pass.py,
pooled_rows_pass.py; the end-to-end parity with sentence-transformers is tests/test_embeddings.py)."""

from __future__ import annotations

import pytest
import torch
from torch import fx

import compiled_engine.kernels  # noqa: F401  (registers the ops)
from compiled_engine.pooling.prefill_attention_pass import use_prefill_attention
from tests.test_paged_attention_bidirectional import _step


@pytest.mark.parametrize("causal", [True, False])
def test_op_matches_the_paged_op_on_a_packed_step(causal):
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 19, 1, 33, 16]
    query, key, value, cache, slots, tables, seq_lens, starts = _step(lengths, 16, 8, 2, 16, generator)
    scale = 16**-0.5
    extra = () if causal else (False,)
    want = torch.ops.compiled_engine.paged_attention(
        query, key, value, cache, slots, tables, seq_lens, starts, scale, -1, 0.0, *extra
    )
    got = torch.ops.compiled_engine.prefill_attention(query, key, value, starts, scale, causal)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_op_reads_strided_rows_and_zeroes_rows_past_the_last_sequence():
    # q, k and v as column slices of one fused projection (the compiled graphs' layout), and two
    # padding rows after the step's sequences.
    generator = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, total = 4, 2, 8, 12
    fused = torch.randn(total + 2, (heads + 2 * kv_heads) * dim, generator=generator)
    q = fused[:, : heads * dim].view(-1, heads, dim)
    k = fused[:, heads * dim : (heads + kv_heads) * dim].view(-1, kv_heads, dim)
    v = fused[:, (heads + kv_heads) * dim :].view(-1, kv_heads, dim)
    starts = torch.tensor([0, 7, total], dtype=torch.int32)
    got = torch.ops.compiled_engine.prefill_attention(q, k, v, starts, 0.3, True)
    want = torch.ops.compiled_engine.prefill_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), starts, 0.3, True
    )
    torch.testing.assert_close(got, want)
    assert bool((got[total:] == 0).all())
    # The second sequence's first row sees only itself: its value row, repeated per query group.
    torch.testing.assert_close(got[7], v[7].repeat_interleave(2, dim=0))


@pytest.mark.parametrize("causal", [True, False])
def test_rows_op_is_the_full_op_at_those_rows(causal):
    generator = torch.Generator().manual_seed(3)
    lengths = [5, 19, 1, 33]
    query, key, value, *_, starts = _step(lengths, 16, 8, 2, 16, generator)
    full = torch.ops.compiled_engine.prefill_attention(query, key, value, starts, 0.25, causal)
    last_rows = (starts[1:] - 1).long()  # last-token pooling
    first_rows = starts[:-1].long()  # CLS pooling
    for rows in (last_rows, first_rows, torch.tensor([3, 40], dtype=torch.int64)):
        got = torch.ops.compiled_engine.prefill_attention_rows(query, key, value, starts, rows, 0.25, causal)
        torch.testing.assert_close(got, full[rows], rtol=1e-5, atol=1e-5)


def test_op_refuses_heads_that_do_not_group():
    q, kv = torch.zeros(3, 3, 4), torch.zeros(3, 2, 4)
    with pytest.raises(ValueError, match="3 query heads do not group over 2 key heads"):
        torch.ops.compiled_engine.prefill_attention(q, kv, kv, torch.tensor([0, 3]), 1.0, True)


def _paged_graph(sliding_window: int) -> fx.GraphModule:
    graph = fx.Graph()
    names = ("query", "key", "value", "kv_cache", "slot_mapping", "block_tables", "seq_lens", "starts")
    q, k, v, cache, slots, tables, seq_lens, starts = (graph.placeholder(n) for n in names)
    out = graph.call_function(
        torch.ops.compiled_engine.paged_attention.default,
        (q, k, v, cache, slots, tables, seq_lens, starts, 0.5, sliding_window, 0.0),
    )
    graph.output(out)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_pass_rewrites_paged_calls_and_the_graph_computes_the_same():
    gm = _paged_graph(-1)
    generator = torch.Generator().manual_seed(2)
    args = _step([9, 4, 21], 16, 4, 2, 8, generator)
    want = gm(*args)
    result = use_prefill_attention(gm)
    assert result.nodes_rewritten == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.compiled_engine.prefill_attention.default]
    torch.testing.assert_close(gm(*args), want, rtol=1e-5, atol=1e-5)


def test_pass_keeps_the_paged_op_for_a_sliding_window():
    gm = _paged_graph(8)
    result = use_prefill_attention(gm)
    assert result.nodes_rewritten == 0
    assert "keep the paged op" in result.notes[1]
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.compiled_engine.paged_attention.default]


def test_pooling_engine_graphs_call_prefill_attention(st_qwen3_llm):
    # Last-token pooling: the last of the body's 2 layers attends only at the pooled rows.
    st_qwen3_llm.embed(["a few words", "and a longer input of several more words"])
    graphs = st_qwen3_llm.engine.runner.captured.graphs
    assert graphs
    for gm in graphs:
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert targets.count(torch.ops.compiled_engine.prefill_attention.default) == 1
        assert targets.count(torch.ops.compiled_engine.prefill_attention_rows.default) == 1
        assert not any("paged_attention" in str(t) for t in targets)


def _captured(fn, *args, rewrite=None):
    """`fn` run through Dynamo (dynamic shapes, traced values on the nodes, as pooling graphs are),
    its graph given to `rewrite` first; returns (the graph, the result, the rewrite's result)."""
    seen: dict = {}

    def backend(gm, example_inputs):
        seen["gm"] = gm
        seen["result"] = rewrite(gm) if rewrite else None
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)(*args)
    return seen["gm"], out, seen["result"]


def _tail_inputs():
    generator = torch.Generator().manual_seed(4)
    query, key, value, *_, starts = _step([6, 11, 3], 16, 4, 2, 8, generator)
    residual = torch.randn(query.shape[0], 32, generator=generator)
    weight = torch.randn(32, 32, generator=generator)
    rows = (starts[1:] - 1).long()
    return query, key, value, starts, rows, residual, weight


def _row_wise_tail(query, key, value, starts, rows, residual, weight):
    out = torch.ops.compiled_engine.prefill_attention(query, key, value, starts, 0.5, True)
    hidden = residual + torch.nn.functional.linear(out.reshape(out.shape[0], -1), weight)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
    return hidden.index_select(0, rows)


def _mixing_tail(query, key, value, starts, rows, residual, weight):
    out = torch.ops.compiled_engine.prefill_attention(query, key, value, starts, 0.5, True)
    hidden = residual + torch.cumsum(out.reshape(out.shape[0], -1), 0)  # mixes rows
    return hidden.index_select(0, rows)


def test_pooled_rows_pass_narrows_a_row_wise_tail_and_keeps_the_result():
    from compiled_engine.pooling.pooled_rows_pass import select_pooled_rows

    inputs = _tail_inputs()
    gm, got, result = _captured(_row_wise_tail, *inputs, rewrite=select_pooled_rows)
    assert result.nodes_rewritten > 0, result.notes
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.compiled_engine.prefill_attention_rows.default in targets
    assert torch.ops.compiled_engine.prefill_attention.default not in targets
    torch.testing.assert_close(got, _row_wise_tail(*inputs), rtol=1e-5, atol=1e-5)


def test_pooled_rows_pass_keeps_a_tail_that_mixes_rows():
    from compiled_engine.pooling.pooled_rows_pass import select_pooled_rows

    inputs = _tail_inputs()
    _, got, result = _captured(_mixing_tail, *inputs, rewrite=select_pooled_rows)
    assert result.nodes_rewritten == 0
    assert "is not known to be row-wise" in result.notes[0]
    torch.testing.assert_close(got, _mixing_tail(*inputs))
