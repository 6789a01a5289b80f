"""Example values for the nodes a pass inserts, computed as Dynamo computes them while tracing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map


@contextmanager
def fake_evaluation(fake_mode: FakeTensorMode) -> Iterator[None]:
    """Run ops on fake tensors (symbolic sizes included) under `fake_mode`.

    Dynamo traces with the Python dispatcher on, so composite ops (linear -> matmul) decompose
    in Python, where symbolic sizes are understood. Without it some builds run the C++
    composite, which reads a concrete numel() of a symbolic tensor: torch 2.11 on CUDA raised
    "Cannot call numel() on tensor with symbolic sizes/strides" in fuse_linears (seen on an
    H200 by bench/gpu_check.py; torch 2.13 on CPU does not).
    """
    with fake_mode, enable_python_dispatcher():
        yield


def set_fake_value(node: fx.Node) -> None:
    """Fill node.meta['example_value'] from its inputs' fake values, as Dynamo would have."""
    args, kwargs = tree_map(_example_value, (node.args, node.kwargs))
    # The mode the inputs' fake values were made in (the backend's tracing context may hold
    # another one, and fake modes cannot be mixed).
    fakes = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, FakeTensor)]
    if not fakes:
        return
    with fake_evaluation(fakes[0].fake_mode):
        if node.op == "call_method":
            value = getattr(args[0], str(node.target))(*args[1:], **kwargs)  # the target names the method
        else:
            # A call_function node's target is the function itself (fx types it as a method name too).
            value = cast(Callable[..., Any], node.target)(*args, **kwargs)
    node.meta["example_value"] = value


def _example_value(arg: Any) -> Any:
    return arg.meta.get("example_value") if isinstance(arg, fx.Node) else arg
