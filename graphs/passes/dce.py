"""Dead-code elimination, run once the rewriting passes are done.

Two jobs:
- Remove the `step_metadata` marker (graphs/step_inputs.py). It exists only to keep the
  attention metadata as graph inputs until the lowering pass has read them; after lowering
  it is dead weight, and left in it would reach Inductor as an opaque call every step.
- Remove whatever lowering left without users: for SDPA models, the whole [T, T] mask
  subgraph, which the paged op does not need.

fx's own `eliminate_dead_code` keeps nodes whose op schema is mutable (so the paged-attention
op, which writes the KV cache, always survives) but treats an in-place *method* call such as
`x.add_(y)` as pure and drops it when its result is unused, although its effect on `x` is
still needed. Dynamo graphs contain such calls, so we extend the impurity test to them.
"""

from __future__ import annotations

from torch import fx

from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.graphs.step_inputs import STEP_METADATA_TARGETS
from compiled_engine.kernels.source_version import source_version


def _is_in_place(node: fx.Node) -> bool:
    if node.op == "call_method":
        return str(node.target).endswith("_")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_")
    return False


def _is_impure(node: fx.Node) -> bool:
    return node.is_impure() or _is_in_place(node)


class DeadCodeElimination:
    name = "dce"
    version = source_version(__name__, "compiled_engine.graphs.step_inputs")

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        before = len(graph.nodes)
        markers = 0
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in STEP_METADATA_TARGETS:
                graph.erase_node(node)
                markers += 1
        graph.eliminate_dead_code(is_impure_node=_is_impure)
        removed = before - len(graph.nodes)
        notes = (f"removed {markers} step_metadata marker(s)",) if markers else ()
        return PassResult(self.name, removed, notes)
