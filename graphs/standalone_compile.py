"""Inductor's standalone_compile over fake example inputs from our own FakeTensorMode.

A bucket graph is compiled from fake inputs whose block-table width is symbolic, made in a
FakeTensorMode with a shape environment of our choosing (graphs/bucket_compiler.py says why).
torch >= 2.12 takes that mode as `fake_mode=`. torch 2.11 (seen on a device machine) has no
such argument, and with dynamic_shapes="from_example_inputs" makes a fresh mode that our fakes
do not belong to; there the mode goes in through the tracing context instead.

The graph is donated where this torch allows it (`donate_graph_module=`, torch >= 2.13):
standalone_compile otherwise deep-copies the GraphModule, every weight included, once per
compile, and cannot copy at all a graph holding an MKLDNN tensor (a oneDNN-packed weight,
graphs/passes/onednn_linear.py). Callers pass a graph of their own to donate (a
`share_graph_module` variant: new nodes, the same weight tensors).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

_PARAMETERS = inspect.signature(torch._inductor.standalone_compile).parameters
TAKES_FAKE_MODE = "fake_mode" in _PARAMETERS
TAKES_DONATION = "donate_graph_module" in _PARAMETERS


# Inductor settings for every step graph. No size asserts: the generated wrapper otherwise checks
# every input's and every custom op output's sizes and strides on each call (84 checks in a
# one-token step of a 6-layer model, ~0.5 us each), and a step's inputs are views of the runner's
# fixed buffers, padded to the bucket's shape (graphs/buckets.py). Patched around the call rather
# than passed as its `options`, which compile_fx applies by calling itself once more.
INDUCTOR_CONFIG = {"size_asserts": False}


def compile_donated(graph: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """`torch._inductor.standalone_compile` under INDUCTOR_CONFIG, donating `graph` (may be
    mutated) where supported."""
    if TAKES_DONATION:
        kwargs["donate_graph_module"] = True
    with torch._inductor.config.patch(INDUCTOR_CONFIG):
        return torch._inductor.standalone_compile(graph, list(example_inputs), **kwargs)


def compile_with_fake_mode(
    graph: fx.GraphModule,
    example_inputs: Sequence[Any],
    fake_mode: FakeTensorMode,
    *,
    takes_fake_mode: bool | None = None,
) -> Any:
    """A CompiledArtifact of `graph` (donated) specialised to `example_inputs` (fakes made in `fake_mode`).

    `takes_fake_mode` (default: whether this torch's standalone_compile does) picks the path.
    """
    if takes_fake_mode is None:
        takes_fake_mode = TAKES_FAKE_MODE
    if takes_fake_mode:
        return compile_donated(
            graph, example_inputs, dynamic_shapes="from_example_inputs", fake_mode=fake_mode
        )
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
        return compile_donated(graph, example_inputs, dynamic_shapes="from_tracing_context")
