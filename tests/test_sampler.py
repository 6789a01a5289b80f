"""The sampler: greedy, temperature, top-k, top-p, the sampled distribution, and seeding."""

from __future__ import annotations

import pytest
import torch

from compiled_engine.sampling_params import SamplingParams
from compiled_engine.worker import sampler as sampler_module
from compiled_engine.worker.sampler import Sampler, SamplingTensors, categorical_draw

CPU = torch.device("cpu")


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sample(logits, params_list, generators=None, default_generator=None):
    generators = generators if generators is not None else [None] * len(params_list)
    tensors = SamplingTensors.build(params_list, generators, CPU, default_generator=default_generator)
    return Sampler()(logits, tensors)


def repeated_draws(logits_row: torch.Tensor, params: SamplingParams, draws: int, seed: int = 0):
    """Many independent draws from one distribution in a single batched call."""
    logits = logits_row.expand(draws, -1).contiguous()
    return sample(logits, [params] * draws, default_generator=seeded(seed))


def test_greedy_is_argmax_of_raw_logits():
    logits = torch.randn(6, 50, generator=seeded(0))
    tokens = sample(logits, [SamplingParams(temperature=0.0, top_k=3, top_p=0.2)] * 6)
    assert tokens.dtype == torch.int64 and tokens.shape == (6,)
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(7, 999), (2, 151_936)], ids=["rows", "wide"])
def test_the_greedy_pick_is_argmax_on_ties_nan_and_inf(dtype, shape):
    # greedy_tokens_of takes max's indices on the CPU; they must be argmax's, first index included.
    generator = seeded(3)
    for trial in range(20):
        logits = torch.randint(-2, 3, shape, generator=generator).to(dtype)  # ties in every row
        if trial % 3 == 0:  # NaN: argmax points at the first one
            logits[0, shape[1] // 2] = logits[0, shape[1] // 3] = float("nan")
        if trial % 4 == 0:
            logits[-1] = float("-inf")  # a row of -inf: index 0
        assert torch.equal(sampler_module.greedy_tokens_of(logits), logits.argmax(dim=-1)), trial


def test_only_temperature_exactly_zero_is_greedy():
    # Two tied best tokens: argmax always answers 0, a real draw (however cold) splits them.
    logits = torch.tensor([4.0, 4.0, 0.0, -1.0])
    greedy = repeated_draws(logits, SamplingParams(temperature=0.0), 400)
    assert set(greedy.tolist()) == {0}
    cold = repeated_draws(logits, SamplingParams(temperature=1e-6), 400)
    assert set(cold.tolist()) == {0, 1}, "a tiny temperature still samples (only among the best)"


def test_tiny_temperature_does_not_produce_nan_or_masked_tokens():
    # The best token is not first: argmax over a NaN row would answer 0.
    logits = torch.tensor([-1e4, 9.99e3, 1e4, 0.0])
    tokens = repeated_draws(logits, SamplingParams(temperature=1e-37), 200)
    assert set(tokens.tolist()) == {2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_one_is_argmax(dtype):
    # Distinct integers: exact in bf16, so there are no ties to break differently.
    logits = torch.stack([torch.randperm(100, generator=seeded(row)) for row in range(8)]).to(dtype)
    tokens = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8, default_generator=seeded(2))
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_never_samples_outside_the_k_best():
    logits = torch.randn(30, generator=seeded(3))
    allowed = set(logits.topk(5).indices.tolist())
    tokens = repeated_draws(logits, SamplingParams(temperature=2.0, top_k=5), 3000)
    seen = set(tokens.tolist())
    assert seen <= allowed
    assert seen == allowed, "at a high temperature every one of the k best should appear"


def test_top_p_never_samples_outside_the_nucleus():
    # probs ~ [0.5, 0.25, 0.125, 0.0625, ...]: top_p=0.8 needs the first three (0.875 >= 0.8).
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.03125]))
    tokens = repeated_draws(logits, SamplingParams(top_p=0.8), 3000)
    assert set(tokens.tolist()) == {0, 1, 2}


