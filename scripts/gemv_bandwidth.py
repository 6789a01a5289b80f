"""How close the quantized GEMVs (kernels/cpu_gemv_quantized.cpp) and torch's int8/int4 kernels come
to streaming memory: one decode row through the Qwen2.5-0.5B shape's LM head and MLP linears, each
against `torch.sum` over a float32 tensor of the same bytes (the read rate torch reaches here), and
against the GEMV's own float inner loop (float32 activations; bf16 ones take the integer loop:
VNNI on AVX-512, vpmaddwd on AVX2).

    .venv/bin/python scripts/gemv_bandwidth.py [--threads N] [--rounds R]

Weights rotate through enough copies (>= 512 MB) that every call reads from memory, as a forward
does. Prints, per shape and kernel, the fastest and median ms and the GB/s of the bytes it reads
(codes plus scales, offsets). Quote the machine's load with the figures.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from compiled_engine.kernels.cpu_gemv_quantized import (
    PACKED_QUANTIZED_WEIGHTS,
    cpu_gemv_int4,
    cpu_gemv_int8,
)
from compiled_engine.kernels.quantized_linear import (
    TORCH_INT4_WEIGHTS,
    int4_weight_linear,
    int8_weight_linear,
)
from compiled_engine.kernels.weight_quantization import QuantizedWeight, quantize_weight
from compiled_engine.records.weight_quantization import WeightQuantization

# Qwen2.5-0.5B: hidden 896, intermediate 4864, vocabulary 151,936 (tied head).
SHAPES = {"lm_head": (151936, 896), "gate_up": (2 * 4864, 896), "down": (896, 4864)}
ROTATE_BYTES = 512 * 2**20


def _time(fn, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _report(label: str, times: list[float], nbytes: int) -> None:
    best, median = min(times), statistics.median(times)
    print(
        f"  {label:<22} best {best * 1e3:7.2f} ms  median {median * 1e3:7.2f} ms  "
        f"{nbytes / best / 1e9:5.1f} GB/s (best)  {nbytes / median / 1e9:5.1f} GB/s (median)"
    )


def _copy(q: QuantizedWeight) -> QuantizedWeight:
    zeros = None if q.zeros is None else q.zeros.clone()
    return QuantizedWeight(q.qweight.clone(), q.scales.clone(), zeros, q.group_size)


def measure(name: str, scheme: WeightQuantization, rounds: int) -> None:
    n, k = SHAPES[name]
    one = quantize_weight(torch.randn(n, k, dtype=torch.bfloat16) / 30, scheme)
    group = scheme.group_size
    packed = PACKED_QUANTIZED_WEIGHTS.get(one.qweight, one.scales, one.zeros, group)
    kernel_bytes = sum(t.numel() * t.element_size() for t in packed.tensors)
    copies = max(2, ROTATE_BYTES // kernel_bytes)
    weights = [one] + [_copy(one) for _ in range(copies - 1)]
    for w in weights:  # packed before timing, as a warm engine has them
        PACKED_QUANTIZED_WEIGHTS.get(w.qweight, w.scales, w.zeros, group)
        if w.zeros is not None:
            TORCH_INT4_WEIGHTS.get(w.qweight, w.scales, w.zeros)
    same_bytes = [torch.ones(kernel_bytes // 4) for _ in range(copies)]  # float32: summed at full speed
    x = torch.randn(1, 1, k, dtype=torch.bfloat16)
    turn = itertools.count()

    def gemv() -> torch.Tensor:
        q = weights[next(turn) % copies]
        if q.zeros is None:
            return cpu_gemv_int8(x, q.qweight, q.scales, None)
        return cpu_gemv_int4(x, q.qweight, q.scales, q.zeros, group, None)

    x32 = x.float()

    def gemv_float_path() -> torch.Tensor:  # float32 activations: the float (non-VNNI) inner loop
        q = weights[next(turn) % copies]
        if q.zeros is None:
            return cpu_gemv_int8(x32, q.qweight, q.scales.float(), None)
        return cpu_gemv_int4(x32, q.qweight, q.scales.float(), q.zeros.float(), group, None)

    def torch_op() -> torch.Tensor:
        q = weights[next(turn) % copies]
        if q.zeros is None:
            return int8_weight_linear(x, q.qweight, q.scales, None)
        return int4_weight_linear(x, q.qweight, q.scales, q.zeros, group, None)

    def read() -> torch.Tensor:
        return same_bytes[next(turn) % copies].sum()

    print(f"{name} [{n}, {k}] {scheme.label}: {kernel_bytes / 1e6:.1f} MB per call, {copies} copies")
    fns = {
        "C++ GEMV": gemv,
        "C++ GEMV, float32 x": gemv_float_path,
        "torch kernel": torch_op,
        "torch.sum, same bytes": read,
    }
    times: dict[str, list[float]] = {label: [] for label in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):  # interleaved, so a burst of load from elsewhere hits each alike
        for label, fn in fns.items():
            times[label] += _time(fn, 1)
    for label, t in times.items():
        _report(label, t, kernel_bytes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--schemes", default="int8,int4")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}")
    schemes = {"int8": WeightQuantization("int8"), "int4": WeightQuantization("int4", 32)}
    with torch.no_grad():
        for name in args.shapes.split(","):
            for scheme in args.schemes.split(","):
                measure(name, schemes[scheme], args.rounds)


if __name__ == "__main__":
    main()
