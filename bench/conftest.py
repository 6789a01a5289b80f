"""Options, parametrisation and shared state for the bench suites.

`--bench-size full|quick|smoke` (or `--bench-quick`, or env BENCH_SIZE) picks the sizes in
bench/workloads.py. Each test is parametrised by model and by system ("ours" / "hf"); both systems of
one workload share a benchmark group, so one JSON holds the pair.
`--peer vllm=PYTHON` / `--peer llamacpp=DIR` add those engines as systems of the decode and
throughput suites (bench/peers/); `--bench-model NAME` (repeatable) picks the models.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import pytest

from bench.models import max_positions, model_names, resolve_model
from bench.peers.runs import PeerSession, PeerUnavailable
from bench.peers.spec import PEER_NAMES, PEER_PATHS, parse_peers
from bench.runners import EngineSettings, engine_settings, load_engine, load_hf, run_engine_generate
from bench.workloads import SIZE_PROFILES, BenchSizes, fixed_requests, sizes_for

SYSTEMS = ("ours", "hf")
# The suites a `--peer` joins (each peer runs the same requests there).
PEER_SUITES = ("test_decode", "test_decode_interleaved", "test_throughput")
BENCH_DTYPES = ("float32", "bfloat16")
BENCH_QUANTIZATIONS = ("int8", "int4")


def pytest_addoption(parser):
    group = parser.getgroup("compiled-engine bench")
    group.addoption(
        "--bench-size",
        choices=SIZE_PROFILES,
        default=None,
        help="workload sizes: full (default), quick (reduced), smoke (CI: every path once)",
    )
    group.addoption("--bench-quick", action="store_true", help="shorthand for --bench-size quick")
    group.addoption(
        "--bench-dtype",
        choices=BENCH_DTYPES,
        default=None,
        help="weights and activations for both systems: float32 (default) or bfloat16 (or env BENCH_DTYPE)",
    )
    group.addoption(
        "--bench-attention-backend",
        default="auto",
        help="our engine's attention_backend (default auto: on CPU the cpu kernel; 'torch' for the "
        "reference op with Inductor's inline attention maths in decode buckets)",
    )
    group.addoption(
        "--bench-quantization",
        choices=BENCH_QUANTIZATIONS,
        default=None,
        help="our engine's weight quantization (int8 / int4, docs/quantization.md; or env "
        "BENCH_QUANTIZATION); a llama.cpp peer then runs its Q8_0 / Q4_0 of the same weights",
    )
    group.addoption(
        "--bench-num-scheduler-steps",
        type=int,
        default=1,
        metavar="N",
        help="our engine's num_scheduler_steps (default 1: one decode step a schedule; docs/performance.md)",
    )
    group.addoption(
        "--peer",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also time a peer engine in the decode and throughput suites (repeatable): "
        + "; ".join(f"{name}=PATH, PATH {PEER_PATHS[name]}" for name in PEER_NAMES)
        + ". One that is not installed there gets a 'not installed' column.",
    )
    group.addoption(
        "--bench-model",
        action="append",
        default=[],
        metavar="NAME",
        help=f"time only these models (repeatable; default: the profile's): {model_names()}",
    )


def _profile(config) -> str:
    if config.getoption("--bench-quick"):
        return "quick"
    return config.getoption("--bench-size") or os.environ.get("BENCH_SIZE") or "full"


def pytest_configure(config):
    config._bench_sizes = sizes_for(_profile(config))
    models = config.getoption("--bench-model")
    unknown = [m for m in models if m not in model_names()]
    if unknown:
        raise pytest.UsageError(f"--bench-model {unknown}: unknown model, expected one of {model_names()}")
    if models:
        config._bench_sizes = dataclasses.replace(config._bench_sizes, models=tuple(dict.fromkeys(models)))
    quantization = config.getoption("--bench-quantization") or os.environ.get("BENCH_QUANTIZATION") or None
    if quantization is not None and quantization not in BENCH_QUANTIZATIONS:
        raise pytest.UsageError(
            f"BENCH_QUANTIZATION must be one of {BENCH_QUANTIZATIONS}, got {quantization!r}"
        )
    config._bench_quantization = quantization
    config._bench_num_scheduler_steps = config.getoption("--bench-num-scheduler-steps")
    if config._bench_num_scheduler_steps < 1:
        raise pytest.UsageError(
            f"--bench-num-scheduler-steps must be >= 1, got {config._bench_num_scheduler_steps}"
        )
    try:
        config._bench_peers = PeerSession(parse_peers(config.getoption("--peer")), quantization)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    dtype = config.getoption("--bench-dtype") or os.environ.get("BENCH_DTYPE") or "float32"
    if dtype not in BENCH_DTYPES:
        raise pytest.UsageError(f"BENCH_DTYPE must be one of {BENCH_DTYPES}, got {dtype!r}")
    config._bench_dtype = dtype
    config._bench_attention_backend = config.getoption("--bench-attention-backend")
    config._bench_started = time.time()


def pytest_generate_tests(metafunc):
    sizes: BenchSizes = metafunc.config._bench_sizes
    models = sizes.startup_models if metafunc.function.__name__ == "test_startup" else sizes.models
    peers = metafunc.config._bench_peers.names() if metafunc.function.__name__ in PEER_SUITES else []
    params = {
        "model_name": list(models),
        "system": [*SYSTEMS, *peers],
        "prompt_len": list(sizes.ttft_prompt_lens),
        "concurrency": list(sizes.decode_concurrency),
        "num_requests": list(sizes.throughput_requests),
    }
    for name, values in params.items():
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, values)


def pytest_collection_modifyitems(config, items):
    """A peer that is not installed skips its tests up front (its column says "not installed")."""
    status = config._bench_peers.status
    for item in items:
        system = item.callspec.params.get("system") if hasattr(item, "callspec") else None
        if system in status and status[system] != "installed":
            item.add_marker(pytest.mark.skip(reason=f"{system}: {status[system]}"))


class BenchSession:
    """Models, engines and HF models, each built once per session and only when a test needs it."""

    def __init__(
        self,
        sizes: BenchSizes,
        dtype: str = "float32",
        attention_backend: str = "auto",
        peers: PeerSession | None = None,
        quantization: str | None = None,
        num_scheduler_steps: int = 1,
    ) -> None:
        self.sizes = sizes
        self.dtype = dtype
        self.attention_backend = attention_backend
        self.quantization = quantization
        self.num_scheduler_steps = num_scheduler_steps
        self.peers = peers or PeerSession({})
        self._engines: dict[str, object] = {}
        self._hf: dict[str, object] = {}
        # Median cold start-up seconds of ours per model, for the warm/cold check.
        self.cold_startup_s: dict[str, float] = {}
        # The compile cache the last cold start-up round filled, per model: the warm rounds' start.
        self.cold_cache_dirs: dict[str, Path] = {}

    def model_dir(self, name: str) -> Path:
        model = resolve_model(name)
        if model.path is None:
            pytest.skip(f"model {name!r} unavailable: {model.missing_reason}")
        return model.path

    def vocab_size(self, name: str) -> int:
        import json

        return int(json.loads((self.model_dir(name) / "config.json").read_text())["vocab_size"])

    def warm_requests(self, name: str) -> list:
        """Requests of a few shapes that every system runs first, so first-call costs are not
        charged to the first test."""
        return fixed_requests(4, 16, 4, self.vocab_size(name), seed=99)

    def decode_requests(self, name: str, concurrency: int) -> list:
        """The decode suites' requests: `concurrency` of the profile's prompt and output lengths
        (skips the test when the model cannot hold them)."""
        s = self.sizes
        max_model_len = self.settings(name).max_model_len
        if s.decode_prompt_len + s.decode_output_len > max_model_len:
            pytest.skip(f"{name} holds {max_model_len} tokens: too few for the decode lengths")
        return fixed_requests(
            concurrency, s.decode_prompt_len, s.decode_output_len, self.vocab_size(name), seed=concurrency
        )

    def settings(self, name: str) -> EngineSettings:
        s = self.sizes
        longest = max(
            max(s.ttft_prompt_lens) + 1,
            s.decode_prompt_len + s.decode_output_len,
            s.throughput_prompt_range[1] + s.throughput_output_range[1],
        )
        return engine_settings(
            max_positions(self.model_dir(name)),
            longest,
            max(max(s.decode_concurrency), max(s.throughput_requests)),
            max(s.decode_concurrency) * s.decode_prompt_len,
        )

    def engine(self, name: str, **options):
        """Our engine for `name` (options such as async_scheduling=True build a separate one).

        Prefix caching is off unless a suite asks for it: the suites repeat their requests round
        after round, and against HF (no prefix cache) every round must compute its prompt."""
        options.setdefault("enable_prefix_caching", False)
        options.setdefault("attention_backend", self.attention_backend)
        if self.quantization is not None:
            options.setdefault("quantization", self.quantization)
        if self.num_scheduler_steps != 1:
            options.setdefault("num_scheduler_steps", self.num_scheduler_steps)
        key = (name, tuple(sorted(options.items())))
        if key not in self._engines and "async_scheduling" in options:
            # The device's default loop is one of the two: the engine built without the option
            # already runs it (on CPU the synchronous loop), so that same engine serves.
            others = tuple(sorted((k, v) for k, v in options.items() if k != "async_scheduling"))
            default = self._engines.get((name, others))
            if default is not None and default.engine.async_scheduling == options["async_scheduling"]:
                self._engines[key] = default
        if key not in self._engines:
            llm = load_engine(self.model_dir(name), self.settings(name), self.dtype, **options)
            warm = self.warm_requests(name)
            run_engine_generate(llm, warm)
            run_engine_generate(llm, warm[:1])
            self._engines[key] = llm
        return self._engines[key]

    def hf(self, name: str):
        if name not in self._hf:
            from bench.runners import run_hf_generate

            model = load_hf(self.model_dir(name), self.dtype)
            run_hf_generate(model, self.warm_requests(name), 4)
            self._hf[name] = model
        return self._hf[name]

    def peer_results(
        self, benchmark, system: str, name: str, workload: str, requests, rounds: int, warmup: int
    ):
        """A peer's measured rounds of `requests` (bench/peers/runs.py); skips when it cannot run.

        The peer times its rounds in its own process after its own warm-up; pytest-benchmark times
        the one call that fetches them, which the report does not read for peers (timed_in)."""
        warm = self.warm_requests(name)
        args = (system, self.model_dir(name), self.dtype, self.settings(name), warm, requests)
        results: list = []

        def fetch():
            if workload == "decode":
                return self.peers.decode(*args, rounds, warmup)
            return self.peers.throughput(*args, rounds)

        try:
            benchmark.pedantic(lambda: results.extend(fetch()), rounds=1, iterations=1, warmup_rounds=0)
        except PeerUnavailable as exc:
            pytest.skip(str(exc))
        benchmark.extra_info["timed_in"] = "peer"
        return results


@pytest.fixture(scope="session")
def bench_session(request):
    config = request.config
    session = BenchSession(
        config._bench_sizes,
        config._bench_dtype,
        config._bench_attention_backend,
        config._bench_peers,
        config._bench_quantization,
        config._bench_num_scheduler_steps,
    )
    yield session
    session.peers.close()


@pytest.fixture(scope="session")
def sizes(request) -> BenchSizes:
    return request.config._bench_sizes


def measured(results: list, warmup_rounds: int) -> list:
    """Drop the warm-up rounds' results (with --benchmark-disable there were none)."""
    return results[warmup_rounds:] if len(results) > warmup_rounds else results