def test_top_p_always_keeps_the_best_token():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    tokens = repeated_draws(logits, SamplingParams(top_p=0.01), 200)
    assert set(tokens.tolist()) == {0}


def test_top_k_then_top_p_on_the_renormalised_distribution():
    # After top_k=2 the renormalised probs are [2/3, 1/3]; top_p=0.6 then keeps only token 0.
    # (On the full distribution, 0.4 < 0.6 would have kept token 1 too.)
    logits = torch.log(torch.tensor([0.4, 0.2, 0.2, 0.2]))
    tokens = repeated_draws(logits, SamplingParams(top_k=2, top_p=0.6), 300)
    assert set(tokens.tolist()) == {0}


def test_top_k_larger_than_vocab_means_no_limit():
    logits = torch.zeros(4)
    tokens = repeated_draws(logits, SamplingParams(top_k=1000), 400)
    assert set(tokens.tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3])
    draws = 6000
    tokens = repeated_draws(logits, SamplingParams(temperature=temperature), draws, seed=7)
    observed = torch.bincount(tokens, minlength=5).double()
    expected = (logits.double() / temperature).softmax(-1) * draws
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    # 4 degrees of freedom: P(chi2 > 18.5) ~ 0.001. The seed is fixed, so this cannot flake.
    assert chi_square < 18.5, f"chi-square {chi_square:.1f}: observed {observed.tolist()}"


def test_wrong_temperature_would_be_caught_by_the_distribution_check():
    # Guard on the test above: sampling at T=1 is measurably different from softmax(logits / 0.5).
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3])
    tokens = repeated_draws(logits, SamplingParams(temperature=1.0), 6000, seed=7)
    observed = torch.bincount(tokens, minlength=5).double()
    expected = (logits.double() / 0.5).softmax(-1) * 6000
    assert ((observed - expected) ** 2 / expected).sum().item() > 18.5


def test_seeded_row_is_reproducible_and_independent_of_the_batch():
    logits = torch.randn(5, 64, generator=seeded(11))
    target = SamplingParams(temperature=1.0, seed=123)
    alone = sample(logits[2:3], [target], [seeded(123)])
    # Same row among different neighbours, in a different position, with a different unseeded stream.
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7), SamplingParams(top_k=4)]
    batch_a = sample(logits[[0, 2, 4]], [others[0], target, others[1]], [None, seeded(123), None], seeded(1))
    batch_b = sample(
        logits[[3, 1, 0, 2]],
        [others[2], others[1], SamplingParams(seed=9), target],
        [None, None, seeded(9), seeded(123)],
        seeded(2),
    )
    assert alone[0] == batch_a[1] == batch_b[3]


def test_seeds_actually_steer_the_draw():
    # Flat logits: a seeded row's token is a function of its seed, and different seeds differ.
    logits = torch.zeros(1, 1000)
    params = [SamplingParams(seed=s) for s in range(20)]
    tokens = [sample(logits, [p], [seeded(p.seed)])[0].item() for p in params]
    again = [sample(logits, [p], [seeded(p.seed)])[0].item() for p in params]
    assert tokens == again
    assert len(set(tokens)) > 15


def test_mixed_batch_of_greedy_seeded_and_unseeded_rows():
    logits = torch.randn(6, 40, generator=seeded(5))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, seed=2),
        SamplingParams(temperature=1.2, top_k=3, seed=3),
        SamplingParams(temperature=1.0, top_p=0.5),
    ]

    def generators():
        return [None, seeded(1), None, seeded(2), seeded(3), None]

    first = sample(logits, params, generators(), seeded(100))
    second = sample(logits, params, generators(), seeded(200))
    assert first[0] == logits[0].argmax() and first[3] == logits[3].argmax()
    # Seeded rows repeat whatever the unseeded stream does.
    assert first[1] == second[1] and first[4] == second[4]
    assert first[4].item() in logits[4].topk(3).indices.tolist()
    # Each seeded row matches the same request sampled alone.
    assert first[1] == sample(logits[1:2], params[1:2], [seeded(1)])[0]
    assert first[4] == sample(logits[4:5], params[4:5], [seeded(3)])[0]


