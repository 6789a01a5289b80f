"""The pipelined scheduler (pipeline parallelism: `pipeline_depth=P`, P steps in flight): steps in
flight hold different requests, no placeholder is ever fed, a request waits for its token, and
blocks come back once the steps reading them are updated."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from compiled_engine.core.engine_core import EngineCore
from compiled_engine.core.scheduler import Scheduler
from compiled_engine.core.scheduler_config import SchedulerConfig
from compiled_engine.records.request import RequestStatus
from compiled_engine.records.scheduler_output import PLACEHOLDER_TOKEN_ID
from tests.test_scheduler_async import make_request, run_workload, sample_all, workloads

NUM_BLOCKS = 64


def make_pipelined(depth: int = 2, **overrides: int) -> Scheduler:
    fields = dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=4, num_kv_blocks=NUM_BLOCKS
    )
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields, max_in_flight_steps=depth, pipeline_depth=depth))


def ids(out) -> list[str]:
    return [s.request_id for s in out.scheduled]


def test_steps_in_flight_take_disjoint_halves_of_the_requests_and_feed_no_placeholder():
    scheduler = make_pipelined()
    for name, length in (("a", 5), ("b", 3), ("c", 9), ("d", 1)):
        scheduler.add_request(make_request(name, prompt_len=length))
    first = scheduler.schedule()
    second = scheduler.schedule()  # the first still in flight
    assert ids(first) == ["a", "b"] and ids(second) == ["c", "d"]
    with pytest.raises(RuntimeError, match="not yet passed to update"):
        scheduler.schedule()
    scheduler.update(first, sample_all(first, token=9))
    third = scheduler.schedule()  # a and b decode with their real token; c and d wait for theirs
    assert ids(third) == ["a", "b"]
    assert [s.token_ids for s in third.scheduled] == [(9,), (9,)]
    scheduler.update(second, sample_all(second))
    fourth = scheduler.schedule()
    assert ids(fourth) == ["c", "d"]
    assert all(PLACEHOLDER_TOKEN_ID not in s.token_ids for out in (third, fourth) for s in out.scheduled)


def test_a_request_whose_token_is_in_flight_waits_but_its_next_prompt_chunk_does_not():
    scheduler = make_pipelined(max_num_batched_tokens=4, max_num_seqs=1)
    request = make_request("a", prompt_len=10)
    scheduler.add_request(request)
    chunks = [scheduler.schedule(), scheduler.schedule()]  # tokens 0-3 and 4-7: no sampling
    assert [c.scheduled[0].start_position for c in chunks] == [0, 4]
    scheduler.update(chunks[0], sample_all(chunks[0]))
    last = scheduler.schedule()  # tokens 8-9, samples the first output
    assert last.scheduled[0].sample and last.scheduled[0].start_position == 8
    scheduler.update(chunks[1], sample_all(chunks[1]))
    waiting = scheduler.schedule()
    assert waiting.is_empty and not waiting.waiting_for_in_flight  # its token is in flight
    scheduler.update(last, sample_all(last, token=5))
    assert scheduler.schedule().scheduled[0].token_ids == (5,)


def test_finishing_and_aborting_while_the_other_step_is_in_flight_leaks_no_block():
    scheduler = make_pipelined()
    a = make_request("a", prompt_len=6, max_tokens=1)
    b = make_request("b", prompt_len=7)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert ids(first) == ["a"] and ids(second) == ["b"]
    (done,) = scheduler.update(first, sample_all(first))  # a ends by length; b's step still runs
    assert done.finished and a.status == RequestStatus.FINISHED_LENGTH
    scheduler.abort_requests(["b"])  # while its step is in flight: its blocks wait for it
    b_blocks = set(second.scheduled[0].block_ids)
    assert b_blocks.isdisjoint(scheduler.kv_cache_manager.block_pool.free_block_ids)
    assert scheduler.schedule().is_empty  # nothing left to run
    assert scheduler.update(second, sample_all(second)) == []
    assert scheduler.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    # The next step tells the runner both ended (an empty schedule() in between loses neither).
    scheduler.add_request(make_request("c", prompt_len=2))
    assert set(scheduler.schedule().finished_request_ids) == {"a", "b"}


def test_bad_pipeline_depths_are_refused_by_name():
    with pytest.raises(ValueError, match="pipeline_depth must be a positive int, got 0"):
        SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=8, pipeline_depth=0
        )
    with pytest.raises(ValueError, match="max_in_flight_steps must equal pipeline_depth=2"):
        SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=16,
            max_model_len=64,
            num_kv_blocks=8,
            max_in_flight_steps=1,
            pipeline_depth=2,
        )


def test_the_pipelined_loop_and_async_scheduling_do_not_mix():
    with pytest.raises(ValueError, match="async scheduling and a pipelined scheduler"):
        EngineCore(make_pipelined(), runner=None, async_scheduling=True)  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(workloads())
def test_pipelined_scheduling_gives_the_sync_outputs_and_never_reuses_a_block_in_flight(workload):
    config, specs = workload
    sync_outputs, _ = run_workload(config, specs, in_flight=1)
    for depth in (2, 3):
        outputs, scheduler = run_workload(config, specs, in_flight=depth, pipeline_depth=depth)
        assert outputs == sync_outputs
