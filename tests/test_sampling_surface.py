"""The full sampling surface: min_p, penalties, min_tokens, logit_bias, logprobs, prompt logprobs,
n, seeds, and the async loop's equality with the synchronous one.

Sampler-level tests run on hand-made logits with fixed seeds, enough draws and bounds that can fail;
penalties and min_tokens are compared with transformers' own logits processors. Engine-level tests
run the tiny llama and compare logprobs with the Hugging Face model's own logits.
"""

from __future__ import annotations

import math
import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from compiled_engine import LLM, SamplingParams
from compiled_engine.errors import InvalidRequestError
from compiled_engine.sampling_params import MAX_LOGPROBS
from compiled_engine.worker import sampler as sampler_module
from compiled_engine.worker.sampler import Sampler, SamplingTensors, process_logits, token_logprobs

CPU = torch.device("cpu")
EOS = 2  # the tiny models' EOS id (tests/model_factory.py)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def build(params_list, *, prompts=None, outputs=None, eos=(), generators=None, default_generator=None):
    generators = generators if generators is not None else [None] * len(params_list)
    return SamplingTensors.build(
        params_list,
        generators,
        CPU,
        default_generator=default_generator,
        prompt_token_ids=prompts,
        output_token_ids=outputs,
        eos_token_ids=eos,
    )


def draws(logits_row: torch.Tensor, params: SamplingParams, count: int, seed: int = 0) -> torch.Tensor:
    """Many independent draws from one row's distribution, in one batched call."""
    logits = logits_row.expand(count, -1).contiguous()
    return Sampler()(logits, build([params] * count, default_generator=seeded(seed)))


def assert_support(tokens: torch.Tensor, expected: set[int]) -> None:
    seen = set(tokens.tolist())
    assert seen <= expected, f"drew tokens outside the kept set: {sorted(seen - expected)}"
    assert seen == expected, f"kept tokens never drawn: {sorted(expected - seen)}"


# --- truncation: top-k, top-p, min-p -------------------------------------------------------------


def test_top_k_restricts_support_per_row():
    logits = torch.randn(200, generator=seeded(1))
    # Two settings interleaved in one batch: each row keeps its own k.
    params = [SamplingParams(temperature=1.5, top_k=3), SamplingParams(temperature=1.5, top_k=10)] * 2500
    tokens = Sampler()(
        logits.expand(len(params), -1).contiguous(), build(params, default_generator=seeded(2))
    )
    assert_support(tokens[0::2], set(logits.topk(3).indices.tolist()))
    assert_support(tokens[1::2], set(logits.topk(10).indices.tolist()))


def _nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """Tokens whose higher-ranked mass is below top_p, with a margin check so rounding cannot decide."""
    sorted_probs, order = probs.double().sort(descending=True)
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    assert (mass_before - top_p).abs().min() > 1e-3, "test logits put a token on the top_p boundary"
    return set(order[mass_before < top_p].tolist())


@pytest.mark.parametrize("top_p", [0.3, 0.75])
def test_top_p_cuts_where_the_mass_reaches_p(top_p):
    logits = torch.randn(40, generator=seeded(3)) * 1.5
    temperature = 0.9
    expected = _nucleus((logits.double() / temperature).softmax(0), top_p)
    assert 2 <= len(expected) < 30
    tokens = draws(logits, SamplingParams(temperature=temperature, top_p=top_p), 6000, seed=4)
    assert_support(tokens, expected)


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_keeps_tokens_at_least_min_p_times_the_best(min_p):
    logits = torch.randn(60, generator=seeded(5)) * 0.7
    temperature = 0.7  # min_p applies to the distribution after temperature (vLLM's order)
    probs = (logits.double() / temperature).softmax(0)
    ratio = probs / probs.max()
    assert (ratio - min_p).abs().min() > 1e-3, "test logits put a token on the min_p boundary"
    expected = set(torch.nonzero(ratio >= min_p).flatten().tolist())
    assert 2 <= len(expected) < 50
    tokens = draws(logits, SamplingParams(temperature=temperature, min_p=min_p), 8000, seed=6)
    assert_support(tokens, expected)


