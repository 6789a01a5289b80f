"""Insert the communication of tensor parallelism into a captured graph.

The weights are already this rank's slices (the loader reads them so, by
compiled_engine/distributed/layout.py), so the traced model computes local pieces; this pass adds
what makes them whole again, module by module as the model's TP plan names them:
- after a row-parallel linear (o_proj, down_proj): `tp_all_reduce` of its partial output;
- a vocab-parallel embedding: ids are shifted into the rank's rows, ids outside them read row 0
  and are zeroed, then `tp_all_reduce` (one rank holds each id, so the sum is exact);
- after the vocab-parallel LM head: `tp_all_gather` of the logits, in rank order.
Column-parallel linears need nothing: their outputs stay split until a row-parallel one.
Nodes are matched to modules by the module stack Dynamo records on each node. Every module the
plan says must communicate has to be found exactly once per graph, or the pass raises:
a graph that silently skipped one would compute wrong logits.
"""

from __future__ import annotations

import operator
import re

import torch
from torch import fx

import compiled_engine.kernels  # noqa: F401  (registers the collective ops)
from compiled_engine.distributed.layout import (
    ROWWISE,
    VOCAB_EMBEDDING,
    VOCAB_HEAD,
    TensorParallelLayout,
)
from compiled_engine.errors import LoweringError
from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.graphs.passes.fake_values import set_fake_value
from compiled_engine.graphs.passes.fuse_linears import linear_operands
from compiled_engine.kernels.source_version import source_version

ALL_REDUCE = torch.ops.compiled_engine.tp_all_reduce.default
ALL_GATHER = torch.ops.compiled_engine.tp_all_gather.default
EMBEDDING_TARGETS = (torch.nn.functional.embedding, torch.ops.aten.embedding.default)

_ROOT = re.compile(r"^L\['[^']+'\]\.?")
_SUBMODULE = re.compile(r"_modules\['([^']+)'\]")
_INDEX = re.compile(r"\[(\d+)\]")


def module_path(node: fx.Node) -> str | None:
    """The dotted path (from the model's root) of the innermost module that made `node`."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, _ = list(stack.values())[-1]
    path = _ROOT.sub("", str(path))
    path = _SUBMODULE.sub(r"\1", path)
    return _INDEX.sub(r".\1", path).replace("..", ".").strip(".")


class ShardForTensorParallel:
    name = "tensor_parallel"
    version = source_version(
        __name__,
        "compiled_engine.graphs.passes.fake_values",
        "compiled_engine.graphs.passes.fuse_linears",
        "compiled_engine.distributed.layout",
        "compiled_engine.kernels.collectives",
    )

    def __init__(self, layout: TensorParallelLayout) -> None:
        self.layout = layout

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        seen: dict[str, int] = {}
        notes: list[str] = []
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            path = module_path(node)
            if path is None:
                continue
            style = self.layout.style(path)
            if style == ROWWISE and linear_operands(node) is not None:
                self._after(graph, node, ALL_REDUCE, ())
            elif style == VOCAB_HEAD and linear_operands(node) is not None:
                self._after(graph, node, ALL_GATHER, (self.layout.world_size,))
            elif style == VOCAB_EMBEDDING and node.target in EMBEDDING_TARGETS:
                self._vocab_embedding(graph, node)
            else:
                continue
            seen[path] = seen.get(path, 0) + 1
            notes.append(f"{style}: {path}")
        expected = dict(self.layout.communicating_modules)
        missing = sorted(set(expected) - set(seen))
        repeated = sorted(p for p, n in seen.items() if n != 1)
        if missing or repeated:
            raise LoweringError(
                f"tensor parallelism (rank {self.layout.rank} of {self.layout.world_size}): the graph "
                f"has no node for module(s) {missing} and more than one for {repeated}; their "
                "outputs would stay partial"
            )
        return PassResult(self.name, len(seen), tuple(notes))

    @staticmethod
    def _after(graph: fx.Graph, node: fx.Node, op, extra_args: tuple) -> None:
        users = list(node.users)
        with graph.inserting_after(node):
            collective = graph.call_function(op, (node, *extra_args))
        collective.meta.update({k: v for k, v in node.meta.items() if k == "nn_module_stack"})
        set_fake_value(collective)
        for user in users:
            user.replace_input_with(node, collective)

    def _vocab_embedding(self, graph: fx.Graph, node: fx.Node) -> None:
        ids, weight = node.args[0], node.args[1]
        start, size = self.layout.vocab_range
        users = list(node.users)
        created: list[fx.Node] = []
        with graph.inserting_before(node):
            local = graph.call_function(operator.sub, (ids, start))
            above = graph.call_function(torch.ge, (local, 0))
            below = graph.call_function(torch.lt, (local, size))
            valid = graph.call_function(torch.logical_and, (above, below))
            safe_ids = graph.call_function(torch.where, (valid, local, 0))
            created += [local, above, below, valid, safe_ids]
        for new in created:
            set_fake_value(new)
        # The lookup itself, on the rank's rows; padding_idx and the rest are training details.
        node.args = (safe_ids, weight)
        node.kwargs = {}
        set_fake_value(node)
        with graph.inserting_after(node):
            keep = graph.call_function(torch.unsqueeze, (valid, -1))
        set_fake_value(keep)
        with graph.inserting_after(keep):
            masked = graph.call_function(torch.where, (keep, node, 0.0))
        set_fake_value(masked)
        with graph.inserting_after(masked):
            summed = graph.call_function(ALL_REDUCE, (masked,))
        set_fake_value(summed)
        for user in users:
            user.replace_input_with(node, summed)
