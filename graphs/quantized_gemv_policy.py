"""Which buckets run their weight-quantized linears on the C++ kernel: decided by timing this machine.

The quantized linears (graphs/passes/quantize_linears.py) run on torch's int8 / int4 CPU kernels
(kernels/quantized_linear.py) unless one of the C++ kernel's forms (kernels/cpu_gemv_quantized.py)
was measured faster at a bucket's row count: the GEMV (a few rows) or the tile path (many rows:
each weight block dequantized to bf16 once and multiplied with every row on AMX);
graphs/passes/cpu_gemv_quantized.py then swaps them.

How, as graphs/gemv_policy.py times the float linears: random quantized weights of the model's
quantized shapes, in as many sets as make the model's own quantized bytes (capped), so that calls
rotating through them stream weights from memory as a forward does; the two forms alternate call
by call and their fastest calls decide (the module docstring there says why not medians). The GEMV
is a candidate up to _MAX_KERNEL_ROWS rows (it re-reads the weight per 4 rows), and once it loses
twice in a row larger ones do not time it; the tiles are timed at every row count until they won
twice in a row. The result is added to the `GemvDecision` (its `quantized_kernel_rows` and
`quantized_tile_rows`), which the compile cache keeps.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from torch import fx

from compiled_engine.graphs.gemv_policy import GemvDecision, alternate_calls
from compiled_engine.graphs.passes.fuse_linears import constant_tensor
from compiled_engine.graphs.passes.quantize_linears import QUANTIZED_LINEAR_OPS
from compiled_engine.kernels.cpu_gemv_quantized import (
    CPU_GEMV_QUANTIZED_VERSION,
    PACKED_QUANTIZED_WEIGHTS,
    cpu_gemm_int4,
    cpu_gemm_int8,
    cpu_gemm_quantized_available,
    cpu_gemv_int4,
    cpu_gemv_int8,
    cpu_gemv_quantized_available,
)
from compiled_engine.kernels.quantized_linear import (
    TORCH_INT4_WEIGHTS,
    int4_weight_linear,
    int8_weight_linear,
)
from compiled_engine.kernels.source_version import source_version

QUANTIZED_GEMV_POLICY_VERSION = f"{source_version(__name__)}-{CPU_GEMV_QUANTIZED_VERSION[:8]}"

_MAX_KERNEL_ROWS = 8
_LOSSES_TO_STOP = 2
_TILE_WINS_TO_STOP = 2
_MAX_SET_LINEARS = 12
_MAX_MEASURED_BYTES = 512 * 2**20


class QuantizedShape(NamedTuple):
    """One quantized linear: [out_features, in_features], and int4's group size (None: int8)."""

    out_features: int
    in_features: int
    group_size: int | None


def quantized_linear_shapes(gm: fx.GraphModule) -> tuple[list[QuantizedShape], torch.dtype | None]:
    """Every quantized linear of `gm` (graph order), and the activations' dtype (their scales')."""
    shapes: list[QuantizedShape] = []
    dtype = None
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in QUANTIZED_LINEAR_OPS:
            continue
        qweight, scales = constant_tensor(gm, node.args[1]), constant_tensor(gm, node.args[2])
        if qweight is None or scales is None:
            continue
        dtype = scales.dtype
        if node.target is int8_weight_linear:
            shapes.append(QuantizedShape(int(qweight.shape[0]), int(qweight.shape[1]), None))
        else:
            shapes.append(QuantizedShape(int(qweight.shape[0]), 2 * int(qweight.shape[1]), int(node.args[4])))
    return shapes, dtype