def test_min_p_then_top_k_then_top_p():
    # probs 0.4, 0.2, 0.15, 0.12, 0.08, 0.05: min_p=0.25 drops the last two (< 0.1), top_k=3 keeps
    # three, top_p=0.7 over the renormalised three (0.53, 0.27, 0.2) keeps the first two.
    logits = torch.tensor([0.4, 0.2, 0.15, 0.12, 0.08, 0.05]).log()
    tokens = draws(logits, SamplingParams(min_p=0.25, top_k=3, top_p=0.7), 4000, seed=7)
    assert_support(tokens, {0, 1})
    # Without top_p, the third survives: the cut above was top_p's, not a bug elsewhere.
    assert_support(draws(logits, SamplingParams(min_p=0.25, top_k=3), 4000, seed=7), {0, 1, 2})


def test_tiny_temperature_equals_greedy():
    logits = torch.randn(64, 500, generator=seeded(8)) * 3
    cold = Sampler()(logits, build([SamplingParams(temperature=1e-5)] * 64, default_generator=seeded(9)))
    greedy = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 64))
    assert torch.equal(cold, greedy) and torch.equal(greedy, logits.argmax(-1))
    # Also with penalties: both take the argmax of the penalised logits.
    prompts = [list(range(i, i + 20)) for i in range(64)]
    pen = dict(repetition_penalty=1.7, presence_penalty=0.5)
    cold = Sampler()(
        logits,
        build([SamplingParams(temperature=1e-5, **pen)] * 64, prompts=prompts, default_generator=seeded(9)),
    )
    greedy = Sampler()(logits, build([SamplingParams(temperature=0.0, **pen)] * 64, prompts=prompts))
    assert torch.equal(cold, greedy)
    assert not torch.equal(greedy, logits.argmax(-1)), "the penalties were meant to change some argmax"


# --- logits processing: penalties, min_tokens, logit_bias --------------------------------------


