"""TokenHistory: a request's tokens kept once, by the scheduler, and read by the runner's staging
and the output processor; tensor-parallel workers hold replicas."""

from __future__ import annotations

import pickle

import pytest

from compiled_engine import LLM, SamplingParams
from compiled_engine.core.scheduler import Scheduler
from compiled_engine.core.scheduler_config import SchedulerConfig
from compiled_engine.records.request import Request, TokenHistory
from compiled_engine.records.runner_output import ModelRunnerOutput


def test_only_the_owner_appends_and_only_a_replica_is_extended():
    history = TokenHistory([1, 2, 3])
    history.append(7)
    assert history.prompt_token_ids == (1, 2, 3) and list(history.output_token_ids) == [7]
    assert history.num_tokens == 4 and history.prompt_array.tolist() == [1, 2, 3]
    with pytest.raises(ValueError):
        history.prompt_array[0] = 9  # read-only: shared by every reader
    with pytest.raises(RuntimeError, match="only a replica"):
        history.extend_replica([8])

    replica = pickle.loads(pickle.dumps(history))  # what a tensor-parallel worker receives
    assert replica.is_replica and not history.is_replica
    assert replica.prompt_token_ids == (1, 2, 3) and list(replica.output_token_ids) == [7]
    with pytest.raises(RuntimeError, match="never append"):
        replica.append(8)
    replica.extend_replica([8])
    assert list(replica.output_token_ids) == [7, 8] and list(history.output_token_ids) == [7]


def test_the_newest_token_follows_the_prompt_then_every_output_in_owner_and_replica():
    history = TokenHistory([1, 2, 3])
    assert history.newest_token_id == 3
    history.append(7)
    assert history.newest_token_id == 7
    replica = pickle.loads(pickle.dumps(history))
    assert replica.newest_token_id == 7
    replica.extend_replica([8, 9])
    assert replica.newest_token_id == 9 and replica.num_tokens == 6
    assert pickle.loads(pickle.dumps(TokenHistory([5]))).newest_token_id == 5
    assert history.num_prompt_tokens == replica.num_prompt_tokens == 3  # kept for the decode row


def test_the_scheduler_appends_to_the_requests_history():
    config = SchedulerConfig(
        num_kv_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32
    )
    scheduler = Scheduler(config)
    request = Request("r", [5, 6, 7], SamplingParams(max_tokens=4))
    history = request.history
    assert request.prompt_token_ids is history.prompt_token_ids
    scheduler.add_request(request)
    step = scheduler.schedule()
    scheduler.update(step, ModelRunnerOutput(request_ids=("r",), sampled_token_ids=(11,)))
    assert request.output_token_ids is history.output_token_ids  # one list, not a copy
    assert list(history.output_token_ids) == [11] and request.num_tokens == 4


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", max_model_len=128, enforce_eager=True)


def test_scheduler_runner_and_output_processor_read_one_history(llm):
    """n = 2 with penalties: each child's history is one object in the scheduler, the runner's
    request state and the output processor, and every output reports exactly its tokens."""
    engine = llm.engine
    params = SamplingParams(
        n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, repetition_penalty=1.3
    )
    processed, params = engine.validate(["import os"], params)[0]
    engine.add_request("parent", processed, params)
    scheduler, runner, outputs = engine.core.scheduler, engine.model_runner, engine.output_processor
    children = outputs.child_ids("parent")
    histories = {child: scheduler._requests[child].history for child in children}
    assert histories[children[0]] is not histories[children[1]]
    # The prompt is shared, not copied per child.
    assert histories[children[0]].prompt_token_ids is histories[children[1]].prompt_token_ids
    for child in children:
        assert runner.request_states[child].history is histories[child]
        assert outputs._states[child].history is histories[child]
    finished = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            for completion in output.outputs:
                history = histories[children[completion.index]]
                assert completion.token_ids == tuple(history.output_token_ids)
            if output.finished:
                finished = output
    assert finished is not None and all(len(c.token_ids) == 6 for c in finished.outputs)
    assert finished.prompt_token_ids == histories[children[0]].prompt_token_ids
    assert not runner.request_states


def test_record_outputs_extends_a_replica_and_leaves_the_owners_history_alone(llm):
    """Rank 0's runner reads the scheduler's history; a tensor-parallel worker's runner holds the
    unpickled replica and takes each update's tokens through record_outputs."""
    runner = llm.engine.model_runner
    penalised = SamplingParams(presence_penalty=0.5)
    owner = TokenHistory([1, 2])
    owner.append(4)
    replica = pickle.loads(pickle.dumps(owner))
    runner.add_request("owner", owner, penalised)
    runner.add_request("replica", replica, penalised)
    try:
        runner.record_outputs("owner", [4])  # the scheduler appended it already
        runner.record_outputs("replica", [5])
        assert list(owner.output_token_ids) == [4]
        assert list(replica.output_token_ids) == [4, 5]
    finally:
        runner.remove_requests(["owner", "replica"])
    assert not runner.request_states
