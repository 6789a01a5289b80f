"""Horizontal GEMM fusion: sibling linears over one input become one linear and a split.

Why: q/k/v projections (and an MLP's gate/up) each read the same activation. Run apart they
are three GEMMs that each stream the activation and pay their own launch/threading cost; for
decode (a handful of rows) each is a GEMV bound by reading its weight, and small ones waste
most of the machine. One GEMM over the weights concatenated along the output dimension does
the same maths in one pass.

Rewrite, for linears `linear(x, W_i, b_i)` that read the same node `x` with constant weights
(`get_attr`, see graphs/passes/freeze_parameters.py) of one dtype, device and input size:

    fused = linear(x, cat(W_1..W_n), cat(b_1..b_n))   # concatenated here, once, not per step
    q, k, v = split(fused, [N_1..N_n], dim=-1)
    each user of linear_i reads part_i.contiguous()

Output sizes may differ (GQA: q wider than k/v). A missing bias among biased siblings is
zeros. `.contiguous()` gives every user the exact layout it had before (a split part is a
strided view); in eager it is one small copy per part, under Inductor it fuses into the
consumer. Linears whose weight is a graph input or whose dtypes differ are left alone.

Memory: the concatenated weights are new tensors, and the model keeps its own. Dynamo traces
several graphs per model (one per shape specialisation), so pass one `FusedWeightCache` to
every FuseLinears of a model: the graphs then share one copy. (Re-pointing the model's
parameters into the fused tensor inside the pass would save the second copy, but breaks
Inductor: AOTAutograd re-fakes each parameter from the metadata Dynamo recorded before the
pass, and a moved storage offset no longer matches.)
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from compiled_engine.graphs.constant_recipes import concat_recipe, recipe_of, record_recipe, zero_rows_recipe
from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.graphs.passes.fake_values import fake_evaluation
from compiled_engine.graphs.passes.freeze_parameters import register_constant
from compiled_engine.kernels.source_version import source_version

LINEAR_TARGETS = (torch._C._nn.linear, torch.ops.aten.linear, torch.ops.aten.linear.default)

FUSED_ATTRIBUTE_PREFIX = "fused_"


@dataclass(frozen=True)
class _Linear:
    node: fx.Node
    input: fx.Node
    weight: torch.Tensor
    weight_node: fx.Node
    bias: torch.Tensor | None


@dataclass(frozen=True)
class _FusedWeights:
    sources: tuple[torch.Tensor | None, ...]  # kept alive so the ids in the cache key stay valid
    weight: torch.Tensor
    bias: torch.Tensor | None


class FusedWeightCache:
    """Concatenated weights keyed by the identity of their sources, shared across graphs."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, ...], _FusedWeights] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get_or_build(
        self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
    ) -> _FusedWeights:
        sources = (*weights, *biases)
        key = tuple(id(t) for t in sources)
        entry = self._entries.get(key)
        if entry is not None and all(a is b for a, b in zip(entry.sources, sources, strict=True)):
            return entry
        weight, bias = _concatenate(weights, biases)
        entry = _FusedWeights(sources, weight, bias)
        self._entries[key] = entry
        return entry


def _concatenate(
    weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    with torch.no_grad():
        weight = torch.cat([w.detach() for w in weights], dim=0)
        if all(b is None for b in biases):
            return weight, None
        # A sibling without bias contributes zeros, so one biased GEMM serves all.
        parts = [
            b.detach() if b is not None else w.new_zeros(w.shape[0])
            for w, b in zip(weights, biases, strict=True)
        ]
        return weight, torch.cat(parts)


def linear_operands(node: fx.Node) -> tuple[Any, Any, Any] | None:
    """(input, weight, bias) of a linear node, however they were passed; None for other nodes."""
    if node.op != "call_function" or node.target not in LINEAR_TARGETS:
        return None
    params = ("input", "weight", "bias")
    values = dict(zip(params, node.args, strict=False))
    values.update({k: v for k, v in node.kwargs.items() if k in params})
    if "input" not in values or "weight" not in values:
        return None
    return values["input"], values["weight"], values.get("bias")


def linear_nodes(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node, Any, Any]]:
    """(node, input, weight, bias) of every linear whose input is a node, in graph order.

    A list, taken up front, so that callers may rewrite the graph as they go through it.
    """
    found = []
    for node in list(graph.nodes):
        operands = linear_operands(node)
        if operands is not None and isinstance(operands[0], fx.Node):
            found.append((node, *operands))
    return found


