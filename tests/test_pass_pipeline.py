"""One pass manager for capture-time and per-bucket passes (graphs/pass_manager.py, pass_pipeline.py)."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from compiled_engine.graphs.bucket_compiler import BucketBuild, BucketVariant
from compiled_engine.graphs.gemv_policy import GemvDecision
from compiled_engine.graphs.pass_manager import (
    AtCapture,
    BucketTarget,
    PassManager,
    PassReport,
    PassResult,
    PerBucket,
    PipelinePass,
    per_bucket,
)
from compiled_engine.graphs.pass_pipeline import default_pass_manager
from compiled_engine.graphs.passes.dce import DeadCodeElimination
from compiled_engine.graphs.passes.freeze_parameters import FreezeParameters, kept_input_indices

# Lowered at 1 row, packed at 8 and in the dynamic graph, torch's GEMM at 4.
LINEARS = GemvDecision(lowered_rows=(1,), packed_rows=(8,), packs_dynamic=True)
MAX_SEQS = 4


def _ran(target: BucketTarget) -> list[str]:
    gm = fx.symbolic_trace(lambda x: x + 1)  # the report lists the passes that ran, rewriting or not
    report = default_pass_manager("AnyModel", 1).run_bucket(gm, target)
    return [r.pass_name for r in report.results]


@pytest.mark.parametrize(
    "bucket, device, backend, expected",
    [
        (1, "cpu", "torch", ["gemv_lowering", "inline_attention"]),
        (4, "cpu", "torch", ["inline_attention"]),  # GEMM, decode-sized
        (8, "cpu", "torch", ["pack_linear_weights"]),  # above max_num_seqs: keeps the op
        (None, "cpu", "torch", ["pack_linear_weights"]),  # the dynamic graph keeps the op
        (1, "cpu", "cpu", ["gemv_lowering"]),  # the C++ kernel is not inlined
        (4, "cuda", "torch", []),  # other devices keep the op
    ],
)
def test_per_bucket_passes_apply_where_their_predicate_holds(bucket, device, backend, expected) -> None:
    assert _ran(BucketTarget(bucket, MAX_SEQS, device, backend, LINEARS)) == expected


def test_capture_and_bucket_passes_are_one_pipeline() -> None:
    manager = default_pass_manager("AnyModel", None)
    stages = {p.name: type(p.where) for p in manager.pipeline}
    assert stages["lower_sdpa"] is AtCapture and stages["gemv_lowering"] is PerBucket
    # A capture run never applies per-bucket passes, and reports every capture pass.
    gm = fx.symbolic_trace(lambda x: x + 1)
    report = manager.run_capture(gm, ())
    assert [r.pass_name for r in report.results] == [p.name for p in manager.capture_passes]


def test_freeze_parameters_runs_in_the_pipeline_and_records_kept_inputs() -> None:
    linear = torch.nn.Linear(2, 3)
    gm = fx.symbolic_trace(lambda x, w, b: torch.nn.functional.linear(x, w, b))
    freeze = PipelinePass(
        FreezeParameters.name,
        FreezeParameters.version,
        AtCapture(lambda g: FreezeParameters(g.example_inputs)),
    )
    report = PassManager([freeze, DeadCodeElimination()]).run_capture(
        gm, (torch.ones(1, 2), linear.weight, linear.bias)
    )
    assert report.result("freeze_parameters").nodes_rewritten == 2
    assert kept_input_indices(gm, 3) == (0,)
    torch.testing.assert_close(gm(torch.ones(1, 2)), linear(torch.ones(1, 2)))


def test_a_pass_reporting_another_name_is_refused() -> None:
    class Liar:
        name = "liar"
        version = "v"

        def __call__(self, gm: fx.GraphModule) -> PassResult:
            return PassResult("someone_else", 0)

    manager = PassManager([per_bucket(Liar, lambda target: True)])
    with pytest.raises(ValueError, match="reported its result as"):
        manager.run_bucket(fx.symbolic_trace(lambda x: x), BucketTarget(1, 1, "cpu", "torch", LINEARS))


def test_pass_reports_round_trip_through_json_and_name_the_variant() -> None:
    report = PassReport(
        (PassResult("gemv_lowering", 29, ("rewrote 29 linear(s)",)), PassResult("inline_attention", 2))
    )
    assert PassReport.from_json(report.to_json()) == report
    with pytest.raises(ValueError):
        PassReport.from_json([{"pass": "x"}])
    assert BucketBuild(1, "loaded", 0.1, True, report).variant == BucketVariant(
        gemv=True, inline_attention=True
    )


# The C++ GEMV at 1 and 2 rows, the lowering also "won" at 2 (it takes precedence), packed at 8.
KERNEL_LINEARS = GemvDecision(lowered_rows=(2,), kernel_rows=(1, 2), packed_rows=(8,))


@pytest.mark.parametrize(
    "bucket, device, backend, expected",
    [
        (1, "cpu", "torch", ["cpu_gemv_linears", "inline_attention"]),
        (1, "cpu", "cpu", ["cpu_gemv_linears"]),
        (2, "cpu", "cpu", ["gemv_lowering"]),
        (8, "cpu", "cpu", ["pack_linear_weights"]),
        (None, "cpu", "cpu", []),
    ],
)
def test_the_cpu_gemv_runs_where_the_policy_chose_it(bucket, device, backend, expected) -> None:
    assert _ran(BucketTarget(bucket, MAX_SEQS, device, backend, KERNEL_LINEARS)) == expected


def test_the_dynamic_graph_takes_the_quantized_tiles_where_the_policy_found_them_winning() -> None:
    # Steps past every bucket run the dynamic graph: left on torch's int8/int4 kernels, a
    # 1,024-token prefill of the 0.5B shape took ~7x bf16's time (docs/performance.md).
    tiles = GemvDecision((), quantized_kernel_rows=(1,), quantized_tile_rows=(16, 64))
    assert "cpu_gemm_quantized" in _ran(BucketTarget(None, MAX_SEQS, "cpu", "cpu", tiles))
    assert "cpu_gemm_quantized" in _ran(BucketTarget(64, MAX_SEQS, "cpu", "cpu", tiles))
    assert "cpu_gemm_quantized" not in _ran(BucketTarget(1, MAX_SEQS, "cpu", "cpu", tiles))
    no_tiles = GemvDecision((), quantized_kernel_rows=(1,))  # e.g. a CPU without AMX
    assert "cpu_gemm_quantized" not in _ran(BucketTarget(None, MAX_SEQS, "cpu", "cpu", no_tiles))
