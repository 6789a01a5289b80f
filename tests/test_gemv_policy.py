"""GEMV policy: per-bucket graph variants that share weights, and the measured decision."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from compiled_engine.graphs import gemv_policy
from compiled_engine.graphs.gemv_policy import (
    GEMV_POLICY_VERSION,
    GemvDecision,
    LinearShape,
    RowTiming,
    decide_gemv_rows,
    gemv_variant,
    linear_weight_shapes,
    measure_gemv_rows,
)
from compiled_engine.graphs.passes.fuse_linears import LINEAR_TARGETS
from compiled_engine.graphs.traced_step import TracedStep
from compiled_engine.kernels.cpu_gemv import cpu_gemv_available
from tests.test_capture import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, PagedBatch, make_model


def count_linears(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in LINEAR_TARGETS)


def _code_and_nodes(gm: fx.GraphModule) -> tuple[str, list[tuple]]:
    return gm.code, [(n.op, n.name, str(n.target)) for n in gm.graph.nodes]


class _TwoLinears(nn.Module):
    """Calls F.linear itself (symbolic_trace keeps nn.Linear opaque), weights nested as in HF."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = nn.Sequential(nn.Linear(32, 48), nn.SiLU(), nn.Linear(48, 16, bias=False))
        self.register_buffer("scale", torch.rand(16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = self.mlp[0], self.mlp[2]
        return F.linear(F.silu(F.linear(x, up.weight, up.bias)), down.weight) * self.scale


def test_variant_of_a_small_graph_shares_weights_and_matches() -> None:
    gm = fx.symbolic_trace(_TwoLinears().eval())
    gm._non_persistent_buffers_set.add("scale")  # as FreezeParameters registers buffers
    before = _code_and_nodes(gm)
    variant, result = gemv_variant(gm, rows=2)

    assert result.nodes_rewritten == 2
    assert (count_linears(gm), count_linears(variant)) == (2, 0)
    assert _code_and_nodes(gm) == before  # the original graph is untouched
    original_state = dict(gm.named_parameters()) | dict(gm.named_buffers())
    variant_state = dict(variant.named_parameters()) | dict(variant.named_buffers())
    assert variant_state.keys() == original_state.keys()
    for name, tensor in original_state.items():
        assert variant_state[name] is tensor and variant_state[name].data_ptr() == tensor.data_ptr()
    assert isinstance(variant.get_parameter("mlp.0.weight"), nn.Parameter)
    assert "scale" not in variant.state_dict()  # non-persistent, as in the original

    x = torch.randn(1, 2, 32)
    with torch.no_grad():
        torch.testing.assert_close(variant(x), gm(x), atol=1e-5, rtol=0)
    # One weight shared, not copied: an in-place update shows in both.
    with torch.no_grad():
        gm.get_parameter("mlp.2.weight").mul_(2)
        torch.testing.assert_close(variant(x), gm(x), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def traced_llama() -> tuple[TracedStep, torch.nn.Module, PagedBatch, list[torch.Tensor]]:
    model = make_model("llama")
    paged = PagedBatch()
    caches = paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM)
    return TracedStep(model, caches), model, paged, caches


def test_variant_of_the_traced_step_graph(traced_llama) -> None:
    traced, model, paged, caches = traced_llama
    gm = traced.graph
    before = _code_and_nodes(gm)
    linears = count_linears(gm)
    assert linears == 4 * NUM_LAYERS + 1  # fused q/k/v and gate/up, plus the lm_head

    variant, result = gemv_variant(gm, rows=3)
    assert result.nodes_rewritten == linears and count_linears(variant) == 0
    assert _code_and_nodes(gm) == before
    assert variant.meta == gm.meta and variant._param_name_to_source == gm._param_name_to_source
    original_state = dict(gm.named_buffers()) | dict(gm.named_parameters())
    for name, tensor in (dict(variant.named_buffers()) | dict(variant.named_parameters())).items():
        assert tensor.data_ptr() == original_state[name].data_ptr()
    assert gm._non_persistent_buffers_set and (
        variant._non_persistent_buffers_set == gm._non_persistent_buffers_set
    )
    # Every node Dynamo annotated still carries its example value, and the rewrite's new
    # nodes have one too.
    annotated = {n.name for n in gm.graph.nodes if "example_value" in n.meta}
    for node in variant.graph.nodes:
        if node.op in ("call_function", "call_method", "get_attr") or node.name in annotated:
            assert "example_value" in node.meta, node.name
    placeholders = [n for n in variant.graph.nodes if n.op == "placeholder"]
    assert all(getattr(n, "_dynamo_source", None) is not None for n in placeholders)

    args = traced.convention.bind(model)(paged.step([(0, torch.arange(3), 0)]), caches)
    with torch.no_grad():
        expected = gm(*args)[0]
        got = variant(*args)[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_linear_weight_shapes_of_the_traced_graph(traced_llama) -> None:
    gm = traced_llama[0].graph
    shapes = linear_weight_shapes(gm)
    q, kv, ffn, hidden = 4 * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, 96, 64
    # What makes each linear's input: RMSNorm before q/k/v, gate/up and the LM head, the
    # attention op before o_proj, SiLU(gate) * up before down_proj.
    per_layer = [
        (q + 2 * kv, hidden, "norm"),
        (hidden, q, "none"),
        (2 * ffn, hidden, "norm"),
        (hidden, ffn, "activation"),
    ]
    expected = per_layer * NUM_LAYERS + [(96, hidden, "norm")]
    assert [(s.out_features, s.in_features, s.prologue) for s in shapes] == expected
    assert {s.dtype for s in shapes} == {torch.float32}


def test_decision_round_trips_through_json() -> None:
    decision = GemvDecision(
        lowered_rows=(1, 2),
        timings=(
            RowTiming(1, 2.0, 1.0, 1.5, 0.5),
            RowTiming(2, 2.5, 1.5, 2.0, 1.0),
            RowTiming(4, 1, 3, 1, 2),
        ),
        unmeasured_rows=(16,),
        reason="measured",
        dtype="float32",
        num_threads=2,
        shapes=((64, 32, "norm", 2),),
    )
    text = decision.to_json()
    assert GemvDecision.from_json(text) == decision
    assert json.loads(text)["version"] == GEMV_POLICY_VERSION
    assert decision.lowers(2) and not decision.lowers(4) and not decision.lowers(16)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (json.dumps({"version": "gemv_policy=0", "lowered_rows": [1]}), "expected"),
        ("{}", "expected"),
        (json.dumps({"version": GEMV_POLICY_VERSION}), "not a GEMV decision"),
        ("not json", "not a GEMV decision"),
    ],
)
def test_stale_or_malformed_decisions_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GemvDecision.from_json(text)


SMALL_SHAPES = [(48, 32), (16, 32), (48, 32)]
# Every prologue kind, so the measured graph is built and compiled with each.
SMALL_LINEARS = [
    LinearShape(48, 32, torch.float32, "norm"),
    LinearShape(16, 32, torch.float32, "none"),
    LinearShape(48, 32, torch.float32, "norm"),
    LinearShape(32, 16, torch.float32, "activation"),
]


def test_measurement_on_small_shapes() -> None:
    candidates = (1, 2, 4)
    # The lowering against the GEMMs alone (the C++ GEMV's own test is below).
    decision = measure_gemv_rows(SMALL_LINEARS, candidates, torch.float32, "cpu", kernel=False)
    assert decision.timings, decision
    for t in decision.timings:
        assert 0 < t.gemm_best_ms <= t.gemm_ms and 0 < t.gemv_best_ms <= t.gemv_ms
    assert set(decision.lowered_rows) <= set(candidates)
    assert decision.lowered_rows == tuple(t.rows for t in decision.timings if t.lowering_wins)
    measured = [t.rows for t in decision.timings]
    assert sorted(measured + list(decision.unmeasured_rows)) == list(candidates)
    assert measured == list(candidates[: len(measured)])  # smallest first, a prefix
    losses = [not t.lowering_wins for t in decision.timings]
    if decision.unmeasured_rows:  # stopped: only after two GEMM wins in a row
        assert losses[-2:] == [True, True]
    # Two GEMM wins in a row end the measuring: nothing after them is timed.
    assert not any(losses[i] and losses[i + 1] for i in range(len(losses) - 2))
    assert decision.shapes == ((16, 32, "none", 1), (32, 16, "activation", 1), (48, 32, "norm", 2))
    assert GemvDecision.from_json(decision.to_json()) == decision


@pytest.fixture
def kernel_without_tiles(monkeypatch):
    """The scripted rules below as on a CPU whose C++ GEMV has neither AMX nor AVX2 register tiles
    (AVX-512 BF16): the kernel is timed up to _MAX_KERNEL_ROWS, whatever this CPU runs."""
    monkeypatch.setattr(gemv_policy, "gemv_isa", lambda: gemv_policy.ISA_AMX_TILES - 1)


def _scripted(wins: dict[int, bool], timed: list[int]):
    def time_rows(rows, linears, weight_sets, generator, **forms):
        timed.append(rows)
        # Medians that say the opposite: the fastest calls decide.
        best = 1.0 if wins[rows] else 3.0
        return RowTiming(rows, gemm_ms=2.0, gemv_ms=4.0 - best, gemm_best_ms=2.0, gemv_best_ms=best)

    return time_rows


@pytest.mark.parametrize(
    ("wins", "lowered", "unmeasured"),
    [
        ({1: True, 2: True, 4: False, 8: False, 16: True}, (1, 2), (16,)),
        ({1: True, 2: False, 4: True, 8: False, 16: False}, (1, 4), ()),  # one loss does not stop
        ({1: False, 2: False, 4: True, 8: True, 16: True}, (), (4, 8, 16)),
        ({1: True, 2: True, 4: True, 8: True, 16: True}, (1, 2, 4, 8, 16), ()),
    ],
)
@pytest.mark.usefixtures("kernel_without_tiles")
def test_measuring_stops_after_two_gemm_wins_in_a_row(monkeypatch, wins, lowered, unmeasured) -> None:
    timed: list[int] = []
    monkeypatch.setattr(gemv_policy, "_time_rows", _scripted(wins, timed))
    decision = measure_gemv_rows(SMALL_SHAPES, [16, 8, 4, 2, 1, 2], torch.float32, "cpu")
    assert decision.lowered_rows == lowered
    assert decision.unmeasured_rows == unmeasured
    assert timed == [r for r in (1, 2, 4, 8, 16) if r not in unmeasured]


def test_off_the_cpu_nothing_is_measured_or_lowered(monkeypatch) -> None:
    timed: list[int] = []
    monkeypatch.setattr(gemv_policy, "_time_rows", _scripted({}, timed))
    decision = measure_gemv_rows(SMALL_SHAPES, [1, 2], torch.bfloat16, torch.device("cuda", 0))
    assert decision.lowered_rows == () and decision.timings == () and timed == []
    assert decision.unmeasured_rows == (1, 2) and "cuBLAS" in decision.reason
    assert not decision.lowers(1)


@pytest.mark.parametrize(
    ("max_bytes", "sets"),
    [
        (2**30, 4),  # sets of 10 + 1 weights: four make the model's 40 + 1 (rounded up)
        (3 * (10 * 64 + 8) * 4 * 4, 3),  # room for three sets only
        (1, 1),  # one set whatever the limit
    ],
)
def test_many_or_large_weights_are_measured_in_rotating_sets(monkeypatch, max_bytes: int, sets: int) -> None:
    seen: list[list[tuple[int, ...]]] = []

    def record(rows, linears, weight_sets, generator, **forms):
        seen.extend([tuple(w.shape) for w in ws] for ws in weight_sets)
        return RowTiming(rows, 1.0, 2.0, 1.0, 2.0)

    monkeypatch.setattr(gemv_policy, "_time_rows", record)
    monkeypatch.setattr(gemv_policy, "_MAX_GRAPH_LINEARS", 10)
    monkeypatch.setattr(gemv_policy, "_MAX_MEASURED_BYTES", max_bytes)
    measure_gemv_rows([(64, 4)] * 40 + [(8, 4)], [1], torch.float32)
    # Proportions kept within one set, and a shape the model has once is still there once.
    assert len(seen) == sets
    assert all(s.count((64, 4)) == 10 and s.count((8, 4)) == 1 for s in seen)


def test_a_small_model_is_measured_whole_in_one_set(monkeypatch) -> None:
    seen: list[list[tuple[int, ...]]] = []

    def record(rows, linears, weight_sets, generator, **forms):
        seen.extend([tuple(w.shape) for w in ws] for ws in weight_sets)
        return RowTiming(rows, 1.0, 2.0, 1.0, 2.0)

    monkeypatch.setattr(gemv_policy, "_time_rows", record)
    measure_gemv_rows(SMALL_SHAPES, [1], torch.float32)
    assert seen == [[(48, 32), (48, 32), (16, 32)]]


def test_decide_reads_the_graph(monkeypatch) -> None:
    seen = {}

    def fake_measure(shapes, candidate_rows, dtype, device):
        seen.update(shapes=shapes, dtype=dtype, device=torch.device(device))
        return GemvDecision(())

    monkeypatch.setattr(gemv_policy, "measure_gemv_rows", fake_measure)
    decide_gemv_rows(fx.symbolic_trace(_TwoLinears()), [1, 2])
    assert seen == {
        "shapes": [
            LinearShape(48, 32, torch.float32, "none"),  # reads the graph input
            LinearShape(16, 48, torch.float32, "activation"),  # reads silu(first)
        ],
        "dtype": torch.float32,
        "device": torch.device("cpu"),
    }


def test_the_lowering_must_win_clearly() -> None:
    # The fastest calls decide, and a tie within the margin goes to the GEMM.
    assert RowTiming(1, gemm_ms=9.0, gemv_ms=1.0, gemm_best_ms=1.0, gemv_best_ms=0.8).lowering_wins
    assert not RowTiming(1, gemm_ms=9.0, gemv_ms=1.0, gemm_best_ms=1.0, gemv_best_ms=0.95).lowering_wins
    assert not RowTiming(1, gemm_ms=1.0, gemv_ms=9.0, gemm_best_ms=1.0, gemv_best_ms=1.2).lowering_wins


def test_nothing_to_measure(monkeypatch) -> None:
    monkeypatch.setattr(gemv_policy, "_time_rows", _scripted({}, []))  # would fail: no rows scripted
    assert measure_gemv_rows(SMALL_SHAPES, [], torch.float32).reason == "no candidate row counts"
    no_linears = measure_gemv_rows([], [1, 2], torch.float32)
    assert no_linears.lowered_rows == () and no_linears.unmeasured_rows == (1, 2)


def test_a_measurement_under_load_says_so() -> None:
    quiet = RowTiming(1, gemm_ms=1.1, gemv_ms=0.6, gemm_best_ms=1.0, gemv_best_ms=0.5)
    busy = RowTiming(2, gemm_ms=1.1, gemv_ms=2.0, gemm_best_ms=1.0, gemv_best_ms=0.5)
    assert not GemvDecision((1,), timings=(quiet,)).noisy
    assert GemvDecision((1, 2), timings=(quiet, busy)).noisy


def test_bad_candidates_are_rejected() -> None:
    with pytest.raises(ValueError, match="positive ints"):
        measure_gemv_rows(SMALL_SHAPES, [0, 1], torch.float32)
    with pytest.raises(ValueError, match="prologue"):
        measure_gemv_rows([LinearShape(4, 4, torch.float32, "softmax")], [1], torch.float32)


KINDS = ("norm", "activation", "none")


def test_prologue_inputs_are_recorded_and_computed_alike() -> None:
    # The measured graph records the same prologue the GEMM side computes eagerly.
    gm = gemv_policy._measured_graph([(8, 16, kind) for kind in KINDS], rows=2)
    assert count_linears(gm) == 0
    generator = torch.Generator().manual_seed(0)
    inputs = [gemv_policy._prologue_inputs(kind, 2, 16, torch.float32, generator) for kind in KINDS]
    weights = [torch.randn(8, 16, generator=generator) for _ in KINDS]
    expected = [
        F.linear(gemv_policy._prologue(k, i), w) for k, i, w in zip(KINDS, inputs, weights, strict=True)
    ]
    got = gm(*[t for group in inputs for t in group], *weights)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_near_tie_between_the_gemm_forms_goes_to_the_packed_one():
    # Where both stream the weights they tie within noise, and this winner decides larger rows.
    def timing(gemm: float, packed: float) -> RowTiming:
        return RowTiming(
            8,
            gemm_ms=gemm,
            gemv_ms=None,
            gemm_best_ms=gemm,
            gemv_best_ms=None,
            packed_ms=packed,
            packed_best_ms=packed,
        )

    assert timing(gemm=1.17, packed=1.23).packing_wins  # torch's GEMM 5% ahead: a tie
    assert not timing(gemm=1.0, packed=1.2).packing_wins  # 20% ahead: torch's GEMM
    assert timing(gemm=2.0, packed=1.0).packing_wins
    assert not RowTiming(8, gemm_ms=1.0, gemv_ms=None, gemm_best_ms=1.0, gemv_best_ms=None).packing_wins


def _scripted_forms(
    outcomes: dict[int, str],
    timed: list[tuple[int, bool, bool]],
    kernel_timed: list[int] | None = None,
    gemm_timed: list[int] | None = None,
):
    """outcomes: rows -> the fastest form ("gemv", "packed", "gemm", "kernel" or "widened") of a
    scripted timing."""

    def time_rows(
        rows, linears, weight_sets, generator, gemv=True, packed=False, kernel=False, widened=False, gemm=True
    ):
        timed.append((rows, gemv, packed or widened))
        if kernel and kernel_timed is not None:
            kernel_timed.append(rows)
        if gemm and gemm_timed is not None:
            gemm_timed.append(rows)
        best = {"gemm": 4.0, "packed": 4.5, "gemv": 4.5, "kernel": 4.5, "widened": 4.5}
        best[outcomes[rows]] = 1.0
        return RowTiming(
            rows,
            gemm_ms=best["gemm"] if gemm else None,
            gemv_ms=best["gemv"] if gemv else None,
            gemm_best_ms=best["gemm"] if gemm else None,
            gemv_best_ms=best["gemv"] if gemv else None,
            packed_ms=best["packed"] if packed else None,
            packed_best_ms=best["packed"] if packed else None,
            kernel_ms=best["kernel"] if kernel else None,
            kernel_best_ms=best["kernel"] if kernel else None,
            widened_ms=best["widened"] if widened else None,
            widened_best_ms=best["widened"] if widened else None,
        )

    return time_rows


@pytest.mark.usefixtures("kernel_without_tiles")
@pytest.mark.parametrize(
    ("outcomes", "lowered", "packed", "packs_dynamic", "unmeasured"),
    [
        # Lowered while it wins; then the packed GEMM wins twice: larger rows take it unmeasured.
        ({1: "gemv", 2: "gemv", 4: "packed", 8: "packed", 16: "gemm"}, (1, 2), (4, 8, 16), True, (16,)),
        # torch's GEMM wins twice after the lowering is out: nothing packs.
        ({1: "gemv", 2: "gemm", 4: "gemm", 8: "packed", 16: "packed"}, (1,), (), False, (8, 16)),
        # The winner changes: measuring goes on until one form wins twice in a row.
        ({1: "packed", 2: "gemm", 4: "packed", 8: "packed", 16: "gemm"}, (), (1, 4, 8, 16), True, (16,)),
    ],
)
def test_packed_gemm_is_timed_beside_the_others(
    monkeypatch, outcomes, lowered, packed, packs_dynamic, unmeasured
):
    monkeypatch.setattr(gemv_policy, "onednn_linear_available", lambda dtype, device: True)
    timed: list[tuple[int, bool, bool]] = []
    monkeypatch.setattr(gemv_policy, "_time_rows", _scripted_forms(outcomes, timed))
    decision = measure_gemv_rows(SMALL_SHAPES, [1, 2, 4, 8, 16], torch.float32, "cpu")
    assert decision.lowered_rows == lowered
    assert decision.packed_rows == packed
    assert decision.packs_dynamic is packs_dynamic and decision.packs(None) is packs_dynamic
    assert decision.unmeasured_rows == unmeasured
    assert all(p for _, _, p in timed)  # every measured row count timed the packed form
    # The lowering is timed until it has lost twice in a row, then no more.
    gemv_timed = [r for r, g, _ in timed if g]
    assert gemv_timed == [r for r, _, _ in timed][: len(gemv_timed)]
    assert GemvDecision.from_json(decision.to_json()) == decision


@pytest.mark.usefixtures("kernel_without_tiles")
@pytest.mark.parametrize(
    ("outcomes", "widened", "widens_dynamic", "unmeasured"),
    [
        # The kernel at few rows, then the widened GEMM twice: larger rows take it unmeasured.
        ({1: "kernel", 2: "kernel", 4: "widened", 8: "widened", 16: "gemm"}, (4, 8, 16), True, (16,)),
        # torch's GEMM wins twice: nothing is widened.
        ({1: "kernel", 2: "kernel", 4: "gemm", 8: "gemm", 16: "widened"}, (), False, (16,)),
    ],
)
def test_where_onednn_cannot_run_the_dtype_the_widened_gemm_takes_the_packed_forms_place(
    monkeypatch, outcomes, widened, widens_dynamic, unmeasured
):
    # fp16: oneDNN packs fp32 and bf16 only (kernels/onednn_linear.py), on any CPU.
    timed: list[tuple[int, bool, bool]] = []
    kernel_timed: list[int] = []
    monkeypatch.setattr(gemv_policy, "cpu_gemv_available", lambda dtype, device: True)
    monkeypatch.setattr(gemv_policy, "_time_rows", _scripted_forms(outcomes, timed, kernel_timed))
    decision = measure_gemv_rows(SMALL_SHAPES, [1, 2, 4, 8, 16], torch.float16, "cpu")
    assert decision.widened_rows == widened and decision.packed_rows == ()
    assert decision.widens_dynamic is widens_dynamic and decision.widens(None) is widens_dynamic
    assert not decision.packs_dynamic
    assert decision.kernel_rows == (1, 2)
    assert decision.unmeasured_rows == unmeasured
    assert all(w for _, _, w in timed)  # every measured row count timed the widened GEMM
    assert "widened to fp32 GEMMs timed" in decision.reason
    assert GemvDecision.from_json(decision.to_json()) == decision


def test_a_real_fp16_measurement_times_the_widened_gemm() -> None:
    decision = measure_gemv_rows([(64, 96), (96, 64)], [16, 32], torch.float16, "cpu")
    assert decision.timings and all(t.widened_best_ms is not None for t in decision.timings)
    assert all(t.packed_best_ms is None for t in decision.timings)
    won = tuple(
        t.rows for t in decision.timings if t.widening_wins and not t.lowering_wins and not t.kernel_wins
    )
    assert decision.widened_rows[: len(won)] == won


def test_without_onednn_nothing_packs(monkeypatch) -> None:
    monkeypatch.setattr(gemv_policy, "onednn_linear_available", lambda dtype, device: False)
    timed: list[tuple[int, bool, bool]] = []
    monkeypatch.setattr(gemv_policy, "_time_rows", _scripted_forms(dict.fromkeys((1, 2, 4), "gemm"), timed))
    decision = measure_gemv_rows(SMALL_SHAPES, [1, 2, 4], torch.float32, "cpu")
    assert decision.packed_rows == () and not decision.packs_dynamic
    assert timed == [(1, True, False), (2, True, False)]  # stops after two GEMM wins, as before
    assert "oneDNN cannot pack" in decision.reason


def test_the_lowering_must_beat_the_faster_gemm_form() -> None:
    # Packed oneDNN at 1.0 ms: a lowering at 0.95 is within the margin of it, though far ahead of F.linear.
    timing = RowTiming(
        1, gemm_ms=5.0, gemv_ms=1.0, gemm_best_ms=5.0, gemv_best_ms=0.95, packed_ms=1.1, packed_best_ms=1.0
    )
    assert timing.packing_wins and not timing.lowering_wins
    assert RowTiming(1, 5.0, 1.0, 5.0, 0.8, 1.1, 1.0).lowering_wins


def test_the_tile_path_is_timed_after_the_dot_path_lost(monkeypatch) -> None:
    """With AMX tiles the kernel is another kernel from TILE_MIN_ROWS rows on: two losses of its
    dot path below that do not stop it being timed there."""
    monkeypatch.setattr(gemv_policy, "onednn_linear_available", lambda dtype, device: True)
    monkeypatch.setattr(gemv_policy, "cpu_gemv_available", lambda dtype, device: True)
    outcomes = {1: "packed", 2: "packed", 4: "kernel", 8: "kernel", 16: "packed"}
    for isa, kernel_rows, kernel_timed in (
        (gemv_policy.ISA_AMX_TILES, (4, 8), [1, 2, 4, 8, 16]),
        (gemv_policy.ISA_AMX_TILES - 1, (), [1, 2]),  # no tiles: two losses end it
    ):
        monkeypatch.setattr(gemv_policy, "gemv_isa", lambda isa=isa: isa)
        kernel_seen: list[int] = []
        monkeypatch.setattr(gemv_policy, "_time_rows", _scripted_forms(outcomes, [], kernel_seen))
        decision = measure_gemv_rows(SMALL_SHAPES, sorted(outcomes), torch.bfloat16, "cpu")
        assert decision.kernel_rows == kernel_rows and kernel_seen == kernel_timed
        # float32 has no tile path: the dot path's two losses end the kernel's timing.
        kernel_seen.clear()
        measure_gemv_rows(SMALL_SHAPES, sorted(outcomes), torch.float32, "cpu")
        assert kernel_seen == [1, 2]


@pytest.mark.parametrize(
    ("outcomes", "kernel_rows", "lowered", "packed", "kernel_timed"),
    [
        # The kernel wins the smallest rows; after two losses in a row it is timed no more.
        (
            {1: "kernel", 2: "kernel", 4: "packed", 8: "packed", 16: "packed"},
            (1, 2),
            (),
            (4, 8, 16),
            [1, 2, 4, 8],
        ),
        # One loss does not stop it; without AMX tiles never timed above 16 rows (the dot path's
        # most).
        (
            {1: "kernel", 2: "gemm", 4: "kernel", 8: "kernel", 16: "kernel", 32: "kernel"},
            (1, 4, 8, 16),
            (),
            (),
            [1, 2, 4, 8, 16],
        ),
        # A lowering that wins takes the row count from it.
        ({1: "gemv", 2: "kernel", 4: "gemm", 8: "gemm", 16: "gemm"}, (2,), (1,), (), [1, 2, 4, 8]),
    ],
)
def test_the_kernel_is_chosen_where_it_is_fastest(
    monkeypatch, outcomes, kernel_rows, lowered, packed, kernel_timed
) -> None:
    monkeypatch.setattr(gemv_policy, "onednn_linear_available", lambda dtype, device: True)
    monkeypatch.setattr(gemv_policy, "gemv_isa", lambda: gemv_policy.ISA_AMX_TILES - 1)  # no tiles
    timed: list[tuple[int, bool, bool]] = []
    kernel_seen: list[int] = []
    monkeypatch.setattr(gemv_policy, "_time_rows", _scripted_forms(outcomes, timed, kernel_seen))
    decision = measure_gemv_rows(SMALL_SHAPES, sorted(outcomes), torch.bfloat16, "cpu")
    assert decision.kernel_rows == kernel_rows and decision.lowered_rows == lowered
    assert decision.packed_rows == packed
    assert kernel_seen == kernel_timed
    assert all(decision.runs_kernel(r) == (r in kernel_rows) for r in (1, 2, 4, 8, 16))
    assert GemvDecision.from_json(decision.to_json()) == decision


def test_the_tile_path_is_timed_up_to_48_rows(monkeypatch) -> None:
    """A bf16 kernel with AMX tiles reads the weight once for every row, so it stays a candidate
    past the dot path's 16 rows: timed up to 48 rows and chosen where it won, never timed at 64."""
    monkeypatch.setattr(gemv_policy, "onednn_linear_available", lambda dtype, device: True)
    monkeypatch.setattr(gemv_policy, "cpu_gemv_available", lambda dtype, device: True)
    monkeypatch.setattr(gemv_policy, "gemv_isa", lambda: gemv_policy.ISA_AMX_TILES)
    outcomes = {1: "kernel", 4: "kernel", 16: "kernel", 24: "packed", 32: "kernel", 48: "kernel"}
    outcomes[64] = "kernel"
    kernel_seen: list[int] = []
    monkeypatch.setattr(gemv_policy, "_time_rows", _scripted_forms(outcomes, [], kernel_seen))
    decision = measure_gemv_rows(SMALL_SHAPES, sorted(outcomes), torch.bfloat16, "cpu")
    assert kernel_seen == [1, 4, 16, 24, 32, 48]
    assert decision.kernel_rows == (1, 4, 16, 32, 48)
    assert not decision.runs_kernel(64) and not decision.runs_kernel(24)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_avx2_register_tiles_are_timed_at_every_bucket_until_two_losses(monkeypatch, dtype) -> None:
    """On AVX2 the kernel runs register tiles from REGISTER_TILE_MIN_ROWS rows, any dtype: another
    kernel, timed again there after its streaming passes lost, and past the dot path's 16 rows up
    to _MAX_REGISTER_TILE_ROWS, until two losses in a row."""
    monkeypatch.setattr(gemv_policy, "onednn_linear_available", lambda dtype, device: True)
    monkeypatch.setattr(gemv_policy, "cpu_gemv_available", lambda dtype, device: True)
    monkeypatch.setattr(gemv_policy, "gemv_isa", lambda: gemv_policy.ISA_AVX2)
    assert gemv_policy.REGISTER_TILE_MIN_ROWS == 8
    outcomes = {1: "packed", 2: "packed", 8: "kernel", 16: "kernel", 64: "packed", 128: "kernel"}
    outcomes |= {256: "packed", 512: "packed", 1024: "kernel"}
    kernel_seen: list[int] = []
    gemm_seen: list[int] = []
    monkeypatch.setattr(gemv_policy, "_time_rows", _scripted_forms(outcomes, [], kernel_seen, gemm_seen))
    decision = measure_gemv_rows(SMALL_SHAPES, sorted(outcomes), dtype, "cpu")
    assert kernel_seen == [1, 2, 8, 16, 64, 128, 256, 512]
    assert decision.kernel_rows == (8, 16, 128)
    assert not decision.runs_kernel(1024) and not decision.runs_kernel(64)
    # The packed form beat torch's GEMM at 1 and 2 rows: from then on the kernel is timed against
    # it alone (torch's GEMM, the slowest form there, costs the most to time).
    assert gemm_seen == [1, 2]
    assert all(t.gemm_best_ms is None for t in decision.timings if t.rows > 2)
    assert decision.packed_rows == (1, 2, 64, 256, 512, 1024) and decision.packs_dynamic
    assert GemvDecision.from_json(decision.to_json()) == decision


def test_torch_gemm_is_timed_until_a_prepared_form_has_beaten_it_twice(monkeypatch) -> None:
    """On AVX2 with the widened form (bf16, no oneDNN bf16): torch's GEMM wins at 1 row, the
    widened form at 2 and 4; from 8 rows, where the register tiles keep the kernel timed, torch's
    GEMM is not timed, and a real timing without it needs a prepared form."""
    time_rows = gemv_policy._time_rows
    monkeypatch.setattr(gemv_policy, "onednn_linear_available", lambda dtype, device: False)
    monkeypatch.setattr(gemv_policy, "cpu_gemv_available", lambda dtype, device: True)
    monkeypatch.setattr(gemv_policy, "gemv_isa", lambda: gemv_policy.ISA_AVX2)
    outcomes = {1: "gemm", 2: "widened", 4: "widened", 8: "kernel", 16: "widened"}
    gemm_seen: list[int] = []
    monkeypatch.setattr(gemv_policy, "_time_rows", _scripted_forms(outcomes, [], [], gemm_seen))
    decision = measure_gemv_rows(SMALL_SHAPES, sorted(outcomes), torch.bfloat16, "cpu")
    assert gemm_seen == [1, 2, 4]
    assert decision.kernel_rows == (8,) and decision.widened_rows == (2, 4, 16)
    with pytest.raises(ValueError, match="a packed or widened form must be timed"):
        time_rows(1, [], [[]], torch.Generator(), gemm=False)


def test_a_real_measurement_picks_the_kernel_only_where_it_was_faster() -> None:
    # bf16 weights big enough that the weight read dominates a call (a few MiB in all).
    shapes = [
        LinearShape(1024, 512, torch.bfloat16, "norm"),
        LinearShape(512, 1408, torch.bfloat16, "activation"),
    ]
    decision = measure_gemv_rows(shapes, (1, 2), torch.bfloat16, "cpu")
    if not cpu_gemv_available(torch.bfloat16):
        assert decision.kernel_rows == () and all(t.kernel_best_ms is None for t in decision.timings)
        return
    assert [t.rows for t in decision.timings] == [1, 2]
    for t in decision.timings:
        assert t.kernel_best_ms is not None and 0 < t.kernel_best_ms <= t.kernel_ms
        # Every GEMM form timed is a rival: on a CPU without native bf16 GEMMs the widened one too
        # (left out, a near tie with torch's GEMM that the widened form beat failed this check).
        rivals = [r for r in (t.gemm_best_ms, t.packed_best_ms, t.widened_best_ms) if r is not None]
        faster = t.kernel_best_ms < min(rivals) and not t.lowering_wins
        assert (t.rows in decision.kernel_rows) == faster
    assert not set(decision.kernel_rows) & set(decision.lowered_rows)
    assert not set(decision.kernel_rows) & set(decision.packed_rows)
