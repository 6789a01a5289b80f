"""A linear through oneDNN over a copy of its weight packed once, as an op the CPU graphs call.

Why: on the CPU we measured, oneDNN's matmul over a weight reordered once into its blocked
layout ran bench-small's linears ~2x faster than torch's `F.linear` (MKL's sgemm over the plain
row-major weight) from a few rows up, and reaches ~177 GFLOP/s in the 64-row decode step
(docs/performance.md). Inductor makes the same oneDNN calls, but only with `freezing`, which
bakes the weights into the compiled code; our artifacts hold code only and take their weights
as inputs (graphs/constant_recipes.py).

So the graph keeps the plain weight as its input, and this op keeps the packed copy: the first
call with a weight packs it, later calls with that same tensor object reuse the copy. The
copies are `PACKED_WEIGHTS`, the one piece of global state these graphs read. Why not a packed
tensor as the graph's input: it has MKLDNN layout, which Inductor's compile caches refuse
("mkldnn tensors unpickleable"), so such a graph could never be saved for a warm start.

A packed copy lives as long as its weight (weakly keyed), and is packed again if the weight
changes in place (its version counter moves). That is this module's Python implementation; where
kernels/cpu_ops.cpp builds, its C++ implementation serves the op, with its own copies kept the
same way (kernels/cpu_ops.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.weak import WeakIdKeyDictionary

from compiled_engine.kernels.source_version import files_version, module_file

# With kernels/cpu_ops.cpp, which holds the op's C++ implementation.
ONEDNN_LINEAR_VERSION = files_version(module_file(__name__), Path(__file__).with_name("cpu_ops.cpp"))

# Weight dtypes the op is offered for; bf16 only where oneDNN reports bf16 support.
_DTYPES = (torch.float32, torch.bfloat16)


def onednn_linear_available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether this torch can pack and run a `dtype` linear with oneDNN on `device`."""
    if torch.device(device).type != "cpu" or dtype not in _DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    from compiled_engine.kernels.cpu_ops import use_native_ops  # it imports this module

    use_native_ops()  # the op's C++ implementation where it builds (kernels/cpu_ops.py)
    return True


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out_features, in_features], CPU) reordered into oneDNN's blocked layout (a copy)."""
    if weight.dim() != 2:
        raise ValueError(f"a linear weight is 2-D, got shape {tuple(weight.shape)}")
    if not onednn_linear_available(weight.dtype, weight.device):
        raise ValueError(f"oneDNN cannot pack a {weight.dtype} weight on {weight.device} with this torch")
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def _version(weight: torch.Tensor) -> int:
    try:
        return weight._version
    except RuntimeError:  # an inference tensor has no version counter, and cannot change in place
        return -1


class PackedWeights:
    """Packed copies of weights, keyed by the weight tensor object."""

    def __init__(self) -> None:
        self._copies: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __len__(self) -> int:
        return len(self._copies)

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of `weight`, made now if there is none or the weight changed since."""
        version = _version(weight)
        entry = self._copies.get(weight)
        if entry is None or entry[0] != version:
            entry = (version, pack_linear_weight(weight))
            self._copies[weight] = entry
        return entry[1]


PACKED_WEIGHTS = PackedWeights()

# Defined with the low-level torch.library API rather than `torch.library.custom_op`: the op
# runs ~25 times per step of bench-small, and on this CPU custom_op's Python wrapper added
# several times the dispatch cost of this registration to every call.
_LIBRARY = torch.library.Library("compiled_engine", "FRAGMENT")
_LIBRARY.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.device.type != "cpu" or weight.device.type != "cpu":
        # Registered as CompositeExplicitAutograd (for every device key): oneDNN's CPU linear.
        raise ValueError(f"onednn_linear runs on CPU tensors, got {x.device} and {weight.device}")
    return torch.ops.mkldnn._linear_pointwise(x, PACKED_WEIGHTS.get(weight), bias, "none", [], "")


def _onednn_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# CompositeExplicitAutograd: kernels/cpu_ops.cpp's CPU kernel, once loaded (kernels/cpu_ops.py),
# takes precedence over this Python implementation (same packing, same call, no Python per call).
_LIBRARY.impl("onednn_linear", _onednn_linear, "CompositeExplicitAutograd")
torch.library.register_fake("compiled_engine::onednn_linear", _onednn_linear_fake, lib=_LIBRARY)

# `F.linear(x, weight, bias)`, through oneDNN over `weight`'s packed copy.
onednn_linear = torch.ops.compiled_engine.onednn_linear.default
