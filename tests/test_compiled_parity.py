"""Greedy parity with transformers when the engine runs Inductor-compiled bucket graphs.

Same prompts and checks as tests/test_parity.py, on llama only, with a small bucket list so the
cold compiles stay affordable: decodes of up to 16 sequences run in the buckets, 64-token
prefill chunks in the dynamic graph. Run with and without linear fusion
(graphs/passes/fuse_linears.py).
"""

from __future__ import annotations

import pytest

from compiled_engine import LLM, SamplingParams
from tests.test_parity import MAX_NEW_TOKENS, PROMPTS, _hf_reference, compare_with_reference

BUCKETS = (1, 2, 4, 8, 16)


@pytest.mark.parametrize("fuse_linears", [True, False], ids=["fused", "unfused"])
def test_greedy_parity_compiled_buckets(llama_dir, fuse_linears):
    prompts = PROMPTS["llama"]
    llm = LLM(
        llama_dir,
        dtype="float32",
        max_num_batched_tokens=64,
        max_num_seqs=16,
        enforce_eager=False,
        compile_buckets=BUCKETS,
        fuse_linears=fuse_linears,
    )
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    excused = compare_with_reference(outputs, _hf_reference(llama_dir, prompts))
    compiled = llm.engine.core.runner.compiled_step
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
    assert llm.engine.num_free_kv_blocks() == llm.engine.num_kv_blocks
