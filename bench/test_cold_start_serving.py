"""Cold-start serving (#18): a `compiled-engine serve` process on an empty compile cache, hit by
streaming requests of mixed lengths that arrive over time, once per compile policy.

Each run launches the server as a user would (a subprocess on 127.0.0.1) with a fresh `--cache-dir`
and a fresh Inductor cache inside it (TORCHINDUCTOR_CACHE_DIR), so nothing compiled earlier is
reused. Once `/health` answers, the seeded workload starts: requests sent at seeded Poisson
arrival times through the official `openai` AsyncOpenAI client, streaming, every chunk's arrival
time recorded per stream. "background" serves steps whose bucket is not built on a fallback
graph while a niced process compiles it; "blocking" compiles it on the request path first.

Reported (benchmark.extra_info, and printed): inter-token latency p50/p99 over all streams, the
longest stall (largest gap between consecutive chunks of any stream), TTFT p50/p99, wall times,
and the server's own graph counters from /metrics. The issue's target for "background": longest
stall <= 250 ms and p99 ITL <= 3x p50; they are reported, not asserted (a 2-core machine shared
with other work decides them as much as the code does). Asserted: every stream got every token
it asked for, and with "background" no step waited on a compile or load (graph_wait_steps_total 0).

One chunk is one step's new tokens for its stream (one token; a token whose text the detokenizer
holds back still gets its chunk, with empty text). Two steps' tokens share a chunk only when the
server's stream reader falls a step behind; that gap then spans two steps. Usage at the end of
each stream checks that every requested token came.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import openai
import pytest

from bench.serving_harness import (
    ServerProcess,
    StreamRecord,
    http_get,
    inter_chunk_gaps,
    percentile,
    quiet_client_heap,
    serve_command,
)
from bench.workloads import BenchRequest, mixed_requests

# Variants: the server's compile policy and any extra flags. Every variant serves with `serve`'s
# defaults otherwise, which on CPU cap the prompt tokens of a step at 16 while requests decode
# (`--long-prefill-token-threshold`, engine_args.SERVING_LONG_PREFILL_DEFAULT); "-uncapped" turns
# the cap off (the default before it); "-chunked-8", "-chunked-32" (the default before 16) and
# "-chunked-64" set it to those. The "-all-cores" one gives the step every core
# (`--cpu-reserved-cores 0`) instead of leaving one to the API server and the client: the baseline
# of that default. Each is the same path as "background" otherwise, so the smoke run leaves them
# out.
VARIANTS = {
    "background": ("background", ()),
    "blocking": ("blocking", ()),
    "background-uncapped": ("background", ("--long-prefill-token-threshold", "0")),
    "background-chunked-8": ("background", ("--long-prefill-token-threshold", "8")),
    "background-chunked-32": ("background", ("--long-prefill-token-threshold", "32")),
    "background-chunked-64": ("background", ("--long-prefill-token-threshold", "64")),
    "background-all-cores": ("background", ("--cpu-reserved-cores", "0")),
}
# The model `compiled-engine serve` runs when given none: what a new user starts first.
MODEL = "embedded"
SERVED_NAME = "cold-bench"
# Per the issue, for the background policy.
TARGET_LONGEST_STALL_S = 0.250
TARGET_P99_OVER_P50 = 3.0
GRAPH_COUNTERS = (
    "compiled_engine:graph_wait_steps_total",
    "compiled_engine:graph_wait_seconds_total",
    "compiled_engine:graph_fallback_steps_total",
)


@dataclass(frozen=True)
class ColdServeSizes:
    num_requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    mean_arrival_gap_s: float  # Poisson arrivals: exponential gaps of this mean
    server_flags: tuple[str, ...] = ()


# Smoke keeps the cold compiles cheap: one small bucket and a step budget of its size, so every
# step fits it and no dynamic graph is compiled (longer prompts are prefilled in chunks).
COLD_SERVE_SIZES = {
    "full": ColdServeSizes(64, (16, 384), (16, 128), 0.25),
    "quick": ColdServeSizes(24, (16, 256), (16, 64), 0.25),
    "smoke": ColdServeSizes(3, (4, 12), (3, 6), 0.2, ("--buckets", "8", "--max-num-batched-tokens", "8")),
}
WORKLOAD_SEED = 18
SERVER_START_TIMEOUT_S = 600


@dataclass(frozen=True)
class ColdServeResult:
    startup_s: float  # launch to the first /health answer
    workload_wall_s: float  # first request sent to the last stream's end
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_max_s: float
    itl_p50_s: float
    itl_p99_s: float
    longest_stall_s: float
    longest_stall_at_s: float  # when that gap ended, from /health
    gaps_over_target: int  # inter-chunk gaps above the 250 ms target, all streams
    num_chunks: int
    graph_counters: dict[str, float]
    first_ready_answer_s: float  # how long the first /ready, asked as /health answered, took
    ready_at_start: dict  # the graphs as that first /ready saw them
    ready_at_end: dict
    # /ready sampled during the run: (asked, answered: seconds from /health; graphs ready, compiled,
    # compiling, queued).
    ready_timeline: list[tuple[float, float, int, int, int, int]]
    # The measuring client's own full garbage collections during the workload (count, longest).
    client_full_collections: int = 0
    client_longest_collection_s: float = 0.0


def summarise(
    streams: list[StreamRecord],
    startup_s: float,
    graph_counters: dict[str, float],
    ready_at_end: dict,
    ready_samples: list[tuple[float, float, dict]],
) -> ColdServeResult:
    ttfts = [s.chunk_at[0] - s.sent_at for s in streams]
    gaps = inter_chunk_gaps(streams)  # (gap, when it ended)
    itls = [g for g, _ in gaps]
    stall, stall_at = max(gaps) if gaps else (0.0, 0.0)
    return ColdServeResult(
        startup_s=startup_s,
        workload_wall_s=max(s.chunk_at[-1] for s in streams) - min(s.sent_at for s in streams),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        ttft_max_s=max(ttfts),
        itl_p50_s=percentile(itls, 50) if itls else 0.0,
        itl_p99_s=percentile(itls, 99) if itls else 0.0,
        longest_stall_s=stall,
        longest_stall_at_s=stall_at,
        gaps_over_target=sum(g > TARGET_LONGEST_STALL_S for g in itls),
        num_chunks=sum(len(s.chunk_at) for s in streams),
        graph_counters=graph_counters,
        first_ready_answer_s=ready_samples[0][1] - ready_samples[0][0],
        ready_at_start=ready_samples[0][2],
        ready_at_end=ready_at_end,
        ready_timeline=[
            (asked, answered, g["ready"], g["compiled"], g["compiling"], g["queued"])
            for asked, answered, g in ready_samples
        ],
    )


def _graph_counters(metrics_text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in GRAPH_COUNTERS:
                found[sample.name] = sample.value
    missing = set(GRAPH_COUNTERS) - found.keys()
    assert not missing, f"/metrics lacks {sorted(missing)}"
    return found


class ColdServer(ServerProcess):
    """`compiled-engine serve` on a fresh compile cache and a fresh Inductor cache, in its own
    process group (the background compiler it starts goes with it). `seed_from`: start from a copy
    of another run's `cache_root` instead (a warm comparison, bench/cold_serving_variants.py)."""

    def __init__(
        self,
        model_dir: Path,
        policy: str,
        dtype: str,
        cache_root: Path,
        flags: tuple[str, ...],
        seed_from: Path | None = None,
    ):
        if seed_from is None:
            cache_root.mkdir(parents=True)
        else:
            shutil.copytree(seed_from, cache_root)
        env = dict(os.environ, TQDM_DISABLE="1", TORCHINDUCTOR_CACHE_DIR=str(cache_root / "inductor"))
        env.pop("COMPILED_ENGINE_COMPILE_POLICY", None)
        command = serve_command(model_dir, dtype, SERVED_NAME, cache_root / "compile-cache", policy, flags)
        super().__init__(command, cache_root / "serve.log", env)


