"""Speculative decoding's parts on their own: the option's checks, n-gram proposals, the acceptance
rule (a chi-square test that it keeps the target distribution, and fails for wrong rules), and the
scheduler's side (runs with stops inside, budgets, the batch-size cut-off, async waits).

The engine end to end (greedy parity, KV pressure, the async loop, stats) is in
tests/test_speculative_engine.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from compiled_engine.core.ngram_proposer import NgramProposer
from compiled_engine.core.scheduler import Scheduler
from compiled_engine.core.scheduler_config import SchedulerConfig
from compiled_engine.default_model_path import default_model_dir
from compiled_engine.engine.output_processor import OutputProcessor
from compiled_engine.engine_args import EngineArgs
from compiled_engine.entrypoints import cli
from compiled_engine.records.engine_core_output import EngineCoreOutput
from compiled_engine.records.request import Request, RequestStatus, TokenHistory
from compiled_engine.records.runner_output import ModelRunnerOutput, TokenLogprobs
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.speculative_config import SpeculativeConfig, parse_speculative_config
from compiled_engine.worker import spec_verifier
from compiled_engine.worker.sampler import SamplingTensors
from compiled_engine.worker.spec_verifier import accepted_prefix, verify_proposals

# --- the option ------------------------------------------------------------------------------


def test_the_config_takes_vllms_shape_and_defaults():
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    # One bound given: the other takes its value.
    only_max = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
    )
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
    )
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)
    # JSON text (the CLI's form) and None.
    text = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    assert parse_speculative_config(text) == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3
    )
    assert parse_speculative_config(None) is None and parse_speculative_config("null") is None


@pytest.mark.parametrize(
    "value,message",
    [
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "num_speculative_tokens must be an int >= 1, got 0",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens must be an int >= 1"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "unknown method 'medusa': choose one of ngram"),
        ({"num_speculative_tokens": 2}, "needs a 'method'"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min=4 exceeds prompt_lookup_max=2",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min must be an int >= 1, got 0",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
            "disable_by_batch_size must be an int >= 1, got 0",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft": "x"}, r"unknown key\(s\) \['draft'\]"),
        ("{not json", "speculative_config is not valid JSON"),
        (["ngram"], "speculative_config must be a dict"),
    ],
)
def test_bad_configs_are_refused_naming_the_problem(value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=value)


def test_the_cli_flag_takes_json_and_refuses_bad_values(capsys):
    parser = cli._build_parser()
    text = '{"method": "ngram", "num_speculative_tokens": 2}'
    args = EngineArgs.from_cli_args(parser.parse_args(["generate", "hi", "--speculative-config", text]))
    assert args.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    with pytest.raises(SystemExit):
        parser.parse_args(
            ["generate", "hi", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}']
        )
    assert "num_speculative_tokens must be an int >= 1, got 0" in capsys.readouterr().err


# --- n-gram proposals ------------------------------------------------------------------------


def _propose(tokens, k, low=1, high=3):
    return NgramProposer(low, high).propose(np.asarray(tokens, dtype=np.int64), k)


def test_the_longest_suffix_match_wins_then_the_most_recent():
    # Suffix [2, 3]: matched at 1-2 (followed by 9) and at 5-6 (followed by 4); the 3-gram [1, 2, 3]
    # only at 0-2, so with n up to 3 the longer match wins.
    tokens = [1, 2, 3, 9, 8, 2, 3, 4, 7, 1, 2, 3]
    assert _propose(tokens, 2, high=3) == (9, 8)
    assert _propose(tokens, 2, high=2) == (4, 7)  # the 2-gram's most recent match
    assert _propose(tokens, 5, high=2) == (4, 7, 1, 2, 3)
    # Fewer tokens than asked when the match is near the end.
    assert _propose([5, 6, 5, 6], 4, high=2) == (5, 6)


def test_a_match_with_a_whole_proposal_after_it_beats_a_later_one_without():
    # Suffix [0, 0] inside a run of zeros: its latest match (positions 7-8) has one token after it,
    # the earlier one (1-2) a whole proposal of 3.
    tokens = [7, 0, 0, 1, 2, 3, 4, 0, 0, 0]
    assert _propose(tokens, 3, high=2) == (1, 2, 3)
    assert _propose(tokens, 8, high=2) == (0,)  # neither has 8 after it: the latest wins


def test_no_proposal_below_the_minimum_or_without_a_match():
    assert _propose([1, 2, 3, 4], 3) == ()  # the last token never occurred before
    assert _propose([1, 2, 9, 2], 3, low=2, high=3) == ()  # only a 1-gram matches
    assert _propose([1, 2, 9, 2], 3, low=1, high=3) == (9, 2)
    assert _propose([7], 3) == ()
    assert _propose([4, 4, 4], 0) == ()


# --- the acceptance rule: it keeps the target distribution ---------------------------------

VOCAB = 6
TRIALS = 20_000


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of observed counts against expected probabilities (categories with p > 0)."""
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    statistic = float((((counts[keep] - expected) ** 2) / expected).sum())
    dof = int(keep.sum()) - 1
    # P(chi2_dof > statistic) = Q(dof / 2, statistic / 2), the regularised upper incomplete gamma.
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


