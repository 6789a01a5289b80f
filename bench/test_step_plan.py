"""Decode with CPU step plans and without, rounds interleaved (#19).

Two engines of the same model in one session: the default (`max_cpu_plan_tokens=16`: decode
buckets up to 16 tokens replay their compiled graph's calls from a plan recorded in C++,
graphs/cpu_step_plan.py) and `max_cpu_plan_tokens=0` (Inductor's Python wrapper every step).
Each timed round decodes the decode workload's requests on one engine, then on the other, so
both sides see the same moments of a noisy machine. TPOT as bench/test_decode.py measures it.

    python -m pytest bench/test_step_plan.py -q -s -p no:cacheprovider -k "1]" \
        [--bench-model qwen2.5-0.5b-shape] [--bench-dtype bfloat16] [--bench-quantization int4]

Printed and in extra_info: each side's TPOT per round, their medians, and the wrapper / plan
ratio of each round (above 1: the plan faster).
"""

from __future__ import annotations

import statistics

import pytest

from bench.conftest import record
from bench.interleaved import interleaved_decode
from bench.workloads import fixed_requests

WARMUP_ROUNDS = 1
PLAN_TOKENS = 16  # EngineArgs.max_cpu_plan_tokens's default


def test_step_plan(benchmark, bench_session, sizes, model_name, system, concurrency):
    if system != "ours":
        pytest.skip("step plans are ours")
    if concurrency > PLAN_TOKENS:
        pytest.skip(f"plans serve decode buckets up to {PLAN_TOKENS} tokens")
    vocab = bench_session.vocab_size(model_name)
    requests = fixed_requests(
        concurrency, sizes.decode_prompt_len, sizes.decode_output_len, vocab, seed=concurrency
    )
    engines = {
        "plan": bench_session.engine(model_name, max_cpu_plan_tokens=PLAN_TOKENS),
        "wrapper": bench_session.engine(model_name, max_cpu_plan_tokens=0),
    }
    benchmark.group = f"step-plan {model_name} concurrency={concurrency}"
    results, tpots = interleaved_decode(benchmark, engines, requests, 2 * sizes.decode_rounds, WARMUP_ROUNDS)
    # The plan engine really replayed plans, the other never did.
    planned = engines["plan"].engine.model_runner.step_graph.decode_graphs.graphs
    assert planned is not None and any(graph.plan is not None for graph in planned._graphs.values())
    assert engines["wrapper"].engine.model_runner.step_graph.decode_graphs.graphs is None
    ratios = [w / p for w, p in zip(tpots["wrapper"], tpots["plan"], strict=True)]
    record(
        benchmark,
        workload="step-plan",
        model=model_name,
        system="ours",
        param=concurrency,
        results=results["plan"],
        plan_tpot_s=tpots["plan"],
        wrapper_tpot_s=tpots["wrapper"],
        wrapper_over_plan=ratios,
        quantization=bench_session.quantization or "none",
    )
    print(
        f"\n{model_name} {bench_session.dtype} {bench_session.quantization or ''} x{concurrency}: "
        "TPOT median "
        f"plan {1e3 * statistics.median(tpots['plan']):.3f} ms, wrapper "
        f"{1e3 * statistics.median(tpots['wrapper']):.3f} ms; wrapper / plan per round "
        f"{', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})"
    )
