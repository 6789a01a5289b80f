"""Speculative decoding on a real engine: greedy outputs equal transformers' (the parity suite's
prompts, k = 1..5) and the engine's own without speculation (randomised requests under KV pressure
with preemption, prefix caching, the async loop on and off, n > 1); stop strings, logprobs and
seeds inside accepted runs; acceptance in stats(); no block leaks."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from compiled_engine import LLM, SamplingParams
from compiled_engine.engine.async_llm import AsyncLLM
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine_args import EngineArgs
from compiled_engine.entrypoints.openai.api_server import build_app
from compiled_engine.worker import spec_verifier
from tests.model_factory import make_tiny_model
from tests.test_parity import MAX_NEW_TOKENS, PROMPTS, compare_with_reference
from tests.test_parity import references as references  # noqa: F401 - the fixture, shared
from tests.test_prefix_caching_engine import ENGINE_OPTIONS, _run
from tests.test_server import ServerThread, _metrics, _post
from tests.test_speculative_decoding import chi_square_p_value


def ngram(k: int, **extra) -> dict:
    # Every n from 1 matches (random prompts rarely repeat 5 tokens), and no batch-size cut-off:
    # these tests want proposals in every step that can have them.
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "disable_by_batch_size": 256,
        **extra,
    }


def _assert_spec_ran_and_nothing_leaked(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.speculative and stats.num_spec_steps > 0
    assert 0 < stats.num_accepted_draft_tokens <= stats.num_draft_tokens
    assert 0.0 < stats.spec_acceptance_rate <= 1.0 and stats.spec_mean_accepted_length > 1.0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


# The default run compares with the engine without speculation (below, under KV pressure) and keeps
# these: transformers' reference for 32 prompts costs ~25 s here, each engine ~15 s more.
@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_parity_with_ngram_speculation(k, model_dirs, references):  # noqa: F811
    prompts = PROMPTS["llama"]
    llm = LLM(model_dirs["llama"], dtype="float32", enforce_eager=True, speculative_config=ngram(k))
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    excused = compare_with_reference(outputs, references("llama", prompts))
    print(f"k={k}: {excused} near-tie divergences excused; stats {llm.stats()}")
    _assert_spec_ran_and_nothing_leaked(llm)


@pytest.mark.slow
def test_greedy_parity_with_speculation_under_preemption(model_dirs, references):  # noqa: F811
    prompts = PROMPTS["llama"]
    llm = LLM(
        model_dirs["llama"],
        dtype="float32",
        enforce_eager=True,
        num_kv_blocks=40,
        max_num_batched_tokens=512,
        speculative_config=ngram(4),
    )
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    compare_with_reference(outputs, references("llama", prompts))
    _assert_spec_ran_and_nothing_leaked(llm)


# --- randomised requests under KV pressure, against the same engine without speculation --------

# (prefix caching, async loop): the default run takes one, -m slow all four. The compiled graphs
# are test_prefix_caching_engine.py's (same options), so in a full run they come from its cache.
SPEC_MODES = [
    pytest.param((False, False), marks=pytest.mark.slow),
    pytest.param((True, False), marks=pytest.mark.slow),
    pytest.param((False, True), marks=pytest.mark.slow),
    (True, True),
]


def _workload(size: int, seed: int = 0):
    """Prompts from a few shared "system prompts" (one a block of tokens repeated, which n-gram
    proposals love) plus short suffixes, arriving over time, each greedy with its own max_tokens."""
    rng = random.Random(seed)
    system_prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(8, 40))] for _ in range(4)]
    system_prompts.append([rng.randrange(3, 384) for _ in range(4)] * 6)
    requests = []
    for i in range(size):
        suffix = [rng.randrange(3, 384) for _ in range(rng.choice([0, 1, 3, 7, 12]))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.5)
        requests.append((str(i), rng.choice(system_prompts) + suffix, params, rng.randrange(0, size // 2)))
    return requests


@pytest.fixture(scope="module")
def plain_engine(llama_dir):
    """No speculation, synchronous, no prefix cache: the reference the other engines must match."""
    return LLM(llama_dir, enable_prefix_caching=False, async_scheduling=False, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def spec_engine(llama_dir):
    """Speculation with prefix caching and the async loop: the default run's engine under test."""
    options = dict(enable_prefix_caching=True, async_scheduling=True, speculative_config=ngram(3))
    return LLM(llama_dir, **options, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def baseline(plain_engine):
    """Each workload's outputs without speculation (the same compiled engine options), made once."""
    llm = plain_engine
    results: dict[int, dict] = {}

    def get(size: int):
        if size not in results:
            results[size] = _run(llm, _workload(size))
        return results[size]

    return get


@pytest.mark.parametrize("mode", SPEC_MODES)
def test_greedy_outputs_match_without_speculation_under_kv_pressure(mode, llama_dir, baseline, request):
    caching, async_ = mode
    if mode == (True, True):
        llm = request.getfixturevalue("spec_engine")
    else:
        llm = LLM(
            llama_dir,
            enable_prefix_caching=caching,
            async_scheduling=async_,
            speculative_config=ngram(3),
            **ENGINE_OPTIONS,
        )
    assert _run(llm, _workload(60)) == baseline(60)
    assert llm.stats().num_preemptions > 0, "the workload was meant to force preemption"
    _assert_spec_ran_and_nothing_leaked(llm)


@pytest.mark.slow
def test_200_randomised_requests_match_in_both_loops(llama_dir, baseline):
    for async_ in (False, True):
        llm = LLM(llama_dir, async_scheduling=async_, speculative_config=ngram(5), **ENGINE_OPTIONS)
        assert _run(llm, _workload(200)) == baseline(200), f"async_scheduling={async_}"
        _assert_spec_ran_and_nothing_leaked(llm)


# --- what each request asks for, inside accepted runs ------------------------------------------


@pytest.fixture(scope="module")
def engines(plain_engine, spec_engine):
    # The compiled engines of the KV-pressure test (ENGINE_OPTIONS: max_model_len 96, 40 blocks of 4).
    return plain_engine, spec_engine


# Repetitive code: n-gram proposals find matches, so runs of several tokens are accepted.
CODE = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef "


def _greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def test_n_samples_stop_strings_and_stop_tokens_match_without_speculation(engines):
    plain, spec = engines
    assert len(plain.get_tokenizer().encode(CODE)) + 32 <= ENGINE_OPTIONS["max_model_len"]
    full = plain.generate(CODE, _greedy(32), use_tqdm=False)[0].outputs[0]
    assert spec.generate(CODE, _greedy(32), use_tqdm=False)[0].outputs[0].token_ids == full.token_ids
    # A stop string and a stop token from the middle of the output: wherever they fall in an
    # accepted run, nothing after them is emitted.
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    stop_token = full.token_ids[len(full.token_ids) // 2]
    for params in (_greedy(32, stop=[stop]), _greedy(32, stop_token_ids=[stop_token])):
        want, got = (llm.generate(CODE, params, use_tqdm=False)[0].outputs[0] for llm in engines)
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        )
    # n > 1 greedy: every sample is the plain output.
    many = spec.generate(CODE, _greedy(20, n=3), use_tqdm=False)[0].outputs
    assert [c.token_ids for c in many] == [full.token_ids[:20]] * 3
    _assert_spec_ran_and_nothing_leaked(spec)


def test_logprobs_of_accepted_runs_match_without_speculation(engines):
    params = _greedy(24, logprobs=3)
    want, got = (llm.generate(CODE, params, use_tqdm=False)[0].outputs[0] for llm in engines)
    assert got.token_ids == want.token_ids
    assert len(got.logprobs) == len(got.token_ids)
    for position, (ours, theirs) in enumerate(zip(got.logprobs, want.logprobs, strict=True)):
        assert list(ours) == list(theirs), position  # the same tokens, in the same order
        for token_id, entry in ours.items():
            assert entry.rank == theirs[token_id].rank
            assert entry.logprob == pytest.approx(theirs[token_id].logprob, abs=1e-4)
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)


