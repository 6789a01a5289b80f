"""QuantizeLinears and CpuGemvQuantized: a captured model's linears on quantized weights give the
logits of the same model with those weights dequantized; recipes rebuild the quantized constants."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch._inductor.compile_fx import compile_fx

from compiled_engine.graphs.capture import capture_model
from compiled_engine.graphs.constant_recipes import (
    build_constants,
    lifted_constant_names,
    lifted_constant_recipes,
)
from compiled_engine.graphs.gemv_policy import GemvDecision
from compiled_engine.graphs.pass_manager import BucketTarget
from compiled_engine.graphs.pass_pipeline import default_pass_manager
from compiled_engine.graphs.passes.cpu_gemv_quantized import CpuGemvQuantized
from compiled_engine.graphs.passes.freeze_parameters import (
    FreezeParameters,
    frozen_callable,
    kept_example_inputs,
)
from compiled_engine.graphs.passes.fuse_linears import LINEAR_TARGETS, FusedWeightCache, FuseLinears
from compiled_engine.graphs.passes.quantize_linears import (
    QUANTIZED_LINEAR_OPS,
    QuantizedWeightCache,
    QuantizeLinears,
)
from compiled_engine.kernels.cpu_gemv_quantized import cpu_gemv_int8, cpu_gemv_quantized_available
from compiled_engine.kernels.quantized_linear import int8_weight_linear
from compiled_engine.kernels.weight_quantization import dequantize, quantize_weight, quantized_linear_names
from compiled_engine.records.weight_quantization import WeightQuantization
from tests.test_capture import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, PagedBatch, make_model
from tests.test_pass_fuse_linears import STEPS

# The LM head kept in the model dtype (quantize_lm_head=False): what the first tests check; the
# default, head quantized too, has its own test below.
SCHEMES = [WeightQuantization("int8", lm_head=False), WeightQuantization("int4", 32, lm_head=False)]


def _count(gm: fx.GraphModule, targets) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def round_trip_linears(model: torch.nn.Module, scheme: WeightQuantization) -> torch.nn.Module:
    """`model` with every linear `scheme` quantizes (the LM head with `scheme.lm_head`) replaced by its
    quantize-dequantize round trip. A tied LM head gets its own copy first: the engine quantizes the
    head's linear only, the input embedding keeps its float weight."""
    head = model.get_output_embeddings()
    if scheme.lm_head and head is not None:
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    with torch.no_grad():
        for _, module in quantized_linear_names(model, scheme.lm_head):
            module.weight.copy_(dequantize(quantize_weight(module.weight, scheme), module.weight.dtype))
    return model


def _dequantized_model(scheme: WeightQuantization) -> torch.nn.Module:
    """The test model with its quantized linears replaced by their quantize-dequantize round trips:
    what the quantized graph must compute (each scheme's scales are per row, so fusing q/k/v first
    changes nothing)."""
    return round_trip_linears(make_model("qwen2"), scheme)


class Recorder:
    """Keeps the graphs the backend saw (after the passes); optionally compiles them with Inductor."""

    def __init__(
        self, quantization: WeightQuantization, lm_head: torch.Tensor, inductor: bool = False
    ) -> None:
        self.quantization = quantization
        self.lm_head = lm_head
        self.inductor = inductor
        self.graphs: list[fx.GraphModule] = []
        self.results = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        freeze = FreezeParameters(example_inputs)
        freeze(gm)
        FuseLinears(FusedWeightCache())(gm)
        self.results.append(QuantizeLinears(QuantizedWeightCache(self.quantization), self.lm_head)(gm))
        gm.graph.lint()
        gm.recompile()
        self.graphs.append(gm)
        kept = freeze.kept_input_indices
        compiled = compile_fx(gm, kept_example_inputs(example_inputs, kept)) if self.inductor else gm
        return frozen_callable(compiled, kept, len(example_inputs))


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label)
def test_a_captured_model_computes_its_dequantized_weights(scheme) -> None:
    # qwen2: q/k/v carry biases, so the ops' bias path runs too. Eager (the engine's enforce_eager).
    paged = PagedBatch()
    reference = capture_model(_dequantized_model(scheme), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
    quantized = capture_model(
        make_model("qwen2"), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM), quantization=scheme
    )
    # int4 through a prefill, a two-sequence step and a decode; int8 (the simpler op) the first
    # only: each step shape is one more trace.
    for chunks in STEPS if scheme.scheme == "int4" else STEPS[:1]:
        torch.testing.assert_close(
            quantized(paged.step(chunks)), reference(paged.step(chunks)), atol=2e-4, rtol=0
        )
    result = quantized.pass_log[0].result("quantize_linears")
    # Per layer, unfused (the eager path): q, k, v, o, gate, up, down; the LM head is kept.
    assert result.nodes_rewritten == 7 * NUM_LAYERS
    assert any("the LM head stays" in note for note in result.notes)