def test_unseeded_rows_follow_the_default_generator():
    logits = torch.zeros(8, 500)
    params = [SamplingParams()] * 8
    assert torch.equal(sample(logits, params, None, seeded(4)), sample(logits, params, None, seeded(4)))
    assert not torch.equal(sample(logits, params, None, seeded(4)), sample(logits, params, None, seeded(5)))


def test_fast_path_flags():
    plain = SamplingTensors.build([SamplingParams(), SamplingParams(temperature=0.5)], [None, None], CPU)
    assert not plain.needs_top_k and not plain.needs_top_p and not plain.all_greedy
    # Greedy rows' top-k/top-p are irrelevant and must not force the slow path.
    greedy = SamplingTensors.build([SamplingParams(temperature=0.0, top_k=5, top_p=0.5)], [None], CPU)
    assert greedy.all_greedy and not greedy.needs_top_k and not greedy.needs_top_p
    mixed = SamplingTensors.build([SamplingParams(top_k=5), SamplingParams(top_p=0.9)], [None, None], CPU)
    assert mixed.needs_top_k and mixed.needs_top_p


def test_fast_path_skips_the_sort(monkeypatch):
    calls = []
    real_sort = torch.Tensor.sort

    def counting_sort(self, *args, **kwargs):
        calls.append(1)
        return real_sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", counting_sort)
    logits = torch.randn(3, 20)
    sample(logits, [SamplingParams(), SamplingParams(temperature=0.3), SamplingParams(temperature=0.0)])
    assert not calls
    sample(logits, [SamplingParams(), SamplingParams(top_p=0.9), SamplingParams(temperature=0.0)])
    assert calls


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="one generator"):
        SamplingTensors.build([SamplingParams()], [], CPU)
    tensors = SamplingTensors.build([SamplingParams()] * 2, [None, None], CPU)
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(3, 10), tensors)
    with pytest.raises(ValueError, match=r"\[rows, vocab\]"):
        Sampler()(torch.zeros(2, 3, 10), tensors)
    with pytest.raises(ValueError, match="cannot draw noise"):
        SamplingTensors.build([SamplingParams(seed=1)], [seeded(1)], torch.device("meta"))


def test_categorical_draw_takes_unnormalised_weights_and_never_a_zero_one():
    weights = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0]])
    params = [SamplingParams(temperature=1.0)] * 2
    tensors = SamplingTensors.build(params, [None, None], CPU, default_generator=seeded(3))
    drawn = torch.stack([categorical_draw(weights, tensors) for _ in range(2000)])
    assert set(drawn[:, 0].tolist()) == {1, 3} and set(drawn[:, 1].tolist()) == {4}
    share = (drawn[:, 0] == 1).double().mean().item()
    assert abs(share - 0.75) < 0.04  # 3 : 1; sd of the share over 2,000 draws is ~0.01


def test_categorical_draw_at_the_top_of_the_interval_takes_a_likely_token(monkeypatch):
    # u * total can round up to the total, which no cumulative entry exceeds: not the last token
    # (weight 0 here), but the likeliest.
    monkeypatch.setattr(sampler_module, "uniform_noise", lambda n, device, params: torch.ones(n))
    weights = torch.tensor([[0.2, 0.7, 0.1, 0.0]])
    params = [SamplingParams(temperature=1.0)]
    tensors = SamplingTensors.build(params, [None], CPU, default_generator=seeded(0))
    assert categorical_draw(weights, tensors).tolist() == [1]
