"""One decode row through quantized weights (#21's one-request rows): the C++ GEMV's integer loop
(bf16 activations) against its float loop and against bf16's C++ GEMV, same run.

    python -m pytest bench/test_quantized_gemv.py -q -s -p no:cacheprovider \
        --benchmark-columns=median,min,rounds --benchmark-json=OUT.json

The Qwen2.5-0.5B shape's linears (bench/test_quantized_many_rows.py's layer, `LAYERS` of them, and
the 151,936 x 896 LM head), random bf16 weights quantized int8 (a scale per output) or int4
(group 32, bf16 scales and zeros), one row a call, as a one-request step calls them; every pass
reads all the weights once, more than the L3 holds, so each call reads memory as a forward does.

- `integer`: `cpu_gemv_int8` / `cpu_gemv_int4` with bf16 x, what the graphs call: on AVX2 the
  vpmaddwd loops (x in int16), with VNNI the vpdpwssd ones.
- `float_loop`: the same op with the row in float32, which takes the float loops (widen,
  convert, multiply-add): what a bf16 row ran on AVX2 before the integer loops.
- `bf16_gemv`: bf16's C++ GEMV (kernels/cpu_gemv.cpp) over the unquantized weights, what a bf16
  model's step runs: #21 asks int8 for >= 1.7x its speed and int4 for >= 2.5x.

The three alternate pass by pass; each one's median pass and the ratios are printed and kept in
extra_info.
"""

from __future__ import annotations

import pytest
import torch

from bench.interleaved import interleaved_medians
from bench.test_quantized_many_rows import LAYER
from compiled_engine.kernels import cpu_gemv_quantized  # noqa: F401  (registers the ops)
from compiled_engine.kernels.cpu_gemv import cpu_gemv_available, cpu_gemv_linear
from compiled_engine.kernels.weight_quantization import quantize_int4, quantize_int8

LM_HEAD = (151936, 896)
LAYERS = {"full": 24, "quick": 8, "smoke": 1}
PASSES = {"full": 9, "quick": 5, "smoke": 1}

pytestmark = pytest.mark.skipif(not cpu_gemv_available(torch.bfloat16), reason="no C++ compiler")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_gemv_one_row(benchmark, request, scheme):
    profile = request.config._bench_sizes.profile
    shapes = [*LAYER * LAYERS[profile], *([LM_HEAD] if profile != "smoke" else [])]
    generator = torch.Generator().manual_seed(21)
    weights = [torch.randn(o, i, generator=generator).to(torch.bfloat16) for o, i in shapes]
    quantized = [quantize_int8(w) if scheme == "int8" else quantize_int4(w, 32) for w in weights]
    xs = [torch.randn(1, i, generator=generator).to(torch.bfloat16) for _, i in shapes]
    xs_float = [x.float() for x in xs]
    ops = torch.ops.compiled_engine

    def quantized_pass(rows: list[torch.Tensor]) -> list[torch.Tensor]:
        pairs = zip(rows, quantized, strict=True)
        if scheme == "int8":
            return [ops.cpu_gemv_int8(x, q.qweight, q.scales, None) for x, q in pairs]
        return [ops.cpu_gemv_int4(x, q.qweight, q.scales, q.zeros, 32, None) for x, q in pairs]

    def bf16_pass() -> list[torch.Tensor]:
        return [cpu_gemv_linear(x, w) for x, w in zip(xs, weights, strict=True)]

    passes = {
        "integer": lambda: quantized_pass(xs),
        "float_loop": lambda: quantized_pass(xs_float),
        "bf16_gemv": bf16_pass,
    }
    # Same maths on both loops (x rounded to int16 in the integer one), and near bf16's product.
    for integer, float_loop, bf16 in zip(*(run() for run in passes.values()), strict=True):
        torch.testing.assert_close(integer.float(), float_loop, rtol=2e-2, atol=5e-2)
        assert (integer.float() - bf16.float()).abs().max() < 0.25 * bf16.float().abs().max()
    benchmark.group = f"the 0.5B shape's linears, one row, {scheme}: integer loop, float loop, bf16 GEMV"
    medians = interleaved_medians(benchmark, passes, PASSES[profile])
    ms = {name: seconds * 1e3 for name, seconds in medians.items()}
    over_float = medians["float_loop"] / medians["integer"]
    over_bf16 = medians["bf16_gemv"] / medians["integer"]
    benchmark.extra_info.update(
        scheme=scheme,
        linears=len(shapes),
        threads=torch.get_num_threads(),
        integer_speedup_over_float_loop=over_float,
        integer_speedup_over_bf16_gemv=over_bf16,
        **{f"{name}_median_s": seconds for name, seconds in medians.items()},
    )
    print(
        f"\n{scheme}, {len(shapes)} linears: integer {ms['integer']:.2f} ms, "
        f"float loop {ms['float_loop']:.2f} ms, bf16 GEMV {ms['bf16_gemv']:.2f} ms; "
        f"{over_float:.2f}x the float loop, {over_bf16:.2f}x bf16"
    )
