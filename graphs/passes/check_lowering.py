"""Refuse a graph that still contains attention not lowered to the paged-attention op.

Attention left as SDPA (any variant), as a fused flash/efficient kernel, or spelled out as
`softmax(q @ k^T)` would run without the KV cache: the engine would produce plausible-looking
but wrong tokens. So any such node is a hard `LoweringError` naming the model class, the node
and the source line it came from. The number of paged-attention calls must also equal the
number of attention layers (one KV cache each), or some layer would read another's cache.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import fx

from compiled_engine.errors import LoweringError
from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.graphs.passes.lower_sdpa import (
    PAGED_ATTENTION_TARGETS,
    SDPA_TARGETS,
    UNLOWERED_REASON_META,
)
from compiled_engine.kernels.source_version import source_version

_FUSED_ATTENTION_OP_NAMES = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_attention_math_for_mps",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
_FUSED_ATTENTION_TARGETS = tuple(
    getattr(torch.ops.aten, name) for name in _FUSED_ATTENTION_OP_NAMES if hasattr(torch.ops.aten, name)
)
_ATTENTION_HOPS = tuple(
    getattr(torch.ops.higher_order, name)
    for name in ("flex_attention",)
    if hasattr(torch.ops.higher_order, name)
)

_SOFTMAX_NAMES = frozenset({"softmax", "_softmax", "safe_softmax", "_safe_softmax"})
_MATMUL_NAMES = frozenset({"matmul", "bmm", "mm", "baddbmm", "einsum", "__matmul__", "__rmatmul__"})
# Ops that shape attention scores between q·kᵀ and the softmax (scale, mask, cap, cast, view).
_SCORE_SHAPING_NAMES = frozenset(
    {
        "mul",
        "div",
        "add",
        "sub",
        "truediv",
        "neg",
        "tanh",
        "masked_fill",
        "where",
        "clamp",
        "to",
        "float",
        "half",
        "bfloat16",
        "type",
        "_to_copy",
        "contiguous",
        "view",
        "reshape",
        "transpose",
        "permute",
        "expand",
        "__mul__",
        "__truediv__",
        "__add__",
        "__sub__",
        "__radd__",
        "__rmul__",
        "__neg__",
    }
)
_SCORE_WALK_LIMIT = 16


def _op_name(node: fx.Node) -> str | None:
    """A comparable name for what a node computes: method name, function name or aten op name."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__.split(".")[-1]
    return getattr(target, "__name__", None)


def _matches(node: fx.Node, targets: tuple) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target.overloadpacket in targets:
        return True
    return target in targets


def _is_weight_placeholder(node: fx.Node) -> bool:
    # Dynamo marks module parameters and buffers as static inputs; anything else is data.
    if node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type") is not None:
        return True
    return isinstance(node.meta.get("example_value"), torch.nn.Parameter) or node.type is torch.nn.Parameter


def _data_dependent_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value depends on a step input tensor (not only on weights, buffers or sizes)."""
    tainted: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            # No example value: a graph from fx.symbolic_trace, whose placeholders are all inputs.
            value = node.meta.get("example_value", node.meta.get("val"))
            is_tensor = value is None or isinstance(value, torch.Tensor)
            if is_tensor and not _is_weight_placeholder(node):
                tainted.add(node)
        elif any(i in tainted for i in node.all_input_nodes):
            tainted.add(node)
    return tainted


def _matmul_operands(node: fx.Node) -> list[fx.Node]:
    args = list(node.args)
    if _op_name(node) == "einsum":
        args = args[1:]
        if len(args) == 1 and isinstance(args[0], (list, tuple)):
            args = list(args[0])
    elif _op_name(node) == "baddbmm":
        args = args[1:3]
    return [a for a in args if isinstance(a, fx.Node)]


def _score_product(softmax: fx.Node, data_nodes: set[fx.Node]) -> fx.Node | None:
    """The activation×activation matmul feeding `softmax` through score-shaping ops, if any."""
    frontier = [a for a in softmax.args[:1] if isinstance(a, fx.Node)]
    seen: set[fx.Node] = set()
    for _ in range(_SCORE_WALK_LIMIT):
        next_frontier = []
        for node in frontier:
            if node in seen:
                continue
            seen.add(node)
            name = _op_name(node)
            if name in _MATMUL_NAMES:
                operands = _matmul_operands(node)
                if sum(o in data_nodes for o in operands) >= 2:
                    return node
            elif name in _SCORE_SHAPING_NAMES:
                next_frontier.extend(node.all_input_nodes)
        frontier = next_frontier
    return None


def _source_line(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    # The innermost frame: its 'File "...", line N' line and the code line (minus caret marks).
    lines = [line.strip() for line in trace.splitlines() if line.strip().strip("^~")]
    return " | ".join(lines[-2:]) if lines else "no source location recorded"


def _describe(node: fx.Node, why: str) -> str:
    return f"node {node.name!r} ({node.op} {_op_name(node) or node.target}): {why}; at {_source_line(node)}"


class CheckLowering:
    """Raises LoweringError unless every attention in the graph is the paged-attention op."""

    name = "check_lowering"
    version = source_version(__name__, "compiled_engine.graphs.passes.lower_sdpa")

    def __init__(self, model_class_name: str, expected_attention_layers: int | None = None) -> None:
        self.model_class_name = model_class_name
        self.expected_attention_layers = expected_attention_layers

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        problems = list(self._unlowered(gm.graph.nodes, gm.graph))
        if problems:
            raise LoweringError(
                f"{self.model_class_name}: captured graph still contains attention that is not the "
                f"paged-attention op, so it would ignore the KV cache:\n  "
                + "\n  ".join(problems)
                + "\nServe it through transformers' AttentionInterface (route a), or make its SDPA "
                "call match graphs/passes/lower_sdpa.py (route b)."
            )
        paged = sum(1 for n in gm.graph.nodes if _matches(n, PAGED_ATTENTION_TARGETS))
        expected = self.expected_attention_layers
        if expected is not None and paged != expected:
            raise LoweringError(
                f"{self.model_class_name}: captured graph has {paged} paged-attention calls but the "
                f"model has {expected} attention layers (one KV cache each)"
            )
        return PassResult(self.name, paged, (f"{paged} paged-attention call(s), no other attention",))

    def _unlowered(self, nodes: Iterable[fx.Node], graph: fx.Graph) -> Iterable[str]:
        data_nodes: set[fx.Node] | None = None
        for node in nodes:
            if _matches(node, SDPA_TARGETS):
                reason = node.meta.get(UNLOWERED_REASON_META)
                why = "scaled_dot_product_attention" + (f" (lower_sdpa: {reason})" if reason else "")
                yield _describe(node, why)
            elif _matches(node, _FUSED_ATTENTION_TARGETS) or _matches(node, _ATTENTION_HOPS):
                yield _describe(node, "fused attention kernel")
            elif _op_name(node) in _SOFTMAX_NAMES:
                if data_nodes is None:
                    data_nodes = _data_dependent_nodes(graph)
                product = _score_product(node, data_nodes)
                if product is not None:
                    yield _describe(node, f"softmax over q·kᵀ scores from {product.name!r}")
