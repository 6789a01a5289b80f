"""Throughput with half the requests JSON-constrained against none, same engine, same run (#20).

    python -m pytest bench/test_structured_outputs.py -q -p no:cacheprovider \
        --benchmark-columns=median,min,rounds --benchmark-json=OUT.json

The embedded model, 64 requests of 64 tokens each (`ignore_eos`: both batches generate the same
tokens), temperature 1; "half-json" constrains every second request to bench/structured_outputs.py's
list-of-records schema, which keeps it inside its grammar for the whole run, so every step fills a
real mask. Target: the half-json median within 15% of none's. `python -m bench.structured_outputs`
is the same comparison with rounds alternating in one loop and the structured-output code's own
seconds (a steadier measure on a shared machine).
"""

from __future__ import annotations

import pytest

from bench.structured_outputs import batch
from compiled_engine import LLM

# (requests, tokens each, rounds) per size profile; smoke runs the path once, eagerly.
SIZES = {"full": (64, 64, 5), "quick": (32, 32, 3), "smoke": (4, 4, 1)}


@pytest.fixture(scope="module")
def llm(request):
    num_requests, _, _ = SIZES[request.config._bench_sizes.profile]
    smoke = request.config._bench_sizes.profile == "smoke"
    engine = LLM(max_num_seqs=num_requests, compile_policy="blocking", enforce_eager=smoke)
    yield engine
    engine.close()


@pytest.mark.parametrize("constrained", [False, True], ids=["none", "half-json"])
def test_structured_outputs_throughput(benchmark, request, llm, constrained):
    num_requests, max_tokens, rounds = SIZES[request.config._bench_sizes.profile]
    prompts, params = batch(num_requests, max_tokens, constrained)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: buckets and the grammar compiled
    outputs: list = []
    benchmark.group = f"structured outputs, {num_requests} requests x {max_tokens} tokens"
    benchmark.pedantic(
        lambda: outputs.append(llm.generate(prompts, params, use_tqdm=False)),
        rounds=rounds,
        iterations=1,
    )
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs[-1])
    assert tokens == num_requests * max_tokens  # ignore_eos: every request ran to max_tokens
    benchmark.extra_info.update(requests=num_requests, tokens=tokens, constrained=constrained)
