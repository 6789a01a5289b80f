"""The C++ GEMV (kernels/cpu_gemv.cpp) past one row: its AVX-512 BF16 dot path against its AMX tile
path, same weights, same rows, same run (the tile path runs bf16 at 4 to 16 rows).

    python -m pytest bench/test_gemv_rows.py -q -p no:cacheprovider \
        --benchmark-columns=median,min,rounds --benchmark-json=OUT.json

Weights shaped like the embedded model's (compiled_engine/default_model: hidden 256, MLP 704,
vocabulary 4,096), bf16: the LM head (4096 x 256), the gate/up projection (1408 x 256) and the
down projection (256 x 704), at 1, 2, 4, 8 and 16 rows; a speculative verification step of
k = 4 runs its linears at 5 rows, padded to the 8-row bucket. The kernel is called through ctypes
with its arguments built once, `CALLS` calls a timed round, on the machine's threads. The dot
path at many rows is what the GEMV cost before the tile path; the GEMV policy
(graphs/gemv_policy.py) decides per bucket whether either beats oneDNN's GEMM.

`test_tiles_against_onednn`: past 16 rows, the tile path against oneDNN's GEMM over its packed
weights (`compiled_engine::onednn_linear`, what the buckets run otherwise), on every linear of
bench-small (bench/models.py: 6 layers' q/k/v, o, gate/up and down, and the LM head; 39 MB of
bf16, more than L2), at 16 to 128 rows. The two alternate pass by pass; each one's median pass
and the tiles' over oneDNN's are printed and kept in extra_info.
"""

from __future__ import annotations

import pytest
import torch

from bench.interleaved import interleaved_medians
from compiled_engine.kernels import cpu_gemv
from compiled_engine.kernels.cpu_attention_build import compiler
from compiled_engine.kernels.onednn_linear import PACKED_WEIGHTS, onednn_linear_available

SHAPES = {"lm_head": (4096, 256), "gate_up": (1408, 256), "down": (256, 704)}
CALLS = {"full": 200, "quick": 100, "smoke": 2}
ROUNDS = {"full": 15, "quick": 5, "smoke": 1}
PATHS = {"dot": cpu_gemv.ISA_AVX512_BF16, "tiles": cpu_gemv.ISA_AMX_TILES}

pytestmark = pytest.mark.skipif(
    compiler() is None or cpu_gemv.gemv_isa() < cpu_gemv.ISA_AMX_TILES, reason="no AMX tile path here"
)


# The tile path starts at 4 rows (below, isa 4 runs the dot path).
CASES = [("dot", rows) for rows in (1, 2, 4, 8, 16)] + [("tiles", rows) for rows in (4, 8, 16)]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(("path", "rows"), CASES)
def test_gemv_rows(benchmark, request, path, rows, shape):
    profile = request.config._bench_sizes.profile
    out_features, in_features = SHAPES[shape]
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    entry = cpu_gemv.PACKED_GEMV_WEIGHTS.get(weight)
    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
    kernel = cpu_gemv.load().ce_cpu_gemv
    args = (x.data_ptr(), in_features, rows, entry.packed_ptr, None, out.data_ptr(),
            in_features, out_features, entry.dtype_code, PATHS[path], torch.get_num_threads())  # fmt: skip
    calls = CALLS[profile]

    def loop() -> None:
        for _ in range(calls):
            kernel(*args)

    loop()  # warm-up (and the check below)
    expected = torch.nn.functional.linear(x.float(), weight.float())
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-1)
    benchmark.group = f"GEMV {shape} {out_features}x{in_features} bf16, {rows} rows ({calls} calls)"
    benchmark.extra_info.update(path=path, rows=rows, shape=shape, calls=calls)
    benchmark.pedantic(loop, rounds=ROUNDS[profile], iterations=1)


# bench-small's linears (bench/models.py): (out_features, in_features), fused as the graphs run them.
BENCH_SMALL_LAYER = ((1024, 512), (512, 512), (2816, 512), (512, 1408))
BENCH_SMALL_LAYERS = 6
BENCH_SMALL_HEAD = (4000, 512)
MANY_ROWS = (16, 24, 32, 48, 64, 96, 128)
PASSES = {"full": 15, "quick": 7, "smoke": 1}


@pytest.mark.skipif(not onednn_linear_available(torch.bfloat16), reason="oneDNN cannot run bf16 here")
@pytest.mark.parametrize("rows", MANY_ROWS)
def test_tiles_against_onednn(benchmark, request, rows):
    profile = request.config._bench_sizes.profile
    generator = torch.Generator().manual_seed(rows)
    shapes = [*BENCH_SMALL_LAYER * BENCH_SMALL_LAYERS, BENCH_SMALL_HEAD]
    weights = [torch.randn(o, i, generator=generator).to(torch.bfloat16) for o, i in shapes]
    xs = [torch.randn(rows, i, generator=generator).to(torch.bfloat16) for _, i in shapes]
    outs = [torch.empty(rows, o, dtype=torch.bfloat16) for o, _ in shapes]
    kernel, threads = cpu_gemv.load().ce_cpu_gemv, torch.get_num_threads()
    tile_args = []
    for x, w, out in zip(xs, weights, outs, strict=True):
        entry = cpu_gemv.PACKED_GEMV_WEIGHTS.get(w)
        out_features, in_features = w.shape
        isa = cpu_gemv.ISA_AMX_TILES
        tile_args.append((x.data_ptr(), in_features, rows, entry.packed_ptr, None, out.data_ptr(),
                          in_features, out_features, entry.dtype_code, isa, threads))  # fmt: skip
        PACKED_WEIGHTS.get(w)  # oneDNN's packed copy, made before timing as a warm engine has it
    onednn = torch.ops.compiled_engine.onednn_linear

    def tiles_pass() -> None:
        for args in tile_args:
            kernel(*args)

    def onednn_pass() -> None:
        for x, w in zip(xs, weights, strict=True):
            onednn(x, w, None)

    tiles_pass()
    # The last layer's down projection and the LM head.
    for x, w, out in zip(xs[-2:], weights[-2:], outs[-2:], strict=True):
        torch.testing.assert_close(out.float(), onednn(x, w, None).float(), rtol=2e-2, atol=2e-1)
    onednn_pass()
    benchmark.group = f"bench-small's linears, bf16, {rows} rows: tiles and oneDNN interleaved"
    medians = interleaved_medians(benchmark, {"tiles": tiles_pass, "onednn": onednn_pass}, PASSES[profile])
    ratio = medians["tiles"] / medians["onednn"]
    benchmark.extra_info.update(
        rows=rows, tiles_median_s=medians["tiles"], onednn_median_s=medians["onednn"],
        tiles_over_onednn=ratio, threads=threads,
    )  # fmt: skip
    tiles_ms, onednn_ms = medians["tiles"] * 1e3, medians["onednn"] * 1e3
    print(f"\n{rows} rows: tiles {tiles_ms:.3f} ms, oneDNN {onednn_ms:.3f} ms, {ratio:.2f}x")
