"""Last-token and CLS pooling: the last layer runs only at the pooled rows.

A pooling graph returns `hidden[0].index_select(0, logits_indices)` (body_runner.py): with LAST or
CLS pooling one row per sequence. Everything after the last attention call (its output
projection, the residual add, the MLP, the final norm) works row by row, so its other rows are
computed only to be dropped; for a 4-layer body that is most of a quarter of the step's FLOPs.
This rewrite, after `use_prefill_attention`, moves the row selection up to the last attention:

    prefill_attention(q, k, v, starts, ...)  ->  prefill_attention_rows(q, k, v, starts, rows, ...)

and gives every full-length tensor the tail reads from outside (the residual stream) an
`index_select` of the same rows, and every reshape that names the token count the row count.
The keys and values (and the earlier layers) still cover every token: the selected queries attend
over their whole sequences.

It rewrites only what it can prove row-wise: each node between the last attention and the output
must be one of the known row-wise calls, keep the token dimension exactly once in its result, and
feed nothing but the tail; reductions and splits must be over the last dimension. Anything else
leaves the graph as it was (the pooled embeddings are the same either way, only slower).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

import compiled_engine.kernels.prefill_attention  # noqa: F401  (registers the ops)
from compiled_engine.graphs.pass_manager import PassResult

NAME = "pooled_rows"

_ROWWISE_FUNCTIONS: set[Any] = {
    torch._C._nn.linear,
    torch.nn.functional.linear,
    operator.add,
    operator.mul,
    operator.sub,
    operator.truediv,
    operator.neg,
    operator.getitem,
    torch.add,
    torch.mul,
    torch.rsqrt,
    torch.tanh,
    torch.nn.functional.silu,
    torch.nn.functional.gelu,
    torch.nn.functional.relu,
    torch.nn.functional.layer_norm,
    torch.nn.functional.dropout,
    torch.functional.split,
    torch.split,
}
_ROWWISE_METHODS = {
    "pow",
    "reshape",
    "view",
    "unsqueeze",
    "contiguous",
    "to",
    "float",
    "type_as",
    "mean",
    "split",
}
# Calls that reduce or split along a dimension: only the last one is row-wise.
_LAST_DIM_ONLY = {"mean", "split", torch.functional.split, torch.split}


def _refuse(reason: str) -> PassResult:
    return PassResult(NAME, 0, (f"kept every row: {reason}",))


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _same_size(a: Any, b: Any) -> bool:
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return False


def _token_dims(value: Any, tokens: torch.SymInt) -> list[int]:
    return [i for i, size in enumerate(value.shape) if _same_size(size, tokens)]


def _dim_argument(node: fx.Node) -> Any:
    if "dim" in node.kwargs:
        return node.kwargs["dim"]
    position = 2 if node.op == "call_function" and node.target is not operator.getitem else 1
    if node.op == "call_method":
        position = 1 if node.target == "mean" else 2
    return node.args[position] if len(node.args) > position else None


def select_pooled_rows(gm: fx.GraphModule) -> PassResult:
    """Rewrite `gm` (in place, then recompiled) so its tail after the last attention runs on the
    pooled rows only; the result says whether it did and, if not, why."""
    graph = gm.graph
    (output,) = [n for n in graph.nodes if n.op == "output"]
    result = output.args[0]
    select = result[0] if isinstance(result, tuple | list) and len(result) == 1 else result
    if not (
        isinstance(select, fx.Node)
        and select.op == "call_method"
        and select.target == "index_select"
        and len(select.args) == 3
        and select.args[1] == 0
    ):
        return _refuse("the graph does not end in index_select(hidden, 0, rows)")
    hidden, _, rows = select.args
    if not isinstance(hidden, fx.Node) or not isinstance(rows, fx.Node):
        return _refuse("the selection's operands are not graph values")
    packet = torch.ops.compiled_engine.prefill_attention
    attention = [n for n in graph.nodes if n.op == "call_function" and n.target in (packet, packet.default)]
    if not attention:
        return _refuse("no prefill_attention call")
    last = attention[-1]
    tokens = _value(last).shape[0] if _value(last) is not None else None
    if not isinstance(tokens, torch.SymInt):
        return _refuse("the token count is not symbolic in the traced graph")
    hidden_value = _value(hidden)
    if not isinstance(hidden_value, torch.Tensor) or _token_dims(hidden_value, tokens) != [0]:
        return _refuse("the selection does not pick rows of the token dimension")

    # The tail: nodes downstream of the last attention that the selection reads.
    downstream: set[fx.Node] = set()
    for node in graph.nodes:
        if node is last or any(isinstance(a, fx.Node) and a in downstream for a in node.all_input_nodes):
            downstream.add(node)
    tail: set[fx.Node] = set()
    stack = [hidden]
    while stack:
        node = stack.pop()
        if node in tail or node not in downstream:
            continue
        tail.add(node)
        stack.extend(node.all_input_nodes)
    if hidden not in tail:
        return _refuse("the pooled hidden states do not depend on the last attention")

    token_symbols: list[fx.Node] = []
    for node in tail:
        if any(user not in tail and user is not select for user in node.users):
            return _refuse(f"{node.name} is read outside the pooled tail")
        if node is last:
            continue
        known = (
            node.target in _ROWWISE_FUNCTIONS
            if node.op == "call_function"
            else node.target in _ROWWISE_METHODS
        )
        if node.op not in ("call_function", "call_method") or not known:
            return _refuse(f"{node.name} ({node.target}) is not known to be row-wise")
        if node.target in _LAST_DIM_ONLY and _dim_argument(node) not in (-1, None):
            return _refuse(f"{node.name} reduces or splits along dimension {_dim_argument(node)}")
        value = _value(node)
        if isinstance(value, torch.Tensor) and len(_token_dims(value, tokens)) != 1:
            return _refuse(f"{node.name} does not keep the token dimension exactly once")
        for arg in node.all_input_nodes:
            arg_value = _value(arg)
            if isinstance(arg_value, torch.SymInt):
                if not _same_size(arg_value, tokens):
                    return _refuse(f"{node.name} reads the size {arg.name}, not the token count")
                token_symbols.append(arg)
            elif isinstance(arg_value, torch.Tensor) and arg not in tail:
                if len(_token_dims(arg_value, tokens)) > 1:
                    return _refuse(f"{arg.name} has the token count in more than one dimension")
            elif arg_value is None and arg not in tail and arg.op != "get_attr":
                return _refuse(f"{arg.name} has no traced value to check")

    # Rewrite: the last attention at the rows, outside full-length operands selected, sizes renamed.
    with graph.inserting_before(last):
        row_count = graph.call_function(torch.ops.aten.sym_size.int, (rows, 0))
    query, key, value_, starts, scale = last.args[:5]
    with graph.inserting_before(last):
        attended = graph.call_function(
            torch.ops.compiled_engine.prefill_attention_rows.default,
            (query, key, value_, starts, rows, scale),
            dict(last.kwargs),
        )
    last.replace_all_uses_with(attended)
    graph.erase_node(last)
    selected: dict[tuple[fx.Node, int], fx.Node] = {}
    for node in list(graph.nodes):
        if node not in tail or node is last:
            continue
        for arg in list(node.all_input_nodes):
            if arg in tail or arg is attended:
                continue
            arg_value = _value(arg)
            if arg in token_symbols:
                node.replace_input_with(arg, row_count)
            elif isinstance(arg_value, torch.Tensor) and _token_dims(arg_value, tokens):
                (dim,) = _token_dims(arg_value, tokens)
                if (arg, dim) not in selected:
                    with graph.inserting_before(node):
                        selected[(arg, dim)] = graph.call_method("index_select", (arg, dim, rows))
                node.replace_input_with(arg, selected[(arg, dim)])
    select.replace_all_uses_with(hidden)
    graph.erase_node(select)
    graph.lint()
    gm.recompile()
    return PassResult(
        NAME, len(tail), (f"{len(tail)} node(s) after the last attention now run on the pooled rows only",)
    )
