"""How each token-count bucket runs its linears: decided by timing this machine, once.

Three forms: torch's `F.linear`; the same GEMM through oneDNN over weights packed once
(graphs/passes/onednn_linear.py, CPU only); and the GEMV lowering (graphs/passes/gemv_lowering.py),
for few rows. The module is named for the last, which came first; everything below about the
lowering holds as written, and the packed form is timed beside torch's GEMM on the same inputs
(see "Packed" at the end of this docstring).

Why measure: a linear rewritten as a multiply-sum and compiled by Inductor streams the weight
on every core where torch's one-row linear uses one (graphs/passes/gemv_lowering.py), but it
reads the weight once per row and, fused into its reduction, recomputes the ops that produce
its input once per output feature; from some row count on, the GEMM wins. Where depends on
the CPU, its thread count, the dtype and the model, so no constant is right.

What is timed: random weights shaped like the model's linears, each fed the way the model
feeds it. Inductor inlines the pointwise ops that make a linear's input (an RMSNorm before
q/k/v, gate/up and the LM head; SiLU(gate) * up before the down projection) into the lowered
reduction, so they run rows x out x in times instead of rows x in. On bench-small at 8 rows
(2 threads, fp32) bare linears favoured the lowering (3.8 against 4.9 ms), the model's whole
step did not (17.6 against 15.0 ms); with their prologues the linears came out nearly level
(4.4 against 4.8 ms), and _MIN_SPEEDUP covers the rest. `linear_weight_shapes` reads each
linear's prologue kind off the graph ("norm", "activation" or "none") and the measurement
rebuilds one like it.

How: one weight set holds each distinct (shape, prologue) in proportion to how often the
model has it (at most _MAX_GRAPH_LINEARS linears, each at least once), and there are as many
sets as make the model's own weight bytes, so that calls rotating through them read weights
from memory, not cache, as a forward does. For each candidate row count, smallest first, it
times calls through one set both ways: torch's `F.linear` on the finished inputs (the
prologue runs once either way in an unlowered graph, a negligible rows x in), and the
prologues plus linears lowered by GemvLowering, compiled by Inductor at that static row
count: one compiled function covering every shape, one graph and C++ build per row count.
The cap on linears bounds that build (25 linears: 2.5 s cold, 1.1 s from Inductor's cache;
5 linears: 1.3 s and 0.2 s). The two forms alternate call by call, so load from elsewhere on
the machine hits both alike. Medians and fastest calls are recorded; the fastest calls
decide. Why not the medians: with another process busy on a 2-core machine, every OpenMP
barrier in the compiled form waits for a descheduled thread, and its median grew up to 25x
(28.6 ms against a fastest 5.5 ms for the same call) while torch's one-threaded GEMV barely
moved: medians measure the neighbour. Load only ever adds time, so the fastest call is the
cost on the quiet machine the engine serves from. The lowering must win by _MIN_SPEEDUP.
Once the GEMM wins at two row counts in a row, larger ones are assumed GEMM and not timed
(recorded in `unmeasured_rows`).

Off the CPU nothing is measured: cuBLAS has proper GEMV kernels, and the decision says
"never lower". The decision serialises to JSON (`to_json`/`from_json`, stamped with
GEMV_POLICY_VERSION) so a warm start reads it from the compile cache instead of re-timing.

`gemv_variant(gm, rows)` then makes the graph for a bucket: a copy of the general graph,
sharing its weights, with every linear rewritten.

Packed: where oneDNN can pack the dtype (kernels/onednn_linear.py), every measured row count
also times the linears through it (weights packed before timing, as a warm engine has them),
and the lowering must beat the faster GEMM form. Once the lowering is out (two losses in a row)
row counts are timed for the two GEMM forms alone, until one has won twice in a row; larger
row counts, and the dynamic graph above the largest bucket, take that winner. Where the kernel is
still timed past that point (the AVX2 register tiles below), a packed / widened form that beat
torch's GEMM twice in a row is timed against it alone: torch's GEMM is timed no more (its
`gemm_ms` is None), since it is the slowest form there and its calls cost the most (torch's bf16
GEMM at 512 rows on a Zen 3: 0.6 s a call; timing it at every bucket to 512 made a bench-small
bf16 measurement take 11-33 s, without it 6-10 s, where the old rule, which stopped timing at
24-32 rows, took 2-3 s). torch's GEMM
wins a row count only by beating the packed form by _PACKED_TIE: at a few rows both stream
the weights and tie within noise, and a tie must not hand the compute-bound rows to it. On bench-small
(2 threads, fp32) the packed form took 2.69 ms where `F.linear` took 5.76 at 8 rows, and won from
4 rows up (docs/performance.md).

Widened: where oneDNN cannot run the dtype (bf16 on a CPU without AVX-512 BF16 or AMX, and
fp16), the fp32 GEMM over widened weights (kernels/widened_linear.py) is timed in the packed
form's place, by the same rules (the tie, two wins in a row for the larger row counts). On a Zen 3
(AVX2), torch's bf16 GEMM took 2.5-7x the fp32 GEMM's time at 16-512 rows, the widened one
1.1-1.2x (docs/performance.md).

Kernel: at the few smallest row counts (up to _MAX_KERNEL_ROWS, until it loses twice in a row; a
bf16 kernel with AMX tiles starts its count again at the tiles' first row count, where it
becomes another kernel, and is timed up to _MAX_TILE_ROWS; the AVX2 kernel likewise at its
register tiles' first row count, timed up to _MAX_REGISTER_TILE_ROWS) the hand-written C++ GEMV
(kernels/cpu_gemv.py, its weights packed before timing) is timed too, on the finished inputs as
torch's GEMM is (it runs the same prologue once). A row count runs it (`kernel_rows`) where its
fastest call beats both GEMM forms, and the lowering then has to beat it by _MIN_SPEEDUP as it
has to beat the GEMMs. On bench-small's linears (bf16, 2 threads, 1 row, a loaded machine) its
fastest call took 2.05 ms against 15.5 (oneDNN), 20.6 (`F.linear`) and 30.6 (the lowering);
docs/performance.md has the rest.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.proxy import GraphAppendingTracer

from compiled_engine.graphs.constant_recipes import RECIPES_META
from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.graphs.passes.fuse_linears import constant_tensor, linear_operands
from compiled_engine.graphs.passes.gemv_lowering import GemvLowering
from compiled_engine.kernels.cpu_gemv import (
    CPU_GEMV_VERSION,
    ISA_AMX_TILES,
    ISA_AVX2,
    PACKED_GEMV_WEIGHTS,
    REGISTER_TILE_MIN_ROWS,
    TILE_MIN_ROWS,
    cpu_gemv,
    cpu_gemv_available,
    gemv_isa,
)
from compiled_engine.kernels.onednn_linear import PACKED_WEIGHTS, onednn_linear, onednn_linear_available
from compiled_engine.kernels.source_version import source_version
from compiled_engine.kernels.widened_linear import widened_linear, widened_linear_available

# A hash of this source and of the C++ GEMV it times: when the measurement, the decision rule or
# the kernel changes, cached decisions stop loading.
GEMV_POLICY_VERSION = f"{source_version(__name__)}-{CPU_GEMV_VERSION[:8]}"

# Larger row counts are assumed GEMM after this many GEMM wins in a row.
_GEMM_WINS_TO_STOP = 2
# How much faster the lowered linears must be to count as a win. The measured prologues are
# the usual ones, not everything Inductor inlines in a real graph (residual adds, embedding
# lookups, casts), so the lowered form's real cost is a little higher: on bench-small at
# 8 rows the linears measured 4.4 ms lowered against 4.8 ms, the whole step 17.6 against 15.0.
_MIN_SPEEDUP = 1.1
# torch's GEMM must beat the packed one by this much to be chosen over it. At a few rows both
# stream the weights and tie within noise; the winner there decides the untimed larger row
# counts (_GEMM_WINS_TO_STOP), where the packed form is the fast one once compute dominates
# (a bench-small bf16 engine here recorded 1.17/1.23 ms torch/packed at 4 rows and 1.29/1.30
# at 8, so its 64-row bucket ran torch's GEMM; docs/performance.md, session 14).
_PACKED_TIE = 1.1
# Row counts above these never time (or run) the C++ GEMV. Its dot path re-reads the weight per 4
# rows, and oneDNN's GEMM takes over well before 16. Its AMX tile path (bf16) reads the weight once
# for every row; on bench-small's linears here it beat oneDNN's GEMM up to 32 rows, tied at 48 and
# lost from 64 (docs/performance.md, "The GEMV's tile path past 16 rows").
_MAX_KERNEL_ROWS = 16
_MAX_TILE_ROWS = 48
# The AVX2 path's register tiles (from REGISTER_TILE_MIN_ROWS) are compute-bound as a GEMM is: on a
# Zen 3 they beat the widened bf16 GEMM and tied fp32's up to 64 rows (docs/performance.md,
# "Register tiles for the AVX2 GEMV"), so they are timed at every bucket until two losses in a row.
_MAX_REGISTER_TILE_ROWS = 512
# A median this far above the fastest call means other work competed for the cores.
_NOISY_SPREAD = 1.5
# Linears in one measured set (see the module docstring); a shape the model has once still
# appears once, so with many distinct shapes a set holds more.
_MAX_GRAPH_LINEARS = 12
# Bytes of random weights a measurement may allocate: fewer sets than the model's bytes would
# ask for beyond it (the working set is then still far beyond any CPU cache).
_MAX_MEASURED_BYTES = 512 * 2**20
# Timed calls per form and row count: at least _MIN_REPEATS, then until _TIME_BUDGET_S has
# passed for the pair, at most _MAX_REPEATS.
_WARMUP_CALLS = 2
_MIN_REPEATS = 5
_MAX_REPEATS = 25
_TIME_BUDGET_S = 0.25

# Prologue kinds: what produces a linear's input, as far as Inductor would fuse it.
NORM, ACTIVATION, NONE = "norm", "activation", "none"
# Walking back from a linear's input: ops passed through (views, pointwise arithmetic) and
# the ones that name the prologue. Anything else (a reduction, a linear, a custom op, a graph
# input) ends the walk; so does _MAX_PROLOGUE_NODES, which keeps it local.
_PASS_THROUGH = frozenset(
    {"view", "reshape", "contiguous", "getitem", "to", "float", "type_as", "unsqueeze", "squeeze"}
    | {"expand", "mul", "add", "sub", "truediv", "neg", "pow", "clone"}
)
_NORM_OPS = frozenset({"rsqrt"})
_ACTIVATION_OPS = frozenset({"silu", "gelu", "sigmoid", "tanh", "exp", "erf", "softplus", "relu"})
_MAX_PROLOGUE_NODES = 64
_NORM_EPS = 1e-6


class LinearShape(NamedTuple):
    """One linear: weight [out_features, in_features] of `dtype`, and its input's prologue kind."""

    out_features: int
    in_features: int
    dtype: torch.dtype
    prologue: str = NONE


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else ""


