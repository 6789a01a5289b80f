"""Structured outputs with speculative decoding: each proposed position is masked by the grammar.

The embedded model (its tokenizer makes JSON readable), eager. Greedy constrained outputs with
speculation are the tokens without it, and valid; proposals actually ran for the constrained
requests (the grammar's matcher advanced through them and was rolled back).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from compiled_engine import LLM, SamplingParams, StructuredOutputsParams
from compiled_engine.default_model_path import default_model_dir
from tests.structured_workload import PERSON
from tests.test_speculative_draft_model import truncated_draft

OPTIONS = dict(enforce_eager=True, dtype="float32", max_model_len=512, async_scheduling=False)
PROMPTS = ["Return a person as JSON: ", '{"name": "ab", "age": 3}\n{"name": "ab", "age": 3}\n', "data = "]


def _requests():
    params = []
    for _ in PROMPTS:
        structured = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
        params.append(SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=structured))
    return params


@pytest.fixture(scope="module")
def without_speculation():
    llm = LLM(**OPTIONS)
    outputs = llm.generate(PROMPTS, _requests(), use_tqdm=False)
    return [o.outputs[0] for o in outputs]


def _speculative_config(method: str, tmp_path_factory) -> dict:
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        }
    folder = tmp_path_factory.mktemp("embedded-draft")
    return {
        "method": "draft_model",
        "model": truncated_draft(default_model_dir(), folder, 2),
        "num_speculative_tokens": 3,
    }


@pytest.mark.parametrize("method", ["ngram", pytest.param("draft_model", marks=pytest.mark.slow)])
def test_json_schema_requests_speculate_and_match_without_speculation(
    method, without_speculation, tmp_path_factory
):
    spec = _speculative_config(method, tmp_path_factory)
    llm = LLM(speculative_config={**spec, "disable_by_batch_size": 8}, **OPTIONS)
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, _requests(), use_tqdm=False)]
    for i, (got, want) in enumerate(zip(outputs, without_speculation, strict=True)):
        assert got.token_ids == want.token_ids, (i, got.text, want.text)
        assert got.finish_reason == "stop", got.text
        jsonschema.validate(json.loads(got.text), PERSON)
    stats = llm.stats()
    # Every request here is constrained: these proposals were all masked per position.
    assert stats.num_spec_steps > 0 and stats.num_accepted_draft_tokens > 0, stats
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
