"""Side runs of the cold-start serving workload (bench/test_cold_start_serving.py, full size), to
tell what sets its stalls: the same requests, arrival times and measurement on other servers.

    python -m bench.cold_serving_variants eager OUT.json     # --enforce-eager: no compiler at all
    python -m bench.cold_serving_variants fill DIR OUT.json  # blocking policy, cold; its caches stay in DIR
    python -m bench.cold_serving_variants warm DIR OUT.json  # background policy on a copy of DIR's caches
    python -m bench.cold_serving_variants stopped OUT.json   # background, its compiler process SIGSTOPped
    python -m bench.cold_serving_variants background OUT.json  # the suite's default variant, chunk times kept
    python -m bench.cold_serving_variants traced OUT.json      # that, with the engine's steps traced

`traced` puts bench/step_trace on the server's PYTHONPATH (its sitecustomize records every
engine step: times, tokens, sequences, prompt chunks) and adds to OUT.json `step_costs`: step
time medians by token bucket, decode-only or with a prompt chunk, and `engine_itl`: the
engine-side inter-token latency (time between the ends of consecutive steps, once per decoding
sequence), p50 and p99. The trace's own cost is a few microseconds a step.

OUT.json holds the run's summary (ColdServeResult) and every stream's chunk times.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.models import EMBEDDED, resolve_model
from bench.test_cold_start_serving import COLD_SERVE_SIZES, MODEL, serve_cold_once

COMPILER_MODULE = "graph_compiler_process"


def stop_compiler_of(server: subprocess.Popen, watch_s: float = 120.0) -> None:
    """SIGSTOP the server's background compiler process as soon as it exists: the same fallback
    steps then run with nothing compiling beside them (the process is killed with the server)."""

    def watch() -> None:
        stopped: set[int] = set()
        deadline = time.monotonic() + watch_s
        while time.monotonic() < deadline and server.poll() is None:
            children = subprocess.run(
                ["ps", "-o", "pid=,args=", "--ppid", str(server.pid)], capture_output=True, text=True
            ).stdout
            for line in children.splitlines():
                pid, _, args = line.strip().partition(" ")
                if COMPILER_MODULE in args and int(pid) not in stopped:
                    os.kill(int(pid), signal.SIGSTOP)
                    stopped.add(int(pid))
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()


def step_report(prefix: Path) -> dict:
    """`step_costs` and `engine_itl` from the engine process's trace (the longest one written)."""
    from compiled_engine.graphs.buckets import bucket_for, default_buckets

    traces = [json.loads(p.read_text()) for p in prefix.parent.glob(prefix.name + ".*.json")]
    steps = [s for s in max(traces, key=len) if s[2] > 0]
    buckets = default_buckets(8192, 256)
    costs: dict[tuple[int, bool], list[float]] = {}
    for started, ended, tokens, _, prompts, _ in steps:
        costs.setdefault((bucket_for(tokens, buckets) or 0, prompts > 0), []).append(ended - started)
    periods = []
    for before, step in zip(steps, steps[1:], strict=False):
        periods += [step[1] - before[1]] * (step[3] - step[4])  # one per decoding sequence
    periods.sort()
    table = [
        {"bucket": b, "prompt_chunk": p, "steps": len(v), "median_s": statistics.median(v),
         "p90_s": sorted(v)[int(0.9 * len(v))]}
        for (b, p), v in sorted(costs.items())
    ]  # fmt: skip
    itl = {"p50_s": periods[len(periods) // 2], "p99_s": periods[int(0.99 * len(periods))]}
    return {"step_costs": table, "engine_itl": itl, "num_steps": len(steps)}


def main(argv: list[str]) -> int:
    variant, *paths = argv or [""]
    sizes = COLD_SERVE_SIZES["full"]
    assert MODEL == EMBEDDED
    model_dir = resolve_model(MODEL).path
    scratch = Path(tempfile.mkdtemp(prefix="cold-serving-"))
    if variant == "eager" and len(paths) == 1:
        eager = dataclasses.replace(sizes, server_flags=(*sizes.server_flags, "--enforce-eager"))
        result, streams = serve_cold_once(model_dir, "blocking", "float32", scratch / "run", eager)
    elif variant == "fill" and len(paths) == 2:
        result, streams = serve_cold_once(model_dir, "blocking", "float32", Path(paths[0]), sizes)
    elif variant == "stopped" and len(paths) == 1:
        root = scratch / "run"
        result, streams = serve_cold_once(
            model_dir, "background", "float32", root, sizes, on_launch=stop_compiler_of
        )
    elif variant == "background" and len(paths) == 1:
        result, streams = serve_cold_once(model_dir, "background", "float32", scratch / "run", sizes)
    elif variant == "traced" and len(paths) == 1:
        prefix = scratch / "steps"
        os.environ["STEP_TRACE_OUT"] = str(prefix)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).parent / "step_trace"), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        result, streams = serve_cold_once(model_dir, "background", "float32", scratch / "run", sizes)
        traced = step_report(prefix)
    elif variant == "warm" and len(paths) == 2:
        root = scratch / "run"
        result, streams = serve_cold_once(model_dir, "background", "float32", root, sizes, Path(paths[0]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    out = {"variant": variant, **dataclasses.asdict(result)}
    if variant == "traced":
        out.update(traced)
    out["streams"] = [dataclasses.asdict(s) for s in streams]
    Path(paths[-1]).write_text(json.dumps(out))
    shown = {k: v for k, v in out.items() if k not in ("streams", "ready_timeline")}
    print(json.dumps(shown, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
