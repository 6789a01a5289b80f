"""Remove nodes that provably return their input unchanged.

Why: HF code written for every dtype and device leaves calls that do nothing for the one a
graph is captured at: `x.to(torch.float32)` on fp32 activations (RMSNorm does two per call),
`cos * attention_scaling` with a scaling of 1.0, `.contiguous()` on a fresh tensor. Each is
a graph node that the later passes must walk and that, eagerly, costs a dispatch and
sometimes a copy. Inductor folds most of them too; dropping them first keeps the graph the
other passes (and a person reading a dump) see short.

Every rule is proved from the example values Dynamo records on each node
(`meta["example_value"]`, fake tensors whose shapes, strides, dtypes and storages mirror the
real run); a node without one is never touched. Sizes are compared with
`statically_known_true`, which never adds a guard: a symbolic size counts as equal only when
it is the same symbol. The rules:

- identity calls, which return `self` at run time: `x.contiguous()` when x is provably
  contiguous; `x.to(...)`, `x.float()`-style casts and `x.type_as(y)` when dtype and device
  already match and no copy or memory format is asked for.
- `x.view(shape)` / `x.reshape(shape)` to x's own shape and dtype: a second view of the same
  memory with the same strides. Kept when x or the view has an in-place user (an in-place
  metadata change such as `t_()` would then hit one and not the other).
- `x * 1`, `1 * x`, `x / 1`, `x - 0`, and `x + 0` for non-floating x, and `x.clone()`: new
  tensors equal to x, with x's dtype, shape and strides. Removing them makes the users read
  x itself, so each is kept when x's or the result's memory is written anywhere in the graph
  (in-place ops, `out=`, ops that declare a mutated argument), or the result is a graph
  output. `x + 0` on floats is kept: -0.0 + 0 is +0.0.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef

from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.graphs.passes.freeze_parameters import mutated_arguments
from compiled_engine.kernels.source_version import source_version

_CAST_METHODS = {
    "float": torch.float32,
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "int": torch.int32,
    "long": torch.int64,
    "bool": torch.bool,
}
_VIEW_METHODS = ("view", "reshape")
_MULTIPLY = (operator.mul, torch.mul)
_DIVIDE = (operator.truediv, torch.div)
_ADD = (operator.add, torch.add)
_SUBTRACT = (operator.sub, torch.sub)


def _value(node: Any) -> Any:
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def _tensor(node: Any) -> torch.Tensor | None:
    value = _value(node)
    return value if isinstance(value, torch.Tensor) else None


def _same_sizes(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b, strict=True))


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and _same_sizes(tuple(a.shape), tuple(b.shape))
        and _same_sizes(tuple(a.stride()), tuple(b.stride()))
    )


def _definitely_contiguous(t: torch.Tensor) -> bool:
    expected: Any = 1
    for size, stride in reversed(list(zip(t.shape, t.stride(), strict=True))):
        if statically_known_true(size == 1):
            continue  # any stride is fine for a dimension of one
        if not statically_known_true(stride == expected):
            return False
        expected = expected * size
    return True


def _is_in_place_user(user: fx.Node, node: fx.Node) -> bool:
    return node in mutated_arguments(user)


class _Facts:
    """What the rules need to know about the whole graph: which memory is ever written."""

    def __init__(self, graph: fx.Graph) -> None:
        self.written: set[StorageWeakRef] = set()
        self.writes_unknown = False
        for node in graph.nodes:
            for target in mutated_arguments(node):
                value = _tensor(target)
                if value is None:
                    self.writes_unknown = True  # cannot tell what memory it writes
                else:
                    self.written.add(StorageWeakRef(value.untyped_storage()))

    def is_written(self, value: torch.Tensor) -> bool:
        return self.writes_unknown or StorageWeakRef(value.untyped_storage()) in self.written


def _is_output(node: fx.Node) -> bool:
    return any(user.op == "output" for user in node.users)


def _self_call(node: fx.Node) -> fx.Node | None:
    """The tensor a method-style call (`x.f(...)` or `Tensor.f(x, ...)`) is called on."""
    if node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def _contiguous_noop(node: fx.Node) -> fx.Node | None:
    if node.op != "call_method" or node.target != "contiguous" or len(node.args) != 1:
        return None
    if node.kwargs.get("memory_format", torch.contiguous_format) is not torch.contiguous_format:
        return None
    x = _self_call(node)
    value = _tensor(x)
    return x if value is not None and _definitely_contiguous(value) else None


def _cast_noop(node: fx.Node) -> fx.Node | None:
    if node.op != "call_method":
        return None
    x = _self_call(node)
    value = _tensor(x)
    if value is None:
        return None
    if node.target in _CAST_METHODS:
        plain = len(node.args) == 1 and not node.kwargs
        return x if plain and value.dtype == _CAST_METHODS[node.target] else None
    if node.target == "type_as":
        other = _tensor(node.args[1]) if len(node.args) == 2 else None
        return x if other is not None and other.dtype == value.dtype and not node.kwargs else None
    if node.target != "to":
        return None
    kwargs = dict(node.kwargs)
    if (
        kwargs.pop("copy", False)
        or kwargs.pop("memory_format", torch.preserve_format) is not torch.preserve_format
    ):
        return None
    kwargs.pop("non_blocking", None)
    requested = list(node.args[1:])
    requested.extend(kwargs.pop(key) for key in ("dtype", "device") if key in kwargs)
    if kwargs:
        return None
    for item in requested:
        if isinstance(item, torch.dtype) and item == value.dtype:
            continue
        if isinstance(item, (torch.device, str)) and torch.device(item) == value.device:
            continue
        return None  # another tensor, a positional bool, or a real conversion
    return x


def _view_noop(node: fx.Node) -> fx.Node | None:
    is_method = node.op == "call_method" and node.target in _VIEW_METHODS
    is_function = node.op == "call_function" and node.target in (torch.reshape, torch.Tensor.view)
    if not (is_method or is_function):
        return None
    x = _self_call(node)
    if x is None:
        return None
    before, after = _tensor(x), _tensor(node)
    if before is None or after is None or not _same_layout(before, after):
        return None
    if _is_output(node) or any(_is_in_place_user(u, n) for n in (x, node) for u in n.users):
        return None
    return x


def _scalar_operand(node: fx.Node, operators: tuple, identity: float, either_side: bool) -> fx.Node | None:
    if node.op != "call_function" or node.target not in operators or node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    if isinstance(a, fx.Node) and type(b) in (int, float) and b == identity:
        return a
    if either_side and isinstance(b, fx.Node) and type(a) in (int, float) and a == identity:
        return b
    return None


def _arithmetic_noop(node: fx.Node) -> fx.Node | None:
    x = (
        _scalar_operand(node, _MULTIPLY, 1, either_side=True)
        or _scalar_operand(node, _DIVIDE, 1, either_side=False)
        or _scalar_operand(node, _SUBTRACT, 0, either_side=False)
    )
    if x is None:
        x = _scalar_operand(node, _ADD, 0, either_side=True)
        value = _tensor(x)
        if value is not None and value.is_floating_point():
            return None  # -0.0 + 0 == +0.0: not the identity on floats
    return x


def _clone_noop(node: fx.Node) -> fx.Node | None:
    is_clone = (node.op == "call_method" and node.target == "clone") or (
        node.op == "call_function" and node.target is torch.clone
    )
    if not is_clone or len(node.args) != 1:
        return None
    if node.kwargs.get("memory_format", torch.preserve_format) is not torch.preserve_format:
        return None
    return _self_call(node)


# (rule name, matcher, result is a fresh tensor that must be shown to be never written)
_RULES: tuple[tuple[str, Callable[[fx.Node], fx.Node | None], bool], ...] = (
    ("contiguous", _contiguous_noop, False),
    ("cast", _cast_noop, False),
    ("view", _view_noop, False),
    ("arithmetic", _arithmetic_noop, True),
    ("clone", _clone_noop, True),
)


class NoopElimination:
    """Drops identity casts, same-shape views, `x * 1`-style arithmetic and unneeded clones."""

    name = "noop_elimination"
    version = source_version(__name__, "compiled_engine.graphs.passes.freeze_parameters")

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        facts = _Facts(graph)
        counts: dict[str, int] = {}
        for node in list(graph.nodes):
            for rule, match, fresh_result in _RULES:
                x = match(node)
                if x is None:
                    continue
                if fresh_result and not self._fresh_copy_removable(node, x, facts):
                    break
                node.replace_all_uses_with(x)
                graph.erase_node(node)
                counts[rule] = counts.get(rule, 0) + 1
                break
        total = sum(counts.values())
        notes = tuple(f"{rule}: {count}" for rule, count in counts.items())
        return PassResult(self.name, total, notes)

    @staticmethod
    def _fresh_copy_removable(node: fx.Node, x: fx.Node, facts: _Facts) -> bool:
        before, after = _tensor(x), _tensor(node)
        if before is None or after is None or not _same_layout(before, after):
            return False
        if _is_output(node):
            return False
        return not (facts.is_written(before) or facts.is_written(after))
