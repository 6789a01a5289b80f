"""Put an op of the same operands in place of every constant-weight linear a kernel can run.

The packed-weight passes (onednn_linear.py, cpu_gemv.py) differ only in the op they call and in
which weights it takes; the walk over the graph, the notes and the metadata kept are this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from compiled_engine.graphs.passes.fake_values import set_fake_value
from compiled_engine.graphs.passes.fuse_linears import constant_tensor, linear_nodes


def swap_constant_linears(
    gm: fx.GraphModule,
    op: Callable,
    runs: Callable[[torch.Tensor], str | None],
) -> tuple[int, list[str]]:
    """Every `linear(x, W, b)` with a 2-D constant W for which `runs(W)` is None becomes
    `op(x, W, b)`; `runs(W)` otherwise says why that one is kept. Returns (rewritten, notes)."""
    graph = gm.graph
    rewritten = 0
    notes: list[str] = []
    for node, x, weight_node, bias in linear_nodes(graph):
        weight = constant_tensor(gm, weight_node)
        if weight is None or weight.dim() != 2:
            notes.append(f"kept {node.name}: weight is not a 2-D graph constant")
            continue
        refused = runs(weight)
        if refused is not None:
            notes.append(f"kept {node.name}: {refused}")
            continue
        with graph.inserting_before(node):
            replacement = graph.call_function(op, (x, weight_node, bias))
        # The linear's own meta (stack trace, source) stays with the value it produced.
        replacement.meta.update(node.meta)
        set_fake_value(replacement)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        rewritten += 1
    return rewritten, notes
