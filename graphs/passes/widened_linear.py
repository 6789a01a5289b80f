"""bf16 / fp16 linears with constant weights run as fp32 GEMMs (kernels/widened_linear.py).

Why: on a CPU whose GEMMs have no half-precision path (no AVX-512 BF16 or AMX: oneDNN cannot pack
bf16 there), torch's bf16 GEMM took 2.5x the fp32 GEMM's time at 16 rows, 5.5x at 64, 7x at 512; widening the
weight costs one pass over it. Which buckets get it is measured per machine
(graphs/gemv_policy.py), in the place of oneDNN's packed GEMM.

Rewrite, for `linear(x, W, b)` whose weight is a bf16 / fp16 graph constant (`get_attr`, see
graphs/passes/freeze_parameters.py):

    widened_linear(x, W, b)

Same operands, so the graph's inputs, constants and their recipes are unchanged.
"""

from __future__ import annotations

import torch
from torch import fx

from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.graphs.passes.swap_linears import swap_constant_linears
from compiled_engine.kernels.source_version import source_version
from compiled_engine.kernels.widened_linear import widened_linear, widened_linear_available


class WidenLinears:
    """Constant bf16 / fp16 linears become `widened_linear(x, weight, bias)`."""

    name = "widen_linears"
    version = source_version(
        __name__,
        "compiled_engine.graphs.passes.fake_values",
        "compiled_engine.graphs.passes.fuse_linears",
        "compiled_engine.graphs.passes.swap_linears",
        "compiled_engine.kernels.widened_linear",
    )

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        def runs(weight: torch.Tensor) -> str | None:
            if widened_linear_available(weight.dtype, weight.device):
                return None
            return f"a {weight.dtype} weight on {weight.device} is not widened"

        rewritten, notes = swap_constant_linears(gm, widened_linear, runs)
        notes.insert(0, f"{rewritten} linear(s) now run as fp32 GEMMs over widened weights")
        return PassResult(self.name, rewritten, tuple(notes))
