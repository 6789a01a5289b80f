"""The quantized linears at many rows (a prompt's, #21): bf16's GEMM against the quantized op, and
against the kernel's tile path forced, same weights, same rows, same run.

    python -m pytest bench/test_quantized_many_rows.py -q -p no:cacheprovider -s \
        --benchmark-columns=median,min,rounds --benchmark-json=OUT.json

The Qwen2.5-0.5B shape's linears of one layer (q/k/v fused, o, gate/up fused, down; bench/models.py)
in bf16, and the same weights quantized int8 and int4 (group 32), bf16 activations: `bf16` is
oneDNN's GEMM over the packed bf16 weight (`compiled_engine::onednn_linear`, what the buckets run
unquantized); `op` is `cpu_gemm_int8` / `cpu_gemm_int4` as the graphs call them (from
DEQUANTIZE_ROWS rows the weight dequantized once, then torch's GEMM; fewer rows, the kernel's
default path); `tiles` is the kernel's AMX tile path called through ctypes at every row count (what
the op ran at every row count before). The three alternate pass by pass; each one's median pass
and op/bf16, tiles/bf16 are printed and kept in extra_info. Needs the tile path (AMX).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from bench.interleaved import interleaved_medians
from compiled_engine.kernels import cpu_gemv_quantized
from compiled_engine.kernels.cpu_attention_build import compiler
from compiled_engine.kernels.onednn_linear import onednn_linear_available
from compiled_engine.kernels.weight_quantization import quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(
    compiler() is None
    or not cpu_gemv_quantized.tiles_available()
    or not onednn_linear_available(torch.bfloat16),
    reason="needs the quantized kernel's AMX tile path and oneDNN's bf16 GEMM",
)

# Qwen2.5-0.5B: hidden 896, q/k/v 896 + 2 x 128, intermediate 4,864. (out_features, in_features).
LAYER = ((1152, 896), (896, 896), (2 * 4864, 896), (896, 4864))
ROWS = {"full": (64, 512, 4096), "quick": (64, 512, 4096), "smoke": (64,)}
PASSES = {"full": 7, "quick": 3, "smoke": 1}


@pytest.mark.parametrize("rows", [64, 512, 4096])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_many_rows(benchmark, request, scheme, rows):
    profile = request.config._bench_sizes.profile
    if rows not in ROWS[profile]:
        pytest.skip(f"{rows} rows are not in the {profile} profile")
    generator = torch.Generator().manual_seed(rows)
    weights = [torch.randn(o, i, generator=generator).to(torch.bfloat16) for o, i in LAYER]
    quantized = [quantize_int8(w) if scheme == "int8" else quantize_int4(w, 32) for w in weights]
    inputs = {i: torch.randn(rows, i, generator=generator).to(torch.bfloat16) for _, i in LAYER}
    ops = torch.ops.compiled_engine
    linear: Callable[..., torch.Tensor]  # the Python implementation, which can force the tiles
    operands: list[tuple]
    if scheme == "int8":
        op, linear = ops.cpu_gemm_int8.default, cpu_gemv_quantized.cpu_gemm_int8_linear
        operands = [(q.qweight, q.scales) for q in quantized]
    else:
        op, linear = ops.cpu_gemm_int4.default, cpu_gemv_quantized.cpu_gemm_int4_linear
        operands = [(q.qweight, q.scales, q.zeros, 32) for q in quantized]
    tiles = functools.partial(linear, isa=cpu_gemv_quantized.ISA_AMX)
    calls = [(inputs[w.shape[1]], w, q) for w, q in zip(weights, operands, strict=True)]

    def bf16_pass() -> None:
        for x, w, _ in calls:
            ops.onednn_linear(x, w, None)

    def op_pass() -> None:
        for x, _, q in calls:
            op(x, *q, None)

    def tile_pass() -> None:
        for x, _, q in calls:
            tiles(x, *q)

    passes = {"bf16": bf16_pass, "op": op_pass, "tiles": tile_pass}
    for run in passes.values():
        run()  # warm-up: packed copies, oneDNN's primitives
    benchmark.group = f"the 0.5B shape's layer linears, {scheme}, {rows} rows: bf16, op and tiles interleaved"
    medians = interleaved_medians(benchmark, passes, PASSES[profile])
    benchmark.extra_info.update(
        scheme=scheme, rows=rows, **{f"{name}_median_s": s for name, s in medians.items()},
        op_over_bf16=medians["op"] / medians["bf16"], tiles_over_bf16=medians["tiles"] / medians["bf16"],
        threads=torch.get_num_threads(),
    )  # fmt: skip
    ms = {name: s * 1e3 for name, s in medians.items()}
    print(
        f"\n{scheme} {rows} rows: bf16 {ms['bf16']:.2f} ms, op {ms['op']:.2f} ms "
        f"({ms['op'] / ms['bf16']:.2f}x), tiles {ms['tiles']:.2f} ms ({ms['tiles'] / ms['bf16']:.2f}x)"
    )
