"""Speculative decoding with a draft model (`{"method": "draft_model", "model": DIR, ...}`).

The target is the session's tiny random Llama; the draft is that model cut to its first layer (a
smaller model with the target's tokenizer, whose guesses the target sometimes takes and sometimes
not, so both acceptance and rejection run). docs/speculative_decoding.md.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from compiled_engine import LLM, SamplingParams
from compiled_engine.engine.draft_model import DraftModelError
from compiled_engine.engine_args import EngineArgs
from compiled_engine.speculative_config import SpeculativeConfig, parse_speculative_config
from tests.model_factory import make_tiny_model
from tests.test_prefix_caching_engine import ENGINE_OPTIONS, _run
from tests.test_speculative_engine import (
    _workload,
    assert_follows_target_distribution,
    use_acceptance_rule,
)
from tests.test_speculative_engine import baseline as baseline  # noqa: F401 - the fixtures, shared
from tests.test_speculative_engine import plain_engine as plain_engine  # noqa: F401
from tests.test_speculative_engine import tiny_vocab_model as tiny_vocab_model  # noqa: F401
from tests.test_speculative_engine import tiny_vocab_targets as tiny_vocab_targets  # noqa: F401


def truncated_draft(target_dir: str | Path, out_dir: Path, num_layers: int = 1) -> str:
    """The target's first `num_layers` layers (with its embeddings, final norm and LM head) saved
    as a model of its own, with the target's tokenizer files when it has them."""
    config = AutoConfig.from_pretrained(target_dir)
    config.num_hidden_layers = num_layers
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, _ = draft.load_state_dict(target.state_dict(), strict=False)
    assert not missing, missing
    draft.generation_config = target.generation_config
    draft.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(target_dir) / name).exists():
            shutil.copy(Path(target_dir) / name, out_dir / name)
    return str(out_dir)


@pytest.fixture(scope="module")
def draft_dir(llama_dir, tmp_path_factory) -> str:
    return truncated_draft(llama_dir, tmp_path_factory.mktemp("draft"))


def draft(model: str, k: int, **extra) -> dict:
    # No batch-size cut-off: these tests want proposals in every step that can have them.
    return {
        "method": "draft_model",
        "model": model,
        "num_speculative_tokens": k,
        "disable_by_batch_size": 256,
        **extra,
    }