def _two_position_trial(logits: torch.Tensor, proposed: tuple[int, int], seed: int) -> np.ndarray:
    """TRIALS independent verifications of proposals (d1, d2) against per-position target logits
    [3, vocab] (rows: before d1, after d1, after d2), as the runner runs them: the proposal rows
    through the verifier, the last row through the sampler. Returns the first two tokens emitted
    per trial [TRIALS, 2] (-1 when a trial emitted only one)."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingTensors.build(
        [SamplingParams(temperature=1.0)] * (2 * TRIALS), [None] * (2 * TRIALS), "cpu", default_generator=gen
    )
    rows = logits[:2].repeat(TRIALS, 1)
    proposed_t = torch.tensor(proposed).repeat(TRIALS)
    accepted, recovered = verify_proposals(rows, proposed_t, params)
    accepted = accepted.view(TRIALS, 2).numpy()
    recovered = recovered.view(TRIALS, 2).numpy()
    bonus = torch.multinomial(logits[2].softmax(dim=-1), TRIALS, replacement=True, generator=gen).numpy()
    emitted = np.full((TRIALS, 2), -1)
    for t in range(TRIALS):
        kept = accepted_prefix(accepted[t].tolist(), 0, 2)
        run = [*proposed[:kept], recovered[t, kept] if kept < 2 else bonus[t]]
        emitted[t] = run[:2] if len(run) >= 2 else [run[0], -1]
    return emitted


def _always_accept(probs, proposed, draft_probs=None):
    return torch.ones(probs.shape[0])


def _keep_proposed_in_residual(probs, proposed, draft_probs=None):
    return probs  # resample from the whole target: the proposed token is over-represented


def _accept_at_half_probability(probs, proposed, draft_probs=None):
    return probs.gather(1, proposed[:, None]).squeeze(1) / 2


RULES = {
    "correct": None,
    "always_accept": ("acceptance_probability", _always_accept),
    "residual_keeps_proposal": ("residual_probs", _keep_proposed_in_residual),
    "half_acceptance": ("acceptance_probability", _accept_at_half_probability),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_rejection_sampling_keeps_the_target_distribution(rule, monkeypatch):
    """Chi-square over 20,000 fixed-seed trials on a 6-token vocabulary: the first emitted token is
    distributed as the target's first position, and the second (after an accepted d1) as its
    second. The engine's rule passes; each deliberately wrong rule fails — so the test can fail."""
    if RULES[rule] is not None:
        name, wrong = RULES[rule]
        monkeypatch.setattr(spec_verifier, name, wrong)
    logits = torch.tensor(
        [
            [1.0, 0.2, -0.5, 0.7, 0.0, -1.0],
            [0.1, 0.9, 0.3, -0.2, 0.4, 0.0],
            [-0.3, 0.0, 0.8, 0.1, 0.5, 0.2],
        ]
    )
    proposed = (3, 1)  # neither is the most likely token: rejections happen at both positions
    emitted = _two_position_trial(logits, proposed, seed=1234)
    target = logits.softmax(dim=-1).numpy().astype(np.float64)
    first = np.bincount(emitted[:, 0], minlength=VOCAB)
    # Trials that kept d1 (a wrong rule may also draw d1 after rejecting it: one token, no second).
    after_d1 = emitted[(emitted[:, 0] == proposed[0]) & (emitted[:, 1] >= 0), 1]
    second = np.bincount(after_d1, minlength=VOCAB)
    p_first = chi_square_p_value(first, target[0])
    p_second = chi_square_p_value(second, target[1])
    if rule == "correct":
        assert p_first > 1e-3 and p_second > 1e-3, (p_first, p_second)
    else:
        assert min(p_first, p_second) < 1e-6, (p_first, p_second)


# Proposals drawn from a draft's own distribution q (min(1, p/q) and the max(0, p - q) residual).
_POINT_MASS_ACCEPTANCE = spec_verifier.acceptance_probability
_POINT_MASS_RESIDUAL = spec_verifier.residual_probs

