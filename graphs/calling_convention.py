"""The engine-owned calling convention of a captured step graph.

Dynamo hands its backend a GraphModule whose placeholders stand for values of the step
function's locals (`inputs`, `kv_caches`, `model`). While the backend runs, each placeholder
carries `meta["grapharg"].source.name`, a Python expression over those locals such as
`L['inputs'].slot_mapping.size()[0]`, `L['kv_caches'][0]` or
`L['model']._modules['lm_head']._parameters['weight']` (Dynamo drops the metadata after the
backend returns, so the convention must be read inside it).

`CallingConvention` freezes that list. `bind(model)` evaluates the `L['model']` sources once
(parameters and buffers never change between steps) and compiles the rest into one Python
function, so a step builds the compiled graph's positional arguments from (StepInputs,
kv_caches) with plain attribute reads: no Dynamo frame, no guard evaluation per step.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from compiled_engine.graphs.step_inputs import StepInputs

# The step function's locals a source may start from, and the Python name each becomes.
_ROOTS = {"inputs": "inputs", "kv_caches": "kv_caches", "model": "model"}
_ROOT_PATTERN = re.compile(r"L\['(\w+)'\]")

StepArgsBuilder = Callable[[StepInputs, list[torch.Tensor]], list[Any]]


@dataclass(frozen=True)
class CallingConvention:
    """The graph's placeholder sources, in placeholder order."""

    sources: tuple[str, ...]

    def __post_init__(self) -> None:
        for source in self.sources:
            roots = _ROOT_PATTERN.findall(source)
            if not roots or not source.startswith("L['"):
                raise ValueError(f"graph input source {source!r} does not start from a step local L['...']")
            unknown = [r for r in roots if r not in _ROOTS]
            if unknown:
                raise ValueError(
                    f"graph input source {source!r} reads {unknown[0]!r}; the step function's locals "
                    f"are {sorted(_ROOTS)}"
                )

    @classmethod
    def from_graph(cls, gm: fx.GraphModule) -> CallingConvention:
        """Read the sources off a Dynamo GraphModule (call this inside the backend)."""
        sources = []
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            grapharg = node.meta.get("grapharg")
            source = getattr(grapharg, "source", None)
            name = getattr(source, "name", None)
            if callable(name):
                name = name()
            if not isinstance(name, str):
                raise ValueError(
                    f"placeholder {node.name!r} has no Dynamo source: build the calling convention "
                    "inside the Dynamo backend, before it returns"
                )
            sources.append(name)
        return cls(tuple(sources))

    def is_constant(self, index: int) -> bool:
        """A source read from the model (a parameter or buffer): the same object every step."""
        return self.sources[index].startswith("L['model']")

    def bind(self, model: torch.nn.Module) -> StepArgsBuilder:
        """A function (StepInputs, kv_caches) -> the graph's positional arguments.

        Model sources are evaluated now, once; the others are compiled into one expression.
        """
        constants: list[Any] = []
        items: list[str] = []
        for i, source in enumerate(self.sources):
            if self.is_constant(i):
                constants.append(model_source_value(source, model))
                items.append(f"_constants[{len(constants) - 1}]")
            else:
                items.append(_python(source))
        code = "def build_step_args(inputs, kv_caches):\n    return [" + ", ".join(items) + "]\n"
        namespace: dict[str, Any] = {"_constants": tuple(constants)}
        # The sources are Dynamo's own reconstructions of our step function's reads, never user text.
        exec(compile(code, "<calling-convention>", "exec"), namespace)  # noqa: S102
        return namespace["build_step_args"]


def model_source_value(source: str, model: torch.nn.Module) -> Any:
    """Evaluate one `L['model']...` source against `model` (a parameter, a buffer, a module)."""
    if not source.startswith("L['model']"):
        raise ValueError(f"source {source!r} does not read the model")
    CallingConvention((source,))  # validates the roots
    return eval(_python(source), {}, {"model": model})  # noqa: S307


def _python(source: str) -> str:
    return _ROOT_PATTERN.sub(lambda m: _ROOTS[m.group(1)], source)
