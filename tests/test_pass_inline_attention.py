"""graphs/passes/inline_attention.py on a small graph: node counts, outputs and cache writes equal."""

from __future__ import annotations

import torch
from torch import fx

import compiled_engine.kernels  # noqa: F401  (registers the ops)
from compiled_engine.graphs.passes.inline_attention import InlineAttention
from tests.test_paged_attention import make_sequences, make_step, new_cache, prefill_cache


class TwoLayers(torch.nn.Module):
    def forward(self, q, k, v, cache0, cache1, slots, tables, seq_lens, qsl):
        a = torch.ops.compiled_engine.paged_attention(q, k, v, cache0, slots, tables, seq_lens, qsl, 0.3)
        b = torch.ops.compiled_engine.paged_attention(
            a, k, v, cache1, slots, tables, seq_lens, qsl, 0.3, sliding_window=4, softcap=5.0
        )
        return a + b


def test_inline_attention_replaces_each_op_and_matches():
    gen = torch.Generator().manual_seed(0)
    spans = [(9, 4, 5), (6, 5, 1)]
    seqs = make_sequences([t for t, _, _ in spans], 2, 8, 12, torch.float32, gen)
    spans_now = [(s, done, n) for s, (_, done, n) in zip(seqs, spans, strict=True)]
    step = make_step(spans_now, 4, num_pad_tokens=2, gen=gen)  # two padding rows too
    caches = []
    for _ in range(2):
        cache = new_cache(12, 2, 8, torch.float32)
        prefill_cache(cache, [(s, done) for s, (_, done, _) in zip(seqs, spans, strict=True)])
        caches.append(cache)
    args = (step.query, step.key, step.value, *caches, *step.args(caches[0])[4:])

    gm = fx.symbolic_trace(TwoLayers())
    expected_caches = [c.clone() for c in caches]
    expected = gm(*args[:3], *expected_caches, *args[5:])
    result = InlineAttention()(gm)
    gm.recompile()
    assert result.nodes_rewritten == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.compiled_engine.kv_cache_write.default) == 2
    assert targets.count(torch.ops.compiled_engine.paged_attention_inline.default) == 2
    assert torch.ops.compiled_engine.paged_attention not in targets
    out = gm(*args)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(caches, expected_caches, strict=True):
        assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())