def test_inductor_compiles_the_quantized_graph_and_recipes_rebuild_its_constants() -> None:
    scheme = WeightQuantization("int4", 32, lm_head=False)
    paged = PagedBatch()
    reference = capture_model(_dequantized_model(scheme), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
    model = make_model("qwen2")
    recorder = Recorder(scheme, model.get_output_embeddings().weight, inductor=True)
    compiled = capture_model(
        model, paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM), graph_compiler=recorder
    )
    step = paged.step(STEPS[0])  # one step shape: one Inductor compile
    torch.testing.assert_close(compiled(step), reference(step), atol=2e-4, rtol=0)
    gm = recorder.graphs[0]
    assert _count(gm, QUANTIZED_LINEAR_OPS) == 4 * NUM_LAYERS
    assert _count(gm, LINEAR_TARGETS) == 1  # the LM head
    # A warm start rebuilds every lifted constant from the model alone: the same quantized values.
    rebuilt = build_constants(lifted_constant_recipes(gm), model)
    attributes = {**dict(gm.named_parameters()), **dict(gm.named_buffers())}
    for name, tensor in zip(lifted_constant_names(gm), rebuilt, strict=True):
        assert torch.equal(tensor, attributes[name]), name


# int4 (the coarser scheme) in the default run; int8 under -m slow (default-suite time budget).
@pytest.mark.parametrize(
    "scheme",
    [pytest.param(WeightQuantization("int8"), marks=pytest.mark.slow), WeightQuantization("int4", 32)],
    ids=lambda s: s.label,
)
def test_the_lm_head_is_quantized_by_default_and_its_logits_stay_close(scheme) -> None:
    # The default (EngineArgs' quantize_lm_head): the head's linear becomes the quantized op too, the
    # graph computes the model with the head's weight round-tripped as well (the embedding kept
    # float), and quantizing the head moves the logits no more than its weight's own rounding.
    paged = PagedBatch()
    caches = lambda: paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM)  # noqa: E731
    model = make_model("qwen2")
    head = model.get_output_embeddings().weight
    quantized = capture_model(model, caches(), quantization=scheme)
    head_kept = capture_model(make_model("qwen2"), caches(), quantization=replace(scheme, lm_head=False))
    reference = capture_model(_dequantized_model(scheme), caches())
    logits = quantized(paged.step(STEPS[0]))
    torch.testing.assert_close(logits, reference(paged.step(STEPS[0])), atol=2e-4, rtol=0)
    # Relative to the engine with the head in float32 (same other linears): the logits move by about
    # the head weight's relative rounding error (random hidden states), well under twice it.
    kept = head_kept(paged.step(STEPS[0]))
    weight_error = float((dequantize(quantize_weight(head, scheme), head.dtype) - head).norm() / head.norm())
    logits_error = float((logits - kept).norm() / kept.norm())
    assert 0 < logits_error < 2 * weight_error, (logits_error, weight_error)
    result = quantized.pass_log[0].result("quantize_linears")
    assert result.nodes_rewritten == 7 * NUM_LAYERS + 1  # the head too
    assert any("quantized" in note and "the LM head" in note for note in result.notes)
    assert not any("the LM head stays" in note for note in result.notes)
    # The graph itself: no float linear left, and one quantized op over the head's [vocab, hidden] weight.
    model = make_model("qwen2")
    recorder = Recorder(scheme, model.get_output_embeddings().weight)
    capture_model(model, caches(), graph_compiler=recorder)(paged.step(STEPS[0]))
    gm = recorder.graphs[0]
    assert _count(gm, LINEAR_TARGETS) == 0
    head_ops = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n.target in QUANTIZED_LINEAR_OPS
        and getattr(gm, str(n.args[1].target)).shape[0] == head.shape[0]
    ]
    assert len(head_ops) == 1


