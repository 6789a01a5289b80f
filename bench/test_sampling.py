"""The sampler's draw at a serving batch: one uniform number per row through the cumulative
distribution (ours, worker/sampler.py) vs the exponential race, argmax(probs / E) with one
E ~ Exp(1) per vocabulary entry (vLLM's draw, and ours before), on the same probabilities.
And the greedy pick (`test_greedy_pick`): torch's `argmax`, `max(dim=-1).indices` (which
worker/sampler.py's `greedy_tokens_of` used on the CPU before) and the C++ pick it uses now
(kernels/cpu_sampler.py), over bf16 logits (the graphs' output dtype in a bf16 model) at
bench-small's 64 and 256 rows x 4,000 and one Qwen2.5 row of 151,936. And a temperature step's
whole draw from bf16 logits (`test_temperature_draw`): torch's ops (`target_probs`, then
`categorical_draw`, what the sampler ran before) against the C++ draw it runs now
(`temperature_draw`), at 64 and 256 rows x 4,096 and 16 rows x 151,936.

    python -m pytest bench/test_sampling.py -q --benchmark-columns=median,min,rounds

Both draw from the same distribution (tests/test_sampler.py checks ours with a chi-square); this
times the draw alone, after `target_probs`, at 256 rows and the embedded model's (4,096) and
Qwen2.5's (151,936) vocabulary sizes, on this process's torch threads.
"""

from __future__ import annotations

import pytest
import torch

from compiled_engine.kernels.cpu_sampler import greedy_pick, sampler_kernels_available, temperature_draw
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.worker.sampler import SamplingTensors, categorical_draw, target_probs, uniform_noise

ROWS = {"full": 256, "quick": 256, "smoke": 4}
VOCABS = (4096, 151_936)
ROUNDS = {4096: 20, 151_936: 5}  # the race over 151,936 entries takes seconds a round


def exponential_race(probs: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_(generator=params.default_generator)
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("draw", ["cumulative", "exponential-race"])
def test_sampling_draw(benchmark, request, draw, vocab):
    rows = ROWS[request.config._bench_sizes.profile]
    params = SamplingTensors.build(
        [SamplingParams(temperature=0.8)] * rows,
        [None] * rows,
        torch.device("cpu"),
        default_generator=torch.Generator().manual_seed(0),
    )
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1))
    probs = target_probs(logits, params)
    fn = categorical_draw if draw == "cumulative" else exponential_race
    benchmark.group = f"sampling draw, {rows} rows x vocab {vocab}"
    rounds = ROUNDS[vocab]
    tokens = benchmark.pedantic(lambda: fn(probs, params), rounds=rounds, iterations=1, warmup_rounds=1)
    assert tokens.shape == (rows,) and bool((probs.gather(1, tokens[:, None]) > 0).all())
    benchmark.extra_info.update(draw=draw, rows=rows, vocab=vocab, threads=torch.get_num_threads())


PICKS = {
    "argmax": lambda logits: logits.argmax(dim=-1),
    "max-indices": lambda logits: logits.max(dim=-1).indices,
    "kernel": greedy_pick,
}


@pytest.mark.parametrize(
    "shape", [(64, 4000), (256, 4000), (1, 151_936)], ids=["64x4000", "256x4000", "1x151936"]
)
@pytest.mark.parametrize("pick", list(PICKS))
def test_greedy_pick(benchmark, request, pick, shape):
    if pick == "kernel" and not sampler_kernels_available():
        pytest.skip("no C++ compiler: the kernel cannot be built")
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    fn = lambda: PICKS[pick](logits)  # noqa: E731
    benchmark.group = f"greedy pick, bf16 {shape[0]} x {shape[1]}"
    calls = 2 if request.config._bench_sizes.profile == "smoke" else 100
    tokens = benchmark.pedantic(lambda: [fn() for _ in range(calls)][-1], rounds=10, warmup_rounds=1)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    benchmark.extra_info.update(pick=pick, calls_per_round=calls, threads=torch.get_num_threads())


@pytest.mark.parametrize(
    "shape", [(64, 4096), (256, 4096), (16, 151_936)], ids=["64x4096", "256x4096", "16x151936"]
)
@pytest.mark.parametrize("draw", ["torch-ops", "kernel"])
def test_temperature_draw(benchmark, request, draw, shape):
    if draw == "kernel" and not sampler_kernels_available():
        pytest.skip("no C++ compiler: the kernel cannot be built")
    rows, vocab = shape
    params = SamplingTensors.build(
        [SamplingParams(temperature=0.8)] * rows,
        [None] * rows,
        torch.device("cpu"),
        default_generator=torch.Generator().manual_seed(0),
    )
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    def torch_ops():
        return categorical_draw(target_probs(logits.float(), params), params)

    def kernel():
        return temperature_draw(logits, params.temperature, uniform_noise(rows, logits.device, params))

    fn = torch_ops if draw == "torch-ops" else kernel
    benchmark.group = f"temperature draw, bf16 {rows} x {vocab}"
    calls = 2 if request.config._bench_sizes.profile == "smoke" else 20
    tokens = benchmark.pedantic(lambda: [fn() for _ in range(calls)][-1], rounds=10, warmup_rounds=1)
    assert tokens.shape == (rows,) and bool(((tokens >= 0) & (tokens < vocab)).all())
    benchmark.extra_info.update(draw=draw, calls_per_round=calls, threads=torch.get_num_threads())
