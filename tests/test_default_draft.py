"""The default model's draft shipped inside the package (compiled_engine/default_model_draft).

It is a small Hugging Face checkpoint with the default model's own tokenizer, the engine takes it
as the default model's draft, greedy outputs with it are the outputs without it, and it has
learned to predict the default model: on held-out standard-library code the default model keeps
most of its proposals, where a random draft of the same shape (the control, in the same test)
gets almost none kept. docs/speculative_decoding.md says how it was trained and what it gains.
"""

from __future__ import annotations

import json
import shutil

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.speculative import completion_prompts
from compiled_engine import LLM, SamplingParams
from compiled_engine.default_model_path import default_draft_dir, default_model_dir

NEW_TOKENS = 48


def test_a_small_checkpoint_with_the_default_models_tokenizer():
    draft, target = default_draft_dir(), default_model_dir()
    config = json.loads((draft / "config.json").read_text())
    target_config = json.loads((target / "config.json").read_text())
    assert config["vocab_size"] == target_config["vocab_size"]
    assert config["max_position_embeddings"] >= target_config["max_position_embeddings"]
    assert (draft / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(draft)
    target_model = AutoModelForCausalLM.from_pretrained(target)
    size = sum(p.numel() for p in model.parameters())
    assert size * 4 <= sum(p.numel() for p in target_model.parameters())


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens, one request at a time (two at once would be past the default
    batch-size cut-off, unspeculated)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [
        list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids)
        for p in prompts
    ]


def _acceptance_and_outputs(draft_dir: str, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 4}
    llm = LLM(enforce_eager=True, max_model_len=512, speculative_config=spec)
    outputs = _greedy(llm, prompts)
    stats = llm.stats()
    llm.close()
    assert stats.num_draft_tokens > 0
    return stats.num_accepted_draft_tokens / stats.num_draft_tokens, outputs


def test_greedy_outputs_are_unchanged_and_the_draft_is_accepted(tmp_path):
    plain = LLM(enforce_eager=True, max_model_len=512)
    prompts = completion_prompts(plain.get_tokenizer(), 2, 128)
    expected = _greedy(plain, prompts)
    plain.close()
    acceptance, outputs = _acceptance_and_outputs(str(default_draft_dir()), prompts)
    assert outputs == expected
    # The control: the same shape with random weights is almost never right.
    random_dir = tmp_path / "random-draft"
    config = AutoConfig.from_pretrained(default_draft_dir())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(random_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_draft_dir() / name, random_dir / name)
    random_acceptance, random_outputs = _acceptance_and_outputs(str(random_dir), prompts)
    assert random_outputs == expected
    assert random_acceptance < 0.1 < 0.4 < acceptance, (random_acceptance, acceptance)
