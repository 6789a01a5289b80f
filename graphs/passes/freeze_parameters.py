"""Turn the model's parameters and buffers from graph inputs into attributes of the graph.

Why: with `inline_inbuilt_nn_modules`, Dynamo hands every weight to the backend as a
placeholder, i.e. a run-time input the graph knows nothing about. A pass that wants to
prepare weights once (concatenate q/k/v in graphs/passes/fuse_linears.py) needs them as
constants it can read at pass time. This pass rewrites each weight placeholder into a
`get_attr` node on an attribute of the GraphModule that holds *the same tensor object* (no
copy: the model and the graph share storage, and the weight's memory is not doubled).

Which placeholders are weights: those whose example input is an `nn.Parameter`, or that
Dynamo itself marked as an nn-module parameter/buffer (it sets `_dynamo_static_input_type =
"unguarded"` on the tensors of the modules it inlines; a user's `mark_static_address` sets
"guarded" by default, and such tensors, e.g. runner-owned step buffers, stay inputs), or
whose Dynamo source reads a module's `_parameters`/`_buffers`. A
weight the graph mutates in place, or whose shape is symbolic, stays an input too: a
constant must not change between calls.

The graph then takes fewer inputs. `kept_input_indices` (set by the call, and recorded on the
graph: `kept_input_indices(gm, len(example_inputs))` reads it back, for callers that ran the pass
through a pass manager) lists, in order, the positions of the inputs the graph still takes;
compile it with `kept_example_inputs(example_inputs, kept_input_indices)` and return
`frozen_callable(compiled, kept_input_indices, len(example_inputs))` to Dynamo.

Caveat: a frozen graph reads the weight tensors it was built with. Updating a weight in place
(`param.copy_()`) is seen; replacing a module's Parameter object is not (Dynamo would not
recompile either, its parameter inputs are unguarded).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._guards import Source

from compiled_engine.graphs.constant_recipes import model_recipe, record_recipe
from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.kernels.source_version import source_version

# Prefix of the GraphModule attributes this pass creates.
FROZEN_ATTRIBUTE_PREFIX = "frozen_"
# gm.meta key: the positions of the example inputs the frozen graph still takes.
KEPT_INPUTS_META = "compiled_engine_kept_inputs"

_DYNAMO_MODULE_STATE = "unguarded"
# How Dynamo spells an input read from a module's parameters or buffers, e.g.
# L['model']._modules['lm_head']._parameters['weight'].
_MODULE_STATE_PATHS = ("._parameters[", "._buffers[")


def mutated_arguments(node: fx.Node) -> list[fx.Node]:
    """Argument nodes that `node` may write to in place (conservative for in-place methods).

    Covers: in-place methods and functions (`x.add_(y)`, `torch.add_`), `operator.setitem`,
    `out=` keyword arguments, and operators whose schema marks an argument as written
    (custom ops declared with `mutates_args`, e.g. the paged-attention op's KV cache).
    """
    if node.op == "call_method":
        # The object a method is called on is a traced value, so a Node.
        return [cast(fx.Node, node.args[0])] if str(node.target).endswith("_") and node.args else []
    if node.op != "call_function":
        return []
    written: list[Any] = []
    target = node.target
    name = getattr(target, "__name__", "")
    if target is operator.setitem or (name.endswith("_") and not name.startswith("_")):
        written.extend(node.args[:1])
    if "out" in node.kwargs:
        written.append(node.kwargs["out"])
    schemas = _schemas(target)
    for schema in schemas:
        for position, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            if position < len(node.args):
                written.append(node.args[position])
            elif argument.name in node.kwargs:
                written.append(node.kwargs[argument.name])
    nodes: list[fx.Node] = []
    for value in written:
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, fx.Node) and item not in nodes:
                nodes.append(item)
    return nodes


def _schemas(target: Any) -> list[torch.FunctionSchema]:
    if isinstance(target, torch._ops.OpOverload):
        return [target._schema]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return [getattr(target, overload)._schema for overload in target.overloads()]
    return []


def is_weight_input(node: fx.Node, example: Any) -> bool:
    """Whether placeholder `node` (with Dynamo example input `example`) holds module state."""
    if not isinstance(example, torch.Tensor):
        return False
    if isinstance(example, torch.nn.Parameter):
        return True
    marked = node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
    if marked is None:
        marked = getattr(example, "_dynamo_static_input_type", None)
    if marked == _DYNAMO_MODULE_STATE:
        return True
    # Dynamo records where each input came from, on the node itself (not in meta).
    source = getattr(node, "_dynamo_source", None)
    path = source.name if source is not None else ""
    return any(part in path for part in _MODULE_STATE_PATHS)


def _has_symbolic_shape(node: fx.Node) -> bool:
    value = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(value, torch.Tensor):
        return False
    return any(not isinstance(d, int) for d in (*value.shape, *value.stride()))


def _unique_attribute(gm: fx.GraphModule, base: str) -> str:
    name, n = base, 1
    while hasattr(gm, name):
        n += 1
        name = f"{base}_{n}"
    return name


def register_constant(
    gm: fx.GraphModule, base_name: str, tensor: torch.Tensor, source: Source | None = None
) -> str:
    """Attach `tensor` to `gm` under a fresh attribute name (no copy) and return the name.

    Parameters stay parameters and everything else becomes a non-persistent buffer, so that
    AOTAutograd/Inductor lift them as run-time inputs of the compiled code (passed by
    reference each call) instead of baking their values into it as constants.

    AOTAutograd requires every parameter/buffer of a Dynamo graph to have a Dynamo source in
    `gm._param_name_to_source` (it keys input deduplication on them); `source` is the frozen
    placeholder's, and a tensor made by a pass gets a ConstantSource named after it. The dict
    is copied first: Dynamo's OutputGraph holds the same object.
    """
    safe = "".join(c if c.isalnum() or c == "_" else "_" for c in base_name)
    name = _unique_attribute(gm, safe)
    if isinstance(tensor, torch.nn.Parameter):
        gm.register_parameter(name, tensor)
    else:
        gm.register_buffer(name, tensor, persistent=False)
    sources = getattr(gm, "_param_name_to_source", None)
    if isinstance(sources, dict):
        copied = dict(sources)
        copied[name] = source if source is not None else ConstantSource(f"compiled_engine_{name}")
        # Dynamo's attribute, undeclared on GraphModule: mypy would type a plain assignment by
        # Module.__getattr__ (Tensor | Module).
        setattr(gm, "_param_name_to_source", copied)  # noqa: B010
    return name


class FreezeParameters:
    """Placeholders holding module parameters/buffers become `get_attr` nodes (same tensors).

    One instance per graph: it needs that graph's `example_inputs` (Dynamo's second backend
    argument, in placeholder order). After the call, `kept_input_indices` holds the positions
    of the inputs the graph still takes.
    """

    name = "freeze_parameters"
    version = source_version(__name__, "compiled_engine.graphs.constant_recipes")

    def __init__(self, example_inputs: Sequence[Any]) -> None:
        self.example_inputs = list(example_inputs)
        self.kept_input_indices: tuple[int, ...] | None = None

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(self.example_inputs):
            raise ValueError(
                f"freeze_parameters: graph has {len(placeholders)} placeholders but "
                f"{len(self.example_inputs)} example inputs were given; pass the backend's example_inputs"
            )
        mutated = {arg for node in graph.nodes for arg in mutated_arguments(node)}
        first_body_node = next((n for n in graph.nodes if n.op != "placeholder"), None)
        kept: list[int] = []
        notes: list[str] = []
        frozen = 0
        for index, (node, example) in enumerate(zip(placeholders, self.example_inputs, strict=True)):
            if not is_weight_input(node, example):
                kept.append(index)
                continue
            if node in mutated:
                kept.append(index)
                notes.append(f"kept {node.name}: mutated in place by the graph")
                continue
            if _has_symbolic_shape(node):
                kept.append(index)
                notes.append(f"kept {node.name}: symbolic shape")
                continue
            source = getattr(node, "_dynamo_source", None)
            attribute = register_constant(gm, FROZEN_ATTRIBUTE_PREFIX + node.name, example, source)
            source_name = source.name if source is not None else None
            if callable(source_name):
                source_name = source_name()
            if isinstance(source_name, str) and source_name.startswith("L['model']"):
                # How a warm start finds this weight again without tracing (graphs/constant_recipes.py).
                record_recipe(gm, attribute, model_recipe(source_name))
            with graph.inserting_before(first_body_node):
                constant = graph.get_attr(attribute)
            constant.meta.update(node.meta)
            node.replace_all_uses_with(constant)
            graph.erase_node(node)
            frozen += 1
        self.kept_input_indices = tuple(kept)
        gm.meta[KEPT_INPUTS_META] = self.kept_input_indices
        notes.insert(0, f"froze {frozen} weight input(s), kept {len(kept)} input(s)")
        return PassResult(self.name, frozen, tuple(notes))


def kept_input_indices(gm: fx.GraphModule, num_inputs: int) -> tuple[int, ...]:
    """The inputs `gm` still takes after freezing (all `num_inputs` if it was not frozen)."""
    return gm.meta.get(KEPT_INPUTS_META, tuple(range(num_inputs)))


def kept_example_inputs(example_inputs: Sequence[Any], kept_input_indices: Sequence[int]) -> list[Any]:
    """The example inputs of a frozen graph: those at `kept_input_indices`, in order."""
    return [example_inputs[i] for i in kept_input_indices]


def frozen_callable(
    fn: Callable[..., Any], kept_input_indices: Sequence[int], num_dynamo_inputs: int
) -> Callable[..., Any]:
    """Adapt `fn` (the frozen graph, or its compiled form) to the arguments Dynamo passes.

    Dynamo hands the backend its own graph object and, after the backend returns, builds the
    call from that graph's remaining placeholders (torch 2.13: codegen reads
    `OutputGraph.graphargs` from the placeholders). So when the pass ran on the graph Dynamo
    gave us, frozen inputs are already not passed; when it ran on a copy, all
    `num_dynamo_inputs` are, and the kept ones are picked out here. Both are handled.
    """
    kept = tuple(kept_input_indices)
    if len(kept) == num_dynamo_inputs:
        return fn

    def call_with_kept_inputs(*args: Any) -> Any:
        if len(args) == num_dynamo_inputs:
            return fn(*[args[i] for i in kept])
        return fn(*args)

    return call_with_kept_inputs
