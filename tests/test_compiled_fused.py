"""The compiled step's graph with linear fusion: 4 GEMMs per decoder layer instead of 7.

Logits of the fused compiled step against the unfused eager capture, across buckets and the
dynamic graph, are checked in tests/test_compiled_step.py (CompiledStep fuses by default).
"""

from __future__ import annotations

import torch

from compiled_engine.graphs.passes.fuse_linears import LINEAR_TARGETS
from compiled_engine.graphs.traced_step import TracedStep
from compiled_engine.model_loader.loader import load_model

BLOCK_SIZE = 16


def _linear_count(traced: TracedStep) -> int:
    return sum(1 for n in traced.graph.graph.nodes if n.op == "call_function" and n.target in LINEAR_TARGETS)


def _traced(llama_dir: str, fuse_linears: bool) -> tuple[TracedStep, int]:
    loaded = load_model(llama_dir, dtype="float32")
    mc = loaded.model_config
    caches = [torch.zeros(2, 8, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim) for _ in range(mc.num_layers)]
    traced = TracedStep(loaded.model, caches, fuse_linears=fuse_linears)
    return traced, mc.num_layers


def test_fused_graph_has_four_linears_per_layer(llama_dir):
    fused, num_layers = _traced(llama_dir, fuse_linears=True)
    unfused, _ = _traced(llama_dir, fuse_linears=False)
    # Per layer: q, k, v, o, gate, up, down -> qkv, o, gate_up, down; plus the lm_head.
    assert _linear_count(unfused) == 7 * num_layers + 1
    assert _linear_count(fused) == 4 * num_layers + 1
    report = fused.pass_log[-1]
    assert report.result("fuse_linears").nodes_rewritten == 5 * num_layers
    assert [r.pass_name for r in report.results] == [
        "freeze_parameters",
        "lower_sdpa",
        "fuse_linears",
        "noop_elimination",
        "dce",
        "check_lowering",
    ]
    # Every weight input of the unfused graph became a constant: the fused graph reads none.
    model_inputs = sum(source.startswith("L['model']") for source in unfused.convention.sources)
    assert model_inputs > 7 * num_layers
    assert report.result("freeze_parameters").nodes_rewritten == model_inputs
    assert not any(source.startswith("L['model']") for source in fused.convention.sources)
    assert "fuse_linears" not in [r.pass_name for r in unfused.pass_log[-1].results]
