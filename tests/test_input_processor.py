"""InputProcessor: every accepted prompt form, and a clear InvalidRequestError for every bad one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from compiled_engine.engine.input_processor import InputProcessor, ProcessedPrompt, ValidatedPrompt
from compiled_engine.errors import InvalidRequestError
from compiled_engine.model_loader.model_config import FULL_ATTENTION, ModelConfig
from compiled_engine.sampling_params import SamplingParams
from tests.model_factory import BOS_ID, build_tokenizer

VOCAB = 384
MAX_LEN = 64
TOKENIZER = build_tokenizer(VOCAB)
MODEL_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    model_type="llama",
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=16,
    hidden_size=64,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    dtype=torch.float32,
    eos_token_ids=frozenset({2}),
    bos_token_id=BOS_ID,
    sliding_windows=(FULL_ATTENTION, FULL_ATTENTION),
)
PARAMS = SamplingParams(max_tokens=4)


@pytest.fixture
def processor() -> InputProcessor:
    return InputProcessor(TOKENIZER, MODEL_CONFIG, MAX_LEN)


def test_text_prompt_is_tokenized_with_default_special_tokens(processor):
    text = "def f(x): return '中文'"
    result = processor.process(text, PARAMS, "r1")
    assert result == ProcessedPrompt(prompt=text, prompt_token_ids=tuple(TOKENIZER(text)["input_ids"]))
    assert result.prompt_token_ids[0] == BOS_ID


def test_prompt_dict_forms(processor):
    text = "hello world"
    assert processor.process({"prompt": text}, PARAMS, "r") == processor.process(text, PARAMS, "r")
    assert processor.process({"prompt_token_ids": [5, 6, 7]}, PARAMS, "r") == ProcessedPrompt(None, (5, 6, 7))
    assert processor.process({"prompt_token_ids": (0, VOCAB - 1)}, PARAMS, "r").prompt_token_ids == (
        0,
        VOCAB - 1,
    )


def test_numpy_integer_ids_become_plain_ints(processor):
    ids = processor.process({"prompt_token_ids": list(np.array([3, 4], dtype=np.int64))}, PARAMS, "r")
    assert ids.prompt_token_ids == (3, 4)
    assert all(type(t) is int for t in ids.prompt_token_ids)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "the prompt is empty"),
        ({"prompt": ""}, "the prompt is empty"),
        ({"prompt_token_ids": []}, r"the prompt is empty \(no token ids\)"),
        ({"prompt_token_ids": [1, True]}, r"prompt token 1 is True \(bool\), not an int"),
        ({"prompt_token_ids": [1, 2.0]}, r"prompt token 1 is 2.0 \(float\), not an int"),
        ({"prompt_token_ids": ["a"]}, r"prompt token 0 is 'a' \(str\)"),
        ({"prompt_token_ids": [3, -1]}, r"prompt token 1 is -1, outside the model's vocabulary \[0, 384\)"),
        ({"prompt_token_ids": [VOCAB]}, r"prompt token 0 is 384, outside"),
        ({"prompt_token_ids": "1 2 3"}, "prompt_token_ids must be a list of ints, got str"),
        ({"prompt_token_ids": None}, "prompt_token_ids must be a list of ints, got NoneType"),
        ({"prompt": 5}, "prompt text must be a str, got int"),
        ({}, "exactly one of"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of"),
        ({"text": "a"}, r"unsupported key\(s\) \['text'\]"),
        (None, "must be a str or a dict .* got NoneType"),
        (7, "got int"),
        (["a", "b"], r"got list \(token ids go in \{'prompt_token_ids'"),
        ([1, 2, 3], "got list"),
        (b"bytes", "got bytes"),
    ],
)
def test_bad_prompts(processor, prompt, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        processor.process(prompt, PARAMS, "req-42")
    assert "req-42" in str(info.value)


def test_prompt_longer_than_max_model_len(processor):
    with pytest.raises(
        InvalidRequestError, match=f"has {MAX_LEN + 1} tokens, more than max_model_len={MAX_LEN}"
    ):
        processor.process({"prompt_token_ids": [5] * (MAX_LEN + 1)}, PARAMS, "r")


def test_prompt_plus_max_tokens_over_max_model_len_names_both(processor):
    params = SamplingParams(max_tokens=10)
    with pytest.raises(
        InvalidRequestError, match="has 60 tokens and max_tokens is 10: 70 tokens .* max_model_len=64"
    ):
        processor.process({"prompt_token_ids": [5] * 60}, params, "r")
    # Exactly filling the context is fine.
    assert len(processor.process({"prompt_token_ids": [5] * 54}, params, "r").prompt_token_ids) == 54


def test_tokenized_ids_outside_model_vocab_rejected():
    small = InputProcessor(TOKENIZER, _config(vocab_size=100), MAX_LEN)
    with pytest.raises(InvalidRequestError, match=r"outside the model's vocabulary \[0, 100\)"):
        small.process("zzzz qqqq 中文", PARAMS, "r")


def test_text_without_tokenizer(processor):
    no_tokenizer = InputProcessor(None, MODEL_CONFIG, MAX_LEN)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        no_tokenizer.process("hello", PARAMS, "r")
    assert no_tokenizer.process({"prompt_token_ids": [1]}, PARAMS, "r").prompt_token_ids == (1,)


def test_sampling_params_must_be_sampling_params(processor):
    with pytest.raises(InvalidRequestError, match="must be a SamplingParams, got dict"):
        processor.process("hi", {"max_tokens": 3}, "r")


def test_max_model_len_default_and_validation():
    assert InputProcessor(TOKENIZER, MODEL_CONFIG).max_model_len == 512
    for bad in (0, -3, True, 2.5, "64"):
        with pytest.raises(ValueError, match="max_model_len must be a positive int"):
            InputProcessor(TOKENIZER, MODEL_CONFIG, bad)


# -- validate_batch -----------------------------------------------------------------------------------


def test_batch_with_default_shared_and_per_prompt_params(processor):
    prompts = ["one", {"prompt_token_ids": [7, 8]}]
    batch = processor.validate_batch(prompts, None)
    assert [v.sampling_params for v in batch] == [SamplingParams(), SamplingParams()]
    assert all(isinstance(v, ValidatedPrompt) for v in batch)
    assert batch[1].processed == ProcessedPrompt(None, (7, 8))

    shared = SamplingParams(max_tokens=3)
    assert [params for _, params in processor.validate_batch(prompts, shared)] == [shared, shared]

    own = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=2)]
    assert [params for _, params in processor.validate_batch(prompts, own)] == own


def test_single_prompt_is_a_batch_of_one(processor):
    (only,) = processor.validate_batch("hello", PARAMS)
    assert only.processed.prompt == "hello"


def test_batch_params_length_mismatch_names_both_lengths(processor):
    with pytest.raises(InvalidRequestError, match="3 prompts but 2 sampling_params"):
        processor.validate_batch(["a", "b", "c"], [PARAMS, PARAMS])


@pytest.mark.parametrize("params", [[PARAMS, {"max_tokens": 2}], {"max_tokens": 2}, 5])
def test_batch_rejects_non_sampling_params(processor, params):
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        processor.validate_batch(["a", "b"], params)


def test_one_bad_prompt_rejects_the_whole_batch_naming_it(processor):
    with pytest.raises(InvalidRequestError, match=r"prompt\[2\].*empty"):
        processor.validate_batch(["fine", {"prompt_token_ids": [1]}, "", "also fine"], PARAMS)
    short = InputProcessor(TOKENIZER, MODEL_CONFIG, 13)
    # Per-prompt params: only the second prompt's max_tokens overflows the context.
    with pytest.raises(
        InvalidRequestError, match=r"prompt\[1\].*max_tokens is 10: 14 tokens.*max_model_len=13"
    ):
        short.validate_batch(
            [{"prompt_token_ids": [1]}, {"prompt_token_ids": [1] * 4}],
            [SamplingParams(max_tokens=1), SamplingParams(max_tokens=10)],
        )


def test_empty_batch(processor):
    assert processor.validate_batch([], None) == []


def _config(**changes) -> ModelConfig:
    return dataclasses.replace(MODEL_CONFIG, **changes)
