"""What the suites run: sizes per profile (full / quick / smoke) and the seeded request sets."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Token ids below this are left out of random prompts: 0..2 are pad/bos/eos in both models.
FIRST_PLAIN_TOKEN = 3

SIZE_PROFILES = ("full", "quick", "smoke")


@dataclass(frozen=True)
class BenchSizes:
    """Every knob a profile sets. Rounds are measured rounds; warm-up rounds come on top."""

    profile: str
    ttft_prompt_lens: tuple[int, ...]
    ttft_rounds: int
    decode_concurrency: tuple[int, ...]
    decode_prompt_len: int
    decode_output_len: int
    decode_rounds: int
    throughput_requests: tuple[int, ...]
    throughput_prompt_range: tuple[int, int]
    throughput_output_range: tuple[int, int]
    throughput_rounds: int
    # HF `generate` has no continuous batching: the throughput baseline runs static batches of this size.
    hf_batch_size: int
    startup_rounds: int
    models: tuple[str, ...]
    # The start-up suite also times the unit tests' tiny model (the warm/cold ratio's "test model").
    startup_models: tuple[str, ...]


FULL = BenchSizes(
    profile="full",
    ttft_prompt_lens=(16, 128, 512),
    ttft_rounds=5,
    decode_concurrency=(1, 4, 16, 64),
    decode_prompt_len=64,
    decode_output_len=64,
    decode_rounds=3,
    throughput_requests=(64, 256),
    throughput_prompt_range=(16, 512),
    throughput_output_range=(16, 256),
    throughput_rounds=1,
    hf_batch_size=64,
    startup_rounds=2,
    models=("embedded", "bench-small"),
    startup_models=("embedded", "bench-small", "test-tiny"),
)

QUICK = BenchSizes(
    profile="quick",
    ttft_prompt_lens=(16, 128, 512),
    ttft_rounds=3,
    decode_concurrency=(1, 4, 16, 64),
    decode_prompt_len=64,
    decode_output_len=32,
    decode_rounds=2,
    throughput_requests=(64,),
    throughput_prompt_range=(16, 256),
    throughput_output_range=(16, 128),
    throughput_rounds=1,
    hf_batch_size=64,
    startup_rounds=1,
    models=("embedded", "bench-small"),
    startup_models=("embedded", "bench-small", "test-tiny"),
)

# Exercises every code path once, as fast as possible: for CI, not for numbers.
SMOKE = BenchSizes(
    profile="smoke",
    ttft_prompt_lens=(16,),
    ttft_rounds=1,
    decode_concurrency=(2,),
    decode_prompt_len=8,
    decode_output_len=4,
    decode_rounds=1,
    throughput_requests=(5,),
    # 5 prompts of 10-12 tokens prefill in one 50-60 token step: the 64-token bucket the session's
    # warm-up already built (bench/conftest.py), so the suite compiles no bucket for it alone.
    throughput_prompt_range=(10, 12),
    throughput_output_range=(2, 6),
    throughput_rounds=1,
    hf_batch_size=2,
    startup_rounds=1,
    models=("bench-small",),
    startup_models=("bench-small",),
)

_PROFILES = {s.profile: s for s in (FULL, QUICK, SMOKE)}


def sizes_for(profile: str) -> BenchSizes:
    if profile not in _PROFILES:
        raise ValueError(f"unknown bench size profile {profile!r}; expected one of {SIZE_PROFILES}")
    return _PROFILES[profile]


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    output_len: int


def random_prompt(length: int, vocab_size: int, rng: random.Random) -> tuple[int, ...]:
    if length < 1:
        raise ValueError(f"prompt length must be at least 1, got {length}")
    if vocab_size <= FIRST_PLAIN_TOKEN:
        raise ValueError(f"vocab_size must exceed {FIRST_PLAIN_TOKEN}, got {vocab_size}")
    return tuple(rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(length))


def fixed_requests(
    num_requests: int, prompt_len: int, output_len: int, vocab_size: int, seed: int
) -> list[BenchRequest]:
    """`num_requests` requests of one prompt length and one output length (TTFT and decode)."""
    rng = random.Random(seed)
    return [BenchRequest(random_prompt(prompt_len, vocab_size, rng), output_len) for _ in range(num_requests)]


def mixed_requests(
    num_requests: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    max_model_len: int,
    seed: int,
) -> list[BenchRequest]:
    """Prompt and output lengths drawn uniformly (inclusive) from the ranges, seeded.

    A draw whose prompt + output would not fit `max_model_len` has its prompt cut to fit, so a
    model with a short context still runs the same number of requests and output tokens.
    """
    lo_p, hi_p = prompt_range
    lo_o, hi_o = output_range
    if not (1 <= lo_p <= hi_p and 1 <= lo_o <= hi_o):
        raise ValueError(f"bad length ranges: prompt {prompt_range}, output {output_range}")
    if lo_p + hi_o > max_model_len:
        raise ValueError(
            f"max_model_len={max_model_len} cannot hold a {lo_p}-token prompt plus {hi_o} output tokens"
        )
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        output_len = rng.randint(lo_o, hi_o)
        prompt_len = min(rng.randint(lo_p, hi_p), max_model_len - output_len)
        requests.append(BenchRequest(random_prompt(prompt_len, vocab_size, rng), output_len))
    return requests


def hf_batches(requests: list[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """Static batches in submission order (no sorting by length: that would need the whole queue)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    return [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