def prologue_kind(x: Any) -> str:
    """NORM, ACTIVATION or NONE: the pointwise ops producing `x` that a lowered linear would inline.

    An activation anywhere in them wins (the costliest to recompute), then a normalisation.
    """
    found = NONE
    pending: list[Any] = [x]
    seen: set[fx.Node] = set()
    while pending and len(seen) < _MAX_PROLOGUE_NODES:
        node = pending.pop()
        if not isinstance(node, fx.Node) or node in seen:
            continue
        seen.add(node)
        name = _op_name(node)
        if name in _ACTIVATION_OPS:
            return ACTIVATION
        if name in _NORM_OPS:
            found = NORM
        elif name not in _PASS_THROUGH:
            continue
        pending.extend(n for n in (*node.args, *node.kwargs.values()) if isinstance(n, fx.Node))
    return found


def linear_weight_shapes(gm: fx.GraphModule) -> list[LinearShape]:
    """Every linear in `gm` whose weight is a graph constant, in graph order."""
    shapes = []
    for node in gm.graph.nodes:
        operands = linear_operands(node)
        if operands is None:
            continue
        weight = constant_tensor(gm, operands[1])
        if weight is not None and weight.dim() == 2:
            out_features, in_features = (int(d) for d in weight.shape)
            shapes.append(LinearShape(out_features, in_features, weight.dtype, prologue_kind(operands[0])))
    return shapes


