"""Start-up: a fresh Python process, from interpreter start to the first generated token.

Ours: import, `LLM(...)` (load, graph capture or cache load, KV-cache allocation, warm-up) and a
1-token request. HF: import, `from_pretrained` and a 1-token `generate`.

Cold (param 0): ours gets an empty compile cache of its own per round, with Inductor's cache
inside it (TORCHINDUCTOR_CACHE_DIR unset), so nothing compiled earlier is reused. Warm (param
1): one untimed cold process fills a cache, then the timed rounds start from it; the script
reports how many traces and compiles the warm process did (both must be 0). HF has no compile
cache, so its warm rounds are its cold path again. The OS file cache is warm in every case (the
weights were read before), so this is not a cold disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.conftest import record
from bench.runners import RunResult

_OURS = """
import json, sys, time
start = time.perf_counter()
from compiled_engine import LLM, SamplingParams
imported = time.perf_counter()
llm = LLM(model=sys.argv[1], dtype=sys.argv[3], **json.loads(sys.argv[2]))
built = time.perf_counter()
step = llm.engine.core.runner.compiled_step
compiled = sum(b.source == "compiled" for b in step.builds.values())
out = llm.generate([{"prompt_token_ids": [3] * 16}], SamplingParams(max_tokens=1, temperature=0.0,
                   ignore_eos=True), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 1
done = time.perf_counter()
print(json.dumps({"import_s": imported - start, "build_s": built - imported, "first_token_s": done - built,
                  "traces": step.num_traces, "compiles": compiled}))
"""

_HF = """
import json, sys, time
start = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM
imported = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[2])).eval()
built = time.perf_counter()
ids = torch.full((1, 16), 3, dtype=torch.long)
with torch.inference_mode():
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=1, min_new_tokens=1, pad_token_id=0)
assert out.shape[1] == 17
done = time.perf_counter()
print(json.dumps({"import_s": imported - start, "build_s": built - imported, "first_token_s": done - built}))
"""


def _run_fresh_process(script: str, args: list[str], cache_dir: Path | None = None) -> tuple[float, dict]:
    import time

    env = dict(os.environ, TQDM_DISABLE="1")
    if cache_dir is not None:
        # Our compile cache, with Inductor's own cache inside it (graphs/compile_cache.py).
        env["COMPILED_ENGINE_CACHE_DIR"] = str(cache_dir)
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=900
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise AssertionError(f"start-up process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    phases = json.loads(proc.stdout.strip().splitlines()[-1])
    return elapsed, phases


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_startup(benchmark, bench_session, sizes, model_name, system, start, tmp_path):
    model_dir: Path = bench_session.model_dir(model_name)
    if system == "ours":
        # The same limits (and so the same KV-cache allocation) the other suites run with.
        args = [
            str(model_dir),
            json.dumps(bench_session.settings(model_name).as_kwargs()),
            bench_session.dtype,
        ]
        script = _OURS
    else:
        args = [str(model_dir), bench_session.dtype]
        script = _HF

    rounds: list[tuple[float, dict]] = []
    counter = iter(range(1000))

    def cache_dir() -> Path | None:
        if system != "ours":
            return None
        if start == "warm":
            return tmp_path / "warm-cache"
        return tmp_path / f"cold-cache-{next(counter)}"  # empty: every cold round compiles

    if system == "ours" and start == "warm":
        _run_fresh_process(script, args, cache_dir())  # fills the cache, untimed

    benchmark.group = f"startup-{start} {model_name}"
    benchmark.pedantic(
        lambda: rounds.append(_run_fresh_process(script, args, cache_dir())),
        rounds=sizes.startup_rounds,
        iterations=1,
        warmup_rounds=0,
    )
    phases = [p for _, p in rounds]
    record(
        benchmark,
        workload="startup",
        model=model_name,
        system=system,
        param=0 if start == "cold" else 1,
        results=[RunResult(elapsed, 1) for elapsed, _ in rounds],
        start=start,
        phases=phases,
    )
    assert all(p["first_token_s"] > 0 for p in phases)
    if system == "ours" and start == "warm":
        # A warm start neither traces the model nor compiles a graph.
        assert all(p["traces"] == 0 and p["compiles"] == 0 for p in phases), phases
    if system == "ours" and start == "cold":
        assert all(p["traces"] == 1 and p["compiles"] >= 1 for p in phases), phases