DRAWN_RULES = {
    "correct": None,
    # The point-mass rule applied to drawn proposals: keep d with p(d), ignoring q.
    "ignores_q": (
        "acceptance_probability",
        lambda probs, proposed, draft_probs=None: _POINT_MASS_ACCEPTANCE(probs, proposed),
    ),
    "residual_ignores_q": (
        "residual_probs",
        lambda probs, proposed, draft_probs=None: _POINT_MASS_RESIDUAL(probs, proposed),
    ),
    "always_accept": ("acceptance_probability", _always_accept),
}


def _two_position_trial_drawn(logits: torch.Tensor, draft_logits: torch.Tensor, seed: int) -> np.ndarray:
    """As `_two_position_trial`, with each trial's proposals d1, d2 drawn from the draft's
    distributions q = softmax(draft_logits) [2, vocab], which the verifier is given."""
    gen = torch.Generator().manual_seed(seed)
    q = draft_logits.softmax(dim=-1)
    drawn = torch.stack(
        [torch.multinomial(q[i], TRIALS, replacement=True, generator=gen) for i in range(2)], 1
    )
    params = SamplingTensors.build(
        [SamplingParams(temperature=1.0)] * (2 * TRIALS), [None] * (2 * TRIALS), "cpu", default_generator=gen
    )
    accepted, recovered = verify_proposals(
        logits[:2].repeat(TRIALS, 1), drawn.reshape(-1), params, q.repeat(TRIALS, 1)
    )
    accepted = accepted.view(TRIALS, 2).numpy()
    recovered = recovered.view(TRIALS, 2).numpy()
    bonus = torch.multinomial(logits[2].softmax(dim=-1), TRIALS, replacement=True, generator=gen).numpy()
    emitted = np.full((TRIALS, 2), -1)
    proposals = drawn.numpy()
    for t in range(TRIALS):
        kept = accepted_prefix(accepted[t].tolist(), 0, 2)
        run = [*proposals[t, :kept], recovered[t, kept] if kept < 2 else bonus[t]]
        emitted[t] = run[:2] if len(run) >= 2 else [run[0], -1]
    return emitted


@pytest.mark.parametrize("rule", list(DRAWN_RULES))
def test_drawn_proposals_keep_the_target_distribution(rule, monkeypatch):
    """Proposals drawn from a draft's q (not the target's p): with min(1, p/q) and the max(0, p - q)
    residual the first two emitted tokens follow p's positions (chi-square, 20,000 fixed-seed
    trials); the point-mass rule, a residual that ignores q, or keeping everything fails."""
    if DRAWN_RULES[rule] is not None:
        monkeypatch.setattr(spec_verifier, *DRAWN_RULES[rule])
    logits = torch.tensor(
        [
            [1.0, 0.2, -0.5, 0.7, 0.0, -1.0],
            [0.1, 0.9, 0.3, -0.2, 0.4, 0.0],
            [-0.3, 0.0, 0.8, 0.1, 0.5, 0.2],
        ]
    )
    # A draft that is roughly right but over-confident in places: every p/q ratio is off 1.
    draft_logits = torch.tensor([[1.5, -0.5, 0.0, 1.2, -0.3, -0.2], [-0.4, 1.6, 0.5, 0.3, -0.1, 0.2]])
    emitted = _two_position_trial_drawn(logits, draft_logits, seed=4321)
    target = logits.softmax(dim=-1).numpy().astype(np.float64)
    first = np.bincount(emitted[:, 0], minlength=VOCAB)
    second = np.bincount(emitted[emitted[:, 1] >= 0, 1], minlength=VOCAB)
    p_first = chi_square_p_value(first, target[0])
    p_second = chi_square_p_value(second, target[1])
    if rule == "correct":
        assert p_first > 1e-3 and p_second > 1e-3, (p_first, p_second)
    else:
        assert min(p_first, p_second) < 1e-6, (p_first, p_second)


def test_one_hot_draft_rows_are_the_point_mass_rule():
    """A deterministic proposal's q is one-hot: min(1, p/q) and max(0, p - q) are then exactly the
    point-mass rule's p(d) and p without d (the runner fills such rows when a step mixes both)."""
    probs = torch.softmax(torch.randn(5, 9, generator=torch.Generator().manual_seed(1)), dim=-1)
    proposed = torch.tensor([0, 3, 8, 3, 5])
    one_hot = torch.nn.functional.one_hot(proposed, 9).float()
    assert torch.allclose(
        spec_verifier.acceptance_probability(probs, proposed, one_hot),
        spec_verifier.acceptance_probability(probs, proposed),
    )
    assert torch.allclose(
        spec_verifier.residual_probs(probs, proposed, one_hot), spec_verifier.residual_probs(probs, proposed)
    )


