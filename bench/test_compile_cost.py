"""What a background compile costs the serving process on the CPU (docs/compile-policy.md).

compile_policy="background" compiles missing graphs in a niced process while the engine
serves. Here a warm engine (every graph it needs built in the warm-up round) decodes with its
batch alone on the machine ("idle"), and again while a cold `compiled-engine warmup` of the same
model runs at nice 19 into a fresh compile cache and a fresh Inductor cache ("compiling"): the
same work the background compiler does (trace, GEMM timing, Inductor and g++ compiles), at the
same priority. Both in one benchmark group; the TPOT ratio is the foreground's cost.

The compiler is given a head start (its imports, model load and trace) before the timed rounds
and must still be compiling when they end, else the round did not measure what it claims.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

from bench.conftest import measured, record
from bench.runners import run_engine_decode
from bench.workloads import fixed_requests

WARMUP_ROUNDS = 1
# Seconds for the compiler process to get past its imports, model load and trace (the smoke
# size, a path check rather than a measurement, gives it less).
HEAD_START_S = {"smoke": 3.0}
# The batch the background compiler competes with (the decode suite's middle concurrency).
CONCURRENCY = 8


@pytest.mark.parametrize("neighbour", ["idle", "compiling"])
def test_decode_beside_a_background_compile(benchmark, bench_session, sizes, model_name, neighbour):
    if model_name != sizes.models[0]:
        pytest.skip("measured on the first bench model only")
    max_model_len = bench_session.settings(model_name).max_model_len
    if sizes.decode_prompt_len + sizes.decode_output_len > max_model_len:
        pytest.skip(f"{model_name} holds {max_model_len} tokens: too few for the decode lengths")
    vocab = bench_session.vocab_size(model_name)
    requests = fixed_requests(CONCURRENCY, sizes.decode_prompt_len, sizes.decode_output_len, vocab, seed=7)
    llm = bench_session.engine(model_name)
    run_engine_decode(llm, requests)  # every graph this batch needs is built before any timing

    compiler = None
    with tempfile.TemporaryDirectory(prefix="bench-compile-cost-") as cold:
        if neighbour == "compiling":
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cold, "inductor"), TQDM_DISABLE="1")
            compiler = subprocess.Popen(
                ["nice", "-n", "19", sys.executable, "-c",
                 "import sys; from compiled_engine.entrypoints.cli import main; sys.exit(main())",
                 "warmup", "--model", str(bench_session.model_dir(model_name)),
                 "--dtype", bench_session.dtype, "--cache-dir", os.path.join(cold, "cache")],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(HEAD_START_S.get(sizes.profile, 20.0))
            assert compiler.poll() is None, f"the compiler exited early ({compiler.returncode})"
        try:
            results = []
            benchmark.group = f"decode beside a background compile {model_name} concurrency={CONCURRENCY}"
            benchmark.pedantic(
                lambda: results.append(run_engine_decode(llm, requests)),
                rounds=sizes.decode_rounds,
                iterations=1,
                warmup_rounds=WARMUP_ROUNDS,
            )
            if compiler is not None:
                assert compiler.poll() is None, "the compiler finished before the timed rounds did"
        finally:
            if compiler is not None:
                compiler.kill()
                compiler.wait()
    results = measured(results, WARMUP_ROUNDS)
    assert all(r.tokens_generated == CONCURRENCY * sizes.decode_output_len for r in results)
    record(
        benchmark,
        workload="decode-beside-compile",
        model=model_name,
        system="ours",
        param=CONCURRENCY,
        results=results,
        neighbour=neighbour,
        prompt_len=sizes.decode_prompt_len,
        output_len=sizes.decode_output_len,
    )