def _histories(num_rows: int, vocab: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    # Few distinct tokens, so repeats are common and counts reach 3-5.
    prompts = [[rng.randrange(0, vocab // 4) for _ in range(rng.randint(1, 30))] for _ in range(num_rows)]
    outputs = [[rng.randrange(0, vocab // 4) for _ in range(rng.randint(0, 25))] for _ in range(num_rows)]
    return prompts, outputs


def _transformers_repetition(logits: torch.Tensor, penalties, prompts, outputs) -> torch.Tensor:
    rows = []
    for row, penalty, prompt, output in zip(logits, penalties, prompts, outputs, strict=True):
        processor = RepetitionPenaltyLogitsProcessor(penalty=penalty)
        rows.append(processor(torch.tensor([prompt + output]), row[None].clone())[0])
    return torch.stack(rows)


def _output_counts(outputs, vocab: int) -> torch.Tensor:
    counts = torch.zeros(len(outputs), vocab)
    for row, output in enumerate(outputs):
        for token in output:
            counts[row, token] += 1
    return counts


def test_repetition_penalty_matches_transformers():
    vocab = 120
    logits = torch.randn(8, vocab, generator=seeded(10)) * 3  # both signs
    prompts, outputs = _histories(8, vocab, seed=11)
    penalties = [1.0, 1.3, 2.0, 0.7, 1.05, 3.0, 0.5, 1.5]
    params = [SamplingParams(temperature=0.0, repetition_penalty=p) for p in penalties]
    ours = process_logits(logits, build(params, prompts=prompts, outputs=outputs))
    expected = _transformers_repetition(logits, penalties, prompts, outputs)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(ours, logits), "the penalties changed nothing"


def test_presence_and_frequency_penalties_count_output_tokens_only():
    vocab = 120
    logits = torch.randn(6, vocab, generator=seeded(12))
    prompts, outputs = _histories(6, vocab, seed=13)
    presence = [0.0, 0.5, -1.0, 2.0, 0.3, 0.0]
    frequency = [0.0, 0.0, 0.7, -0.4, 1.1, 2.0]
    params = [
        SamplingParams(presence_penalty=p, frequency_penalty=f)
        for p, f in zip(presence, frequency, strict=True)
    ]
    ours = process_logits(logits, build(params, prompts=prompts, outputs=outputs))
    counts = _output_counts(outputs, vocab)
    # vLLM's definition; prompt tokens do not count.
    expected = (
        logits - torch.tensor(frequency)[:, None] * counts - torch.tensor(presence)[:, None] * (counts > 0)
    )
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_min_tokens_matches_transformers_min_new_tokens():
    vocab = 50
    logits = torch.randn(5, vocab, generator=seeded(14))
    prompt = [5, 6, 7]
    stop_ids = (11, 12)
    cases = [(0, False), (2, False), (3, False), (1, True), (4, True)]  # (outputs so far, ignore_eos)
    params = [
        SamplingParams(min_tokens=3, max_tokens=10, stop_token_ids=stop_ids, ignore_eos=ignore)
        for _, ignore in cases
    ]
    outputs = [[20] * done for done, _ in cases]
    ours = process_logits(logits, build(params, prompts=[prompt] * 5, outputs=outputs, eos=(EOS,)))
    for row, (done, ignore_eos) in enumerate(cases):
        banned = list(stop_ids) if ignore_eos else [EOS, *stop_ids]
        processor = MinNewTokensLengthLogitsProcessor(len(prompt), 3, banned)
        expected = processor(torch.tensor([prompt + outputs[row]]), logits[row][None].clone())[0]
        torch.testing.assert_close(ours[row], expected, rtol=0, atol=0)
        assert torch.isinf(ours[row, stop_ids[0]]) == (done < 3)
        assert torch.isinf(ours[row, EOS]) == (done < 3 and not ignore_eos)


def test_logit_bias_is_added_before_the_penalties():
    vocab = 30
    logits = torch.randn(2, vocab, generator=seeded(15))
    bias = {3: 5.0, 7: -2.5, 29: 0.25}
    plain = process_logits(logits, build([SamplingParams(logit_bias=bias), SamplingParams()]))
    expected = logits.clone()
    for token, value in bias.items():
        expected[0, token] += value
    torch.testing.assert_close(plain, expected, rtol=0, atol=1e-6)
    # Order matters with a repetition penalty: (x + b) / r, not x / r + b.
    params = [SamplingParams(logit_bias=bias, repetition_penalty=2.0)]
    ours = process_logits(logits[:1], build(params, prompts=[[3, 7]]))
    reference = _transformers_repetition(expected[:1], [2.0], [[3, 7]], [[]])
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


def test_everything_together_in_vllm_order():
    vocab = 80
    logits = torch.randn(4, vocab, generator=seeded(16)) * 2
    prompts, outputs = _histories(4, vocab, seed=17)
    outputs[0] = outputs[0][:1]  # fewer than min_tokens: EOS and the stop token banned
    bias = {EOS: 1.0, 9: 3.0}
    params = [
        SamplingParams(
            logit_bias=bias,
            min_tokens=2,
            stop_token_ids=[9],
            repetition_penalty=1.4,
            presence_penalty=0.3,
            frequency_penalty=0.2,
        )
    ] * 4
    ours = process_logits(logits, build(params, prompts=prompts, outputs=outputs, eos=(EOS,)))
    step = logits.clone()
    step[:, EOS] += 1.0
    step[:, 9] += 3.0
    step[0, [EOS, 9]] = float("-inf")
    step = _transformers_repetition(step, [1.4] * 4, prompts, outputs)
    counts = _output_counts(outputs, vocab)
    expected = step - 0.2 * counts - 0.3 * (counts > 0)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


def test_penalties_steer_greedy_rows():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    assert Sampler()(logits, build([SamplingParams(temperature=0.0)]))[0] == 0
    penalised = build([SamplingParams(temperature=0.0, frequency_penalty=0.5)], outputs=[[0]])
    assert Sampler()(logits, penalised)[0] == 1


def test_plain_batches_skip_the_optional_stages(monkeypatch):
    calls = []
    real = sampler_module.process_logits

    def counting(logits, params):
        calls.append(1)
        return real(logits, params)

    monkeypatch.setattr(sampler_module, "process_logits", counting)
    logits = torch.randn(3, 40)
    plain = build(
        [SamplingParams(), SamplingParams(temperature=0.3, top_k=5), SamplingParams(temperature=0.0)]
    )
    assert plain.penalties is None and plain.logit_bias is None and plain.min_tokens_banned is None
    assert plain.min_p is None
    Sampler()(logits, plain)
    Sampler()(logits, build([SamplingParams(temperature=0.0)] * 3))
    assert not calls
    # min_p on a greedy row cannot change its argmax: no min_p stage either.
    assert build([SamplingParams(temperature=0.0, min_p=0.5)]).min_p is None
    Sampler()(logits[:1], build([SamplingParams(temperature=0.0, presence_penalty=1.0)], outputs=[[1]]))
    assert calls == [1]


def test_sampler_leaves_the_raw_logits_untouched():
    logits = torch.randn(2, 30, generator=seeded(18))
    before = logits.clone()
    params = [SamplingParams(logit_bias={1: 3.0}, repetition_penalty=2.0, min_tokens=1, min_p=0.1)] * 2
    Sampler()(logits, build(params, prompts=[[1, 2]] * 2, outputs=[[], []], eos=(EOS,)))
    assert torch.equal(logits, before)


def test_token_logprobs_are_log_softmax_with_vllm_ranks():
    logits = torch.randn(5, 70, generator=seeded(19)) * 2
    chosen = torch.tensor([0, 5, 69, 33, 12])
    top_ids, top_values, chosen_logprobs, ranks = token_logprobs(logits, chosen, 4)
    reference = logits.double().log_softmax(-1)
    torch.testing.assert_close(top_values.double(), reference.topk(4).values, rtol=0, atol=1e-6)
    assert torch.equal(top_ids, reference.topk(4).indices)
    torch.testing.assert_close(
        chosen_logprobs.double(), reference.gather(1, chosen[:, None])[:, 0], rtol=0, atol=1e-6
    )
    expected_ranks = (reference > reference.gather(1, chosen[:, None])).sum(-1) + 1
    assert torch.equal(ranks, expected_ranks)


def test_seeded_rows_with_penalties_do_not_depend_on_the_batch():
    logits = torch.randn(4, 100, generator=seeded(20))
    target = SamplingParams(seed=5, presence_penalty=0.8, min_p=0.02, top_k=40)
    history = dict(prompts=[[1, 2, 3]], outputs=[[4, 4, 9]])
    alone = Sampler()(logits[1:2], build([target], generators=[seeded(5)], **history))
    others = [
        SamplingParams(),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(top_p=0.5),
    ]
    batch = Sampler()(
        logits[[0, 1, 2, 3]],
        build(
            [others[0], target, others[1], others[2]],
            prompts=[[7], [1, 2, 3], [8, 8], []],
            outputs=[[], [4, 4, 9], [1], [2]],
            generators=[None, seeded(5), None, None],
            default_generator=seeded(99),
        ),
    )
    assert alone[0] == batch[1]


# --- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"n": 0}, "n must"),
        ({"n": 2.0}, "n must"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": "1"}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": math.inf}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias keys"),
        ({"logit_bias": {True: 1.0}}, "logit_bias keys"),
        ({"logit_bias": {3: math.inf}}, "logit_bias values"),
        ({"logit_bias": {3: "x"}}, "logit_bias values"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_bad_sampling_params_are_clear_errors(kwargs, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        SamplingParams(**kwargs)


def test_sampling_params_copy_logit_bias_and_stay_hashable():
    bias = {3: 1}
    params = SamplingParams(logit_bias=bias)
    bias[3] = 100.0
    assert params.logit_bias == {3: 1.0}
    assert params == SamplingParams(logit_bias={3: 1.0}) and params != SamplingParams(logit_bias={3: 2.0})
    hash(params)


# --- engine level: the tiny llama ------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", max_model_len=256, enforce_eager=True)


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    return AutoModelForCausalLM.from_pretrained(
        llama_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of the HF model's logits at every position of `token_ids` (float64)."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([token_ids])).logits[0]
    return logits.double().log_softmax(-1)


def _check_position(entry, token_id: int, reference_row: torch.Tensor, num_top: int) -> None:
    """One position's logprob dict against the reference row: the token, the top-N, the ranks."""
    assert token_id in entry
    assert entry[token_id].logprob == pytest.approx(reference_row[token_id].item(), abs=1e-4)
    assert entry[token_id].rank == int((reference_row >= reference_row[token_id] - 1e-6).sum())
    top = reference_row.topk(num_top)
    expected_ids = top.indices.tolist()
    assert set(entry) == {token_id, *expected_ids}
    for rank, (top_id, value) in enumerate(zip(expected_ids, top.values.tolist(), strict=True), 1):
        assert entry[top_id].logprob == pytest.approx(value, abs=1e-4)
        if top_id != token_id:
            assert entry[top_id].rank == rank


PROMPTS = [{"prompt_token_ids": [5, 9, 11, 40, 7, 7, 9]}, "def add(a, b):\n    return", "import os"]


def test_logprobs_are_the_raw_model_logprobs(llm, hf_model):
    # Penalties and a temperature change the sampling, not the reported logprobs (vLLM's default).
    params = SamplingParams(
        max_tokens=8, temperature=0.8, seed=3, logprobs=5, presence_penalty=0.5, repetition_penalty=1.3
    )
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        full = list(out.prompt_token_ids) + list(completion.token_ids)
        reference = _hf_logprobs(hf_model, full)
        num_prompt = len(out.prompt_token_ids)
        for i, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
            _check_position(entry, token_id, reference[num_prompt + i - 1], 5)
        expected_sum = sum(
            reference[num_prompt + i - 1, t].item() for i, t in enumerate(completion.token_ids)
        )
        assert completion.cumulative_logprob == pytest.approx(expected_sum, abs=1e-3)
        assert out.prompt_logprobs is None


def test_logprobs_zero_gives_only_the_sampled_token(llm):
    out = llm.generate(
        "import os", SamplingParams(max_tokens=4, temperature=0.0, logprobs=0), use_tqdm=False
    )[0]
    completion = out.outputs[0]
    assert [list(entry) for entry in completion.logprobs] == [[t] for t in completion.token_ids]
    assert all(entry[t].rank == 1 for entry, t in zip(completion.logprobs, completion.token_ids, strict=True))
    plain = llm.generate("import os", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def _check_prompt_logprobs(out, hf_model, num_top: int) -> None:
    prompt = list(out.prompt_token_ids)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    reference = _hf_logprobs(hf_model, prompt)
    for position in range(1, len(prompt)):
        _check_position(out.prompt_logprobs[position], prompt[position], reference[position - 1], num_top)


def test_prompt_logprobs_match_transformers(llm, hf_model):
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=4)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        _check_prompt_logprobs(out, hf_model, 4)
    single = llm.generate({"prompt_token_ids": [17]}, params, use_tqdm=False)[0]
    assert single.prompt_logprobs == [None]


@pytest.fixture(scope="module")
def compiled_chunked(llama_dir):
    """Compiled graphs, a token budget that chunks long prompts, the async loop."""
    return LLM(
        llama_dir,
        dtype="float32",
        max_model_len=96,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        compile_buckets=(4, 16),
        async_scheduling=True,
    )


def test_prompt_logprobs_with_chunked_prefill_compiled_graphs_and_the_prefix_cache(
    compiled_chunked, hf_model
):
    # 40 tokens: chunks of 32 (above every bucket: the dynamic graph) and 8 (bucket 16, whose 8
    # sequence rows hold its 8 logits rows). 12 tokens: bucket 16, 12 logits rows > 8 sequence rows,
    # so the step moves to the dynamic graph.
    rng = random.Random(21)
    long_prompt = [rng.randrange(3, 384) for _ in range(40)]
    short_prompt = [rng.randrange(3, 384) for _ in range(12)]
    prompts = [{"prompt_token_ids": long_prompt}, {"prompt_token_ids": short_prompt}]
    # The same prompts once without prompt logprobs: their blocks are now in the prefix cache.
    compiled_chunked.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2, logprobs=2)
    for out in compiled_chunked.generate(prompts, params, use_tqdm=False):
        _check_prompt_logprobs(out, hf_model, 2)
    stats = compiled_chunked.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_min_tokens_holds_off_eos_and_stop_tokens(llm):
    # A huge bias makes EOS the argmax at every step: without min_tokens the request ends at once.
    forced_eos = dict(temperature=0.0, max_tokens=10, logit_bias={EOS: 100.0})
    first = llm.generate("import os", SamplingParams(**forced_eos), use_tqdm=False)[0].outputs[0]
    assert first.token_ids == (EOS,) and first.finish_reason == "stop"
    held = llm.generate("import os", SamplingParams(min_tokens=5, **forced_eos), use_tqdm=False)[0].outputs[0]
    # Five tokens that cannot be EOS, then EOS (transformers' and vLLM's semantics).
    assert len(held.token_ids) == 6 and EOS not in held.token_ids[:5] and held.token_ids[5] == EOS
    # Stop tokens too: the greedy continuation's first token is a stop token, held off for 3.
    plain = llm.generate("import os", SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    stop = plain.outputs[0].token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3, stop_token_ids=[stop])
    out = llm.generate("import os", params, use_tqdm=False)[0].outputs[0]
    assert stop not in out.token_ids[:3]


def test_bad_request_values_checked_against_the_model(llm):
    with pytest.raises(InvalidRequestError, match="logit_bias token 384 is outside"):
        llm.generate(["import os", "x"], SamplingParams(logit_bias={384: 1.0}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# --- n and seeds -----------------------------------------------------------------------------------


def test_n_returns_n_distinct_samples_in_one_output(llm):
    params = SamplingParams(n=6, temperature=1.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(["def add(a, b):", "import os"], params, use_tqdm=False)
    assert len(outs) == 2
    for out in outs:
        assert out.finished and [c.index for c in out.outputs] == list(range(6))
        assert all(len(c.token_ids) == 16 and c.finished for c in out.outputs)
        assert len({c.token_ids for c in out.outputs}) == 6
    assert llm.engine.num_free_kv_blocks() == llm.engine.num_kv_blocks


def test_seeded_requests_reproduce_alone_and_in_any_batch(llm):
    target = SamplingParams(
        temperature=1.0, seed=42, max_tokens=12, top_k=60, presence_penalty=0.4, ignore_eos=True
    )
    parent = SamplingParams(temperature=1.2, seed=7, n=3, max_tokens=10, min_p=0.01, ignore_eos=True)
    alone = llm.generate("class Stack:", target, use_tqdm=False)[0].outputs[0].token_ids
    alone_n = [c.token_ids for c in llm.generate("import os", parent, use_tqdm=False)[0].outputs]
    assert len(set(alone_n)) == 3, "a seeded parent's samples get distinct seeds"
    unseeded = SamplingParams(temperature=1.0, max_tokens=8)
    for num_others in (2, 7):
        prompts = [f"x = {i}" for i in range(num_others)] + ["class Stack:", "import os"]
        params = [unseeded] * num_others + [target, parent]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert outs[-2].outputs[0].token_ids == alone
        assert [c.token_ids for c in outs[-1].outputs] == alone_n
    # Sample i of a seeded parent is the request with seed + i (vLLM's derivation).
    second = llm.generate(
        "import os", SamplingParams(**{**_fields(parent), "n": 1, "seed": 8}), use_tqdm=False
    )
    assert second[0].outputs[0].token_ids == alone_n[1]


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_aborting_the_parent_aborts_every_sample(llm):
    engine = llm.engine
    processed, params = engine.validate(["import os"], SamplingParams(n=4, max_tokens=50, ignore_eos=True))[0]
    engine.add_request("parent", processed, params)
    engine.step()
    engine.step()
    assert engine.core.scheduler.num_running == 4
    engine.abort_request(["parent"])
    assert not engine.has_unfinished_requests()
    assert engine.num_free_kv_blocks() == engine.num_kv_blocks
    assert not engine.output_processor.has_request("parent")
    assert not engine.model_runner.request_states


def test_n_children_ids_cannot_collide(llm):
    engine = llm.engine
    processed, params = engine.validate(["import os"], SamplingParams(max_tokens=2))[0]
    engine.add_request("r-1", processed, params)
    with pytest.raises(InvalidRequestError, match="'r-1' is already in use"):
        engine.add_request("r", processed, SamplingParams(n=2, max_tokens=2))
    engine.abort_request(["r-1"])
    assert not engine.has_unfinished_requests()


# --- the async loop equals the synchronous one -----------------------------------------------------

ENGINE_OPTIONS = dict(
    dtype="float32",
    max_model_len=96,
    block_size=4,
    num_kv_blocks=40,  # small: preemption happens
    max_num_seqs=8,
    max_num_batched_tokens=32,
    compile_buckets=(4, 16),
)


@pytest.fixture(scope="module")
def sync_and_async(llama_dir):
    return LLM(llama_dir, async_scheduling=False, **ENGINE_OPTIONS), LLM(
        llama_dir, async_scheduling=True, **ENGINE_OPTIONS
    )


def _workload(seed: int, sampled: bool, penalties: bool = True):
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(40):
        prompts.append({"prompt_token_ids": [rng.randrange(3, 384) for _ in range(rng.randint(1, 40))]})
        extra = {}
        if penalties:
            extra = dict(
                repetition_penalty=rng.choice([1.0, 1.5, 2.5]),
                presence_penalty=rng.choice([0.0, 1.0, 2.0]),
                frequency_penalty=rng.choice([0.0, 0.5, 2.0]),
            )
        params.append(
            SamplingParams(
                temperature=rng.choice([0.7, 1.0]) if sampled else 0.0,
                seed=1000 + i if sampled else None,
                max_tokens=rng.randint(4, 24),
                min_tokens=rng.choice([0, 3]),
                logprobs=rng.choice([None, 2]),
                ignore_eos=True,
                **extra,
            )
        )
    return prompts, params


def _results(outs):
    return [[(c.token_ids, c.finish_reason) for c in out.outputs] for out in outs]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_async_equals_sync_with_penalties(sync_and_async, sampled):
    sync, async_ = sync_and_async
    prompts, params = _workload(30 + sampled, sampled)
    expected = sync.generate(prompts, params, use_tqdm=False)
    got = async_.generate(prompts, params, use_tqdm=False)
    assert _results(got) == _results(expected)
    for a, b in zip(got, expected, strict=True):
        if b.outputs[0].logprobs is not None:
            for entry_a, entry_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                assert entry_a.keys() == entry_b.keys()
                for token_id, lp in entry_b.items():
                    assert entry_a[token_id].logprob == pytest.approx(lp.logprob, abs=1e-4)
    # The penalties matter for these outputs (so a penalty missing a token would show).
    plain_prompts, plain_params = _workload(30 + sampled, sampled, penalties=False)
    plain = sync.generate(plain_prompts, plain_params, use_tqdm=False)
    changed = sum(p != e for p, e in zip(_results(plain), _results(expected), strict=True))
    assert changed >= 20
    for llm in sync_and_async:
        stats = llm.stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
        assert not llm.engine.model_runner.request_states
    assert sync.stats().num_preemptions > 0 or async_.stats().num_preemptions > 0


def test_cli_generate_with_n_and_logprobs(llama_dir, capsys):
    from compiled_engine.entrypoints import cli

    argv = ["generate", "--model", llama_dir, "--enforce-eager", "--max-tokens", "3", "--temperature", "1"]
    code = cli.main([*argv, "--n", "2", "--logprobs", "2", "--seed", "4", "import os"])
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.count("import os") == 2 and printed.count("-" * 40) == 2
    token_lines = [
        line for line in printed.splitlines() if re.match(r"  ['\"].*['\"]: -?\d+\.\d{3}  \[", line)
    ]
    assert len(token_lines) == 6  # one per generated token
