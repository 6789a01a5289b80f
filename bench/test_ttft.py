"""Time to first token by prompt length: one request, max_tokens=1 (prefill + first sample)."""

from __future__ import annotations

import pytest

from bench.conftest import measured, record
from bench.runners import run_engine_generate, run_hf_generate
from bench.workloads import fixed_requests

WARMUP_ROUNDS = 1


def test_ttft(benchmark, bench_session, sizes, model_name, system, prompt_len):
    max_model_len = bench_session.settings(model_name).max_model_len
    if prompt_len + 1 > max_model_len:
        pytest.skip(f"{model_name} holds {max_model_len} tokens: no room for a {prompt_len}-token prompt")
    vocab = bench_session.vocab_size(model_name)
    requests = fixed_requests(1, prompt_len, 1, vocab, seed=prompt_len)
    if system == "ours":
        llm = bench_session.engine(model_name)

        def run():
            return run_engine_generate(llm, requests)
    else:
        model = bench_session.hf(model_name)

        def run():
            return run_hf_generate(model, requests, batch_size=1)

    results = []
    benchmark.group = f"ttft {model_name} prompt={prompt_len}"
    benchmark.pedantic(
        lambda: results.append(run()), rounds=sizes.ttft_rounds, iterations=1, warmup_rounds=WARMUP_ROUNDS
    )
    results = measured(results, WARMUP_ROUNDS)
    assert all(r.tokens_generated == 1 for r in results)
    record(benchmark, workload="ttft", model=model_name, system=system, param=prompt_len, results=results)
