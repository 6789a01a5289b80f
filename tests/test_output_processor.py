"""The output processor's records are the ones the public constructors build (it builds them
without their frozen __init__, which costs about a microsecond a field every step)."""

from __future__ import annotations

import dataclasses

from transformers import AutoTokenizer

from compiled_engine.default_model_path import default_model_dir
from compiled_engine.engine.output_processor import OutputProcessor
from compiled_engine.outputs import CompletionOutput, RequestOutput
from compiled_engine.records.engine_core_output import EngineCoreOutput
from compiled_engine.records.request import TokenHistory
from compiled_engine.sampling_params import SamplingParams


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