def test_greedy_rows_keep_the_argmax_prefix():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    accepted, recovered = verify_proposals(logits, torch.tensor([1, 0, 1]), None)
    assert accepted.tolist() == [True, True, False]
    assert recovered.tolist() == [1, 0, 2]
    assert accepted_prefix(accepted.tolist(), 0, 3) == 2


def test_seeded_verification_repeats_and_greedy_rows_in_a_mixed_batch_stay_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    proposed = torch.tensor([3, 4, 5, int(logits[3].argmax())])
    params_list = [SamplingParams(temperature=1.0, seed=9)] * 3 + [SamplingParams(temperature=0.0)]

    def run():
        # One generator per request: its rows draw from it in turn (worker/model_runner.py).
        gen = torch.Generator().manual_seed(77)
        params = SamplingTensors.build(params_list, (gen, gen, gen, None), "cpu")
        return verify_proposals(logits, proposed, params)

    first, second = run(), run()
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert bool(first[0][3]) and int(first[1][3]) == int(logits[3].argmax())


# --- the scheduler's side --------------------------------------------------------------------

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)


def _scheduler(**overrides) -> Scheduler:
    fields = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        block_size=4,
        num_kv_blocks=64,
        speculative=NGRAM,
    )
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields))


def _request(request_id: str, prompt, **params) -> Request:
    return Request(request_id, list(prompt), SamplingParams(**{"max_tokens": 16, **params}))


def _run_step(scheduler: Scheduler, tokens: dict[str, int], accepted: dict[str, int] | None = None):
    out = scheduler.schedule()
    ids = tuple(s.request_id for s in out.scheduled if s.sample)
    counts = None
    if any(s.num_draft_tokens for s in out.scheduled):
        counts = tuple((accepted or {}).get(i, 0) for i in ids)
    runner = ModelRunnerOutput(ids, tuple(tokens[i] for i in ids), num_accepted_drafts=counts)
    return out, scheduler.update(out, runner)


def test_a_decode_with_a_match_verifies_proposals_and_emits_the_accepted_run():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", [5, 6, 7, 8, 5, 6]))  # suffix 5 6 → proposes 7 8 5
    _run_step(scheduler, {"a": 7})  # prefill samples 7: history ... 5 6 7
    out, outputs = _run_step(scheduler, {"a": 42}, {"a": 2})
    (step,) = out.scheduled
    # History 5 6 7 8 5 6 7: the 2-gram "6 7" matched at 1-2, followed by 8 5 6.
    assert step.token_ids == (7, 8, 5, 6) and step.num_draft_tokens == 3
    assert step.start_position == 6 and len(step.block_ids) == 3  # 10 positions in blocks of 4
    # Two proposals kept, then the runner's token; only the kept ones count as computed.
    assert outputs[0].new_token_ids == (8, 5, 42)
    request = scheduler._requests["a"]
    assert request.num_computed_tokens == 9 and request.history.num_tokens == 10
    assert (scheduler.num_spec_steps, scheduler.num_draft_tokens, scheduler.num_accepted_draft_tokens) == (
        1,
        3,
        2,
    )


def test_a_stop_inside_an_accepted_run_ends_it_there_and_frees_every_block():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", [5, 6, 7, 8, 5, 6], stop_token_ids=[5]))
    _run_step(scheduler, {"a": 7})
    _, outputs = _run_step(scheduler, {"a": 42}, {"a": 3})  # proposals 8 5 6 all kept
    (out,) = outputs
    assert out.new_token_ids == (8, 5) and out.finished and out.stop_reason == 5
    assert scheduler._kv_cache_manager.num_free_blocks == 64
    assert not scheduler.has_unfinished_requests()


def test_max_tokens_and_the_budget_bound_the_proposals():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", [5, 6, 7, 8, 5, 6], max_tokens=3))
    _run_step(scheduler, {"a": 7})  # 1 output: room for 1 proposal, then the verified token
    out, outputs = _run_step(scheduler, {"a": 9}, {"a": 1})
    assert out.scheduled[0].num_draft_tokens == 1
    assert outputs[0].new_token_ids == (8, 9) and outputs[0].finish_reason == "length"
    # A budget of 2 tokens leaves room for one proposal.
    scheduler = _scheduler(max_num_batched_tokens=2)
    scheduler.add_request(_request("b", [5, 6]))
    _run_step(scheduler, {"b": 5})
    out, _ = _run_step(scheduler, {"b": 6}, {"b": 1})
    assert out.scheduled[0].token_ids == (5, 6)


