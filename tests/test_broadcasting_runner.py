"""Rank 0's BroadcastingRunner, in one process: a one-rank group has no workers to spawn, so the
broadcaster runs for real (every message crosses the group) while the engine stays in-process.

The two-rank engines in test_tensor_parallel.py check that workers apply the messages; this checks
what rank 0 sends and that driving a step through the broadcaster changes no token.
"""

from __future__ import annotations

import pickle
import random
from collections import Counter

import torch

from compiled_engine import LLM, SamplingParams
from compiled_engine.distributed.broadcasting_runner import BroadcastingRunner
from compiled_engine.distributed.process_group import RendezvousAddress, TensorParallelGroup
from compiled_engine.distributed.runner_messages import (
    AddRequest,
    CollectStep,
    LaunchStep,
    RecordOutputs,
    RemoveRequests,
)
from compiled_engine.distributed.workers import WorkerProcesses

ENGINE = dict(
    device="cpu",
    enforce_eager=True,
    max_num_seqs=4,
    max_model_len=64,
    num_kv_blocks=48,
    enable_prefix_caching=False,
)


def test_the_broadcaster_sends_typed_messages_and_changes_no_token(llama_dir):
    rng = random.Random(11)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(5 + 7 * i)]} for i in range(3)]
    # One request with sampling state (penalties): only its outputs and its end are broadcast.
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    ]
    llm = LLM(llama_dir, **ENGINE)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    address = RendezvousAddress.on_localhost()
    group = TensorParallelGroup(0, 1, address, torch.device("cpu"))
    workers = WorkerProcesses(1, address, serve_rank=lambda rank, address: None)  # ranks 1..0: none
    sent = []
    broadcast = group.broadcast

    def recording_broadcast(obj=None):
        sent.append(obj)
        return broadcast(obj)

    group.broadcast = recording_broadcast
    try:
        runner = llm.engine.model_runner
        steps_before = runner.timeline.num_steps
        llm.engine.core.runner = BroadcastingRunner(runner, group, workers)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        workers.stop()
        group.close()

    assert outputs == expected
    kinds = Counter(type(message) for message in sent)
    assert kinds[AddRequest] == 3
    num_steps = runner.timeline.num_steps - steps_before
    assert num_steps > 0 and kinds[LaunchStep] == kinds[CollectStep] == num_steps
    (stateful,) = [m.request_id for m in sent if isinstance(m, AddRequest) and m.params.has_penalties]
    recorded = [m for m in sent if isinstance(m, RecordOutputs)]
    assert {m.request_id for m in recorded} == {stateful}
    assert sum(len(m.token_ids) for m in recorded) == 6
    assert [m.request_ids for m in sent if isinstance(m, RemoveRequests)] == [(stateful,)]
    assert set(kinds) == {AddRequest, LaunchStep, CollectStep, RecordOutputs, RemoveRequests}
    # What crosses to a worker is the message itself, unchanged by pickling.
    assert all(pickle.loads(pickle.dumps(message)) == message for message in sent)
    assert runner.request_states == {}
