"""Greedy parity with transformers when the engine runs Inductor-compiled bucket graphs.

Same prompts and checks as tests/test_parity.py, on llama only, with a small bucket list so the
cold compiles stay affordable: decodes of up to 16 sequences run in the buckets, 64-token
prefill chunks in the dynamic graph. Run with and without linear fusion
(graphs/passes/fuse_linears.py), and with every unlowered graph's linears forced onto oneDNN's
packed weights (graphs/passes/onednn_linear.py; the measured policy may or may not pick them
for a model this small), and (slow) with every bucket up to 8 rows forced onto the C++ GEMV
(graphs/passes/cpu_gemv.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compiled_engine import LLM, SamplingParams
from compiled_engine.graphs.compiled_step import CompiledStep
from compiled_engine.graphs.gemv_policy import GemvDecision
from compiled_engine.kernels.cpu_gemv import cpu_gemv_available
from compiled_engine.kernels.onednn_linear import onednn_linear_available
from tests.test_parity import MAX_NEW_TOKENS, PROMPTS, _hf_reference, compare_with_reference

BUCKETS = (1, 2, 4, 8, 16)


@pytest.mark.parametrize(
    ("fuse_linears", "packed"),
    [
        (True, False),
        pytest.param(False, False, marks=pytest.mark.slow),
        pytest.param(True, True, marks=pytest.mark.slow),
        pytest.param(True, "kernel", marks=pytest.mark.slow),
    ],
    ids=["fused", "unfused", "packed", "kernel"],
)
def test_greedy_parity_compiled_buckets(llama_dir, fuse_linears, packed, monkeypatch, tmp_path):
    if packed == "kernel":
        if not cpu_gemv_available(torch.float32):
            pytest.skip("the C++ GEMV cannot be built here")
        kernel_rows = tuple(b for b in BUCKETS if b <= 8)

        def kernel_for_small_buckets(step):
            return GemvDecision((), kernel_rows=kernel_rows)

        monkeypatch.setattr(CompiledStep, "gemv_decision", kernel_for_small_buckets)
    elif packed:
        if not onednn_linear_available(torch.float32):
            pytest.skip("this torch has no oneDNN (mkldnn) on CPU")
        measured = CompiledStep.gemv_decision

        def packing_everywhere(step):
            decision = measured(step)
            unlowered = tuple(b for b in step.buckets if not decision.lowers(b))
            return dataclasses.replace(decision, packed_rows=unlowered, packs_dynamic=True)

        monkeypatch.setattr(CompiledStep, "gemv_decision", packing_everywhere)
    prompts = PROMPTS["llama"]
    llm = LLM(
        llama_dir,
        dtype="float32",
        max_num_batched_tokens=64,
        max_num_seqs=16,
        enforce_eager=False,
        compile_buckets=BUCKETS,
        fuse_linears=fuse_linears,
        # A forced policy compiles other graphs for the same manifest: its own cache.
        cache_dir=str(tmp_path) if packed else None,
    )
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    excused = compare_with_reference(outputs, _hf_reference(llama_dir, prompts))
    compiled = llm.engine.model_runner.step_graph
    print(
        f"llama compiled (fuse_linears={fuse_linears}): {excused} near-tie divergences excused; "
        f"compile s {compiled.compile_seconds}"
    )
    # Full decode batches ran in the largest bucket, prefill chunks in the dynamic graph.
    assert {16, None} <= set(compiled.compiled_buckets)
    passes = {r.pass_name: r for r in compiled.traced.pass_log[0].results}
    if fuse_linears:  # q/k/v and gate/up of every layer: 5 linears fused per layer
        assert passes["fuse_linears"].nodes_rewritten == 5 * llm.engine.model_config.num_layers
    else:
        assert "fuse_linears" not in passes
    if packed == "kernel":
        small = [build for bucket, build in compiled.builds.items() if bucket is not None and bucket <= 8]
        assert small and all(build.variant.gemv_kernel for build in small)
    elif packed:
        builds = compiled.builds
        assert builds[16].variant.packed_linears and builds[None].variant.packed_linears
    assert llm.engine.num_free_kv_blocks() == llm.engine.num_kv_blocks
