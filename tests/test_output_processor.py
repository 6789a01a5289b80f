"""The output processor's records are the ones the public constructors build (it builds them
without their frozen __init__, which costs about a microsecond a field every step)."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoTokenizer

from compiled_engine.default_model_path import default_model_dir
from compiled_engine.engine.output_processor import OutputProcessor
from compiled_engine.errors import InvalidRequestError
from compiled_engine.outputs import CompletionOutput, RequestOutput
from compiled_engine.records.engine_core_output import EngineCoreOutput
from compiled_engine.records.request import TokenHistory
from compiled_engine.records.runner_output import TokenLogprobs
from compiled_engine.sampling_params import RequestOutputKind, SamplingParams


def test_outputs_equal_what_their_constructors_build():
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    prompt_ids = tokenizer.encode("def add(a, b):", add_special_tokens=False)
    output_ids = tokenizer.encode("\n    return a + b\n", add_special_tokens=False)
    history = TokenHistory(prompt_ids)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", "def add(a, b):", SamplingParams(max_tokens=len(output_ids)), {"r": history})
    results = []
    for i, token_id in enumerate(output_ids):
        history.append(token_id)  # the scheduler's update, before the core's outputs
        last = i == len(output_ids) - 1
        core_output = EngineCoreOutput("r", (token_id,), last, "length" if last else None)
        (result,) = processor.process([core_output]).request_outputs
        results.append(result)
    final = results[-1]
    expected = RequestOutput(
        request_id="r",
        prompt="def add(a, b):",
        prompt_token_ids=tuple(prompt_ids),
        outputs=(
            CompletionOutput(
                index=0,
                text=tokenizer.decode(output_ids),
                token_ids=tuple(output_ids),
                finish_reason="length",
            ),
        ),
        finished=True,
    )
    assert final == expected and hash(final) == hash(expected)
    assert dataclasses.asdict(final) == dataclasses.asdict(expected)  # every field, set
    assert not results[0].finished and results[0].outputs[0].token_ids == tuple(output_ids[:1])


# -- output kinds ------------------------------------------------------------------------------------


def _run_kind(tokenizer, params: SamplingParams, outputs_by_child: list[list[int]]):
    """Feed the same token updates (one token a step per child) to a processor under `params`;
    returns its RequestOutputs, step by step (a list per step); the last step ends every child
    by length."""
    prompt = "def add(a, b):"
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    n = len(outputs_by_child)
    ids = ["r"] if n == 1 else [f"r-{i}" for i in range(n)]
    histories = {rid: TokenHistory(prompt_ids) for rid in ids}
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", prompt, params, histories)
    steps = []
    num_steps = len(outputs_by_child[0])
    for step in range(num_steps):
        core_outputs = []
        for rid, tokens in zip(ids, outputs_by_child, strict=True):
            token_id = tokens[step]
            histories[rid].append(token_id)
            last = step == num_steps - 1
            core_outputs.append(EngineCoreOutput(rid, (token_id,), last, "length" if last else None))
        steps.append(processor.process(core_outputs).request_outputs)
    assert not processor.has_request("r")  # every state is gone once the request ended
    return steps


def _joined(deltas: list[RequestOutput], index: int) -> tuple[str, tuple[int, ...]]:
    text, tokens = "", ()
    for delta in deltas:
        for completion in delta.outputs:
            if completion.index == index:
                text += completion.text
                tokens += completion.token_ids
    return text, tokens


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_delta_and_final_only_report_what_cumulative_does():
    """DELTA's pieces add up to CUMULATIVE's final output; FINAL_ONLY reports exactly that final
    output, once, and nothing before — with and without a stop string (which FINAL_ONLY
    detokenizes as it goes), for n = 1 and n = 2 (two samples, different tokens)."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    child_a = _tokens(tokenizer, "\n    return a + b  # sum\n")
    child_b = _tokens(tokenizer, "\n    total = a\n    total += b\n")
    length = min(len(child_a), len(child_b))
    for children in ([child_a], [child_a[:length], child_b[:length]]):
        for stop in (None, ("+ b",)):
            base = SamplingParams(max_tokens=64, n=len(children), stop=stop)
            cumulative = _run_kind(tokenizer, base, children)
            deltas = _run_kind(
                tokenizer, dataclasses.replace(base, output_kind=RequestOutputKind.DELTA), children
            )
            final_only = _run_kind(
                tokenizer, dataclasses.replace(base, output_kind=RequestOutputKind.FINAL_ONLY), children
            )
            # A stop string ends the request in the output processor: it stops at that step in
            # every run, which the three must agree on.
            (final,) = [outputs for outputs in cumulative if outputs and outputs[0].finished][0]
            assert final.finished
            if stop is not None:
                assert final.outputs[0].finish_reason == "stop" and "+ b" not in final.outputs[0].text
            else:
                assert final.outputs[0].text == tokenizer.decode(children[0])
            # FINAL_ONLY: nothing until the end, then the very record CUMULATIVE ends with.
            reported = [outputs for outputs in final_only if outputs]
            assert reported == [[final]]
            # DELTA: every step's record holds only that step's tokens; they add up.
            flat = [output for outputs in deltas for output in outputs]
            assert flat[-1].finished and not any(o.finished for o in flat[:-1])
            for completion in final.outputs:
                text, tokens = _joined(flat, completion.index)
                assert (text, tokens) == (completion.text, completion.token_ids)
            assert all(len(c.token_ids) <= 1 for o in flat for c in o.outputs)


def test_delta_reports_logprobs_per_step_and_prompt_logprobs_once():
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    prompt_ids = tokenizer.encode("x = 1", add_special_tokens=False)
    output_ids = _tokens(tokenizer, "\ny = 2\n")
    runs = {}
    for kind in RequestOutputKind:
        history = TokenHistory(prompt_ids)
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(max_tokens=16, logprobs=1, prompt_logprobs=0, output_kind=kind)
        processor.add_request("r", "x = 1", params, {"r": history})
        reported = []
        for i, token_id in enumerate(output_ids):
            history.append(token_id)
            last = i == len(output_ids) - 1
            record = TokenLogprobs(token_id, -0.5 - i, 1, (token_id,), (-0.5 - i,))
            prompt_logprobs = None
            if i == 0:  # the core attaches them to the first token
                prompt_logprobs = (None, *(TokenLogprobs(t, -1.0, 1, (), ()) for t in prompt_ids[1:]))
            out = EngineCoreOutput(
                "r", (token_id,), last, "length" if last else None, None, (record,), prompt_logprobs
            )
            reported += processor.process([out]).request_outputs
        runs[kind] = reported
    final = runs[RequestOutputKind.CUMULATIVE][-1]
    assert runs[RequestOutputKind.FINAL_ONLY] == [final]
    deltas = runs[RequestOutputKind.DELTA]
    assert [len(d.outputs[0].logprobs) for d in deltas] == [1] * len(output_ids)
    assert [lp for d in deltas for lp in d.outputs[0].logprobs] == final.outputs[0].logprobs
    assert deltas[-1].outputs[0].cumulative_logprob == final.outputs[0].cumulative_logprob
    assert deltas[0].prompt_logprobs == final.prompt_logprobs is not None
    assert all(d.prompt_logprobs is None for d in deltas[1:])


def test_an_output_kind_that_is_not_one_is_refused():
    with pytest.raises(InvalidRequestError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")  # type: ignore[arg-type]
