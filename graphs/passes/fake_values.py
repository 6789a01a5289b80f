"""Example values for the nodes a pass inserts, computed as Dynamo computes them while tracing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode


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
