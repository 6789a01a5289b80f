"""bf16 linears on a CPU without bf16 GEMMs: torch's bf16 GEMM against the widened fp32 GEMM
(kernels/widened_linear.py), bench-small's linears, interleaved pass by pass.

    python -m pytest bench/test_widened_linear.py -q -s -p no:cacheprovider \
        --benchmark-columns=median,min,rounds --benchmark-json=OUT.json

Every linear of bench-small (bench/models.py: 6 layers' fused q/k/v, o, gate/up and down, and the
LM head; 39 MB of bf16), fed `rows` rows, one pass through all of them: torch's `F.linear` on the
bf16 tensors (what a bucket runs where no other form was measured faster) and `widened_linear`
on the same tensors. fp32's `F.linear` over fp32 copies of the weights runs in the same rounds as
the floor the widening approaches (its weights take twice the memory), and the C++ GEMV over its
packed copies (kernels/cpu_gemv.cpp; on AVX2 its register tiles from 8 rows), which the policy
times beside the widened form. Each one's median pass and the ratios are printed and kept in
extra_info. Where oneDNN runs bf16 (AVX-512 BF16, AMX) the
policy never times the widened form, and this suite skips.

`test_quantized_prompt_rows_widened`: the int8 / int4 ops at DEQUANTIZE_ROWS rows (a 512-token
prompt's linears, the 0.5B shape's layer) dequantize the weight once and, where bf16 GEMMs are not
native, run it widened (int4 on AVX2 keeps the kernel instead: its int8-x path); against torch's
bf16 GEMM over the same dequantized weight (their path before), interleaved.

Where the int4 op multiplies x rounded to int8 (`gemm_int4_rounds_x_to_int8`), its results are
checked against `gemm_int4_reference`, the same rounding, not the plain linear.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.interleaved import interleaved_medians
from bench.test_gemv_rows import BENCH_SMALL_HEAD, BENCH_SMALL_LAYER, BENCH_SMALL_LAYERS
from bench.test_quantized_many_rows import LAYER as QWEN_LAYER  # the 0.5B shape's layer linears
from compiled_engine.kernels import cpu_gemv_quantized
from compiled_engine.kernels.cpu_gemv import cpu_gemv_available, cpu_gemv_linear
from compiled_engine.kernels.onednn_linear import onednn_linear_available
from compiled_engine.kernels.weight_quantization import dequantize, quantize_int4, quantize_int8
from compiled_engine.kernels.widened_linear import widened_linear

ROWS = (16, 64, 512)
PASSES = {"full": 11, "quick": 5, "smoke": 1}


pytestmark = pytest.mark.skipif(
    onednn_linear_available(torch.bfloat16), reason="oneDNN runs bf16 here: the widened form is no candidate"
)


@pytest.mark.parametrize("rows", ROWS)
def test_widened_against_bf16_gemm(benchmark, request, rows):
    profile = request.config._bench_sizes.profile
    generator = torch.Generator().manual_seed(rows)
    shapes = [*BENCH_SMALL_LAYER * BENCH_SMALL_LAYERS, BENCH_SMALL_HEAD]
    weights = [torch.randn(o, i, generator=generator).to(torch.bfloat16) for o, i in shapes]
    weights32 = [w.float() for w in weights]
    xs = [torch.randn(rows, i, generator=generator).to(torch.bfloat16) for _, i in shapes]

    def bf16_pass() -> list[torch.Tensor]:
        return [F.linear(x, w) for x, w in zip(xs, weights, strict=True)]

    def widened_pass() -> list[torch.Tensor]:
        return [widened_linear(x, w, None) for x, w in zip(xs, weights, strict=True)]

    def fp32_pass() -> list[torch.Tensor]:
        return [F.linear(x.float(), w) for x, w in zip(xs, weights32, strict=True)]

    def kernel_pass() -> list[torch.Tensor]:  # packed copies made by the first call, outside the rounds
        return [cpu_gemv_linear(x, w) for x, w in zip(xs, weights, strict=True)]

    passes = {"bf16": bf16_pass, "widened": widened_pass, "fp32": fp32_pass}
    if cpu_gemv_available(torch.bfloat16):
        passes["kernel"] = kernel_pass
    for form in passes.keys() & {"widened", "kernel"}:  # each form of ours against torch's bf16 GEMM
        for ours, theirs in zip(passes[form]()[-2:], bf16_pass()[-2:], strict=True):
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-1)
    benchmark.group = f"bench-small's linears, bf16, {rows} rows: torch's bf16 GEMM, widened, fp32, C++ GEMV"
    medians = interleaved_medians(benchmark, passes, PASSES[profile])
    benchmark.extra_info.update(
        rows=rows,
        threads=torch.get_num_threads(),
        **{f"{name}_median_s": seconds for name, seconds in medians.items()},
        widened_over_bf16=medians["widened"] / medians["bf16"],
        widened_over_fp32=medians["widened"] / medians["fp32"],
    )
    ms = {name: seconds * 1e3 for name, seconds in medians.items()}
    line = (
        f"\n{rows} rows: bf16 GEMM {ms['bf16']:.2f} ms, widened {ms['widened']:.2f} ms, "
        f"fp32 {ms['fp32']:.2f} ms; "
        f"widened / bf16 {medians['widened'] / medians['bf16']:.2f}x, "
        f"widened / fp32 {medians['widened'] / medians['fp32']:.2f}x"
    )
    if "kernel" in medians:
        # The C++ GEMV: its AVX2 register tiles from 8 rows (kernels/cpu_gemv.cpp).
        benchmark.extra_info["kernel_over_widened"] = medians["kernel"] / medians["widened"]
        line += f"; C++ GEMV {ms['kernel']:.2f} ms, {medians['kernel'] / medians['widened']:.2f}x widened"
    print(line)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_prompt_rows_widened(benchmark, request, scheme):
    """The quantized ops' dequantize-once path (from DEQUANTIZE_ROWS rows): `op`, as the graphs call
    it, now widens the dequantized weight's GEMM; `bf16_gemm` is what it ran before, torch's bf16
    GEMM over the same dequantized weight."""
    profile = request.config._bench_sizes.profile
    rows = cpu_gemv_quantized.DEQUANTIZE_ROWS
    generator = torch.Generator().manual_seed(rows)
    weights = [torch.randn(o, i, generator=generator).to(torch.bfloat16) for o, i in QWEN_LAYER]
    quantized = [quantize_int8(w) if scheme == "int8" else quantize_int4(w, 32) for w in weights]
    xs = [torch.randn(rows, i, generator=generator).to(torch.bfloat16) for _, i in QWEN_LAYER]
    ops = torch.ops.compiled_engine
    if scheme == "int8":
        op = ops.cpu_gemm_int8.default
        operands = [(q.qweight, q.scales) for q in quantized]
    else:
        op = ops.cpu_gemm_int4.default
        operands = [(q.qweight, q.scales, q.zeros, 32) for q in quantized]

    def op_pass() -> list[torch.Tensor]:
        return [op(x, *q, None) for x, q in zip(xs, operands, strict=True)]

    def bf16_gemm_pass() -> list[torch.Tensor]:
        return [F.linear(x, dequantize(q, torch.bfloat16)) for x, q in zip(xs, quantized, strict=True)]

    for ours, theirs, x, q in zip(op_pass(), bf16_gemm_pass(), xs, quantized, strict=True):
        expected = cpu_gemv_quantized.gemm_int4_reference(x, q) if scheme == "int4" else theirs.float()
        torch.testing.assert_close(ours.float(), expected, rtol=2e-2, atol=2e-1)
    benchmark.group = f"the 0.5B shape's layer linears, {scheme}, {rows} rows: op (widened) and bf16 GEMM"
    medians = interleaved_medians(benchmark, {"op": op_pass, "bf16_gemm": bf16_gemm_pass}, PASSES[profile])
    ratio = medians["op"] / medians["bf16_gemm"]
    benchmark.extra_info.update(
        scheme=scheme, rows=rows, op_median_s=medians["op"], bf16_gemm_median_s=medians["bf16_gemm"],
        op_over_bf16_gemm=ratio, threads=torch.get_num_threads(),
    )  # fmt: skip
    print(
        f"\n{scheme} {rows} rows: op {medians['op'] * 1e3:.2f} ms, "
        f"bf16 GEMM {medians['bf16_gemm'] * 1e3:.2f} ms, {ratio:.2f}x"
    )


@pytest.mark.parametrize("rows", [16, 64])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_decode_rows_against_bf16(benchmark, request, scheme, rows):
    """#21's "16 and 64 requests no slower than bf16" on a CPU without bf16 GEMMs: the int8 / int4
    ops as the graphs call them (here their many-rows AVX2 path: each chunk of a block widened once,
    to int16 pairs for these bf16 rows (int4: to bytes, x rounded to int8), rows in register tiles)
    against bf16's fastest forms on the same weights, the C++ GEMV (its register tiles) and the
    widened GEMM, the 0.5B shape's layer, interleaved."""
    if not cpu_gemv_available(torch.bfloat16):
        pytest.skip("no C++ compiler: neither the quantized ops' kernel nor the bf16 GEMV runs")
    profile = request.config._bench_sizes.profile
    generator = torch.Generator().manual_seed(rows)
    weights = [torch.randn(o, i, generator=generator).to(torch.bfloat16) for o, i in QWEN_LAYER]
    quantized = [quantize_int8(w) if scheme == "int8" else quantize_int4(w, 32) for w in weights]
    xs = [torch.randn(rows, i, generator=generator).to(torch.bfloat16) for _, i in QWEN_LAYER]
    ops = torch.ops.compiled_engine

    def op_pass() -> list[torch.Tensor]:
        if scheme == "int8":
            return [
                ops.cpu_gemm_int8(x, q.qweight, q.scales, None) for x, q in zip(xs, quantized, strict=True)
            ]
        return [
            ops.cpu_gemm_int4(x, q.qweight, q.scales, q.zeros, 32, None)
            for x, q in zip(xs, quantized, strict=True)
        ]

    def gemv_pass() -> list[torch.Tensor]:
        return [cpu_gemv_linear(x, w) for x, w in zip(xs, weights, strict=True)]

    def widened_pass() -> list[torch.Tensor]:
        return [widened_linear(x, w, None) for x, w in zip(xs, weights, strict=True)]

    for ours, x, q in zip(op_pass(), xs, quantized, strict=True):
        expected = (
            cpu_gemv_quantized.gemm_int4_reference(x, q)
            if scheme == "int4"
            else F.linear(x.float(), dequantize(q))
        )
        torch.testing.assert_close(ours.float(), expected, rtol=2e-2, atol=2e-1)
    benchmark.group = (
        f"the 0.5B shape's layer linears, {rows} rows: {scheme} op against bf16's C++ GEMV and widened GEMM"
    )
    passes = {"op": op_pass, "bf16_gemv": gemv_pass, "bf16_widened": widened_pass}
    medians = interleaved_medians(benchmark, passes, PASSES[profile])
    best_bf16 = min(medians["bf16_gemv"], medians["bf16_widened"])
    benchmark.extra_info.update(
        scheme=scheme,
        rows=rows,
        threads=torch.get_num_threads(),
        op_over_best_bf16=medians["op"] / best_bf16,
        **{f"{name}_median_s": seconds for name, seconds in medians.items()},
    )
    ms = {name: seconds * 1e3 for name, seconds in medians.items()}
    print(
        f"\n{scheme} {rows} rows: op {ms['op']:.2f} ms, bf16 C++ GEMV {ms['bf16_gemv']:.2f} ms, "
        f"bf16 widened {ms['bf16_widened']:.2f} ms; op / best bf16 {medians['op'] / best_bf16:.2f}x"
    )
