"""Offline throughput: many requests with seeded random prompt and output lengths.

Ours: everything handed to `LLM.generate` at once (continuous batching). HF: static left-padded
batches of `hf_batch_size` in submission order, each generating its longest request's output length;
only each request's own output length counts as generated tokens.
"""

from __future__ import annotations

import pytest

from bench.conftest import measured, record
from bench.models import max_positions
from bench.runners import run_engine_generate, run_hf_generate
from bench.workloads import mixed_requests

# A round takes minutes at full size, so none is spent on warm-up: both systems were already warmed
# when the session loaded them (bench/conftest.py), and the HF and our rounds are charged alike.
WARMUP_ROUNDS = 0


def test_throughput(benchmark, bench_session, sizes, model_name, system, num_requests):
    model_dir = bench_session.model_dir(model_name)
    max_model_len = min(max_positions(model_dir), bench_session.settings(model_name).max_model_len)
    if sizes.throughput_prompt_range[0] + sizes.throughput_output_range[1] > max_model_len:
        pytest.skip(f"{model_name} holds {max_model_len} tokens: too few for the throughput lengths")
    requests = mixed_requests(
        num_requests,
        sizes.throughput_prompt_range,
        sizes.throughput_output_range,
        bench_session.vocab_size(model_name),
        max_model_len,
        seed=num_requests,
    )
    benchmark.group = f"throughput {model_name} requests={num_requests}"
    if system not in ("ours", "hf"):  # a --peer: it times its own rounds (bench/peers/)
        results = bench_session.peer_results(
            benchmark, system, model_name, "throughput", requests, sizes.throughput_rounds, WARMUP_ROUNDS
        )
    else:
        if system == "ours":
            llm = bench_session.engine(model_name)

            def run():
                return run_engine_generate(llm, requests)
        else:
            model = bench_session.hf(model_name)

            def run():
                return run_hf_generate(model, requests, batch_size=sizes.hf_batch_size)

        results = []
        benchmark.pedantic(
            lambda: results.append(run()),
            rounds=sizes.throughput_rounds,
            iterations=1,
            warmup_rounds=WARMUP_ROUNDS,
        )
        results = measured(results, WARMUP_ROUNDS)
    wanted = sum(r.output_len for r in requests)
    assert all(r.tokens_generated == wanted for r in results)
    record(
        benchmark,
        workload="throughput",
        model=model_name,
        system=system,
        param=num_requests,
        results=results,
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        hf_batch_size=sizes.hf_batch_size,
    )
