"""Client loads for an OpenAI-compatible server, driven by the official async `openai` client.

Two loads, both streaming `/v1/completions` with text prompts as a new user would send them:

- `BurstLoad` (issue #19's): waves of concurrent streams, each wave sent at once and awaited before
  the next; every stream asks for a seeded 8-48 tokens at temperature 0.8, and every fourth one is
  abandoned (the client closes the stream) after its third chunk.
- `SteadyLoad`: N client loops, each sending its next request as soon as the last one ended, for a
  fixed time; what was started before the end is awaited.

Every request sets `ignore_eos`, so both servers generate exactly the tokens asked for (a sampled
EOS would otherwise end streams at different points on different servers). A chunk is counted
when it carries a choice; one chunk is one token unless the detokenizer held a partial character
back. The summary (`LoadResult`) counts the tokens the client received.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import openai
from openai._constants import DEFAULT_CONNECTION_LIMITS

from bench.serving_harness import StreamRecord, inter_chunk_gaps, percentile, quiet_client_heap

WORDS = (
    "the cat sat on a warm mat while rain fell over the quiet town and a small boat drifted "
    "past the old mill where children played near the river at dusk"
).split()


@dataclass(frozen=True)
class BurstLoad:
    waves: int
    streams_per_wave: int
    token_range: tuple[int, int]  # max_tokens drawn uniformly from this range, both ends included
    abandon_every: int = 4  # every n-th stream is abandoned...
    abandon_after_chunks: int = 3  # ...after this many chunks
    temperature: float = 0.8
    seed: int = 19


@dataclass(frozen=True)
class SteadyLoad:
    concurrency: int
    duration_s: float
    token_range: tuple[int, int]
    temperature: float = 0.8
    seed: int = 19


@dataclass(frozen=True)
class LoadResult:
    total_s: float  # first request sent to the last stream's end
    num_requests: int
    num_abandoned: int
    output_tokens: int  # tokens the client received (usage for whole streams, chunks for abandoned)
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    longest_gap_s: float
    num_chunks: int


def prompt_text(rng: random.Random) -> str:
    start = rng.randrange(len(WORDS))
    length = rng.randint(4, 12)
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(length))


def make_client(url: str) -> openai.AsyncOpenAI:
    # The client's own retries (2), as a new user has them: under a 256-stream burst a server may
    # drop a connection before the request is read (seen with vLLM's), which the client resends.
    # Every stream of a wave at once (1000 connections), each kept for the next wave, but dropped
    # well before a server closes it (uvicorn's keep-alive is 5 s, the client's default too: a
    # connection reused just as the server closes it fails the request).
    limits = type(DEFAULT_CONNECTION_LIMITS)(
        max_connections=1000, max_keepalive_connections=1000, keepalive_expiry=2.0
    )
    http_client = openai.DefaultAsyncHttpxClient(limits=limits)
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=900, http_client=http_client)


async def stream_one(
    client: openai.AsyncOpenAI,
    model: str,
    prompt: str,
    max_tokens: int,
    temperature: float,
    t0: float,
    abandon_after: int | None = None,
) -> StreamRecord:
    record = StreamRecord(sent_at=time.perf_counter() - t0, expected_tokens=max_tokens)
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    try:
        async for chunk in stream:
            if chunk.choices:
                record.chunk_at.append(time.perf_counter() - t0)
                if abandon_after is not None and len(record.chunk_at) >= abandon_after:
                    record.abandoned = True
                    record.completion_tokens = len(record.chunk_at)
                    break
            if chunk.usage is not None:
                record.completion_tokens = chunk.usage.completion_tokens
    finally:
        await stream.close()  # early: the connection closes, and the server aborts the request
    return record


async def run_burst(url: str, model: str, load: BurstLoad) -> list[StreamRecord]:
    rng = random.Random(load.seed)
    client = make_client(url)
    try:
        t0 = time.perf_counter()
        records: list[StreamRecord] = []
        for _ in range(load.waves):
            wave = []
            for i in range(load.streams_per_wave):
                abandoned = i % load.abandon_every == load.abandon_every - 1
                abandon = load.abandon_after_chunks if abandoned else None
                wave.append(
                    stream_one(
                        client,
                        model,
                        prompt_text(rng),
                        rng.randint(*load.token_range),
                        load.temperature,
                        t0,
                        abandon,
                    )
                )
            records += await asyncio.gather(*wave)
        return records
    finally:
        await client.close()


async def run_steady(url: str, model: str, load: SteadyLoad) -> list[StreamRecord]:
    rng = random.Random(load.seed)
    client = make_client(url)
    t0 = time.perf_counter()
    deadline = t0 + load.duration_s

    async def loop(seed: int) -> list[StreamRecord]:
        own = random.Random(seed)
        done = []
        while time.perf_counter() < deadline:
            done.append(
                await stream_one(
                    client,
                    model,
                    prompt_text(own),
                    own.randint(*load.token_range),
                    load.temperature,
                    t0,
                )
            )
        return done

    try:
        loops = await asyncio.gather(*(loop(rng.randrange(2**31)) for _ in range(load.concurrency)))
        return [r for records in loops for r in records]
    finally:
        await client.close()


def summarise(records: list[StreamRecord]) -> LoadResult:
    with_chunks = [r for r in records if r.chunk_at]
    total = max(r.chunk_at[-1] for r in with_chunks) - min(r.sent_at for r in records)
    gaps = [g for g, _ in inter_chunk_gaps(records)]
    ttfts = [r.chunk_at[0] - r.sent_at for r in with_chunks]
    tokens = sum(r.completion_tokens for r in records)
    return LoadResult(
        total_s=total,
        num_requests=len(records),
        num_abandoned=sum(r.abandoned for r in records),
        output_tokens=tokens,
        requests_per_s=len(records) / total,
        output_tokens_per_s=tokens / total,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(gaps, 50),
        itl_p99_s=percentile(gaps, 99),
        longest_gap_s=max(gaps, default=0.0),
        num_chunks=sum(len(r.chunk_at) for r in records),
    )


def check_complete(records: list[StreamRecord]) -> None:
    """Every stream not abandoned got every token it asked for."""
    for r in records:
        assert r.chunk_at, "a stream ended without a token"
        if not r.abandoned:
            assert r.completion_tokens == r.expected_tokens, (r.completion_tokens, r.expected_tokens)


def run_load(url: str, model: str, load: BurstLoad | SteadyLoad) -> list[StreamRecord]:
    with quiet_client_heap():  # the same client for every server: its pauses measured for none
        if isinstance(load, BurstLoad):
            return asyncio.run(run_burst(url, model, load))
        return asyncio.run(run_steady(url, model, load))
