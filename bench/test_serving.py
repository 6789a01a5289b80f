"""Online serving (#19): `compiled-engine serve` and vLLM's OpenAI server under the same client load.

Each server is started for real on 127.0.0.1 (a subprocess, as a user would) on the embedded model
and driven by the official async `openai` client (bench/serving_load.py):

- "burst": the issue's load, waves of concurrent streams (2 x 256 at full size, 8-48 tokens each,
  temperature 0.8, a quarter abandoned after 3 chunks); reported: total time (the median over
  rounds is the headline), requests/s, output tok/s, TTFT and inter-token p50/p99.
- "steady": N client loops streaming back to back for a fixed time; the same figures.

Systems: "ours" on a warm cache (`compiled-engine warmup` fills a fresh compile cache first, with
the user's Inductor cache; the server starts from it, then one untimed wave), "ours-fresh" (burst
only: empty compile and Inductor caches, the default background compile policy, timed from the
first request), and "vllm" (`--peer vllm=PYTHON`: vLLM's own server, same model folder, dtype and
thread count; one untimed wave first). Without the peer its rows are skipped and say "not installed".

One server runs at a time (starting the next stops the last), so no idle server shares the cores.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch

from bench.serving_harness import ServerProcess, serve_command
from bench.serving_load import BurstLoad, LoadResult, SteadyLoad, check_complete, run_load, summarise
from bench.serving_peers import start_vllm_server, vllm_python

MODEL = "embedded"
SERVED_NAME = "serving-bench"


@dataclass(frozen=True)
class ServingSizes:
    burst: BurstLoad
    steady: SteadyLoad
    rounds: int  # timed rounds per load on a warm server (the fresh one gets one)
    server_flags: tuple[str, ...] = ()


SERVING_SIZES = {
    "full": ServingSizes(BurstLoad(2, 256, (8, 48)), SteadyLoad(64, 20.0, (8, 48)), rounds=3),
    "quick": ServingSizes(BurstLoad(2, 64, (8, 48)), SteadyLoad(16, 8.0, (8, 48)), rounds=2),
    # Eager: the harness and both loads once, without minutes of compiling on a shared CI machine
    # (the compiled paths' smoke runs are the cold-start suite's).
    "smoke": ServingSizes(
        BurstLoad(2, 4, (3, 6)), SteadyLoad(2, 1.0, (3, 6)), rounds=1, server_flags=("--enforce-eager",)
    ),
}
CASES = [
    ("vllm", "burst"),
    ("vllm", "steady"),
    ("ours", "burst"),
    ("ours", "steady"),
    ("ours-fresh", "burst"),
]


class Servers:
    """At most one server alive; each system's server is started once and reused by its loads."""

    def __init__(self, config, root: Path, model_dir: Path, dtype: str, sizes: ServingSizes) -> None:
        self.config, self.root, self.model_dir, self.dtype, self.sizes = config, root, model_dir, dtype, sizes
        self.current: tuple[str, ServerProcess] | None = None
        self.startup_s: dict[str, float] = {}

    def get(self, system: str) -> ServerProcess:
        if self.current is not None and self.current[0] == system:
            return self.current[1]
        self.stop()
        server = self._start(system)
        try:
            self.startup_s[system] = server.wait_healthy()
        except BaseException:
            server.stop()
            raise
        self.current = (system, server)
        return server

    def stop(self) -> None:
        if self.current is not None:
            self.current[1].stop()
            self.current = None

    def _start(self, system: str) -> ServerProcess:
        run = self.root / system
        threads = torch.get_num_threads()
        if system == "vllm":
            python, why = vllm_python(self.config)
            if python is None:
                pytest.skip(f"vllm: {why}")
        run.mkdir(parents=True)
        if system == "vllm":
            log = run / "serve.log"
            return start_vllm_server(python, self.model_dir, self.dtype, SERVED_NAME, log, threads)
        caches = run if system == "ours-fresh" else self.root / "warm-caches"
        env = dict(os.environ, TQDM_DISABLE="1")
        if system == "ours-fresh":  # Inductor's own cache empty too, as on a new machine
            env["TORCHINDUCTOR_CACHE_DIR"] = str(caches / "inductor")
        env.pop("COMPILED_ENGINE_COMPILE_POLICY", None)
        if system == "ours" and "--enforce-eager" not in self.sizes.server_flags:
            self._warm_up(caches, env)
        command = serve_command(
            self.model_dir, self.dtype, SERVED_NAME, caches / "compile-cache", flags=self.sizes.server_flags
        )
        return ServerProcess(command, run / "serve.log", env)

    def _warm_up(self, caches: Path, env: dict[str, str]) -> None:
        """`compiled-engine warmup` with the server's options: every bucket into the caches."""
        command = [
            sys.executable, "-m", "compiled_engine.entrypoints.cli", "warmup", "--model", str(self.model_dir),
            "--dtype", self.dtype, "--cache-dir", str(caches / "compile-cache"), *self.sizes.server_flags,
        ]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def servers(request, bench_session, sizes, tmp_path_factory):
    pool = Servers(
        request.config,
        tmp_path_factory.mktemp("serving"),
        bench_session.model_dir(MODEL),
        bench_session.dtype,
        SERVING_SIZES[sizes.profile],
    )
    yield pool
    pool.stop()


def _median_result(results: list[LoadResult]) -> dict:
    return {k: statistics.median(getattr(r, k) for r in results) for k in asdict(results[0])}


@pytest.mark.parametrize(("served_by", "load_name"), CASES, ids=[f"{s}-{load}" for s, load in CASES])
def test_serving(benchmark, servers, sizes, served_by, load_name):
    system = served_by
    serving_sizes = SERVING_SIZES[sizes.profile]
    if system == "ours-fresh" and sizes.profile == "smoke":
        pytest.skip("a fresh cache is the cold-start suite's smoke run; timed at full and quick sizes")
    load = serving_sizes.burst if load_name == "burst" else serving_sizes.steady
    server = servers.get(system)
    fresh = system == "ours-fresh"
    if not fresh:
        # Untimed: the server's first requests (connections, first calls, graphs loaded) cost extra.
        streams = load.concurrency if isinstance(load, SteadyLoad) else load.streams_per_wave
        run_load(server.url, SERVED_NAME, BurstLoad(1, streams, load.token_range))
    rounds: list[LoadResult] = []

    def one_round() -> None:
        try:
            records = run_load(server.url, SERVED_NAME, load)
        except BaseException as exc:
            print(server.log()[-4000:])
            print(f"the {system} {load_name} load failed: {exc!r}")
            raise
        check_complete(records)
        rounds.append(summarise(records))

    benchmark.group = f"serving {MODEL} {load_name}"
    benchmark.pedantic(one_round, rounds=1 if fresh else serving_sizes.rounds, iterations=1, warmup_rounds=0)
    median = _median_result(rounds)
    info = dict(
        workload=f"serving-{load_name}",
        model=MODEL,
        system=system,
        param=load.streams_per_wave if isinstance(load, BurstLoad) else load.concurrency,
        load=asdict(load),
        dtype=servers.dtype,
        server_flags=list(serving_sizes.server_flags),
        startup_s=servers.startup_s.get(system),
        rounds=[asdict(r) for r in rounds],
        **{f"median_{k}": v for k, v in median.items()},
    )
    benchmark.extra_info.update(info)
    shown = {k: v for k, v in info.items() if k != "rounds"}
    print(f"\nserving, {system} {load_name}: {json.dumps(shown, indent=1)}")
    assert all(r.num_chunks >= r.num_requests for r in rounds)