def record(benchmark, *, workload: str, model: str, system: str, param: int, results: list, **extra) -> None:
    """The extra_info the report reads: who ran what, and per-round token counts and decode times."""
    benchmark.extra_info.update(
        workload=workload,
        model=model,
        system=system,
        param=param,
        tokens_generated=results[-1].tokens_generated,
        round_elapsed_s=[r.elapsed_s for r in results],
        round_tokens_per_s=[r.tokens_generated / r.elapsed_s for r in results],
        **extra,
    )
    tpots = [r.tpot_s for r in results if r.tpot_s is not None]
    if tpots:
        benchmark.extra_info["round_tpot_s"] = tpots
        benchmark.extra_info["tpot_median_s"] = statistics.median(tpots)


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """Machine, command, profile, wall time and the hardware floors, measured in this same session."""
    from bench.floors import describe_machine, measure_rates, model_floors

    sizes: BenchSizes = config._bench_sizes
    args = " ".join(shlex.quote(a) for a in config.invocation_params.args)
    rates = measure_rates()
    # The decode suite's shape: batch = largest concurrency, context = prompt + half the output.
    batch = max(sizes.decode_concurrency)
    context = sizes.decode_prompt_len + sizes.decode_output_len // 2
    floors = {}
    for name in sizes.models:
        model = resolve_model(name)
        if model.path is not None:
            floors[name] = model_floors(model.path, rates, batch=batch, context=context)
    output_json["compiled_engine_bench"] = {
        "profile": sizes.profile,
        "dtype": config._bench_dtype,
        "quantization": config._bench_quantization,
        "num_scheduler_steps": config._bench_num_scheduler_steps,
        "attention_backend": config._bench_attention_backend,
        "sizes": sizes.__dict__,
        "command": f"{Path(sys.executable).name} -m pytest {args}",
        "session_wall_s": time.time() - config._bench_started,
        "machine": describe_machine(),
        "rates": rates.__dict__,
        "floors": floors,
        "peers": config._bench_peers.describe(),
    }