@dataclass(frozen=True)
class RowTiming:
    """Milliseconds of one call through all the measured linears at `rows` rows, per form.

    Medians and fastest calls; a form's fields are None where it was not timed.
    """

    rows: int
    gemm_ms: float | None  # torch's F.linear; None once a prepared form has settled (module docstring)
    gemv_ms: float | None  # Inductor-compiled prologues and multiply-sums
    gemm_best_ms: float | None
    gemv_best_ms: float | None
    packed_ms: float | None = None  # oneDNN over packed weights
    packed_best_ms: float | None = None
    kernel_ms: float | None = None  # the C++ GEMV over its packed weights
    kernel_best_ms: float | None = None
    # The fp32 GEMM over widened bf16 / fp16 weights (kernels/widened_linear.py): timed instead
    # of the packed form where oneDNN cannot run the dtype, so at most one of the two is set.
    widened_ms: float | None = None
    widened_best_ms: float | None = None

    @property
    def packing_wins(self) -> bool:
        """Whether oneDNN over packed weights is the GEMM to use here: unless torch's GEMM's
        fastest call beat it by _PACKED_TIE (a tie goes to the packed form, see there)."""
        return self.packed_best_ms is not None and (
            self.gemm_best_ms is None or self.packed_best_ms < self.gemm_best_ms * _PACKED_TIE
        )

    @property
    def widening_wins(self) -> bool:
        """Whether the widened GEMM is the GEMM to use here, by the packed form's rule."""
        return self.widened_best_ms is not None and (
            self.gemm_best_ms is None or self.widened_best_ms < self.gemm_best_ms * _PACKED_TIE
        )

    @property
    def _best_gemm_ms(self) -> float:
        # The faster form's call, whichever the row count then runs: the lowering and the kernel
        # must beat every GEMM form (module docstring), not only the one a near tie picked.
        timed = [t for t in (self.gemm_best_ms, self.packed_best_ms, self.widened_best_ms) if t is not None]
        return min(timed)

    @property
    def lowering_wins(self) -> bool:
        """Whether the lowering beat the faster GEMM form and the C++ GEMV by _MIN_SPEEDUP (fastest calls)."""
        if self.gemv_best_ms is None:
            return False
        rival = self._best_gemm_ms
        if self.kernel_best_ms is not None:
            rival = min(rival, self.kernel_best_ms)
        return rival > _MIN_SPEEDUP * self.gemv_best_ms

    @property
    def kernel_wins(self) -> bool:
        """Whether the C++ GEMV beat both GEMM forms (fastest calls) and the lowering did not win."""
        return (
            self.kernel_best_ms is not None
            and self.kernel_best_ms < self._best_gemm_ms
            and not self.lowering_wins
        )

    def spreads(self) -> list[float]:
        """Median over fastest call, per timed form."""
        pairs: tuple[tuple[float | None, float | None], ...] = (
            (self.gemm_ms, self.gemm_best_ms),
            (self.gemv_ms, self.gemv_best_ms),
            (self.packed_ms, self.packed_best_ms),
            (self.kernel_ms, self.kernel_best_ms),
            (self.widened_ms, self.widened_best_ms),
        )
        return [median / best for median, best in pairs if median is not None and best]


