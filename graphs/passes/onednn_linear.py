"""Linears with constant weights run through oneDNN over a packed copy (kernels/onednn_linear.py).

Why: on the CPU we measured, oneDNN's matmul over a weight reordered into its blocked layout
ran bench-small's linears ~2x faster than torch's `F.linear` from a few rows up
(docs/performance.md). Which buckets get it is measured per machine (graphs/gemv_policy.py);
GEMV-lowered buckets have no linears left for this pass.

Rewrite, for `linear(x, W, b)` whose weight is a graph constant (`get_attr`, see
graphs/passes/freeze_parameters.py) that oneDNN can pack (CPU, fp32, or bf16 where supported):

    onednn_linear(x, W, b)

Same operands, so the graph's inputs, constants and their recipes are unchanged; the op packs
W on its first call and keeps the copy (kernels/onednn_linear.py says why not in the graph).
"""

from __future__ import annotations

import torch
from torch import fx

from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.graphs.passes.swap_linears import swap_constant_linears
from compiled_engine.kernels.onednn_linear import (
    onednn_linear,
    onednn_linear_available,
)
from compiled_engine.kernels.source_version import source_version


class PackLinearWeights:
    """Constant-weight linears become `onednn_linear(x, weight, bias)`."""

    name = "pack_linear_weights"
    version = source_version(
        __name__,
        "compiled_engine.graphs.passes.fake_values",
        "compiled_engine.graphs.passes.fuse_linears",
        "compiled_engine.graphs.passes.swap_linears",
        "compiled_engine.kernels.onednn_linear",
    )

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        def runs(weight: torch.Tensor) -> str | None:
            if onednn_linear_available(weight.dtype, weight.device):
                return None
            return f"oneDNN cannot pack a {weight.dtype} weight on {weight.device}"

        rewritten, notes = swap_constant_linears(gm, onednn_linear, runs)
        notes.insert(0, f"{rewritten} linear(s) now run through oneDNN on packed weights")
        return PassResult(self.name, rewritten, tuple(notes))