def test_speculation_stops_above_the_batch_size_limit_and_skips_constrained_requests():
    config = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=2,
        prompt_lookup_min=1,
        prompt_lookup_max=1,
        disable_by_batch_size=2,
    )
    scheduler = _scheduler(speculative=config)
    for name in "abc":
        scheduler.add_request(_request(name, [5, 6, 5]))
    _run_step(scheduler, dict.fromkeys("abc", 6))
    out, _ = _run_step(scheduler, dict.fromkeys("abc", 5))
    assert all(s.num_draft_tokens == 0 for s in out.scheduled)  # 3 running > 2
    scheduler.abort_requests("c")
    out, _ = _run_step(scheduler, dict.fromkeys("ab", 5), {})
    assert all(s.num_draft_tokens == 2 for s in out.scheduled)
    # Penalties make each position's distribution depend on the run before it: no proposals.
    scheduler = _scheduler()
    scheduler.add_request(_request("p", [5, 6, 5], presence_penalty=0.5))
    _run_step(scheduler, {"p": 6})
    out, _ = _run_step(scheduler, {"p": 5})
    assert out.scheduled[0].num_draft_tokens == 0


def test_with_a_step_in_flight_a_speculating_request_waits_for_its_token():
    scheduler = _scheduler(max_in_flight_steps=2)
    request = _request("a", [5, 6, 7, 5, 6])
    scheduler.add_request(request)
    first = scheduler.schedule()  # the prefill, in flight
    assert scheduler.schedule().is_empty  # its proposals need the token it samples
    scheduler.update(first, ModelRunnerOutput(("a",), (7,)))
    second = scheduler.schedule()
    assert second.scheduled[0].num_draft_tokens > 0
    assert request.has_proposals_in_flight
    assert scheduler.schedule().is_empty  # how many tokens it will have is not known yet
    scheduler.update(second, ModelRunnerOutput(("a",), (1,), num_accepted_drafts=(0,)))
    assert request.status is RequestStatus.RUNNING and request.output_token_ids == [7, 1]
    assert request.num_computed_tokens == 6 and not request.has_proposals_in_flight


# --- the output side: a stop string inside a run -----------------------------------------------


def test_a_stop_string_inside_a_run_cuts_tokens_text_and_logprobs_there():
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    prompt_ids = tokenizer.encode("def add(a, b):", add_special_tokens=False)
    run = tokenizer.encode("\n    return a + b\n\nx = 1", add_special_tokens=False)
    # The stop string ends inside the run: at the token that completes "a + b".
    stop_at = next(i for i in range(len(run)) if "a + b" in tokenizer.decode(run[: i + 1]))
    assert stop_at < len(run) - 1
    history = TokenHistory(prompt_ids)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=32, stop=["a + b"], logprobs=0)
    processor.add_request("r", "def add(a, b):", params, {"r": history})
    for token_id in run:
        history.append(token_id)  # the scheduler appended the whole verified run
    records = tuple(TokenLogprobs(t, -0.5, 1, (), ()) for t in run)
    out = EngineCoreOutput("r", tuple(run), False, None, None, new_logprobs=records)
    processed = processor.process([out])
    (result,) = processed.request_outputs
    completion = result.outputs[0]
    assert processed.stopped_by_string == ["r"]  # the core must stop it
    assert completion.finish_reason == "stop" and completion.stop_reason == "a + b"
    assert completion.text == "\n    return "
    assert completion.token_ids == tuple(run[: stop_at + 1])
    assert len(completion.logprobs) == stop_at + 1
    assert completion.cumulative_logprob == pytest.approx(-0.5 * (stop_at + 1))


def test_the_last_prompt_chunk_can_speculate_behind_a_chunk_in_flight():
    """The async loop: a prompt's last chunk (one token) scheduled while its previous chunk is in
    flight starts past that chunk, proposals included."""
    scheduler = _scheduler(max_in_flight_steps=2, max_num_batched_tokens=5)
    request = _request("a", [5, 6, 7, 5, 6, 7])  # two chunks: 5 tokens, then 1
    scheduler.add_request(request)
    first = scheduler.schedule()
    assert first.scheduled[0].token_ids == (5, 6, 7, 5, 6) and not first.scheduled[0].sample
    second = scheduler.schedule()
    (last,) = second.scheduled
    assert last.start_position == 5 and last.token_ids[0] == 7 and last.num_draft_tokens > 0
    scheduler.update(first, ModelRunnerOutput((), ()))
    scheduler.update(second, ModelRunnerOutput(("a",), (9,), num_accepted_drafts=(1,)))
    assert request.num_computed_tokens == 7 and request.output_token_ids == [last.token_ids[1], 9]
