"""Replace each opaque paged-attention call by a KV-cache write and attention maths Inductor can fuse.

Why: on CPU the opaque op runs its reference implementation eagerly inside the compiled graph:
~40 small torch calls per layer (dispatch overhead dominates a one-token decode) and a
per-head strided bmm that is slow at batch 64. Written as plain tensor maths instead
(kernels/inline_attention.py: block-table gather, broadcast-multiply-sum, masked softmax),
Inductor compiles the attention together with the rest of the step and fuses the gather
into the reductions, so the gathered keys and values are never materialised.

Rewrite, per `paged_attention(q, k, v, kv_cache, slots, tables, seq_lens, qsl, scale, window, cap)`:

    kv_cache_write(k, v, kv_cache, slots)            # the one mutation, still an opaque op
    out = paged_attention_inline(q, kv_cache, tables, seq_lens, qsl, scale, window, cap)  # composite

`paged_attention_inline` is a CompositeImplicitAutograd operator over that maths: AOTAutograd
decomposes it when Inductor compiles the graph, and the graph itself stays serialisable for
the compile cache. The write stays ahead of the read in graph order, and functionalisation
makes the read see the written cache.

Only for graphs that go to Inductor with static token counts (a bucket): eagerly, or over a
large prefill, the unfused maths would materialise [T, context, heads, dim] tensors.
graphs/pass_pipeline.py picks the buckets (its `inlines_attention` predicate).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

import compiled_engine.kernels.inline_attention  # noqa: F401  (registers both ops)
from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.graphs.passes.lower_sdpa import PAGED_ATTENTION_TARGETS
from compiled_engine.kernels.source_version import source_version

_OP_PARAMS = (
    "query",
    "key",
    "value",
    "kv_cache",
    "slot_mapping",
    "block_tables",
    "seq_lens",
    "query_start_loc",
    "scale",
    "sliding_window",
    "softcap",
)
_OP_DEFAULTS: dict[str, Any] = {"sliding_window": -1, "softcap": 0.0}


def _operands(node: fx.Node) -> dict[str, Any]:
    values = dict(_OP_DEFAULTS)
    values.update(zip(_OP_PARAMS, node.args, strict=False))
    values.update(node.kwargs)
    missing = [p for p in _OP_PARAMS if p not in values]
    if missing:
        raise ValueError(f"inline_attention: {node.name} lacks {missing}")
    return values


class InlineAttention:
    """Every paged-attention op node becomes kv_cache_write + inline attention maths."""

    name = "inline_attention"
    version = source_version(
        __name__, "compiled_engine.graphs.passes.lower_sdpa", "compiled_engine.kernels.inline_attention"
    )

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        rewritten = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in PAGED_ATTENTION_TARGETS:
                continue
            a = _operands(node)
            with graph.inserting_before(node):
                graph.call_function(
                    torch.ops.compiled_engine.kv_cache_write.default,
                    (a["key"], a["value"], a["kv_cache"], a["slot_mapping"]),
                )
                out = graph.call_function(
                    torch.ops.compiled_engine.paged_attention_inline.default,
                    (a["query"], a["kv_cache"], a["block_tables"], a["seq_lens"], a["query_start_loc"]),
                    {"scale": a["scale"], "sliding_window": a["sliding_window"], "softcap": a["softcap"]},
                )
            # Same result shape, dtype and (fresh, contiguous) layout as the op's output.
            out.meta.update(node.meta)
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            rewritten += 1
        return PassResult(self.name, rewritten, (f"inlined {rewritten} paged-attention call(s)",))
