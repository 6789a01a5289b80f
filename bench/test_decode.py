"""Decode time per output token (TPOT) with N requests decoding together.

Each round: N requests of `decode_prompt_len` tokens, `decode_output_len` greedy tokens each, all
prefilled in one step. The benchmark times the whole round; TPOT = (time from the moment every
request has its first token to the last token) / (decode steps in that window), per round.
"""

from __future__ import annotations

from bench.conftest import measured, record
from bench.runners import run_engine_decode, run_hf_decode

WARMUP_ROUNDS = 1


def test_decode(benchmark, bench_session, sizes, model_name, system, concurrency):
    requests = bench_session.decode_requests(model_name, concurrency)
    benchmark.group = f"decode {model_name} concurrency={concurrency}"
    if system not in ("ours", "hf"):  # a --peer: it times its own rounds (bench/peers/)
        results = bench_session.peer_results(
            benchmark, system, model_name, "decode", requests, sizes.decode_rounds, WARMUP_ROUNDS
        )
    else:
        if system == "ours":
            llm = bench_session.engine(model_name)

            def run():
                return run_engine_decode(llm, requests)
        else:
            model = bench_session.hf(model_name)

            def run():
                return run_hf_decode(model, requests)

        results = []
        benchmark.pedantic(
            lambda: results.append(run()),
            rounds=sizes.decode_rounds,
            iterations=1,
            warmup_rounds=WARMUP_ROUNDS,
        )
        results = measured(results, WARMUP_ROUNDS)
    assert all(r.tokens_generated == concurrency * sizes.decode_output_len for r in results)
    assert all(r.decode_steps == sizes.decode_output_len - 1 for r in results), [
        r.decode_steps for r in results
    ]
    record(
        benchmark,
        workload="decode",
        model=model_name,
        system=system,
        param=concurrency,
        results=results,
        prompt_len=sizes.decode_prompt_len,
        output_len=sizes.decode_output_len,
        # Ours and a llama.cpp peer run quantized weights under --bench-quantization; HF never does.
        quantization=(bench_session.quantization or "none") if system != "hf" else "none",
    )
