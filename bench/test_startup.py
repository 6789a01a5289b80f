"""Cold start: a fresh Python process, from interpreter start to the first generated token.

Ours: import, `LLM(...)` (load, graph capture, KV-cache allocation, warm-up) and a 1-token request.
HF: import, `from_pretrained` and a 1-token `generate`. Only the cold start exists today; a warm
start (compile cache reused across processes) arrives with the compile cache and is not measured yet.
The OS file cache is warm in both cases (the weights were read before), so this is not a cold disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.conftest import record
from bench.runners import RunResult

_OURS = """
import json, sys, time
start = time.perf_counter()
from compiled_engine import LLM, SamplingParams
imported = time.perf_counter()
llm = LLM(model=sys.argv[1], dtype="float32", **json.loads(sys.argv[2]))
built = time.perf_counter()
out = llm.generate([{"prompt_token_ids": [3] * 16}], SamplingParams(max_tokens=1, temperature=0.0,
                   ignore_eos=True), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 1
done = time.perf_counter()
print(json.dumps({"import_s": imported - start, "build_s": built - imported, "first_token_s": done - built}))
"""

_HF = """
import json, sys, time
start = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM
imported = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
built = time.perf_counter()
ids = torch.full((1, 16), 3, dtype=torch.long)
with torch.inference_mode():
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=1, min_new_tokens=1, pad_token_id=0)
assert out.shape[1] == 17
done = time.perf_counter()
print(json.dumps({"import_s": imported - start, "build_s": built - imported, "first_token_s": done - built}))
"""


def _run_fresh_process(script: str, args: list[str]) -> tuple[float, dict]:
    import time

    env = dict(os.environ, TQDM_DISABLE="1")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=600
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise AssertionError(f"start-up process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    phases = json.loads(proc.stdout.strip().splitlines()[-1])
    return elapsed, phases


def test_startup_cold(benchmark, bench_session, sizes, model_name, system):
    model_dir: Path = bench_session.model_dir(model_name)
    if system == "ours":
        # The same limits (and so the same KV-cache allocation) the other suites run with.
        args = [str(model_dir), json.dumps(bench_session.settings(model_name).as_kwargs())]
        script = _OURS
    else:
        args = [str(model_dir)]
        script = _HF

    runs = []
    benchmark.group = f"startup-cold {model_name}"
    benchmark.pedantic(
        lambda: runs.append(_run_fresh_process(script, args)),
        rounds=sizes.startup_rounds,
        iterations=1,
        warmup_rounds=0,
    )
    phases = [p for _, p in runs]
    record(
        benchmark,
        workload="startup",
        model=model_name,
        system=system,
        param=0,
        results=[RunResult(elapsed, 1) for elapsed, _ in runs],
        start="cold",
        phases=phases,
    )
    assert all(p["first_token_s"] > 0 for p in phases)
