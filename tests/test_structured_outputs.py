"""Structured outputs (xgrammar) on the embedded model: every sampled output keeps its constraint.

A randomized mix of JSON schemas, regexes, choices and a grammar at temperature 1.0, with n > 1,
shared prompts (prefix caching) and long ones (chunked prefill), in a KV cache small enough to
force preemption, in the synchronous and the async loop. Bad constraints are refused alone;
unconstrained greedy rows are unchanged by constrained ones beside them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compiled_engine import LLM, SamplingParams, StructuredOutputsParams
from compiled_engine.errors import InvalidRequestError
from compiled_engine.structured_output.constraint import build_grammar
from compiled_engine.structured_output.logits_mask import GrammarMasks
from tests.structured_workload import PERSON, structured_cases

ENGINE_OPTIONS = dict(
    enforce_eager=True,
    dtype="float32",
    max_model_len=512,
    block_size=8,
    num_kv_blocks=48,  # 384 tokens for up to 16 sequences: preemption is certain
    max_num_seqs=16,
    max_num_batched_tokens=64,  # the long prompts are chunked
)


@pytest.fixture(scope="module")
def llm():
    """The async loop: a constrained row's next mask needs the token the step in flight samples."""
    return LLM(async_scheduling=True, **ENGINE_OPTIONS)


def _run_and_check(llm: LLM, cases) -> None:
    outputs = llm.generate([c.prompt for c in cases], [c.params for c in cases], use_tqdm=False)
    for case, output in zip(cases, outputs, strict=True):
        assert len(output.outputs) == case.params.n
        for completion in output.outputs:
            assert completion.finish_reason == "stop", (case.params.structured_outputs, completion.text)
            case.check(completion.text)


