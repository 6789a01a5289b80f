"""Scheduler with two steps in flight (the async loop): placeholders, deferred frees, the drain
before preemption, no step spent past max_tokens, and the same outputs as the synchronous loop
over random workloads."""

from __future__ import annotations

import random
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_engine.core.scheduler import Scheduler
from compiled_engine.core.scheduler_config import SchedulerConfig
from compiled_engine.records.request import Request, RequestStatus
from compiled_engine.records.runner_output import ModelRunnerOutput
from compiled_engine.records.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from compiled_engine.sampling_params import SamplingParams

VOCAB, EOS, STOP = 50, 2, 3


def make_scheduler(in_flight: int = 2, **overrides: int) -> Scheduler:
    fields = dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=4, num_kv_blocks=64
    )
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields, max_in_flight_steps=in_flight))


def make_request(request_id: str, prompt_len: int, max_tokens: int = 8, **params) -> Request:
    prompt = [10 + i % 30 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params))


def sample_all(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    ids = tuple(s.request_id for s in out.scheduled if s.sample)
    return ModelRunnerOutput(ids, (token,) * len(ids))


def test_next_step_feeds_a_placeholder_for_the_token_in_flight():
    scheduler = make_scheduler()
    request = make_request("a", prompt_len=5)
    scheduler.add_request(request)
    first = scheduler.schedule()
    second = scheduler.schedule()  # step 1 still in flight
    (decode,) = second.scheduled
    assert decode.token_ids == (PLACEHOLDER_TOKEN_ID,)
    assert decode.start_position == 5 and decode.sample and decode.num_output_tokens == 1
    with pytest.raises(RuntimeError, match="not yet passed to update"):
        scheduler.schedule()
    with pytest.raises(ValueError, match="oldest step"):
        scheduler.update(second, sample_all(second))
    scheduler.update(first, sample_all(first, token=9))
    assert request.output_token_ids == [9] and request.num_computed_tokens == 5
    third = scheduler.schedule()  # the placeholder of step 2 again, the token of step 1 is known
    assert third.scheduled[0].token_ids == (PLACEHOLDER_TOKEN_ID,)
    assert third.scheduled[0].start_position == 6
    scheduler.update(second, sample_all(second, token=11))
    assert request.output_token_ids == [9, 11]


def test_a_request_that_reaches_max_tokens_is_not_scheduled_for_a_wasted_step():
    scheduler = make_scheduler()
    request = make_request("a", prompt_len=3, max_tokens=2)
    scheduler.add_request(request)
    first = scheduler.schedule()
    second = scheduler.schedule()  # samples token 2 of 2
    assert len(second.scheduled) == 1
    scheduler.update(first, sample_all(first))
    third = scheduler.schedule()
    assert third.is_empty and not third.waiting_for_in_flight  # token 2 is owed: nothing to run
    outputs = scheduler.update(second, sample_all(second))
    assert outputs[0].finished and outputs[0].finish_reason == "length"
    assert scheduler.num_discarded_tokens == 0
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_a_stop_in_step_n_discards_step_n_plus_1_and_frees_blocks_after_it():
    scheduler = make_scheduler()
    request = make_request("a", prompt_len=4, stop_token_ids=[STOP])
    scheduler.add_request(request)
    first = scheduler.schedule()
    second = scheduler.schedule()
    blocks = set(second.scheduled[0].block_ids)
    outputs = scheduler.update(first, sample_all(first, token=STOP))
    assert outputs[0].finished and request.status == RequestStatus.FINISHED_STOPPED
    # Step 2 still writes into the request's blocks: they are not free yet.
    assert blocks.isdisjoint(scheduler.kv_cache_manager.block_pool.free_block_ids)
    assert scheduler.update(second, sample_all(second)) == []
    assert scheduler.num_discarded_tokens == 1
    assert blocks <= set(scheduler.kv_cache_manager.block_pool.free_block_ids)
    assert request.output_token_ids == [STOP]


def test_an_abort_while_two_steps_are_in_flight_frees_after_the_newest():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=4))
    first = scheduler.schedule()
    second = scheduler.schedule()
    scheduler.abort_requests(["a"])  # its 2 blocks: the prompt's and the one step 2 writes into
    assert scheduler.kv_cache_manager.num_free_blocks == 62
    assert scheduler.update(first, sample_all(first)) == []
    assert scheduler.kv_cache_manager.num_free_blocks == 62
    scheduler.update(second, sample_all(second))
    assert scheduler.kv_cache_manager.num_free_blocks == 64
    assert scheduler.num_discarded_tokens == 2