@pytest.mark.skipif(not cpu_gemv_quantized_available(torch.float32), reason="no C++ compiler")
def test_the_cpu_gemv_pass_swaps_the_ops_and_keeps_the_results() -> None:
    q = quantize_weight(torch.randn(70, 33), WeightQuantization("int8"))
    root = torch.nn.Module()
    root.register_buffer("qweight", q.qweight)
    root.register_buffer("scales", q.scales)
    graph = fx.Graph()
    x = graph.placeholder("x")
    out = graph.call_function(
        int8_weight_linear, (x, graph.get_attr("qweight"), graph.get_attr("scales"), None)
    )
    graph.output(graph.call_function(F.relu, (out,)))
    gm = fx.GraphModule(root, graph)
    x = torch.randn(1, 2, 33)
    expected = gm(x)
    result = CpuGemvQuantized()(gm)
    assert result.nodes_rewritten == 1
    assert _count(gm, (cpu_gemv_int8,)) == 1 and _count(gm, (int8_weight_linear,)) == 0
    torch.testing.assert_close(gm(x), expected, atol=1e-5, rtol=1e-5)


def test_the_quantized_gemv_runs_where_the_policy_measured_it_and_the_decision_keeps_it() -> None:
    decision = GemvDecision(lowered_rows=(), quantized_kernel_rows=(1, 2), quantized_timings=((1, 2.0, 1.0),))
    assert GemvDecision.from_json(decision.to_json()) == decision
    manager = default_pass_manager("AnyModel", 1)
    for bucket, ran in ((1, True), (2, True), (4, False), (None, False)):
        gm = fx.symbolic_trace(lambda x: x + 1)
        report = manager.run_bucket(gm, BucketTarget(bucket, 4, "cpu", "cpu", decision))
        assert report.ran("cpu_gemv_quantized") == ran, bucket


def test_the_tile_path_runs_where_the_policy_measured_it_and_the_decision_keeps_it() -> None:
    decision = GemvDecision(
        lowered_rows=(),
        quantized_kernel_rows=(1,),
        quantized_timings=((1, 2.0, 1.0),),
        quantized_tile_rows=(16, 32),
        quantized_tile_timings=((16, 9.0, 3.0),),
    )
    assert GemvDecision.from_json(decision.to_json()) == decision
    manager = default_pass_manager("AnyModel", 1)
    for bucket, gemv, tiles in ((1, True, False), (16, False, True), (32, False, True), (8, False, False)):
        gm = fx.symbolic_trace(lambda x: x + 1)
        report = manager.run_bucket(gm, BucketTarget(bucket, 4, "cpu", "cpu", decision))
        assert report.ran("cpu_gemv_quantized") == gemv and report.ran("cpu_gemm_quantized") == tiles, bucket


@pytest.mark.skipif(not cpu_gemv_quantized_available(torch.bfloat16), reason="no C++ compiler")
def test_the_policy_gives_each_timed_row_count_one_form() -> None:
    from compiled_engine.graphs.quantized_gemv_policy import QuantizedShape, measure_quantized_rows
    from compiled_engine.kernels.cpu_gemv_quantized import cpu_gemm_quantized_available

    shapes = [QuantizedShape(192, 128, None), QuantizedShape(128, 256, 32)]
    measured = measure_quantized_rows(shapes, (1, 2, 16, 24), torch.bfloat16)
    assert not set(measured.gemv_rows) & set(measured.tile_rows)
    assert {r for r, _, _ in measured.gemv_timings} <= {1, 2}  # the GEMV only up to 8 rows
    # A form wins a row count only where its fastest call beat torch's kernel's.
    assert all(gemv < torch_ms for r, torch_ms, gemv in measured.gemv_timings if r in measured.gemv_rows)
    if cpu_gemm_quantized_available(torch.bfloat16):
        assert [r for r, _, _ in measured.tile_timings] == [1, 2, 16, 24][: len(measured.tile_timings)]
        wins = [tiles < torch_ms for r, torch_ms, tiles in measured.tile_timings if r in measured.tile_rows]
        assert all(wins)
    else:
        assert measured.tile_rows == () and measured.tile_timings == ()
