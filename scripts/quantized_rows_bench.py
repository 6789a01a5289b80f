"""Every linear of the Qwen2.5-0.5B shape (24 layers' q/k/v, o, gate/up, down, and the tied
151,936 x 896 head) once, at M token rows, bf16 activations, through each form the quantized-linear
policy chooses among (graphs/quantized_gemv_policy.py) and the bf16 linear it has to beat:

    bf16   F.linear over the bf16 weights (oneDNN)
    bf16-gemv  the bf16 C++ GEMV (kernels/cpu_gemv.py; what our bf16 decode takes at a few rows),
           timed up to 8 rows only
    tiles  cpu_gemm_int8 / _int4, the many-rows op: its AMX tile path, or without AMX (bf16 x,
           AVX-512 BF16) its AVX-512 widen-once path
    gemv   cpu_gemv_int8 / _int4, the C++ GEMV (timed up to 8 rows only)
    torch  torch's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu

Random weights (~1 GB bf16, ~0.5 GB int8), so every pass streams them from memory. Per form the
fastest of 3 passes, in the calling thread's CPU time (time.thread_time: on a shared machine,
time the thread was not running is left out; memory stalls are in).

    .venv/bin/python scripts/quantized_rows_bench.py --scheme int8 --rows 1,16,64 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from compiled_engine.kernels.cpu_gemv import cpu_gemv
from compiled_engine.kernels.cpu_gemv_quantized import (
    cpu_gemm_int4,
    cpu_gemm_int8,
    cpu_gemv_int4,
    cpu_gemv_int8,
)
from compiled_engine.kernels.quantized_linear import int4_weight_linear, int8_weight_linear
from compiled_engine.kernels.weight_quantization import QuantizedWeight, quantize_int4, quantize_int8

LAYER_SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
HEAD_SHAPE = (151936, 896)
GROUP_SIZE = 32


def _forms(scheme: str) -> dict:
    def ops(int8_op, int4_op):  # noqa: ANN001, ANN202
        if scheme == "int8":
            return lambda x, w, q: int8_op(x, q.qweight, q.scales, None)
        return lambda x, w, q: int4_op(x, q.qweight, q.scales, q.zeros, GROUP_SIZE, None)

    return {
        "bf16": lambda x, w, q: F.linear(x, w),
        "bf16-gemv": lambda x, w, q: cpu_gemv(x, w, None),
        "tiles": ops(cpu_gemm_int8, cpu_gemm_int4),
        "gemv": ops(cpu_gemv_int8, cpu_gemv_int4),
        "torch": ops(int8_weight_linear, int4_weight_linear),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scheme", choices=("int8", "int4"), default="int8")
    parser.add_argument("--rows", default="1,16,64", help="comma-separated row counts")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = LAYER_SHAPES * args.layers + [HEAD_SHAPE]
    weights: list[tuple[torch.Tensor, QuantizedWeight]] = []
    for n, k in shapes:
        w = torch.randn(n, k, dtype=torch.bfloat16) / 30
        weights.append((w, quantize_int8(w) if args.scheme == "int8" else quantize_int4(w, GROUP_SIZE)))
    forms = _forms(args.scheme)
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, k, dtype=torch.bfloat16) for _, k in shapes]
            names = [f for f in forms if f not in ("gemv", "bf16-gemv") or rows <= 8]
            best = {}
            for name in names:
                forms[name](xs[0], *weights[0])  # packs on first call
            for _ in range(3):
                for name in names:
                    start = time.thread_time()
                    for x, (w, q) in zip(xs, weights, strict=True):
                        forms[name](x, w, q)
                    best[name] = min(best.get(name, float("inf")), (time.thread_time() - start) * 1e3)
            print(
                f"{args.scheme} rows={rows} " + "  ".join(f"{n}={best[n]:.1f} ms" for n in names), flush=True
            )


if __name__ == "__main__":
    main()