@dataclass(frozen=True)
class GemvDecision:
    """How each row count (bucket) runs its linears, and the evidence.

    `lowered_rows` get the GEMV lowering; `kernel_rows` (none of them lowered) the C++ GEMV;
    `packed_rows` (neither) oneDNN over packed weights; `widened_rows` (where oneDNN cannot run
    the dtype) the fp32 GEMM over widened weights; any other row count torch's GEMM.
    `packs_dynamic` / `widens_dynamic`: the same for the dynamic graph (steps above the largest bucket).
    """

    lowered_rows: tuple[int, ...]
    timings: tuple[RowTiming, ...] = ()
    unmeasured_rows: tuple[int, ...] = ()  # given the form that won the last measured rows
    reason: str = ""
    device: str = "cpu"
    dtype: str = ""
    num_threads: int = 0
    # (out_features, in_features, prologue, count) of the linears, for a person reading the cache.
    shapes: tuple[tuple[int, int, str, int], ...] = ()
    packed_rows: tuple[int, ...] = ()
    packs_dynamic: bool = False
    kernel_rows: tuple[int, ...] = ()
    # Weight-quantized linears (graphs/quantized_gemv_policy.py): the row counts where the C++
    # GEMV's int8/int4 variants beat torch's kernels, and (rows, torch's fastest ms, the GEMV's).
    quantized_kernel_rows: tuple[int, ...] = ()
    quantized_timings: tuple[tuple[int, float, float], ...] = ()
    # ... and where the kernel's tile path (many rows, AMX) beat both, with (rows, torch's fastest
    # ms, the tiles') for the row counts timed (larger ones follow two wins in a row untimed).
    quantized_tile_rows: tuple[int, ...] = ()
    quantized_tile_timings: tuple[tuple[int, float, float], ...] = ()
    widened_rows: tuple[int, ...] = ()
    widens_dynamic: bool = False
    version: str = field(default=GEMV_POLICY_VERSION)

    def lowers(self, rows: int) -> bool:
        """Whether a graph run at exactly `rows` token rows should be lowered."""
        return rows in self.lowered_rows

    def runs_kernel(self, rows: int) -> bool:
        """Whether a graph run at exactly `rows` token rows should run its linears on the C++ GEMV."""
        return rows in self.kernel_rows

    def runs_quantized_kernel(self, rows: int) -> bool:
        """Whether a graph run at exactly `rows` rows should run its quantized linears on the C++ GEMV."""
        return rows in self.quantized_kernel_rows

    def runs_quantized_tiles(self, rows: int | None) -> bool:
        """Whether a graph run at exactly `rows` rows (None: the dynamic graph) should run its
        quantized linears on the tile path. The dynamic graph runs the steps larger than every
        bucket, where the tiles' lead over torch's kernels only grows (they read the integers once
        per call, torch's int8 kernel ~9x slower than them at 64 rows already): it takes them
        wherever the policy found them winning at all."""
        if rows is None:
            return bool(self.quantized_tile_rows)
        return rows in self.quantized_tile_rows

    def packs(self, rows: int | None) -> bool:
        """Whether a graph run at exactly `rows` rows (None: the dynamic graph) should pack."""
        return self.packs_dynamic if rows is None else rows in self.packed_rows

    def widens(self, rows: int | None) -> bool:
        """Whether a graph run at exactly `rows` rows (None: the dynamic graph) should widen its
        bf16 / fp16 linears into fp32 GEMMs."""
        return self.widens_dynamic if rows is None else rows in self.widened_rows

    @property
    def noisy(self) -> bool:
        """Whether other work competed for the cores while timing: better re-measured than cached.

        Under steady load even the fastest calls mislead (a busy run on bench-small timed the
        1-row lowering at 88 ms, 1.6 ms quiet, and lowered nothing); the spread shows it.
        """
        return any(spread > _NOISY_SPREAD for t in self.timings for spread in t.spreads())

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GemvDecision:
        """Parse `to_json` output; ValueError when it is malformed or from another policy version."""
        try:
            data = json.loads(text)
            if data.get("version") != GEMV_POLICY_VERSION:
                raise ValueError(
                    f"GEMV decision is {data.get('version')!r}, expected {GEMV_POLICY_VERSION!r}"
                )
            return cls(
                lowered_rows=tuple(int(r) for r in data["lowered_rows"]),
                timings=tuple(
                    RowTiming(
                        rows=int(t["rows"]),
                        gemm_ms=_optional_float(t["gemm_ms"]),
                        gemv_ms=_optional_float(t["gemv_ms"]),
                        gemm_best_ms=_optional_float(t["gemm_best_ms"]),
                        gemv_best_ms=_optional_float(t["gemv_best_ms"]),
                        packed_ms=_optional_float(t["packed_ms"]),
                        packed_best_ms=_optional_float(t["packed_best_ms"]),
                        kernel_ms=_optional_float(t["kernel_ms"]),
                        kernel_best_ms=_optional_float(t["kernel_best_ms"]),
                        widened_ms=_optional_float(t["widened_ms"]),
                        widened_best_ms=_optional_float(t["widened_best_ms"]),
                    )
                    for t in data["timings"]
                ),
                packed_rows=tuple(int(r) for r in data["packed_rows"]),
                packs_dynamic=bool(data["packs_dynamic"]),
                widened_rows=tuple(int(r) for r in data["widened_rows"]),
                widens_dynamic=bool(data["widens_dynamic"]),
                kernel_rows=tuple(int(r) for r in data["kernel_rows"]),
                quantized_kernel_rows=tuple(int(r) for r in data["quantized_kernel_rows"]),
                quantized_timings=tuple(
                    (int(r), float(a), float(b)) for r, a, b in data["quantized_timings"]
                ),
                quantized_tile_rows=tuple(int(r) for r in data["quantized_tile_rows"]),
                quantized_tile_timings=tuple(
                    (int(r), float(a), float(b)) for r, a, b in data["quantized_tile_timings"]
                ),
                unmeasured_rows=tuple(int(r) for r in data["unmeasured_rows"]),
                reason=str(data["reason"]),
                device=str(data["device"]),
                dtype=str(data["dtype"]),
                num_threads=int(data["num_threads"]),
                shapes=tuple((int(o), int(i), str(k), int(c)) for o, i, k, c in data["shapes"]),
                version=data["version"],
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as error:
            raise ValueError(f"not a GEMV decision: {error}") from error


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


# One measured linear: (out_features, in_features, prologue kind).
_Linear = tuple[int, int, str]


def _check_rows(candidate_rows: Sequence[int]) -> tuple[int, ...]:
    rows = tuple(sorted(set(candidate_rows)))
    if any(not isinstance(r, int) or r < 1 for r in rows):
        raise ValueError(f"candidate row counts must be positive ints, got {list(candidate_rows)}")
    return rows


def _as_linear(shape: tuple[int, int] | LinearShape) -> _Linear:
    kind = shape.prologue if isinstance(shape, LinearShape) else NONE
    if kind not in (NORM, ACTIVATION, NONE):
        raise ValueError(f"unknown prologue kind {kind!r}")
    return int(shape[0]), int(shape[1]), kind


def measure_gemv_rows(
    shapes: Sequence[tuple[int, int]] | Sequence[LinearShape],
    candidate_rows: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    kernel: bool = True,
) -> GemvDecision:
    """Time `shapes` (one per linear, repeats included) both ways per row count.

    A plain (out, in) pair is a linear without a prologue. See the module docstring.
    Candidates are measured smallest first; off the CPU nothing is measured or lowered.
    `kernel`: whether the C++ GEMV is a candidate (where it can run).
    """
    rows_to_try = _check_rows(candidate_rows)
    device = torch.device(device)
    counts = Counter(_as_linear(s) for s in shapes)
    described = tuple((o, i, k, c) for (o, i, k), c in sorted(counts.items()))
    device_name, dtype_name = str(device), str(dtype).removeprefix("torch.")

    def never_lowered(reason: str) -> GemvDecision:
        return GemvDecision(
            (),
            unmeasured_rows=rows_to_try,
            reason=reason,
            device=device_name,
            dtype=dtype_name,
            shapes=described,
        )

    if device.type == "cuda":
        return never_lowered("not measured on cuda: cuBLAS has fast GEMV kernels, never lowered")
    if device.type != "cpu":
        return never_lowered(
            f"not measured on {device.type}: the lowering is only measured on CPUs, never lowered"
        )
    if not counts or not rows_to_try:
        return never_lowered("no constant-weight linears" if not counts else "no candidate row counts")

    generator = torch.Generator().manual_seed(seed)
    per_set, num_sets = _weight_sets_layout(counts, dtype)
    linears = [linear for linear, copies in per_set.items() for _ in range(copies)]
    weight_sets = [
        [torch.rand(o, i, generator=generator, dtype=dtype) for o, i, _ in linears] for _ in range(num_sets)
    ]
    packing = onednn_linear_available(dtype, device)
    # Where oneDNN cannot run the dtype (bf16 without AVX-512 BF16 or AMX, fp16), the widened
    # GEMM takes the packed form's place: the GEMM form timed against torch's.
    widening = not packing and widened_linear_available(dtype, device)
    prepared = packing or widening
    kernel_available = kernel and cpu_gemv_available(dtype, device)
    timings: list[RowTiming] = []
    unmeasured: list[int] = []
    gemm_wins_in_a_row = 0
    kernel_losses_in_a_row = 0
    # From TILE_MIN_ROWS on, a bf16 kernel on a CPU with AMX runs its tile path: another kernel,
    # which its dot path's losses at fewer rows say nothing about.
    tiles = kernel_available and dtype == torch.bfloat16 and gemv_isa() >= ISA_AMX_TILES
    # So is the AVX2 path's register tiles from REGISTER_TILE_MIN_ROWS, every dtype.
    register_tiles = kernel_available and gemv_isa() == ISA_AVX2
    tiles_from = TILE_MIN_ROWS if tiles else REGISTER_TILE_MIN_ROWS if register_tiles else None
    max_kernel_rows = (
        _MAX_TILE_ROWS if tiles else _MAX_REGISTER_TILE_ROWS if register_tiles else _MAX_KERNEL_ROWS
    )
    # The GEMM form that won the last unlowered rows (packed / widened or torch's), and how many in a row.
    gemm_form, form_wins_in_a_row = False, 0
    for rows in rows_to_try:
        if tiles_from is not None and rows >= tiles_from:
            kernel_losses_in_a_row, tiles_from = 0, None
        lowering_in_play = gemm_wins_in_a_row < _GEMM_WINS_TO_STOP
        kernel_in_play = (
            kernel_available and rows <= max_kernel_rows and kernel_losses_in_a_row < _GEMM_WINS_TO_STOP
        )
        if (
            not lowering_in_play
            and not kernel_in_play
            and (not prepared or form_wins_in_a_row >= _GEMM_WINS_TO_STOP)
        ):
            unmeasured.append(rows)
            continue
        # A packed / widened form that beat torch's GEMM twice in a row has settled the GEMM
        # form: where the kernel is still timed, against that form alone (module docstring).
        gemm_settled = prepared and gemm_form and form_wins_in_a_row >= _GEMM_WINS_TO_STOP
        timing = _time_rows(
            rows,
            linears,
            weight_sets,
            generator,
            gemv=lowering_in_play,
            packed=packing,
            kernel=kernel_in_play,
            widened=widening,
            gemm=not gemm_settled,
        )
        timings.append(timing)
        if lowering_in_play:
            gemm_wins_in_a_row = 0 if timing.lowering_wins else gemm_wins_in_a_row + 1
        if kernel_in_play:
            kernel_losses_in_a_row = 0 if timing.kernel_wins else kernel_losses_in_a_row + 1
        if not timing.lowering_wins:
            won = timing.packing_wins or timing.widening_wins
            same = won == gemm_form
            gemm_form, form_wins_in_a_row = won, (form_wins_in_a_row + 1 if same else 1)

    def prepared_rows(wins: Callable[[RowTiming], bool], form_timed: bool) -> tuple[int, ...]:
        measured = tuple(t.rows for t in timings if wins(t) and not t.lowering_wins and not t.kernel_wins)
        return measured + (tuple(unmeasured) if gemm_form and form_timed else ())

    return GemvDecision(
        lowered_rows=tuple(t.rows for t in timings if t.lowering_wins),
        kernel_rows=tuple(t.rows for t in timings if t.kernel_wins),
        timings=tuple(timings),
        unmeasured_rows=tuple(unmeasured),
        reason=(
            f"measured: {num_sets} set(s) of {len(linears)} weights, "
            f"{sum(w.nbytes for ws in weight_sets for w in ws) / 2**20:.1f} MiB"
            + ("" if packing else f"; oneDNN cannot pack {dtype} here, not timed")
            + (f"; {dtype} widened to fp32 GEMMs timed in its place" if widening else "")
            + ("" if kernel_available or not kernel else f"; the C++ GEMV cannot run {dtype} here, not timed")
        ),
        num_threads=torch.get_num_threads(),
        packed_rows=prepared_rows(lambda t: t.packing_wins, packing),
        packs_dynamic=gemm_form and packing,
        widened_rows=prepared_rows(lambda t: t.widening_wins, widening),
        widens_dynamic=gemm_form and widening,
        device=device_name,
        dtype=dtype_name,
        shapes=described,
    )


def decide_gemv_rows(
    gm: fx.GraphModule, candidate_rows: Sequence[int], device: torch.device | str | None = None
) -> GemvDecision:
    """`measure_gemv_rows` for `gm`'s constant-weight linears, on their device and dtype.

    A graph with linears of several dtypes is measured in the one holding most weight bytes.
    """
    shapes = linear_weight_shapes(gm)
    weight_bytes: Counter[torch.dtype] = Counter()
    for s in shapes:
        weight_bytes[s.dtype] += s.out_features * s.in_features * s.dtype.itemsize
    dtype = weight_bytes.most_common(1)[0][0] if weight_bytes else torch.get_default_dtype()
    if device is None:
        devices = {t.device for t in (*gm.parameters(), *gm.buffers())}
        device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    return measure_gemv_rows(shapes, candidate_rows, dtype, device)


def _weight_sets_layout(counts: Counter[_Linear], dtype: torch.dtype) -> tuple[dict[_Linear, int], int]:
    """Weights of each linear kind in one measured set, and how many sets (module docstring)."""
    scale = min(1.0, _MAX_GRAPH_LINEARS / sum(counts.values()))
    per_set = {linear: max(1, round(count * scale)) for linear, count in counts.items()}
    set_bytes = sum(o * i * n for (o, i, _), n in per_set.items()) * dtype.itemsize
    model_bytes = sum(o * i * c for (o, i, _), c in counts.items()) * dtype.itemsize
    return per_set, max(1, min(math.ceil(model_bytes / set_bytes), _MAX_MEASURED_BYTES // set_bytes))


def _prologue_inputs(
    kind: str, rows: int, in_features: int, dtype: torch.dtype, generator: torch.Generator
) -> list[torch.Tensor]:
    """Random inputs of a linear's prologue: hidden states and norm weight, gate and up, or x."""
    per_row = [torch.randn(1, rows, in_features, generator=generator, dtype=dtype)]
    if kind == NORM:
        return [*per_row, torch.randn(in_features, generator=generator, dtype=dtype)]
    if kind == ACTIVATION:
        return [*per_row, torch.randn(1, rows, in_features, generator=generator, dtype=dtype)]
    return per_row


_PROLOGUE_INPUTS = {NORM: 2, ACTIVATION: 2, NONE: 1}


def _prologue(kind: str, inputs: Sequence[Any]) -> Any:
    """The input a linear of `kind` sees; on tensors, or on fx Proxies to record it in a graph."""
    if kind == NORM:  # RMSNorm
        hidden, scale = inputs
        return hidden * torch.rsqrt((hidden * hidden).mean(-1, keepdim=True) + _NORM_EPS) * scale
    if kind == ACTIVATION:  # SwiGLU
        gate, up = inputs
        return F.silu(gate) * up
    return inputs[0]


def _measured_graph(linears: Sequence[_Linear], rows: int) -> fx.GraphModule:
    """(prologue inputs of each linear..., weights...) -> each linear of its prologue, lowered.

    Lowered by the very pass the buckets get, so the timed code is what they would run.
    """
    graph = fx.Graph()
    tracer = GraphAppendingTracer(graph)
    xs = []
    for index, (_, _, kind) in enumerate(linears):
        inputs = [graph.placeholder(f"x{index}_{k}") for k in range(_PROLOGUE_INPUTS[kind])]
        xs.append(_prologue(kind, [fx.Proxy(node, tracer) for node in inputs]).node)
    ws = [graph.placeholder(f"w{index}") for index in range(len(linears))]
    graph.output(tuple(graph.call_function(F.linear, (x, w)) for x, w in zip(xs, ws, strict=True)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    lowered = GemvLowering(max_rows=rows, rows_hint=rows)(gm).nodes_rewritten
    if lowered != len(linears):
        raise RuntimeError(f"gemv_policy: the lowering rewrote {lowered} of {len(linears)} linears")
    gm.recompile()
    return gm


def _time_rows(
    rows: int,
    linears: Sequence[_Linear],
    weight_sets: list[list[torch.Tensor]],
    generator: torch.Generator,
    gemv: bool = True,
    packed: bool = False,
    kernel: bool = False,
    widened: bool = False,
    gemm: bool = True,
) -> RowTiming:
    """Time the linears at `rows` rows: torch's GEMM (unless `gemm` is False, when a packed or
    widened form must be timed), plus the lowering (`gemv`), oneDNN over packed weights
    (`packed`), the C++ GEMV (`kernel`) and the widened GEMM (`widened`) when asked."""
    if not gemm and not packed and not widened:
        raise ValueError("_time_rows: without torch's GEMM a packed or widened form must be timed")
    # Inputs of their own for every linear, as in a model where each layer reads its own
    # activation: shared ones would let Inductor fuse reductions that a real graph cannot.
    inputs = [_prologue_inputs(kind, rows, i, weight_sets[0][0].dtype, generator) for _, i, kind in linears]
    flat_inputs = [t for group in inputs for t in group]
    # Every call, of any form, takes the next set: none reads weights the call before it left
    # in cache (unless there is one set, when the model's weights fit in cache anyway).
    turns = itertools.cycle(weight_sets)
    forms: dict[str, Callable[[], Any]] = {}
    with torch.no_grad():
        # The unlowered graph computes each prologue once, a negligible rows x in: untimed.
        xs = [_prologue(kind, group) for (_, _, kind), group in zip(linears, inputs, strict=True)]
        if gemm:
            forms["gemm"] = lambda: [F.linear(x, w) for x, w in zip(xs, next(turns), strict=True)]
        if packed:
            for w in itertools.chain.from_iterable(weight_sets):
                PACKED_WEIGHTS.get(w)  # packed before timing, as a warm engine has them
            forms["packed"] = lambda: [
                onednn_linear(x, w, None) for x, w in zip(xs, next(turns), strict=True)
            ]
        if kernel:
            for w in itertools.chain.from_iterable(weight_sets):
                PACKED_GEMV_WEIGHTS.get(w)  # packed before timing, as a warm engine has them
            forms["kernel"] = lambda: [cpu_gemv(x, w, None) for x, w in zip(xs, next(turns), strict=True)]
        if widened:
            forms["widened"] = lambda: [
                widened_linear(x, w, None) for x, w in zip(xs, next(turns), strict=True)
            ]
        if gemv:
            from torch._inductor.compile_fx import compile_fx  # Inductor imports slowly; only when timing

            # Outside AOT mode compile_fx returns the compiled callable; its annotation also
            # covers the AOT outputs (paths, weights), which this call never asks for.
            measured = _measured_graph(linears, rows)
            compiled = cast(Callable[..., Any], compile_fx(measured, [*flat_inputs, *weight_sets[0]]))
            forms["gemv"] = lambda: compiled(*flat_inputs, *next(turns))
        seconds = dict(zip(forms, _alternate(*forms.values()), strict=True))

    def median_ms(form: str) -> float | None:
        return statistics.median(seconds[form]) * 1e3 if form in seconds else None

    def best_ms(form: str) -> float | None:
        return min(seconds[form]) * 1e3 if form in seconds else None

    return RowTiming(
        rows,
        gemm_ms=median_ms("gemm"),
        gemv_ms=median_ms("gemv"),
        gemm_best_ms=best_ms("gemm"),
        gemv_best_ms=best_ms("gemv"),
        packed_ms=median_ms("packed"),
        packed_best_ms=best_ms("packed"),
        kernel_ms=median_ms("kernel"),
        kernel_best_ms=best_ms("kernel"),
        widened_ms=median_ms("widened"),
        widened_best_ms=best_ms("widened"),
    )


def alternate_calls(*fns: Callable[[], Any]) -> list[list[float]]:
    """Seconds per call of each fn, calls interleaved (graphs/quantized_gemv_policy.py times with it too)."""
    return _alternate(*fns)


def _alternate(*fns: Callable[[], Any]) -> list[list[float]]:
    """Seconds per call of each fn, calls interleaved so that outside load hits all of them alike."""
    for _ in range(_WARMUP_CALLS):
        for fn in fns:
            fn()
    seconds: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while len(seconds[0]) < _MAX_REPEATS and (
        len(seconds[0]) < _MIN_REPEATS or time.perf_counter() - start < _TIME_BUDGET_S
    ):
        for fn, record in zip(fns, seconds, strict=True):
            begin = time.perf_counter()
            fn()
            record.append(time.perf_counter() - begin)
    return seconds


def gemv_variant(gm: fx.GraphModule, rows: int) -> tuple[fx.GraphModule, PassResult]:
    """A new GraphModule for running `gm` at `rows` token rows only, every linear as multiply-sum.

    `gm` is left untouched. The new module holds the very same weight tensors (no copy: the
    attributes are registered on it by reference, parameters as parameters, buffers with their
    persistence) and copies of the nodes with their meta (example values included, which
    Inductor and the other passes read), plus Dynamo's attributes (`meta`,
    `_param_name_to_source`, ...), so it compiles exactly as `gm` would.
    """
    variant = share_graph_module(gm)
    result = GemvLowering(max_rows=rows, rows_hint=rows)(variant)
    variant.graph.lint()
    variant.recompile()
    return variant, result


def share_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule with a copy of `gm`'s graph and `gm`'s own attribute objects (weights shared)."""
    graph = copy.deepcopy(gm.graph)  # nodes copied, each node's meta dict shallow-copied
    for old, new in zip(gm.graph.nodes, graph.nodes, strict=True):
        source = getattr(old, "_dynamo_source", None)  # read by calling conventions, not in meta
        if source is not None:
            new._dynamo_source = source
    # Registers each get_attr target on the new module: the same tensor object, a Parameter as
    # a parameter, any other tensor as a (persistent) buffer.
    variant = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    for node in graph.nodes:
        if node.op == "get_attr":
            _copy_persistence(gm, variant, str(node.target))
    for key, value in vars(gm).items():
        # Dynamo's extras; containers copied so that adding to one module leaves the other alone.
        if key not in vars(variant):
            setattr(variant, key, copy.copy(value) if isinstance(value, (dict, list, set)) else value)
    variant.meta = dict(gm.meta)
    if RECIPES_META in variant.meta:  # a variant's passes record recipes of their own constants
        variant.meta[RECIPES_META] = dict(variant.meta[RECIPES_META])
    return variant


def _copy_persistence(source: torch.nn.Module, target: torch.nn.Module, qualified_name: str) -> None:
    *path, name = qualified_name.split(".")
    for part in path:
        source, target = getattr(source, part), getattr(target, part)
    if name in source._non_persistent_buffers_set:
        target._non_persistent_buffers_set.add(name)
