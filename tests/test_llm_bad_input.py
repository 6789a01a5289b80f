"""Bad input: a clear error naming the problem, raised before any work is queued; the engine
keeps serving afterwards and every KV block is back in the pool."""

from __future__ import annotations

import math

import pytest

from compiled_engine import LLM, SamplingParams
from compiled_engine.errors import InvalidRequestError

MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, enforce_eager=True)


def _still_serves(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.num_free_kv_blocks() == engine.num_kv_blocks
    outs = llm.generate(
        ["def f(x):", {"prompt_token_ids": [5, 6, 7]}],
        SamplingParams(max_tokens=4, temperature=0.0),
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4] or all(o.finished for o in outs)
    assert engine.num_free_kv_blocks() == engine.num_kv_blocks


BAD_PROMPTS = [
    pytest.param({"prompt_token_ids": [1] * (MAX_MODEL_LEN + 1)}, "max_model_len", id="prompt-too-long"),
    pytest.param({"prompt_token_ids": []}, "empty", id="empty-ids"),
    pytest.param("", "empty", id="empty-string"),
    pytest.param({"prompt_token_ids": [1, 10**6]}, "vocab", id="id-out-of-vocab"),
    pytest.param({"prompt_token_ids": [1, -1]}, "vocab", id="negative-id"),
    pytest.param({"prompt_token_ids": [1, 2.5]}, "int", id="float-id"),
    pytest.param({"prompt_token_ids": [1, True]}, "int", id="bool-id"),
    pytest.param(None, "prompt", id="none-prompt"),
    pytest.param(42, "prompt", id="int-prompt"),
    pytest.param({"text": "hi"}, "prompt", id="dict-without-prompt"),
]


@pytest.mark.parametrize("prompt,needle", BAD_PROMPTS)
def test_bad_prompt_rejected_in_a_batch(llm, prompt, needle):
    # The bad prompt sits between good ones: nothing may be queued.
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(
            ["ok", prompt, {"prompt_token_ids": [3, 4]}], SamplingParams(max_tokens=2), use_tqdm=False
        )
    assert needle in str(info.value).lower()
    _still_serves(llm)


def test_prompt_plus_max_tokens_beyond_max_model_len(llm):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate({"prompt_token_ids": [1] * 90}, SamplingParams(max_tokens=10), use_tqdm=False)
    message = str(info.value)
    assert "90" in message and "10" in message and str(MAX_MODEL_LEN) in message
    _still_serves(llm)


def test_sampling_params_list_length_mismatch(llm):
    with pytest.raises(InvalidRequestError, match="3.*2|2.*3"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    _still_serves(llm)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_sampling_params_validated_on_construction(kwargs, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        SamplingParams(**kwargs)


def test_error_mid_batch_leaves_no_blocks_and_serves_others(llm):
    # A valid batch after many rejected ones still matches a fresh run of the same prompts.
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = llm.generate(["import os", "class A:"], params, use_tqdm=False)
    with pytest.raises(InvalidRequestError):
        llm.generate(["import os", None], params, use_tqdm=False)
    second = llm.generate(["import os", "class A:"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert llm.engine.num_free_kv_blocks() == llm.engine.num_kv_blocks