def _random_weight(shape: QuantizedShape, dtype: torch.dtype, generator: torch.Generator) -> tuple[Any, ...]:
    n, k, group = shape
    if group is None:
        q = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
        return (q, torch.rand(n, generator=generator).to(dtype) / 64)
    q = torch.randint(0, 256, (n, k // 2), generator=generator, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=generator).to(dtype) / 64
    zeros = torch.randn(n, k // group, generator=generator).to(dtype) / 64
    return (q, scales, zeros, group)


def _nbytes(shape: QuantizedShape) -> int:
    return shape.out_features * shape.in_features // (1 if shape.group_size is None else 2)


class QuantizedRows(NamedTuple):
    """Where the quantized linears leave torch's kernels, and the timings that decided it."""

    gemv_rows: tuple[int, ...]  # the C++ GEMV won
    gemv_timings: tuple[tuple[int, float, float], ...]  # (rows, torch's fastest ms, the GEMV's)
    tile_rows: tuple[int, ...]  # the kernel's tile path won
    tile_timings: tuple[tuple[int, float, float], ...]  # (rows, torch's fastest ms, the tiles'); the
    # tile rows past the last timed one (see measure_quantized_rows) have none


def measure_quantized_rows(
    shapes: Sequence[QuantizedShape], candidate_rows: Sequence[int], dtype: torch.dtype, seed: int = 0
) -> QuantizedRows:
    """Per candidate row count, the fastest of torch's kernels, the C++ GEMV (up to
    _MAX_KERNEL_ROWS rows, until it lost twice in a row) and the tile path (where it runs).
    Once the tiles beat everything _TILE_WINS_TO_STOP times in a row, larger row counts take them
    without timing (their lead grows with the rows: they read the integers once per call)."""
    rows_to_try = sorted({r for r in candidate_rows if r >= 1})
    gemv_ok = cpu_gemv_quantized_available(dtype)
    tiles_ok = cpu_gemm_quantized_available(dtype)
    if not shapes or not rows_to_try or not (gemv_ok or tiles_ok):
        return QuantizedRows((), (), (), ())
    counts = Counter(shapes)
    scale = min(1.0, _MAX_SET_LINEARS / sum(counts.values()))
    per_set = [s for s, c in counts.items() for _ in range(max(1, round(c * scale)))]
    set_bytes = sum(_nbytes(s) for s in per_set)
    model_bytes = sum(_nbytes(s) * c for s, c in counts.items())
    num_sets = max(1, min(math.ceil(model_bytes / set_bytes), _MAX_MEASURED_BYTES // max(1, set_bytes)))
    generator = torch.Generator().manual_seed(seed)
    weight_sets = [[_random_weight(s, dtype, generator) for s in per_set] for _ in range(num_sets)]
    for weights in itertools.chain.from_iterable(
        weight_sets
    ):  # packed before timing, as a warm engine has them
        if len(weights) == 2:
            PACKED_QUANTIZED_WEIGHTS.get(*weights)
        else:
            TORCH_INT4_WEIGHTS.get(*weights[:3])
            PACKED_QUANTIZED_WEIGHTS.get(*weights)
    gemv_rows: list[int] = []
    tile_rows: list[int] = []
    gemv_timings: list[tuple[int, float, float]] = []
    tile_timings: list[tuple[int, float, float]] = []
    gemv_losses = tile_wins = 0
    with torch.no_grad():
        for rows in rows_to_try:
            if tile_wins >= _TILE_WINS_TO_STOP:
                tile_rows.append(rows)
                continue
            xs = [torch.randn(1, rows, s.in_features, generator=generator).to(dtype) for s in per_set]
            turns = itertools.cycle(weight_sets)
            forms = {"torch": _calls(xs, turns, int8_weight_linear, int4_weight_linear)}
            if gemv_ok and rows <= _MAX_KERNEL_ROWS and gemv_losses < _LOSSES_TO_STOP:
                forms["gemv"] = _calls(xs, turns, cpu_gemv_int8, cpu_gemv_int4)
            if tiles_ok:
                forms["tiles"] = _calls(xs, turns, cpu_gemm_int8, cpu_gemm_int4)
            fastest = {
                name: min(seconds) * 1e3
                for name, seconds in zip(forms, alternate_calls(*forms.values()), strict=True)
            }
            winner = min(fastest, key=fastest.__getitem__)
            if "gemv" in fastest:
                gemv_timings.append((rows, fastest["torch"], fastest["gemv"]))
                gemv_losses = 0 if fastest["gemv"] < fastest["torch"] else gemv_losses + 1
            if "tiles" in fastest:
                tile_timings.append((rows, fastest["torch"], fastest["tiles"]))
            if winner == "gemv":
                gemv_rows.append(rows)
            elif winner == "tiles":
                tile_rows.append(rows)
            tile_wins = tile_wins + 1 if winner == "tiles" else 0
    return QuantizedRows(tuple(gemv_rows), tuple(gemv_timings), tuple(tile_rows), tuple(tile_timings))


def _calls(
    xs: list[torch.Tensor], turns: Iterator[list[tuple[Any, ...]]], int8_op: Callable, int4_op: Callable
) -> Callable[[], Any]:
    """One call through a weight set (the next one each time), every linear on its scheme's op."""
    return lambda: [
        int8_op(x, *w, None) if len(w) == 2 else int4_op(x, *w, None)
        for x, w in zip(xs, next(turns), strict=True)
    ]


def with_quantized_rows(
    decision: GemvDecision, gm: fx.GraphModule, candidate_rows: Sequence[int]
) -> GemvDecision:
    """`decision` plus where `gm`'s quantized linears run on the C++ GEMV (unchanged without any)."""
    shapes, dtype = quantized_linear_shapes(gm)
    if not shapes or dtype is None or decision.device != "cpu":
        return decision
    measured = measure_quantized_rows(shapes, candidate_rows, dtype)
    return replace(
        decision,
        quantized_kernel_rows=measured.gemv_rows,
        quantized_timings=measured.gemv_timings,
        quantized_tile_rows=measured.tile_rows,
        quantized_tile_timings=measured.tile_timings,
    )