def test_preemption_waits_for_the_step_in_flight():
    # Two requests fill the 4 blocks; the next decode of the older one needs a fifth.
    scheduler = make_scheduler(num_kv_blocks=4, max_model_len=16)
    old, new = make_request("old", prompt_len=8), make_request("new", prompt_len=7)
    scheduler.add_request(old)
    scheduler.add_request(new)
    first = scheduler.schedule()
    assert [s.request_id for s in first.scheduled] == ["old", "new"]
    second = scheduler.schedule()
    assert second.is_empty and second.waiting_for_in_flight
    assert old.status == new.status == RequestStatus.RUNNING  # nothing was preempted yet
    scheduler.update(first, sample_all(first))
    third = scheduler.schedule()  # nothing in flight now: preempting is safe
    assert third.preempted_request_ids == ("new",)
    assert [s.request_id for s in third.scheduled] == ["old"]


def test_a_step_given_up_for_the_steps_in_flight_puts_nothing_in_flight():
    """Rows built before a request that must wait for the step in flight to preempt are taken
    back: the empty `waiting_for_in_flight` step leaves every request as it found it."""
    scheduler = make_scheduler(num_kv_blocks=3, max_model_len=16)  # 3 blocks of 4
    first_in = make_request("a", prompt_len=3, max_tokens=2)
    full = make_request("b", prompt_len=8, max_tokens=2)
    scheduler.add_request(first_in)
    scheduler.add_request(full)
    first = scheduler.schedule()  # both prompts: every block
    assert [s.request_id for s in first.scheduled] == ["a", "b"]
    # "a" decodes into its own block; "b" needs a fourth block, which only preemption could give.
    second = scheduler.schedule()
    assert second.is_empty and second.waiting_for_in_flight
    for request, prompt_len in ((first_in, 3), (full, 8)):
        assert request.num_in_flight_tokens == prompt_len and request.num_pending_outputs == 1
    scheduler.update(first, sample_all(first))
    third = scheduler.schedule()
    assert third.preempted_request_ids == ("b",)
    (row,) = third.scheduled
    assert row.request_id == "a" and row.start_position == 3 and row.token_ids == (7,)


def test_cancel_step_undoes_the_newest_step_only():
    scheduler = make_scheduler()
    request = make_request("a", prompt_len=4)
    scheduler.add_request(request)
    first = scheduler.schedule()
    scheduler.schedule()
    scheduler.cancel_step()
    assert request.num_in_flight_tokens == 4 and request.num_pending_outputs == 1
    again = scheduler.schedule()
    assert again.scheduled[0].token_ids == (PLACEHOLDER_TOKEN_ID,)
    scheduler.cancel_step()
    scheduler.update(first, sample_all(first))
    assert request.num_computed_tokens == 4 and request.output_token_ids == [7]


# --- random workloads: async equals sync, and no block is reused while a step reads it -------


def token_for(request_id: str, num_outputs: int) -> int:
    """The fake model: the next token depends only on the request and how far it has got."""
    return random.Random(f"{request_id}/{num_outputs}").randrange(VOCAB)