def test_seeded_sampling_with_speculation_is_reproducible_and_batch_independent(engines):
    _, spec = engines
    params = SamplingParams(temperature=0.8, max_tokens=24, seed=1234, ignore_eos=True)
    alone = spec.generate(CODE, params, use_tqdm=False)[0].outputs[0].token_ids
    again = spec.generate(CODE, params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    mixed = spec.generate(["import os", CODE, "class Stack:"], [others, params, others], use_tqdm=False)
    assert alone == again == mixed[1].outputs[0].token_ids
    other_seed = SamplingParams(temperature=0.8, max_tokens=24, seed=99, ignore_eos=True)
    assert spec.generate(CODE, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    assert spec.stats().num_free_kv_blocks == spec.stats().num_kv_blocks


@pytest.mark.slow  # the scheduler's side is tested in test_speculative_decoding.py
def test_speculation_turns_off_above_the_batch_size_limit(llama_dir):
    llm = LLM(
        llama_dir,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        enable_prefix_caching=False,  # so that copies of one prompt start in the same step
        speculative_config=ngram(4, disable_by_batch_size=2),
    )
    # Four at once: no proposals until two have finished.
    llm.generate([CODE] * 4, [_greedy(n) for n in (2, 2, 30, 30)], use_tqdm=False)
    before = llm.stats().num_spec_steps
    assert before > 0
    llm.generate([CODE] * 3, _greedy(8), use_tqdm=False)  # three running all along: none
    assert llm.stats().num_spec_steps == before


@pytest.mark.slow  # a server of its own (~15 s)
def test_server_metrics_report_acceptance(llama_dir):
    engine = AsyncLLM(
        LLMEngine(
            EngineArgs(
                model=llama_dir,
                dtype="float32",
                max_model_len=256,
                enforce_eager=True,
                speculative_config=ngram(4),
            )
        )
    )
    server = ServerThread(build_app(engine, served_model_names=["spec"]))
    try:
        body = json.dumps(
            {"model": "spec", "prompt": CODE, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
        )
        status, response = _post(f"{server.url}/v1/completions", body.encode(), {})
        assert status == 200 and response["usage"]["completion_tokens"] == 24
        metrics = _metrics(server.url)
        stats = engine.stats()
        assert metrics["compiled_engine:spec_decode_num_drafts_total{}"] == stats.num_spec_steps > 0
        assert metrics["compiled_engine:spec_decode_num_draft_tokens_total{}"] == stats.num_draft_tokens
        assert (
            metrics["compiled_engine:spec_decode_num_accepted_tokens_total{}"]
            == stats.num_accepted_draft_tokens
        )
        assert metrics["compiled_engine:spec_decode_acceptance_rate{}"] == pytest.approx(
            stats.spec_acceptance_rate
        )
        assert metrics["compiled_engine:spec_decode_mean_accepted_length{}"] > 1.0
    finally:
        server.stop()


# --- temperature 1.0 end to end: the output distribution is the target's -----------------------

TINY_VOCAB = 8
NUM_SAMPLES = 4000


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    # Larger weights than the default tiny model's: peaked distributions, so a wrong rule shows.
    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("tiny-vocab"),
            vocab_size=TINY_VOCAB,
            init_std=0.5,
            seed=3,
            with_tokenizer=False,
        )
    )


@pytest.fixture(scope="module")
def tiny_vocab_targets(tiny_vocab_model):
    """The exact distributions of the 2nd and 3rd sampled tokens after PROMPT at temperature 1, by
    enumerating every earlier token with transformers' model."""
    model = AutoModelForCausalLM.from_pretrained(tiny_vocab_model, dtype=torch.float32).eval()

    def next_probs(prefix: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([TINY_PROMPT + prefix])).logits[0, -1].double().softmax(-1)

    p1 = next_probs([])
    second = torch.zeros(TINY_VOCAB, dtype=torch.float64)
    third = torch.zeros(TINY_VOCAB, dtype=torch.float64)
    for a in range(TINY_VOCAB):
        p2 = next_probs([a])
        second += p1[a] * p2
        for b in range(TINY_VOCAB):
            third += p1[a] * p2[b] * next_probs([a, b])
    return second.numpy(), third.numpy()


# Every token occurs in the prompt, so whatever comes first has an n-gram match: the second token is
# always verified against a proposal.
TINY_PROMPT = list(range(TINY_VOCAB)) * 2


# ~50 s each here: the default run has the verifier's own chi-square test (test_speculative_decoding.py).
@pytest.mark.slow
@pytest.mark.parametrize("rule", ["correct", "residual_keeps_proposal", "always_accept"])
def test_temperature_one_outputs_follow_the_target_distribution(
    rule, tiny_vocab_model, tiny_vocab_targets, monkeypatch
):
    """Chi-square of the 2nd and 3rd tokens of 4,000 seeded requests against transformers' exact
    distributions. The engine's rule passes; a deliberately wrong one (swapped into the verifier)
    fails, so the test can tell."""
    use_acceptance_rule(monkeypatch, rule)
    llm = LLM(
        tiny_vocab_model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        speculative_config=ngram(2, disable_by_batch_size=4096),
    )
    assert_follows_target_distribution(llm, rule, tiny_vocab_targets)


def use_acceptance_rule(monkeypatch, rule: str) -> None:
    """Swap a deliberately wrong acceptance rule into the verifier ("correct" keeps the engine's)."""
    wrong = {"residual_keeps_proposal": ("residual_probs", lambda probs, proposed, draft_probs=None: probs)}
    wrong["always_accept"] = (
        "acceptance_probability",
        lambda probs, proposed, draft_probs=None: torch.ones(len(proposed)),
    )
    if rule in wrong:
        monkeypatch.setattr(spec_verifier, *wrong[rule])


def assert_follows_target_distribution(llm: LLM, rule: str, targets) -> None:
    """NUM_SAMPLES seeded requests at temperature 1.0; the chi-square of their 2nd and 3rd tokens
    against `targets` (transformers' exact distributions) passes for the correct rule and fails
    for a wrong one."""
    params = [
        SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i) for i in range(NUM_SAMPLES)
    ]
    outputs = llm.generate([{"prompt_token_ids": TINY_PROMPT}] * NUM_SAMPLES, params, use_tqdm=False)
    tokens = np.array([o.outputs[0].token_ids for o in outputs])
    assert llm.stats().num_spec_steps >= NUM_SAMPLES  # every request verified a proposal
    second, third = targets
    p_second = chi_square_p_value(np.bincount(tokens[:, 1], minlength=TINY_VOCAB), second)
    p_third = chi_square_p_value(np.bincount(tokens[:, 2], minlength=TINY_VOCAB), third)
    if rule == "correct":
        assert p_second > 1e-3 and p_third > 1e-3, (p_second, p_third)
    else:
        assert min(p_second, p_third) < 1e-6, (p_second, p_third)