async def _stream_one(client, request: BenchRequest, send_at: float, t0: float) -> StreamRecord:
    await asyncio.sleep(max(0.0, t0 + send_at - time.perf_counter()))
    record = StreamRecord(sent_at=time.perf_counter() - t0, expected_tokens=request.output_len)
    # The token ids go in `extra_body`, which the client sends as they are: passed as `prompt`, the
    # `openai` client walks the list element by element before sending (6.2 ms a request for 384
    # ids, 0.9 ms this way: bench/test_client_prompt.py; the server gets the same JSON). This
    # client records every stream's chunks on one event loop, so that walk, at each arrival, was
    # counted as inter-token latency of the streams already running (docs/performance.md,
    # "Session 13").
    stream = await client.completions.create(
        model=SERVED_NAME,
        prompt="",
        max_tokens=request.output_len,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "prompt": list(request.prompt_token_ids)},
    )
    async for chunk in stream:
        now = time.perf_counter() - t0
        if chunk.choices:
            record.chunk_at.append(now)
        if chunk.usage is not None:
            record.completion_tokens = chunk.usage.completion_tokens
    return record


async def _sample_ready(url: str, t0: float, into: list, every_s: float = 0.5) -> None:
    """/ready every `every_s`, from the moment /health answered: the graphs' states over the run,
    and how long the server took to answer (a stalled server answers late)."""
    while True:
        asked = time.perf_counter() - t0
        _, body = await asyncio.to_thread(http_get, f"{url}/ready")
        into.append((asked, time.perf_counter() - t0, json.loads(body)["graphs"]))
        await asyncio.sleep(every_s)