def _assert_draft_ran_and_nothing_leaked(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.speculative and stats.num_spec_steps > 0
    # A draft of the target's own first layer: it is right sometimes, wrong sometimes.
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


# --- the option ------------------------------------------------------------------------------


def test_the_config_takes_vllms_draft_model_shape(draft_dir):
    config = parse_speculative_config(
        {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}
    )
    assert config == SpeculativeConfig(method="draft_model", model=draft_dir, num_speculative_tokens=3)
    text = json.dumps({"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 2})
    assert EngineArgs(speculative_config=text).speculative_config.model == draft_dir


@pytest.mark.parametrize(
    "value,message",
    [
        (
            {"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 0},
            "num_speculative_tokens must be",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "method 'draft_model' needs 'model'"),
        (
            {"method": "draft_model", "model": "/nonexistent/draft", "num_speculative_tokens": 2},
            "draft model folder '/nonexistent/draft' does not exist",
        ),
        ({"method": "eagle", "model": "{draft}", "num_speculative_tokens": 2}, "unknown method 'eagle'"),
        (
            {"method": "ngram", "model": "{draft}", "num_speculative_tokens": 2},
            "'model' is for method 'draft_model'",
        ),
    ],
)
def test_bad_draft_configs_are_refused_naming_the_problem(value, message, draft_dir):
    if value.get("model") == "{draft}":
        value = {**value, "model": draft_dir}
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=value)


def test_a_draft_with_another_vocabulary_is_refused_at_load(llama_dir, tmp_path):
    other = make_tiny_model(tmp_path, vocab_size=320, num_layers=1)
    with pytest.raises(DraftModelError, match="vocabulary of 320 tokens, the target.s has 384"):
        LLM(llama_dir, dtype="float32", enforce_eager=True, speculative_config=draft(str(other), 2))


def test_a_draft_with_another_tokenizer_is_refused_at_load(llama_dir, draft_dir, tmp_path):
    # Same size, two tokens' ids swapped: the same ids would mean other text.
    other = Path(shutil.copytree(draft_dir, tmp_path / "other-tokenizer"))
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(DraftModelError, match="different tokenizer"):
        LLM(llama_dir, dtype="float32", enforce_eager=True, speculative_config=draft(str(other), 2))


# --- greedy outputs are the target's ---------------------------------------------------------

PROMPTS = [[1, 17, 42, 99, 5], [1, 200, 201, 202, 203, 204, 205, 206, 207, 208], [1, 77] * 9]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def eager_reference(llama_dir):
    llm = LLM(llama_dir, dtype="float32", enforce_eager=True, max_model_len=128)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


# k = 3 in the default run (each engine costs a few seconds); every k with -m slow.
@pytest.mark.parametrize("k", [pytest.param(k, marks=pytest.mark.slow) if k != 3 else k for k in range(1, 6)])
def test_greedy_outputs_match_without_speculation_for_each_k(k, llama_dir, draft_dir, eager_reference):
    llm = LLM(
        llama_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        speculative_config=draft(draft_dir, k),
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == eager_reference
    _assert_draft_ran_and_nothing_leaked(llm)
    assert llm.engine.draft_proposer.num_steps > 0


# --- randomised requests under KV pressure, against the engine without speculation -------------

EAGER_OPTIONS = {**ENGINE_OPTIONS, "enforce_eager": True}


@pytest.fixture(scope="module")
def eager_baseline(llama_dir):
    """The cheap default run's reference: the eager engine without speculation, synchronous."""
    llm = LLM(llama_dir, async_scheduling=False, **EAGER_OPTIONS)
    results: dict[int, dict] = {}

    def get(size: int):
        if size not in results:
            results[size] = _run(llm, _workload(size))
        return results[size]

    return get


# ~33 s each: the default run's budget (greedy identity at k=3 stays in it).
@pytest.mark.parametrize(
    "async_", [pytest.param(True, marks=pytest.mark.slow), pytest.param(False, marks=pytest.mark.slow)]
)
def test_greedy_outputs_match_under_kv_pressure_eager(async_, llama_dir, draft_dir, eager_baseline):
    """The default run's version: 24 requests, eager (no compile), prefix caching on."""
    llm = LLM(
        llama_dir,
        enable_prefix_caching=True,
        async_scheduling=async_,
        speculative_config=draft(draft_dir, 3),
        **EAGER_OPTIONS,
    )
    assert _run(llm, _workload(24)) == eager_baseline(24)
    assert llm.stats().num_preemptions > 0, "the workload was meant to force preemption"
    _assert_draft_ran_and_nothing_leaked(llm)


# The compiled engines, 60 and 200 requests, each loop with and without prefix caching.
@pytest.mark.slow
@pytest.mark.parametrize(
    "async_,caching,size", [(True, True, 60), (False, False, 60), (True, False, 200), (False, True, 200)]
)
def test_greedy_outputs_match_under_kv_pressure(async_, caching, size, llama_dir, draft_dir, baseline):  # noqa: F811
    llm = LLM(
        llama_dir,
        enable_prefix_caching=caching,
        async_scheduling=async_,
        speculative_config=draft(draft_dir, 3),
        **ENGINE_OPTIONS,
    )
    assert _run(llm, _workload(size)) == baseline(size)
    assert llm.stats().num_preemptions > 0, "the workload was meant to force preemption"
    _assert_draft_ran_and_nothing_leaked(llm)


# --- temperature 1.0: the output distribution is the target's ----------------------------------


@pytest.fixture(scope="module")
def tiny_vocab_draft(tiny_vocab_model, tmp_path_factory):  # noqa: F811
    return truncated_draft(tiny_vocab_model, tmp_path_factory.mktemp("tiny-vocab-draft"))


# Each sample runs the draft's own steps: slow, like the n-gram one.
@pytest.mark.slow
@pytest.mark.parametrize("rule", ["correct", "residual_keeps_proposal", "always_accept"])
def test_temperature_one_outputs_follow_the_target_distribution(
    rule,
    tiny_vocab_model,  # noqa: F811
    tiny_vocab_targets,  # noqa: F811
    tiny_vocab_draft,
    monkeypatch,
):
    """Chi-square of the 2nd and 3rd tokens of 4,000 seeded requests against transformers' exact
    distributions, with the draft proposing. A deliberately wrong acceptance rule fails."""
    use_acceptance_rule(monkeypatch, rule)
    llm = LLM(
        tiny_vocab_model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=64,
        speculative_config=draft(tiny_vocab_draft, 2, disable_by_batch_size=4096),
    )
    assert_follows_target_distribution(llm, rule, tiny_vocab_targets)