class FakeDevice:
    """Runs steps in order: resolves placeholders from the previous step's samples, keeps each
    slot's (request, position, token) and checks every context read."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.block_size = config.block_size
        self.slots: dict[int, tuple[str, int, int]] = {}
        self.tokens: dict[str, list[int]] = {}  # prompt + every token sampled, device side
        self.last_samples: dict[str, int] = {}

    def run(self, out: SchedulerOutput, requests: dict[str, Request]) -> ModelRunnerOutput:
        samples: dict[str, int] = {}
        for s in out.scheduled:
            known = self.tokens.setdefault(s.request_id, list(requests[s.request_id].prompt_token_ids))
            if s.start_position == 0:
                del known[len(requests[s.request_id].prompt_token_ids) :]  # recompute after preemption
                known.extend(requests[s.request_id].output_token_ids)
            tokens = list(s.token_ids)
            if PLACEHOLDER_TOKEN_ID in tokens:
                assert tokens.index(PLACEHOLDER_TOKEN_ID) == len(tokens) - 1, "placeholder not last"
                tokens[-1] = self.last_samples[s.request_id]  # sampled by the step just before
            for position in range(s.start_position):
                block = s.block_ids[position // self.block_size]
                slot = block * self.block_size + position % self.block_size
                assert self.slots.get(slot) == (s.request_id, position, known[position]), "bad context"
            for offset, token in enumerate(tokens):
                position = s.start_position + offset
                block = s.block_ids[position // self.block_size]
                self.slots[block * self.block_size + position % self.block_size] = (
                    s.request_id,
                    position,
                    token,
                )
                assert position >= len(known) or known[position] == token
                if position == len(known):
                    known.append(token)
            if s.sample:
                samples[s.request_id] = token_for(s.request_id, s.num_output_tokens)
                known.append(samples[s.request_id])
        self.last_samples = samples
        return ModelRunnerOutput(tuple(samples), tuple(samples.values()))


@st.composite
def workloads(draw):
    config = dict(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(8, 40)),
        block_size=draw(st.sampled_from([2, 4])),
        num_kv_blocks=draw(st.integers(12, 40)),
        max_model_len=48,
    )
    specs = []
    for _ in range(draw(st.integers(2, 12))):
        prompt_len = draw(st.integers(1, 20))
        specs.append(
            dict(
                arrival=draw(st.integers(0, 10)),
                prompt_len=prompt_len,
                max_tokens=draw(st.integers(1, 20)),
                stop=draw(st.booleans()),
                abort_after=draw(st.one_of(st.none(), st.integers(0, 6))),
            )
        )
    return config, specs


def run_workload(
    config: dict, specs: list[dict], in_flight: int, pipeline_depth: int = 1
) -> tuple[dict, Scheduler]:
    scheduler_config = SchedulerConfig(**config, max_in_flight_steps=in_flight, pipeline_depth=pipeline_depth)
    scheduler = Scheduler(scheduler_config)
    device = FakeDevice(scheduler_config)
    live: dict[str, Request] = {}
    produced: dict[str, list[int]] = {}
    pending: deque[tuple[SchedulerOutput, ModelRunnerOutput, set[int]]] = deque()
    pool = scheduler.kv_cache_manager.block_pool

    def read_by_in_flight() -> set[int]:
        return set().union(*(blocks for _, _, blocks in pending)) if pending else set()

    def collect_oldest() -> None:
        out, result, _ = pending.popleft()
        for output in scheduler.update(out, result):
            produced[output.request_id].extend(output.new_token_ids)
            spec = specs[int(output.request_id)]
            if spec["abort_after"] is not None and len(produced[output.request_id]) >= spec["abort_after"]:
                scheduler.abort_requests([output.request_id])
        assert read_by_in_flight().isdisjoint(pool.free_block_ids), "a block in use was freed"

    for step_index in range(3000):
        for i, spec in enumerate(specs):
            if spec["arrival"] == step_index:
                total = spec["prompt_len"] + spec["max_tokens"]
                if total > 48 or total - 1 > config["num_kv_blocks"] * config["block_size"]:
                    continue
                request = Request(
                    str(i),
                    [10 + (i + j) % 30 for j in range(spec["prompt_len"])],
                    SamplingParams(
                        max_tokens=spec["max_tokens"], stop_token_ids=[STOP] if spec["stop"] else None
                    ),
                    eos_token_ids=frozenset({EOS}),
                )
                scheduler.add_request(request)
                live[str(i)], produced[str(i)] = request, []
        out = scheduler.schedule()
        while out.waiting_for_in_flight:  # (more than once only with 3 steps in flight)
            assert pending, "waiting for a step although none is in flight"
            collect_oldest()
            out = scheduler.schedule()
        newly_read = {b for s in out.scheduled for b in s.block_ids}
        for held_out, _, _ in pending:
            owners = {b: s.request_id for s in held_out.scheduled for b in s.block_ids}
            for s in out.scheduled:
                for b in s.block_ids:
                    assert owners.get(b, s.request_id) == s.request_id, f"block {b} handed out while read"
        if pipeline_depth > 1:
            # Pipelined: no placeholders, and no request samples in two steps in flight at once.
            assert all(PLACEHOLDER_TOKEN_ID not in s.token_ids for s in out.scheduled)
            sampling = {s.request_id for s in out.scheduled if s.sample}
            for held_out, _, _ in pending:
                assert sampling.isdisjoint(s.request_id for s in held_out.scheduled if s.sample)
        if not out.is_empty:
            pending.append((out, device.run(out, live), newly_read))
        if len(pending) == in_flight or (out.is_empty and pending):
            collect_oldest()
        if step_index > max(s["arrival"] for s in specs) and not scheduler.has_unfinished_requests():
            while pending:
                collect_oldest()
            break
    else:
        pytest.fail("workload did not finish")
    assert pool.num_free_blocks == config["num_kv_blocks"]
    assert all(r.status.finished for r in live.values())
    for request_id, request in live.items():
        assert produced[request_id] == request.output_token_ids
    return {rid: tuple(tokens) for rid, tokens in produced.items()}, scheduler


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_async_scheduling_gives_the_sync_outputs_and_never_reuses_a_block_in_flight(workload):
    config, specs = workload
    sync_outputs, _ = run_workload(config, specs, in_flight=1)
    async_outputs, async_scheduler = run_workload(config, specs, in_flight=2)
    assert async_outputs == sync_outputs
    for request_id, tokens in sync_outputs.items():
        spec = specs[int(request_id)]
        assert len(tokens) <= spec["max_tokens"]
        assert all(t == token_for(request_id, n) for n, t in enumerate(tokens))