def constant_tensor(gm: fx.GraphModule, node: Any) -> torch.Tensor | None:
    """The tensor a `get_attr` node reads, or None when `node` is anything else."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


def _constant_linear(gm: fx.GraphModule, node: fx.Node) -> tuple[_Linear | None, str | None]:
    operands = linear_operands(node)
    if operands is None:
        return None, None
    x, weight_node, bias_node = operands
    if not isinstance(x, fx.Node):
        return None, None
    weight = constant_tensor(gm, weight_node)
    if weight is None:
        return None, f"{node.name}: weight is not a constant (run freeze_parameters first)"
    bias = constant_tensor(gm, bias_node)
    if bias_node is not None and bias is None:
        return None, f"{node.name}: bias is not a constant"
    if weight.dim() != 2 or (bias is not None and (bias.dim() != 1 or bias.dtype != weight.dtype)):
        return None, f"{node.name}: unusual weight/bias shapes or dtypes"
    return _Linear(node, x, weight, weight_node, bias), None


def _record_fused_recipes(
    gm: fx.GraphModule, siblings: list[_Linear], weight_name: str, bias_name: str | None
) -> None:
    """Record how to rebuild the fused tensors from the model (graphs/constant_recipes.py).

    Only when every part has a recipe itself (weights frozen by freeze_parameters): a graph
    with a constant lacking one is simply never saved to the compile cache.
    """
    weights = [w for s in siblings if (w := recipe_of(gm, str(s.weight_node.target))) is not None]
    if len(weights) != len(siblings):
        return
    record_recipe(gm, weight_name, concat_recipe(weights))
    if bias_name is None:
        return
    biases = []
    for sibling, weight in zip(siblings, weights, strict=True):
        if sibling.bias is None:
            biases.append(zero_rows_recipe(weight))
            continue
        operands = linear_operands(sibling.node)
        assert operands is not None, "a fused sibling is a linear"
        bias_node = operands[2]
        bias = recipe_of(gm, str(bias_node.target))
        if bias is None:
            return
        biases.append(bias)
    record_recipe(gm, bias_name, concat_recipe(biases))


def _fake(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


class FuseLinears:
    """Sibling linears with constant weights over one input become one linear plus a split."""

    name = "fuse_linears"
    version = source_version(
        __name__,
        "compiled_engine.graphs.constant_recipes",
        "compiled_engine.graphs.passes.fake_values",
        "compiled_engine.graphs.passes.freeze_parameters",
    )

    def __init__(self, weight_cache: FusedWeightCache | None = None) -> None:
        self.weight_cache = weight_cache if weight_cache is not None else FusedWeightCache()

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        groups: dict[tuple, list[_Linear]] = {}
        notes: list[str] = []
        for node in gm.graph.nodes:
            linear, skipped = _constant_linear(gm, node)
            if skipped:
                notes.append(skipped)
            if linear is None:
                continue
            w = linear.weight
            groups.setdefault((linear.input, w.dtype, w.device, w.shape[1]), []).append(linear)
        fused_groups = replaced = 0
        for siblings in groups.values():
            if len(siblings) < 2:
                continue
            self._fuse(gm, siblings)
            fused_groups += 1
            replaced += len(siblings)
            notes.append(f"fused {[s.node.name for s in siblings]} ({[s.weight.shape[0] for s in siblings]})")
        notes.insert(0, f"{replaced} linear(s) fused into {fused_groups}")
        return PassResult(self.name, replaced, tuple(notes))

    def _fuse(self, gm: fx.GraphModule, siblings: list[_Linear]) -> None:
        graph = gm.graph
        fused = self.weight_cache.get_or_build([s.weight for s in siblings], [s.bias for s in siblings])
        sizes = [s.weight.shape[0] for s in siblings]
        base = FUSED_ATTRIBUTE_PREFIX + siblings[0].weight_node.name
        weight_name = register_constant(gm, base + "_weight", fused.weight)
        bias_name = register_constant(gm, base + "_bias", fused.bias) if fused.bias is not None else None
        _record_fused_recipes(gm, siblings, weight_name, bias_name)
        x = siblings[0].input
        # The example values' own mode: the one in the tracing context may be another instance.
        fake_mode = getattr(_fake(x), "fake_mode", None)

        with graph.inserting_before(siblings[0].node):
            weight_node = graph.get_attr(weight_name)
            bias_node = graph.get_attr(bias_name) if bias_name is not None else None
            fused_node = graph.call_function(torch._C._nn.linear, (x, weight_node, bias_node))
            split_node = graph.call_function(torch.split, (fused_node, sizes), {"dim": -1})
            parts = [graph.call_function(operator.getitem, (split_node, i)) for i in range(len(sizes))]
            contiguous = [graph.call_method("contiguous", (part,)) for part in parts]

        if fake_mode is not None:
            with fake_evaluation(fake_mode):
                fake_weight = fake_mode.from_tensor(fused.weight, static_shapes=True)
                fake_bias = (
                    None if fused.bias is None else fake_mode.from_tensor(fused.bias, static_shapes=True)
                )
                fake_out = torch._C._nn.linear(_fake(x), fake_weight, fake_bias)
                fake_parts = torch.split(fake_out, sizes, dim=-1)
            weight_node.meta["example_value"] = fake_weight
            if bias_node is not None:
                bias_node.meta["example_value"] = fake_bias
            fused_node.meta["example_value"] = fake_out
            split_node.meta["example_value"] = fake_parts
            for part, fake_part in zip(parts, fake_parts, strict=True):
                part.meta["example_value"] = fake_part

        for sibling, replacement in zip(siblings, contiguous, strict=True):
            # `.contiguous()` of a part has exactly the layout the sibling's output had.
            replacement.meta.update({k: v for k, v in sibling.node.meta.items() if k != "tensor_dict"})
            sibling.node.replace_all_uses_with(replacement)
            graph.erase_node(sibling.node)
