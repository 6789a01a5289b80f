"""The engine process's wire form of a step's outputs (records/output_delta.py)."""

from __future__ import annotations

import pickle

from compiled_engine.outputs import CompletionOutput, Logprob, RequestOutput
from compiled_engine.records.output_delta import CompletionDelta, RequestDelta, from_wire, to_wire


def _output(request_id: str, prompt_len: int, **completion) -> RequestOutput:
    fields = dict(index=0, text=" x", token_ids=(7,), finish_reason=None, stop_reason=None)
    fields.update(completion)
    return RequestOutput(
        request_id=request_id,
        prompt="p" * prompt_len,
        prompt_token_ids=tuple(range(prompt_len)),
        outputs=(CompletionOutput(**fields),),
        finished=fields["finish_reason"] is not None,
    )


def test_round_trip_keeps_every_field_the_stream_reads():
    logprobs = [{7: Logprob(-0.5, 1, " x")}]
    outputs = [
        _output("a", 8),
        _output("b", 8, text="", token_ids=(1, 2), finish_reason="stop", stop_reason="\n"),
        _output("c", 8, logprobs=logprobs, cumulative_logprob=-0.5),
        RequestOutput(
            request_id="n2",
            prompt=None,
            prompt_token_ids=(1,),
            outputs=(
                CompletionOutput(0, "a", (3,), None),
                CompletionOutput(1, "b", (4,), "length"),
            ),
            finished=False,
            prompt_logprobs=[None, {1: Logprob(-1.0, 2, "q")}],
        ),
    ]
    got = from_wire(pickle.loads(pickle.dumps(to_wire(outputs), protocol=pickle.HIGHEST_PROTOCOL)))
    assert [type(d) for d in got] == [RequestDelta] * 4
    for delta, output in zip(got, outputs, strict=True):
        assert delta.request_id == output.request_id
        assert delta.finished == output.finished
        assert delta.prompt_logprobs == output.prompt_logprobs
        assert all(type(c) is CompletionDelta for c in delta.outputs)
        # Every CompletionOutput field, by name, in the record's order.
        assert [c._asdict() for c in delta.outputs] == [vars(c) for c in output.outputs]


def test_the_wire_carries_no_prompt():
    """What a step sends does not grow with the prompt (it used to carry it every step)."""
    short = pickle.dumps(to_wire([_output(str(i), 4) for i in range(64)]))
    long = pickle.dumps(to_wire([_output(str(i), 2000) for i in range(64)]))
    assert len(long) == len(short)
    assert len(pickle.dumps([_output(str(i), 2000) for i in range(64)])) > 100 * len(short)
