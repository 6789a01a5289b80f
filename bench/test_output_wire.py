"""What one step's outputs cost on the pipe from the engine process to the API server (#19).

256 requests decoding under the null model (bench/null_model.py) with DELTA outputs, what the
server's engine asks for; one step's `RequestOutput`s, sent the way the engine process sent them
before (the records pickled, each with its prompt) and the way it sends them now
(records/output_delta.py: `to_wire`, pickled, unpickled, `from_wire`). A round is one side's
whole trip: build the message, pickle it, unpickle it, rebuild the reader's records. The same
outputs are also given 1,024-token prompts (the null model's own are 32 tokens), which only the
old form carries.

    python -m pytest bench/test_output_wire.py -q --benchmark-columns=median,min,rounds
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from bench.null_model import null_engine, start_decoding, stop_all
from compiled_engine.records.output_delta import from_wire, to_wire
from compiled_engine.sampling_params import RequestOutputKind

NUM_RUNNING = 256
ROUNDS = {"full": 300, "quick": 100, "smoke": 3}


@pytest.fixture(scope="module")
def step_outputs():
    engine = null_engine(NUM_RUNNING)
    request_ids = start_decoding(engine, NUM_RUNNING, output_kind=RequestOutputKind.DELTA)
    try:
        outputs = engine.step()
    finally:
        stop_all(engine, request_ids)
        engine.close()
    assert len(outputs) == NUM_RUNNING and all(len(o.outputs[0].token_ids) == 1 for o in outputs)
    return outputs


def _records_trip(outputs):
    return pickle.loads(pickle.dumps(outputs, protocol=pickle.HIGHEST_PROTOCOL))


def _wire_trip(outputs):
    return from_wire(pickle.loads(pickle.dumps(to_wire(outputs), protocol=pickle.HIGHEST_PROTOCOL)))


@pytest.mark.parametrize("prompt_tokens", [32, 1024])
@pytest.mark.parametrize("form", ["records", "wire"])
def test_step_outputs_over_the_pipe(benchmark, request, step_outputs, form, prompt_tokens):
    outputs = step_outputs
    if prompt_tokens != len(outputs[0].prompt_token_ids):
        outputs = [dataclasses.replace(o, prompt_token_ids=tuple(range(prompt_tokens))) for o in outputs]
    trip = _records_trip if form == "records" else _wire_trip
    rounds = ROUNDS[request.config._bench_sizes.profile]
    benchmark.group = f"one step's outputs, engine process to server, {prompt_tokens}-token prompts"
    received = benchmark.pedantic(trip, args=(outputs,), rounds=rounds, iterations=1, warmup_rounds=3)
    benchmark.extra_info.update(form=form, running=NUM_RUNNING, prompt_tokens=prompt_tokens)
    # What the stream reads arrives intact either way.
    assert [(r.request_id, r.finished, r.outputs[0].text, r.outputs[0].token_ids) for r in received] == [
        (o.request_id, o.finished, o.outputs[0].text, o.outputs[0].token_ids) for o in outputs
    ]
