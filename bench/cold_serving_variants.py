"""Side runs of the cold-start serving workload (bench/test_cold_start_serving.py, full size), to
tell what sets its stalls: the same requests, arrival times and measurement on other servers.

    python -m bench.cold_serving_variants eager OUT.json     # --enforce-eager: no compiler at all
    python -m bench.cold_serving_variants fill DIR OUT.json  # blocking policy, cold; its caches stay in DIR
    python -m bench.cold_serving_variants warm DIR OUT.json  # background policy on a copy of DIR's caches
    python -m bench.cold_serving_variants stopped OUT.json   # background, its compiler process SIGSTOPped
    python -m bench.cold_serving_variants background OUT.json  # the suite's default variant, chunk times kept

OUT.json holds the run's summary (ColdServeResult) and every stream's chunk times.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
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
    elif variant == "warm" and len(paths) == 2:
        root = scratch / "run"
        result, streams = serve_cold_once(model_dir, "background", "float32", root, sizes, Path(paths[0]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    out = {"variant": variant, **dataclasses.asdict(result)}
    out["streams"] = [dataclasses.asdict(s) for s in streams]
    Path(paths[-1]).write_text(json.dumps(out))
    shown = {k: v for k, v in out.items() if k not in ("streams", "ready_timeline")}
    print(json.dumps(shown, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
