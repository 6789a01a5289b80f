"""Weight-quantized linears run on the C++ GEMV's int8/int4 variants (kernels/cpu_gemv_quantized.py).

Why: at one to a few token rows a quantized linear is a read of its integers, and the C++ GEMV
streams them packed in 64-feature blocks on every core; torch's int8/int4 CPU kernels
(kernels/quantized_linear.py) are built for more rows. Which buckets get it is measured per
machine (graphs/quantized_gemv_policy.py); elsewhere torch's kernels stay.

Rewrite, for the ops graphs/passes/quantize_linears.py emits (same operands, so the graph's
constants and their recipes are unchanged; the op packs its copy on first call):

    int8_weight_linear(x, W_q, scales, b)                    -> cpu_gemv_int8(x, W_q, scales, b)
    int4_weight_linear(x, W_q, scales, zeros, group, b)      -> cpu_gemv_int4(x, W_q, scales, zeros, group, b)

`CpuGemmQuantized` does the same onto the kernel's tile path (`cpu_gemm_int8` / `cpu_gemm_int4`),
for the buckets where the policy measured that one fastest (many rows).
"""

from __future__ import annotations

from torch import fx

from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.kernels.cpu_gemv_quantized import (
    CPU_GEMV_QUANTIZED_VERSION,
    cpu_gemm_int4,
    cpu_gemm_int8,
    cpu_gemv_int4,
    cpu_gemv_int8,
)
from compiled_engine.kernels.quantized_linear import int4_weight_linear, int8_weight_linear
from compiled_engine.kernels.source_version import source_version

_SWAPS = {int8_weight_linear: cpu_gemv_int8, int4_weight_linear: cpu_gemv_int4}
_TILE_SWAPS = {int8_weight_linear: cpu_gemm_int8, int4_weight_linear: cpu_gemm_int4}


class CpuGemvQuantized:
    """int8/int4 weight-only linears move from torch's kernels to the C++ GEMV's."""

    name = "cpu_gemv_quantized"
    version = source_version(__name__) + f"-{CPU_GEMV_QUANTIZED_VERSION[:8]}"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        rewritten = _swap(gm, _SWAPS)
        return PassResult(self.name, rewritten, (f"{rewritten} quantized linear(s) now run on the C++ GEMV",))


class CpuGemmQuantized:
    """int8/int4 weight-only linears move from torch's kernels to the C++ kernel's tile path."""

    name = "cpu_gemm_quantized"
    version = source_version(__name__) + f"-{CPU_GEMV_QUANTIZED_VERSION[:8]}"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        rewritten = _swap(gm, _TILE_SWAPS)
        return PassResult(
            self.name, rewritten, (f"{rewritten} quantized linear(s) now run on the C++ kernel's tile path",)
        )


def _swap(gm: fx.GraphModule, swaps: dict) -> int:
    rewritten = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in swaps:
            node.target = swaps[node.target]
            rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
