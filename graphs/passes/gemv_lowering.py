"""Rewrite few-row linears as broadcast-multiply + sum, for Inductor to emit as a reduction.

Why: decoding a handful of tokens makes every linear a GEMV, bound by reading the weight.
On the CPUs we measured, torch's one-row `F.linear` runs single-threaded at ~10.5 GB/s
whatever `set_num_threads` says, while `(x.unsqueeze(-2) * w).sum(-1)` compiled by Inductor
is one fused, parallel reduction over the weight at ~22 GB/s (bench-small, 1-token forward,
fp32: 8.50 → 3.44 ms; bf16: 5.54 → 2.15 ms).

Only for graphs that go to Inductor: run eagerly, the rewrite materialises a
[rows, out, in] product and is far slower than the GEMM. And only for small static token
counts: the reduction reads the weight once per row, where a GEMM reuses it across rows,
so from a few rows on the GEMM wins again. Where the crossover lies is the caller's
decision, by measurement per bucket (graphs/gemv_policy.py); this pass is parametric in it
(`max_rows`).

Tried and dropped: reducing to [out, *lead] (`product.movedim(-2, 0).sum(-1)`, then moved
back and made contiguous), so that Inductor's loops put the weight rows outermost and read
each weight row once for all rows. On bench-small's 25 linears alone (2 threads, fp32,
contiguous inputs) it took 3.3 / 3.7 / 5.4 ms at 2 / 4 / 8 rows against 4.2 / 5.2 / 6.9 ms
for this form. In the model's graph it was a disaster: Inductor kept the [out, rows] layout
for the residual stream, and the next linears' reductions came out as a serial loop over
output features with a parallel region inside each: a 4-token step of bench-small took
134 ms against 14 ms unlowered.

A linear is rewritten when the number of rows it multiplies (the product of its input's
leading dimensions) is known to be at most `max_rows`: from the example value's static
shape, or, for a graph the caller will only ever run at `rows_hint` rows or fewer
(a bucket's token count), from that promise. Any other linear is left alone with a note.

The new nodes get example values computed in the inputs' own fake mode, as Dynamo would
have recorded them, so passes that run later (and graph dumps) see a fully annotated graph.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.graphs.passes.fake_values import fake_evaluation
from compiled_engine.graphs.passes.fuse_linears import linear_nodes
from compiled_engine.kernels.source_version import source_version


def _static_rows(x: fx.Node) -> int | None:
    value = x.meta.get("example_value", x.meta.get("val"))
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    leading = value.shape[:-1]
    if not all(is_concrete_int(d) for d in leading):
        return None  # a symbolic size: reading its value would specialise the graph
    return math.prod(int(d) for d in leading)


def _fake(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _rewrite(graph: fx.Graph, x: fx.Node, weight: Any, bias: Any) -> list[fx.Node]:
    """Insert `(x.unsqueeze(-2) * weight).sum(-1) (+ bias)`; its nodes in order, the result last."""
    expanded = graph.call_method("unsqueeze", (x, -2))
    product = graph.call_function(operator.mul, (expanded, weight))
    nodes = [expanded, product, graph.call_method("sum", (product, -1))]
    if bias is not None:
        nodes.append(graph.call_function(operator.add, (nodes[-1], bias)))
    return nodes


def _annotate(nodes: list[fx.Node]) -> None:
    """Example values for the rewrite's nodes, computed from their operands' fake values."""
    for node in nodes:
        operands = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
        fakes = [_fake(a) for a in operands]
        if not fakes or not all(isinstance(f, FakeTensor) for f in fakes):
            return  # an operand without a fake value: leave the rest unannotated too
        args = [_fake(a) if isinstance(a, fx.Node) else a for a in node.args]
        # The operands' own mode: the one in a tracing context may be another instance.
        with fake_evaluation(fakes[0].fake_mode):
            if node.op == "call_method":
                value = getattr(args[0], str(node.target))(*args[1:])
            else:
                # A call_function node's target is the function itself (fx types it as a method name too).
                value = cast(Callable[..., Any], node.target)(*args)
        node.meta["example_value"] = value


class GemvLowering:
    """Linears over at most `max_rows` rows become `(x.unsqueeze(-2) * w).sum(-1) (+ b)`."""

    name = "gemv_lowering"
    version = source_version(
        __name__, "compiled_engine.graphs.passes.fake_values", "compiled_engine.graphs.passes.fuse_linears"
    )

    def __init__(self, max_rows: int, rows_hint: int | None = None) -> None:
        if max_rows < 1:
            raise ValueError(f"gemv_lowering: max_rows must be at least 1, got {max_rows}")
        if rows_hint is not None and rows_hint < 1:
            raise ValueError(f"gemv_lowering: rows_hint must be at least 1 or None, got {rows_hint}")
        self.max_rows = max_rows
        self.rows_hint = rows_hint

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        rewritten = 0
        notes: list[str] = []
        for node, x, weight, bias in linear_nodes(graph):
            rows = _static_rows(x)
            if rows is None:
                rows = self.rows_hint
            if rows is None:
                notes.append(f"kept {node.name}: row count not static and no rows_hint given")
                continue
            if rows > self.max_rows:
                notes.append(f"kept {node.name}: {rows} rows > max_rows {self.max_rows}")
                continue
            with graph.inserting_before(node):
                nodes = _rewrite(graph, x, weight, bias)
            _annotate(nodes)
            result = nodes[-1]
            # The linear's own meta (stack trace, source) stays with the value it produced; its
            # example value too, which has the same shape, dtype and strides.
            result.meta.update(node.meta)
            node.replace_all_uses_with(result)
            graph.erase_node(node)
            rewritten += 1
        notes.insert(0, f"rewrote {rewritten} linear(s) as multiply-sum (max_rows {self.max_rows})")
        return PassResult(self.name, rewritten, tuple(notes))