def _check_engine_after(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_preemptions > 0, "the workload was meant to force preemption"
    assert stats.prefix_cache_hits > 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_mixed_constraints_sampled_at_temperature_one_all_validate(llm):
    _run_and_check(llm, structured_cases(14, seed=1, json_object=False))
    _check_engine_after(llm)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_two_hundred_mixed_constraints_all_validate(async_scheduling):
    llm = LLM(async_scheduling=async_scheduling, **ENGINE_OPTIONS)
    # No free-form objects here: with any keys and any string values, the tiny model may run out
    # of tokens before closing one (an honest "length", but not a validating output).
    _run_and_check(llm, structured_cases(200, seed=2, json_object=False))
    _check_engine_after(llm)


def test_unconstrained_greedy_rows_unchanged_by_constrained_neighbours(llm):
    prompts = ["def parse(text):", "import os", "The result is"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    cases = structured_cases(6, seed=3)
    mixed = llm.generate(
        [*prompts, *(c.prompt for c in cases)], [greedy] * 3 + [c.params for c in cases], use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone


def test_constraint_that_cannot_finish_ends_by_length(llm):
    params = SamplingParams(
        temperature=1.0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a{40}")
    )
    for output in llm.generate(["hello", "import os"], params, use_tqdm=False):
        completion = output.outputs[0]
        assert completion.finish_reason == "length"
        assert set(completion.text) == {"a"}


def test_bad_constraint_is_refused_alone_and_the_engine_keeps_serving(llm):
    good = SamplingParams(
        temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["x"])
    )
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a(b"))
    with pytest.raises(InvalidRequestError, match=r"structured_outputs.regex is invalid: .*parenthesis"):
        llm.generate(["one", "two"], [good, bad], use_tqdm=False)
    (output,) = llm.generate("one", good, use_tqdm=False)
    assert output.outputs[0].text == "x"


def test_each_distinct_constraint_compiles_once(llm):
    before = llm.engine.grammars.num_compiles
    schema = {"type": "object", "properties": {"k": {"enum": [before, "compile-once"]}}, "required": ["k"]}
    params = SamplingParams(max_tokens=24, structured_outputs=StructuredOutputsParams(json=schema))
    llm.generate(["a", "b", "c"], params, use_tqdm=False)
    llm.generate("d", params, use_tqdm=False)
    assert llm.engine.grammars.num_compiles == before + 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", 3]}, "entries must be non-empty strings"),
        ({"json": "{not json"}, "json is not valid JSON"),
        ({"json": "[1, 2]"}, "must be a JSON schema"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"json_object": "yes"}, "json_object must be a bool"),
    ],
)
def test_malformed_structured_outputs_params_are_refused(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_refuses_a_non_params_constraint():
    with pytest.raises(InvalidRequestError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": PERSON})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"regex": "a(b"}, r"regex is invalid: Regex parsing error .*parenthesis is not closed"),
        ({"grammar": "root ::= foo"}, r"grammar is invalid: .*Rule \"foo\" is not defined"),
        ({"json": {"type": "nonsense"}}, r"json is invalid: Unsupported type \"nonsense\""),
        ({"json": {"type": "integer", "multipleOf": 3}}, r"'multipleOf' at # .*does not support"),
        (
            {"json": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}},
            r"'uniqueItems' at #/properties/a",
        ),
        ({"json": {"$ref": "https://example.com/schema.json"}}, "only local references"),
    ],
)
def test_invalid_or_unsupported_constraints_name_the_problem(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        build_grammar(StructuredOutputsParams(**kwargs))


def test_grammar_masks_forbid_exactly_the_unset_bits_of_constrained_rows():
    rng = np.random.default_rng(0)
    vocab = 100  # not a multiple of 32: the last word's high bits lie past the vocabulary
    logits = torch.randn(4, vocab)
    bitmask = rng.integers(-(2**31), 2**31, size=(2, 4), dtype=np.int64).astype(np.int32)
    masks = GrammarMasks.of_rows([None, bitmask[0], None, bitmask[1]])
    assert masks is not None
    got = masks.apply(logits.clone())
    # Reference: unpack the bits with numpy; row r keeps token t iff bit t % 32 of word t // 32 is set.
    expected = logits.clone()
    for row, mask in ((1, bitmask[0]), (3, bitmask[1])):
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        expected[row, torch.from_numpy(~allowed)] = float("-inf")
    assert torch.equal(got, expected)
    assert GrammarMasks.of_rows([None, None]) is None


def _allowed(mask: np.ndarray) -> set[int]:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_request_grammar_follows_the_history_and_ends_a_failed_compile():
    from concurrent.futures import Future

    from transformers import AutoTokenizer

    from compiled_engine.default_model_path import default_model_dir
    from compiled_engine.structured_output.compiler import GrammarCompilerPool
    from compiled_engine.structured_output.request_grammar import RequestGrammar

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    pool = GrammarCompilerPool(tokenizer, vocab_size=4096, eos_token_ids=[0])
    grammar = pool.request_grammar(StructuredOutputsParams(choice=["yes", "no"]))
    grammar.wait(timeout=60)
    assert grammar.is_ready()
    yes = tokenizer.encode("yes", add_special_tokens=False)
    first = grammar.next_token_bitmask([])
    assert first is not None and yes[0] in _allowed(first) and 0 not in _allowed(first)
    done = grammar.next_token_bitmask(yes)  # complete: only EOS may follow
    assert done is not None and _allowed(done) == {0}
    after = grammar.next_token_bitmask([*yes, 0, 0])  # ignore_eos: EOS after EOS keeps the constraint
    assert after is not None and _allowed(after) == {0}
    again = grammar.next_token_bitmask([])  # fewer tokens than consumed: rebuilt from the history
    assert again is not None and np.array_equal(again, first)
    failed: Future = Future()
    failed.set_exception(RuntimeError("compiler crashed"))
    broken = RequestGrammar(failed, vocab_size=4096, stop_token_ids=[0])
    mask = broken.next_token_bitmask([])
    assert mask is not None and _allowed(mask) == {0}
    pool.close()
