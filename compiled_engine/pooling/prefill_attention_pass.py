"""A pooling graph's attention calls become `prefill_attention`: no KV cache, flash-style maths.

A pooling step holds every sequence whole, from its first token, and keeps nothing (body_runner.py),
so writing keys and values into a paged cache only to read them back is wasted work, and the paged
ops' CPU kernel attends one query row at a time. This rewrite, run on each graph the pooling body
captures before it is compiled, turns every paged-attention call (any backend's op: the pass
pipeline may already have retargeted it) into

    prefill_attention(query, key, value, query_start_loc, scale, causal)

(kernels/prefill_attention.py). Calls with a sliding window or soft-capping keep the paged op,
which implements them; the cache and its metadata then stay in use for those layers only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

import compiled_engine.kernels.prefill_attention  # noqa: F401  (registers the op)
from compiled_engine.graphs.pass_manager import PassResult

_PAGED_OP_NAMES = ("paged_attention", "paged_attention_cpu", "paged_attention_triton")


def _paged_targets() -> set[Any]:
    import compiled_engine.kernels  # noqa: F401  (registers the ops)

    namespace = torch.ops.compiled_engine
    packets = [getattr(namespace, name) for name in _PAGED_OP_NAMES if hasattr(namespace, name)]
    # Captured calls name the packet (the torch op as the model calls it) or, once the pipeline
    # retargeted them, the backend op's default overload.
    return {*packets, *(packet.default for packet in packets)}


def _arguments(node: fx.Node) -> dict[str, Any]:
    """The call's arguments by schema name, defaults filled in (the cpu op has no `causal`)."""
    target: Any = node.target
    schema = (target.default if isinstance(target, torch._ops.OpOverloadPacket) else target)._schema
    values: dict[str, Any] = {}
    for index, argument in enumerate(schema.arguments):
        if index < len(node.args):
            values[argument.name] = node.args[index]
        elif argument.name in node.kwargs:
            values[argument.name] = node.kwargs[argument.name]
        else:
            values[argument.name] = argument.default_value
    return values


def use_prefill_attention(gm: fx.GraphModule) -> PassResult:
    """Rewrite `gm`'s paged-attention calls in place (then recompile it); counts the rewrites."""
    targets = _paged_targets()
    rewritten = 0
    kept = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in targets:
            continue
        args = _arguments(node)
        if args["sliding_window"] > 0 or args["softcap"] > 0:
            kept += 1
            continue
        with gm.graph.inserting_before(node):
            replacement = gm.graph.call_function(
                torch.ops.compiled_engine.prefill_attention.default,
                (args["query"], args["key"], args["value"], args["query_start_loc"], args["scale"]),
                {"causal": args.get("causal", True)},
            )
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    notes = [f"{rewritten} attention call(s) now run prefill_attention"]
    if kept:
        notes.append(f"{kept} call(s) with a sliding window or soft-capping keep the paged op")
    return PassResult("prefill_attention", rewritten, tuple(notes))
