"""Linears with constant weights run on the C++ GEMV over a packed copy (kernels/cpu_gemv.py).

Why: at one to a few token rows a linear is a read of its weight, and the kernel streams a copy
packed for it on every core (bf16 with AVX-512 BF16 where the CPU has it), where torch's one-row
linear did not reach the machine's bandwidth. Which buckets get it is measured per machine
(graphs/gemv_policy.py); such a bucket runs neither the GEMV lowering nor oneDNN's packed GEMM.

Rewrite, for `linear(x, W, b)` whose weight is a graph constant (`get_attr`, see
graphs/passes/freeze_parameters.py) of a dtype the kernel runs (CPU float32, bfloat16, float16):

    cpu_gemv(x, W, b)

Same operands, so the graph's inputs, constants and their recipes are unchanged; the op packs
W on its first call and keeps the copy, as oneDNN's packed linear does.
"""

from __future__ import annotations

import torch
from torch import fx

from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.graphs.passes.swap_linears import swap_constant_linears
from compiled_engine.kernels.cpu_gemv import CPU_GEMV_VERSION, cpu_gemv, cpu_gemv_available
from compiled_engine.kernels.source_version import source_version


class CpuGemvLinears:
    """Constant-weight linears become `cpu_gemv(x, weight, bias)`."""

    name = "cpu_gemv_linears"
    version = (
        source_version(
            __name__,
            "compiled_engine.graphs.passes.fake_values",
            "compiled_engine.graphs.passes.fuse_linears",
            "compiled_engine.graphs.passes.swap_linears",
        )
        + f"-{CPU_GEMV_VERSION[:8]}"
    )

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        def runs(weight: torch.Tensor) -> str | None:
            if cpu_gemv_available(weight.dtype, weight.device):
                return None
            return f"the C++ GEMV cannot run a {weight.dtype} weight on {weight.device}"

        rewritten, notes = swap_constant_linears(gm, cpu_gemv, runs)
        notes.insert(0, f"{rewritten} linear(s) now run on the C++ GEMV over packed weights")
        return PassResult(self.name, rewritten, tuple(notes))