async def run_workload(
    url: str, requests: list[BenchRequest], arrivals: list[float], t0: float, ready_samples: list
):
    # The client's default pool (1000 connections) holds every stream at once.
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)
    sampler = asyncio.create_task(_sample_ready(url, t0, ready_samples))
    try:
        streams = (_stream_one(client, r, at, t0) for r, at in zip(requests, arrivals, strict=True))
        records = await asyncio.gather(*streams)
        while not ready_samples:  # the first /ready may answer after a short workload ends
            if sampler.done():
                sampler.result()  # raises what stopped it
            await asyncio.sleep(0.05)
        return records
    finally:
        sampler.cancel()
        await client.close()


def seeded_workload(sizes: ColdServeSizes, vocab_size: int, max_model_len: int):
    requests = mixed_requests(
        sizes.num_requests, sizes.prompt_range, sizes.output_range, vocab_size, max_model_len, WORKLOAD_SEED
    )
    rng = random.Random(WORKLOAD_SEED)
    arrivals, at = [], 0.0
    for _ in requests:
        arrivals.append(at)
        at += rng.expovariate(1.0 / sizes.mean_arrival_gap_s)
    return requests, arrivals


def serve_cold_once(
    model_dir: Path,
    policy: str,
    dtype: str,
    cache_root: Path,
    sizes: ColdServeSizes,
    seed_from: Path | None = None,
    on_launch: Callable[[subprocess.Popen], None] | None = None,
) -> tuple[ColdServeResult, list[StreamRecord]]:
    """One server, one workload. `seed_from`: see ColdServer; `on_launch(process)`: called once the
    server process exists (bench/cold_serving_variants.py uses both)."""
    config = json.loads((model_dir / "config.json").read_text())
    max_model_len = int(config["max_position_embeddings"])
    requests, arrivals = seeded_workload(sizes, int(config["vocab_size"]), max_model_len)
    server = ColdServer(model_dir, policy, dtype, cache_root, sizes.server_flags, seed_from)
    if on_launch is not None:
        on_launch(server.proc)
    try:
        startup_s = server.wait_healthy()
        t0 = time.perf_counter()  # serving has started: every time below counts from here
        ready_samples: list = []
        with quiet_client_heap() as collections:
            streams = asyncio.run(run_workload(server.url, requests, arrivals, t0, ready_samples))
        counters = _graph_counters(http_get(f"{server.url}/metrics")[1])
        ready_at_end = json.loads(http_get(f"{server.url}/ready")[1])["graphs"]
    except BaseException:
        print(server.log()[-4000:])
        raise
    finally:
        server.stop()
    for s in streams:
        assert s.completion_tokens == s.expected_tokens, (s.completion_tokens, s.expected_tokens)
        assert s.chunk_at, "a stream ended without a token"
    result = summarise(streams, startup_s, counters, ready_at_end, ready_samples)
    result = dataclasses.replace(
        result,
        client_full_collections=collections.full,
        client_longest_collection_s=collections.longest_s,
    )
    return result, streams


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cold_start_serving(benchmark, bench_session, sizes, variant, tmp_path):
    policy, extra_flags = VARIANTS[variant]
    if extra_flags and sizes.profile == "smoke":
        pytest.skip("the same path as its policy without the flags: timed at full and quick sizes")
    cold_sizes = COLD_SERVE_SIZES[sizes.profile]
    cold_sizes = dataclasses.replace(cold_sizes, server_flags=cold_sizes.server_flags + extra_flags)
    model_dir = bench_session.model_dir(MODEL)
    runs = []
    counter = iter(range(1000))
    benchmark.group = f"cold-start serving {MODEL} ({cold_sizes.num_requests} streams)"
    benchmark.pedantic(
        lambda: runs.append(
            serve_cold_once(
                model_dir, policy, bench_session.dtype, tmp_path / f"cold-{next(counter)}", cold_sizes
            )
        ),
        rounds=1,
        iterations=1,
        warmup_rounds=0,
    )
    result, streams = runs[-1]
    info = asdict(result)
    info.update(
        workload="cold-serving",
        model=MODEL,
        system=f"ours-{variant}",
        param=cold_sizes.num_requests,
        policy=policy,
        variant=variant,
        server_flags=list(cold_sizes.server_flags),
        itl_p99_over_p50=result.itl_p99_s / result.itl_p50_s if result.itl_p50_s else None,
        meets_stall_target=result.longest_stall_s <= TARGET_LONGEST_STALL_S,
        meets_itl_target=result.itl_p99_s <= TARGET_P99_OVER_P50 * result.itl_p50_s,
        streams=[asdict(s) for s in streams],
    )
    benchmark.extra_info.update(info)
    shown = {k: v for k, v in info.items() if k not in ("streams", "ready_timeline")}
    print(f"\ncold-start serving, {variant}: {json.dumps(shown, indent=1)}")
    assert result.num_chunks >= len(streams)
    if policy == "background":
        # The point of the policy: no step compiled or loaded its graph on the request path.
        assert result.graph_counters["compiled_engine:graph_wait_steps_total"] == 0, result.graph_counters
