"""The engine with attention_backend="triton" (kernels under triton's interpreter on CPU) gives
Hugging Face's own greedy tokens on a tiny model, compiled and eager, and an unavailable backend
is a clear error at start-up."""

from __future__ import annotations

import pytest

from compiled_engine import LLM, SamplingParams
from compiled_engine.kernels.backends import AttentionBackendUnavailableError
from tests.hf_greedy import MAX_TOKENS, PROMPTS, hf_greedy_tokens

triton = pytest.importorskip("triton", reason="the triton backend needs the triton package")


@pytest.fixture(scope="module")
def hf_tokens(llama_dir):
    return hf_greedy_tokens(llama_dir)


# Slow: the eager case runs the same Triton kernel through the same select_attention_backend pass
# (checked on a captured graph by test_pass_select_attention_backend.py) on the eager path that
# test_parity.py runs every default run; the compiled case stays.
@pytest.mark.parametrize(
    "enforce_eager", [pytest.param(True, marks=pytest.mark.slow), False], ids=["eager", "compiled"]
)
def test_triton_backend_matches_hf_greedy(llama_dir, hf_tokens, enforce_eager, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not triton.knobs.runtime.interpret:
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    llm = LLM(
        llama_dir,
        dtype="float32",
        attention_backend="triton",
        enforce_eager=enforce_eager,
        max_model_len=64,
        max_num_seqs=4,
        block_size=4,
        num_kv_blocks=32,
        compile_buckets=(4, 16),
    )
    runner = llm.engine.model_runner
    assert runner.attention_backend.name == "triton"
    pass_log = runner.step_graph.captured.pass_log if enforce_eager else runner.step_graph.traced.pass_log
    # Every graph's attention calls (2 layers) now run the Triton op.
    assert [r.result("select_attention_backend").nodes_rewritten for r in pass_log] == [2] * len(pass_log)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_tokens


def test_unavailable_backend_fails_at_start_up_with_a_clear_error(llama_dir, monkeypatch):
    with pytest.raises(ValueError, match="unknown attention_backend 'fast'"):
        LLM(llama_dir, attention_backend="fast", enforce_eager=True)
    with pytest.raises(AttentionBackendUnavailableError, match="flashinfer"):
        LLM(llama_dir, attention_backend="flashinfer", enforce_eager=True)
