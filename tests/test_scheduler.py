"""Scheduler: budget split, chunked prefill, FCFS admission, preemption, stop checks, aborts,
rejection of impossible requests, and invariants over random workloads."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_engine.core.scheduler import Scheduler
from compiled_engine.core.scheduler_config import SchedulerConfig
from compiled_engine.errors import InvalidRequestError
from compiled_engine.records.engine_core_output import EngineCoreOutput
from compiled_engine.records.request import Request, RequestStatus
from compiled_engine.records.runner_output import ModelRunnerOutput
from compiled_engine.records.scheduler_output import SchedulerOutput
from compiled_engine.sampling_params import SamplingParams

NEXT_TOKEN = 7  # what the fake runner samples unless a test says otherwise


def make_scheduler(**overrides: int) -> Scheduler:
    fields = dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=4, num_kv_blocks=64
    )
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields))


def make_request(
    request_id: str, prompt_len: int, max_tokens: int = 8, eos: frozenset[int] = frozenset(), **params
) -> Request:
    prompt = [1000 + i for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=eos)


def step(
    scheduler: Scheduler, sample: Callable[[str], int] = lambda _: NEXT_TOKEN
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = scheduler.schedule()
    ids = tuple(s.request_id for s in out.scheduled if s.sample)
    outputs = scheduler.update(out, ModelRunnerOutput(ids, tuple(sample(i) for i in ids)))
    return out, outputs


def tokens_per_request(out: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: len(s.token_ids) for s in out.scheduled}


# --- the basic step ------------------------------------------------------------------------


def test_prefill_then_decode_feeds_the_sampled_token():
    scheduler = make_scheduler()
    request = make_request("a", prompt_len=10)
    scheduler.add_request(request)

    out, outputs = step(scheduler)
    (prefill,) = out.scheduled
    assert prefill.token_ids == tuple(request.prompt_token_ids)
    assert prefill.start_position == 0
    assert prefill.sample
    assert len(prefill.block_ids) == 3  # 10 tokens in blocks of 4
    assert prefill.num_output_tokens == 0
    assert out.num_batched_tokens == 10
    assert outputs == [EngineCoreOutput("a", (NEXT_TOKEN,), False, None, None)]
    assert request.num_computed_tokens == 10

    out, _ = step(scheduler)
    (decode,) = out.scheduled
    assert decode.token_ids == (NEXT_TOKEN,)
    assert decode.start_position == 10
    assert decode.sample
    assert decode.num_output_tokens == 1
    assert decode.block_ids == prefill.block_ids  # position 10 still fits block 3


def test_long_prompt_is_chunked_and_samples_only_at_the_end():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request("a", prompt_len=20)
    scheduler.add_request(request)

    chunks = []
    for _ in range(3):
        out, outputs = step(scheduler)
        (chunk,) = out.scheduled
        chunks.append(chunk)
        assert len(chunk.block_ids) * 4 >= chunk.start_position + len(chunk.token_ids)
    assert [len(c.token_ids) for c in chunks] == [8, 8, 4]
    assert [c.start_position for c in chunks] == [0, 8, 16]
    assert [c.sample for c in chunks] == [False, False, True]
    assert sum((c.token_ids for c in chunks), ()) == tuple(request.prompt_token_ids)
    assert [len(c.block_ids) for c in chunks] == [2, 4, 5]
    assert outputs[0].new_token_ids == (NEXT_TOKEN,)


def test_running_decodes_come_first_and_waiting_prefill_takes_the_rest_of_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("old", prompt_len=4))
    step(scheduler)
    scheduler.add_request(make_request("new", prompt_len=20))

    out, _ = step(scheduler)
    assert [s.request_id for s in out.scheduled] == ["old", "new"]
    assert tokens_per_request(out) == {"old": 1, "new": 7}
    assert out.num_batched_tokens == 8
    assert [s.sample for s in out.scheduled] == [True, False]


def test_a_prefilling_running_request_keeps_priority_over_waiting_ones():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", prompt_len=20))
    step(scheduler)
    scheduler.add_request(make_request("b", prompt_len=4))

    out, _ = step(scheduler)
    assert tokens_per_request(out) == {"a": 8}
    out, _ = step(scheduler)
    assert tokens_per_request(out) == {"a": 4, "b": 4}


def test_waiting_requests_are_admitted_fcfs_without_skipping():
    # 4 blocks of 4 tokens. "big" takes 3, "huge" needs 3 more (does not fit), "tiny" would fit
    # in the last block but must wait behind "huge".
    scheduler = make_scheduler(num_kv_blocks=4)
    scheduler.add_request(make_request("big", prompt_len=12, max_tokens=1))
    scheduler.add_request(make_request("huge", prompt_len=12, max_tokens=1))
    scheduler.add_request(make_request("tiny", prompt_len=2, max_tokens=1))

    out, _ = step(scheduler)
    assert tokens_per_request(out) == {"big": 12}
    assert scheduler.num_waiting == 2
    out, _ = step(scheduler)  # "big" finished last step and freed its blocks
    assert [s.request_id for s in out.scheduled] == ["huge", "tiny"]
    assert tokens_per_request(out) == {"huge": 12, "tiny": 2}
    assert out.finished_request_ids == ("big",)


def test_running_set_is_capped_by_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    for name, max_tokens in [("a", 1), ("b", 3), ("c", 3)]:
        scheduler.add_request(make_request(name, prompt_len=3, max_tokens=max_tokens))

    out, _ = step(scheduler)
    assert set(tokens_per_request(out)) == {"a", "b"}
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)  # "a" finished at once
    out, _ = step(scheduler)
    assert tokens_per_request(out) == {"b": 1, "c": 3}
    assert scheduler.num_running == 2


# --- preemption ----------------------------------------------------------------------------


def test_preemption_takes_the_newest_request_and_requeues_it_at_the_head():
    # Cache of 3 blocks of 4. Three one-block prompts fill it; on the first decode step "r0"
    # needs a second block: "r2" (newest) is preempted, then "r1" needs a block and, being the
    # newest left, preempts itself.
    scheduler = make_scheduler(num_kv_blocks=3, max_model_len=64)
    r0 = make_request("r0", prompt_len=4, max_tokens=2)
    r1 = make_request("r1", prompt_len=4, max_tokens=2)
    r2 = make_request("r2", prompt_len=4, max_tokens=2)
    for request in (r0, r1, r2):
        scheduler.add_request(request)
    step(scheduler)
    late = make_request("late", prompt_len=1, max_tokens=1)
    scheduler.add_request(late)

    out, outputs = step(scheduler, sample=lambda rid: {"r0": 21}.get(rid, NEXT_TOKEN))
    assert tokens_per_request(out) == {"r0": 1}
    assert out.preempted_request_ids == ("r2", "r1")
    for victim in (r1, r2):
        assert victim.status == RequestStatus.WAITING
        assert victim.num_computed_tokens == 0
        assert victim.num_preemptions == 1
        assert scheduler.kv_cache_manager.get_block_ids(victim.request_id) == ()
    # A step that preempted admits nothing new, even though a block is free now.
    assert late.status == RequestStatus.WAITING
    assert outputs[0].finished and r0.status == RequestStatus.FINISHED_LENGTH

    # r1 (preempted last, so at the head) comes back before r2, and "late" waits behind both.
    out, _ = step(scheduler)
    assert out.finished_request_ids == ("r0",)
    assert [s.request_id for s in out.scheduled] == ["r1"]
    (recompute,) = out.scheduled
    assert recompute.token_ids == tuple(r1.prompt_token_ids) + (NEXT_TOKEN,)
    assert recompute.start_position == 0
    assert recompute.sample
    assert recompute.num_output_tokens == 1


def test_recompute_after_preemption_is_chunked_and_samples_only_at_the_end_of_known_tokens():
    # 4 blocks of 2 tokens, budget 4. Both requests decode until r0 needs a 4th block and
    # preempts r1, which holds prompt (2) + 3 outputs by then.
    scheduler = make_scheduler(block_size=2, num_kv_blocks=4, max_num_batched_tokens=4, max_model_len=64)
    r0 = make_request("r0", prompt_len=2, max_tokens=5)
    r1 = make_request("r1", prompt_len=2, max_tokens=4)
    scheduler.add_request(r0)
    scheduler.add_request(r1)
    counter = iter(range(100, 10_000))

    def sample(_: str) -> int:
        return next(counter)

    preempted_at = None
    for step_index in range(4):
        out, _ = step(scheduler, sample)
        if out.preempted_request_ids:
            preempted_at = step_index
            assert out.preempted_request_ids == ("r1",)
    assert preempted_at == 3
    assert r1.status == RequestStatus.WAITING
    assert len(r1.output_token_ids) == 3
    known = tuple(r1.all_token_ids)

    recompute_chunks = []
    while len(recompute_chunks) < 2:
        out, _ = step(scheduler, sample)
        recompute_chunks += [s for s in out.scheduled if s.request_id == "r1"]
    first, second = recompute_chunks
    assert (first.start_position, first.token_ids, first.sample) == (0, known[:4], False)
    assert (second.start_position, second.token_ids, second.sample) == (4, known[4:], True)
    assert second.num_output_tokens == 3
    assert r0.status == RequestStatus.FINISHED_LENGTH


def test_oldest_request_always_progresses_under_pressure():
    # Cache holds exactly one request's peak; many requests compete. Everything must finish.
    scheduler = make_scheduler(block_size=2, num_kv_blocks=5, max_num_batched_tokens=3, max_model_len=64)
    requests = [make_request(f"r{i}", prompt_len=3, max_tokens=8) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        out, _ = step(scheduler)
        assert not out.is_empty
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    assert all(len(r.output_token_ids) == 8 for r in requests)
    assert sum(r.num_preemptions for r in requests) > 0
    assert scheduler.kv_cache_manager.num_free_blocks == 5


# --- stop checks ---------------------------------------------------------------------------


def run_one(request: Request, tokens: list[int], **config) -> list[EngineCoreOutput]:
    scheduler = make_scheduler(**config)
    scheduler.add_request(request)
    feed = iter(tokens)
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs += step(scheduler, lambda _: next(feed))[1]
    return outputs


def test_stop_token_finishes_with_the_token_as_stop_reason():
    request = make_request("a", prompt_len=3, max_tokens=10, stop_token_ids=(5,))
    outputs = run_one(request, [9, 5, 9])
    assert request.output_token_ids == [9, 5]
    assert outputs[-1] == EngineCoreOutput("a", (5,), True, "stop", 5)
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == 5


def test_eos_finishes_with_no_stop_reason_unless_ignored():
    request = make_request("a", prompt_len=3, max_tokens=10, eos=frozenset({2}))
    outputs = run_one(request, [9, 2, 9])
    assert outputs[-1] == EngineCoreOutput("a", (2,), True, "stop", None)
    assert request.stop_reason is None

    ignoring = make_request("b", prompt_len=3, max_tokens=3, eos=frozenset({2}), ignore_eos=True)
    outputs = run_one(ignoring, [2, 2, 2])
    assert ignoring.output_token_ids == [2, 2, 2]
    assert outputs[-1].finish_reason == "length"


def test_max_tokens_finishes_with_length():
    request = make_request("a", prompt_len=3, max_tokens=2)
    outputs = run_one(request, [4, 4, 4])
    assert [o.finished for o in outputs] == [False, True]
    assert outputs[-1].finish_reason == "length"
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_stop_token_wins_over_eos_and_length_on_the_same_token():
    request = make_request("a", prompt_len=3, max_tokens=1, eos=frozenset({5}), stop_token_ids=(5,))
    outputs = run_one(request, [5])
    assert outputs == [EngineCoreOutput("a", (5,), True, "stop", 5)]


def test_request_ending_exactly_at_max_model_len_finishes_with_length():
    request = make_request("a", prompt_len=6, max_tokens=2)
    outputs = run_one(request, [3, 3, 3], max_model_len=8)
    assert len(request.output_token_ids) == 2 and request.num_tokens == 8
    assert outputs[-1].finish_reason == "length"


def test_finished_request_frees_blocks_at_once_and_is_reported_next_step():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=5, max_tokens=1))
    out, outputs = step(scheduler)
    assert out.finished_request_ids == ()
    assert outputs[0].finished
    assert scheduler.kv_cache_manager.num_free_blocks == 64
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_request_ids == ("a",)
    assert scheduler.schedule().finished_request_ids == ()  # reported once


# --- aborts and external finishes --------------------------------------------------------


def test_abort_running_and_waiting_requests_frees_blocks_and_reports_them():
    scheduler = make_scheduler(max_num_seqs=1)
    running = make_request("run", prompt_len=6)
    waiting = make_request("wait", prompt_len=6)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 62

    scheduler.abort_requests(["run", "wait", "unknown"])
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache_manager.num_free_blocks == 64
    assert (scheduler.num_running, scheduler.num_waiting) == (0, 0)
    out = scheduler.schedule()
    assert out.is_empty
    assert set(out.finished_request_ids) == {"run", "wait"}

    scheduler.abort_requests("run")  # already finished: no-op
    assert scheduler.schedule().finished_request_ids == ()


def test_abort_while_a_step_is_in_flight_drops_its_token():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=3))
    scheduler.add_request(make_request("b", prompt_len=3))
    out = scheduler.schedule()
    scheduler.abort_requests(["a"])
    outputs = scheduler.update(out, ModelRunnerOutput(("a", "b"), (1, 2)))
    assert [o.request_id for o in outputs] == ["b"]
    assert scheduler.num_running == 1
    assert scheduler.schedule().finished_request_ids == ("a",)


def test_finish_requests_for_a_stop_string():
    scheduler = make_scheduler()
    request = make_request("a", prompt_len=3)
    scheduler.add_request(request)
    step(scheduler)
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert scheduler.kv_cache_manager.num_free_blocks == 64
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_requests(["a"], RequestStatus.RUNNING)


# --- bad input -------------------------------------------------------------------------------


def test_request_larger_than_the_whole_cache_is_rejected():
    scheduler = make_scheduler(num_kv_blocks=2, block_size=4)  # 8 tokens
    with pytest.raises(InvalidRequestError, match="whole cache holds 8"):
        scheduler.add_request(make_request("prompt", prompt_len=9, max_tokens=1))
    with pytest.raises(InvalidRequestError, match="needs up to 9 tokens"):
        scheduler.add_request(make_request("growth", prompt_len=6, max_tokens=4))
    scheduler.add_request(make_request("exact", prompt_len=6, max_tokens=3))  # peak 8 cached tokens
    assert scheduler.num_waiting == 1


def test_request_longer_than_max_model_len_is_rejected():
    scheduler = make_scheduler(max_model_len=10)
    with pytest.raises(InvalidRequestError, match="exceeds max_model_len 10"):
        scheduler.add_request(make_request("a", prompt_len=8, max_tokens=3))
    scheduler.add_request(make_request("b", prompt_len=8, max_tokens=2))


def test_empty_duplicate_and_used_requests_are_rejected():
    scheduler = make_scheduler()
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        scheduler.add_request(make_request("a", prompt_len=0))
    scheduler.add_request(make_request("b", prompt_len=2))
    with pytest.raises(InvalidRequestError, match="already queued"):
        scheduler.add_request(make_request("b", prompt_len=2))
    used = make_request("c", prompt_len=2)
    used.status = RequestStatus.RUNNING
    with pytest.raises(InvalidRequestError, match="must be new"):
        scheduler.add_request(used)
    assert scheduler.num_waiting == 1


def test_update_checks_the_runner_output_and_the_step_order():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=3))
    out = scheduler.schedule()
    with pytest.raises(RuntimeError, match="not yet passed to update"):
        scheduler.schedule()
    with pytest.raises(ValueError, match="expected \\('a',\\)"):
        scheduler.update(out, ModelRunnerOutput(("b",), (1,)))
    with pytest.raises(ValueError, match="with 2 token"):
        scheduler.update(out, ModelRunnerOutput(("a",), (1, 2)))
    scheduler.update(out, ModelRunnerOutput(("a",), (1,)))
    with pytest.raises(ValueError, match="not the oldest step in flight"):
        scheduler.update(out, ModelRunnerOutput(("a",), (1,)))


@pytest.mark.parametrize(
    "field",
    ["max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks", "max_in_flight_steps"],
)
def test_config_rejects_non_positive_limits(field):
    fields = dict(max_num_seqs=1, max_num_batched_tokens=1, max_model_len=1, num_kv_blocks=1)
    fields[field] = 0
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**fields)


# --- random workloads ------------------------------------------------------------------------

EOS, STOP = 0, 1
VOCAB = 40  # EOS and STOP are each sampled 1 time in 40


@st.composite
def workloads(draw):
    max_model_len = draw(st.integers(4, 48))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    # A cache between half and 1.5x max_model_len: tight enough to force preemption often,
    # sometimes too small for the longest requests (which must then be rejected).
    cache_tokens = draw(st.integers(max_model_len // 2, 3 * max_model_len // 2))
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.integers(1, 40)),
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=max(1, cache_tokens // block_size),
    )
    specs = []
    for _ in range(draw(st.integers(2, 10))):
        prompt_len = draw(st.integers(1, max_model_len - 1))
        specs.append(
            {
                "arrival": draw(st.integers(0, 8)),
                "prompt_len": prompt_len,
                # Up to 2 past max_model_len, so a few requests are invalid.
                "max_tokens": draw(st.integers(1, max_model_len - prompt_len + 2)),
                "use_eos": draw(st.booleans()),
                "stop": draw(st.booleans()),
                "ignore_eos": draw(st.booleans()),
            }
        )
    # (step, kind, which request): abort before scheduling, abort while the step runs,
    # or an external stop (as the engine does on a stop string).
    events = draw(
        st.lists(
            st.tuples(
                st.integers(0, 30), st.sampled_from(["abort", "abort_in_flight", "stop"]), st.integers(0, 9)
            ),
            max_size=6,
        )
    )
    return config, specs, events, draw(st.randoms(use_true_random=False))


def expected_valid(config: SchedulerConfig, prompt_len: int, max_tokens: int) -> bool:
    return prompt_len + max_tokens <= config.max_model_len and (
        prompt_len + max_tokens - 1 <= config.num_kv_blocks * config.block_size
    )


class PagedCacheModel:
    """Stands in for the runner's KV cache: every slot remembers (request, token) written into it,
    so a block handed to two requests, or reused while still owned, shows up as a wrong read."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.block_size = config.block_size
        self.slots: list[tuple[str, int] | None] = [None] * (config.num_kv_blocks * config.block_size)

    def slot(self, block_ids: tuple[int, ...], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def run(self, scheduled, request: Request) -> None:
        known = request.all_token_ids
        for position in range(scheduled.start_position):  # the context attention would read
            assert self.slots[self.slot(scheduled.block_ids, position)] == (
                request.request_id,
                known[position],
            )
        for offset, token in enumerate(scheduled.token_ids):
            self.slots[self.slot(scheduled.block_ids, scheduled.start_position + offset)] = (
                request.request_id,
                token,
            )


def check_invariants(scheduler: Scheduler, out: SchedulerOutput, live: dict[str, Request]) -> None:
    config = scheduler.config
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    assert (
        out.num_batched_tokens
        == sum(len(s.token_ids) for s in out.scheduled)
        <= config.max_num_batched_tokens
    )
    assert len(out.scheduled) <= config.max_num_seqs
    assert scheduler.num_running <= config.max_num_seqs
    assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)

    owner: dict[int, str] = {}
    for request_id, request in live.items():
        blocks = kv.get_block_ids(request_id)
        if request.status != RequestStatus.RUNNING:
            assert blocks == (), f"{request.status} request {request_id} still owns blocks"
        for block_id in blocks:
            assert block_id not in owner, f"block {block_id} owned by {owner[block_id]} and {request_id}"
            owner[block_id] = request_id
            assert pool.ref_count(block_id) == 1
    free = pool.free_block_ids
    assert len(set(free)) == len(free)
    assert set(free).isdisjoint(owner) and len(free) + len(owner) == config.num_kv_blocks

    for scheduled in out.scheduled:
        request = live[scheduled.request_id]
        end = scheduled.start_position + len(scheduled.token_ids)
        assert len(scheduled.token_ids) >= 1
        assert scheduled.start_position == request.num_computed_tokens
        assert scheduled.token_ids == tuple(request.all_token_ids[scheduled.start_position : end])
        assert scheduled.sample == (end == request.num_tokens)
        assert scheduled.block_ids == kv.get_block_ids(scheduled.request_id)
        assert len(scheduled.block_ids) * config.block_size >= end
        assert scheduled.num_output_tokens == len(request.output_token_ids)
    for request_id in out.preempted_request_ids:
        request = live[request_id]
        assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
        assert request_id not in {s.request_id for s in out.scheduled}


def check_finished_request(request: Request, use_eos: bool) -> None:
    params = request.sampling_params
    outputs = request.output_token_ids
    assert len(outputs) <= params.max_tokens

    def stops(token: int) -> bool:
        return (token == STOP and params.stop_token_ids is not None) or (
            token == EOS and use_eos and not params.ignore_eos
        )

    if request.status == RequestStatus.FINISHED_ABORTED:
        assert not any(stops(t) for t in outputs)
        return
    if request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == "external":
        return
    assert not any(stops(t) for t in outputs[:-1]), "a stop token was missed"
    if request.status == RequestStatus.FINISHED_LENGTH:
        assert not stops(outputs[-1])
        assert len(outputs) == params.max_tokens
    else:
        assert request.status == RequestStatus.FINISHED_STOPPED and stops(outputs[-1])
        assert request.stop_reason == (STOP if outputs[-1] == STOP and params.stop_token_ids else None)


@settings(max_examples=100, deadline=None)
@given(workloads())
def test_random_workloads_keep_invariants_and_finish(workload):
    config, specs, events, rng = workload
    scheduler = Scheduler(config)
    cache = PagedCacheModel(config)
    live: dict[str, Request] = {}  # every accepted request, finished or not
    use_eos: dict[str, bool] = {}
    reported_finished: list[str] = []
    names = [f"req{i}" for i in range(len(specs))]

    def runner_sample(request_id: str) -> int:
        return rng.randrange(VOCAB)

    for step_index in range(5000):
        for name, spec in zip(names, specs, strict=True):
            if spec["arrival"] == step_index:
                request = Request(
                    name,
                    [rng.randrange(VOCAB) for _ in range(spec["prompt_len"])],
                    SamplingParams(
                        max_tokens=spec["max_tokens"],
                        stop_token_ids=(STOP,) if spec["stop"] else None,
                        ignore_eos=spec["ignore_eos"],
                    ),
                    eos_token_ids=frozenset({EOS}) if spec["use_eos"] else frozenset(),
                )
                if expected_valid(config, spec["prompt_len"], spec["max_tokens"]):
                    scheduler.add_request(request)
                    live[name] = request
                    use_eos[name] = spec["use_eos"]
                else:
                    with pytest.raises(InvalidRequestError):
                        scheduler.add_request(request)
        step_events = [(kind, names[i % len(names)]) for s, kind, i in events if s == step_index]
        for kind, name in step_events:
            if kind == "abort":
                scheduler.abort_requests([name])
            elif kind == "stop" and name in live and not live[name].status.finished:
                live[name].stop_reason = "external"
                scheduler.finish_requests([name], RequestStatus.FINISHED_STOPPED)

        out = scheduler.schedule()
        reported_finished += out.finished_request_ids
        check_invariants(scheduler, out, live)
        if scheduler.has_unfinished_requests():
            assert not out.is_empty, "no progress although requests are unfinished"
        for scheduled in out.scheduled:
            cache.run(scheduled, live[scheduled.request_id])
        for kind, name in step_events:
            if kind == "abort_in_flight":
                scheduler.abort_requests([name])
        sampling_ids = tuple(s.request_id for s in out.scheduled if s.sample)
        outputs = scheduler.update(
            out, ModelRunnerOutput(sampling_ids, tuple(runner_sample(i) for i in sampling_ids))
        )
        for output in outputs:
            request = live[output.request_id]
            assert output.new_token_ids == (request.output_token_ids[-1],)
            assert output.finished == request.status.finished
            assert output.finish_reason == request.status.finish_reason

        all_arrived = step_index >= max(spec["arrival"] for spec in specs)
        if all_arrived and not scheduler.has_unfinished_requests():
            break
    else:
        pytest.fail("workload did not finish within 5000 steps")

    reported_finished += scheduler.schedule().finished_request_ids
    assert sorted(reported_finished) == sorted(live), "each request is reported finished exactly once"
    assert scheduler.kv_cache_manager.num_free_blocks == config.num_kv_blocks
    assert (scheduler.num_running, scheduler.num_waiting) == (0, 0)
    for name, request in live.items():
        assert request.status.finished
        check_finished_request(request, use_eos[name])


# --- the long-prefill threshold ------------------------------------------------------------


def test_a_long_prefill_threshold_caps_each_prompt_chunk_beside_decodes():
    scheduler = make_scheduler(long_prefill_token_threshold=8)
    scheduler.add_request(make_request("decoding", prompt_len=5))
    out, _ = step(scheduler)
    assert tokens_per_request(out) == {"decoding": 5}  # under the cap: one chunk
    scheduler.add_request(make_request("long", prompt_len=30))
    chunks = []
    while True:
        out, _ = step(scheduler)
        counts = tokens_per_request(out)
        assert counts["decoding"] == 1  # the running request decodes in every step
        chunks.append(counts["long"])
        if sum(chunks) == 30:
            break
    assert chunks == [8, 8, 8, 6]  # the step budget (64) would have taken it at once
    out, _ = step(scheduler)
    assert tokens_per_request(out) == {"decoding": 1, "long": 1}  # it samples once its prompt is in


def test_a_long_prefill_threshold_caps_the_prompts_of_a_whole_step_while_one_decodes():
    scheduler = make_scheduler(long_prefill_token_threshold=8)
    scheduler.add_request(make_request("decoding", prompt_len=5))
    step(scheduler)
    for name in ("a", "b"):
        scheduler.add_request(make_request(name, prompt_len=12))
    steps = []
    while True:
        counts = tokens_per_request(step(scheduler)[0])
        assert counts.pop("decoding") == 1
        steps.append(counts)
        if sum(c for s in steps for c in s.values()) >= 24:
            break
    # Together, not 8 each: the decoding request waits for at most 8 prompt tokens per step.
    assert steps == [{"a": 8}, {"a": 4, "b": 4}, {"a": 1, "b": 8}]
    # With nothing decoding, each prompt may take the threshold in the same step.
    idle = make_scheduler(long_prefill_token_threshold=8)
    for name in ("c", "d"):
        idle.add_request(make_request(name, prompt_len=12))
    assert tokens_per_request(step(idle)[0]) == {"c": 8, "d": 8}


def test_with_buckets_the_threshold_fills_a_decoding_step_to_the_bucket_below():
    # Threshold 16, buckets (1, 2, 4, 8, 16, 24): 3 decodes + 16 prompt tokens would be 19, padded
    # to 24; the step takes 13 and runs at 16. 9 decodes: 9 + 15 = 24 (the bucket within 25).
    for decoding, chunk in ((3, 13), (9, 15)):
        scheduler = make_scheduler(
            long_prefill_token_threshold=16,
            step_token_buckets=(1, 2, 4, 8, 16, 24),
            max_num_seqs=16,
            num_kv_blocks=256,
        )
        for i in range(decoding):
            scheduler.add_request(make_request(f"d{i}", prompt_len=2, max_tokens=50))
        step(scheduler)
        scheduler.add_request(make_request("long", prompt_len=40))
        counts = tokens_per_request(step(scheduler)[0])
        assert counts.pop("long") == chunk
        assert counts == {f"d{i}": 1 for i in range(decoding)}
    # Without buckets the threshold itself.
    scheduler = make_scheduler(long_prefill_token_threshold=16, num_kv_blocks=256)
    for i in range(3):
        scheduler.add_request(make_request(f"d{i}", prompt_len=2, max_tokens=50))
    step(scheduler)
    scheduler.add_request(make_request("long", prompt_len=40))
    assert tokens_per_request(step(scheduler)[0])["long"] == 16


def test_with_buckets_the_threshold_is_kept_where_the_bucket_below_leaves_under_half():
    # 7 decodes + 16 = 23: the bucket below (16) would leave 9 >= 8; 6 decodes with buckets
    # (1, 8, 32): the bucket below 22 is 8, leaving 2 < 8, so the threshold itself (16) stands.
    scheduler = make_scheduler(
        long_prefill_token_threshold=16, step_token_buckets=(1, 8, 32), num_kv_blocks=256
    )
    for i in range(6):
        scheduler.add_request(make_request(f"d{i}", prompt_len=1, max_tokens=50))
    step(scheduler)
    scheduler.add_request(make_request("long", prompt_len=40))
    assert tokens_per_request(step(scheduler)[0])["long"] == 16


@pytest.mark.parametrize("buckets", [[1, 2], (2, 1), (1, 1), (0, 4), (1, True)])
def test_bad_step_token_buckets_are_refused(buckets):
    with pytest.raises(ValueError, match="step_token_buckets must be a tuple of ascending distinct ints"):
        make_scheduler(step_token_buckets=buckets)


def test_no_threshold_takes_a_prompt_up_to_the_budget():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("long", prompt_len=30))
    out, _ = step(scheduler)
    assert tokens_per_request(out) == {"long": 30}


@pytest.mark.parametrize("value", [-1, 2.5, True])
def test_a_bad_long_prefill_threshold_is_refused(value):
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an int >= 0"):
        make_scheduler(long_prefill_token_threshold=value)


def test_preemptions_of_a_step_that_scheduled_nothing_reach_the_next_step():
    # The engine runs no step for an empty output, so the runner (its persistent batch) learns of
    # a preemption only from a step that runs: a victim's row must not keep its old block table.
    scheduler = make_scheduler(num_kv_blocks=4)
    scheduler.add_request(make_request("a", prompt_len=4, max_tokens=4))
    step(scheduler)  # its first block is full: the next token needs a second one
    pool = scheduler.kv_cache_manager.block_pool
    held = pool.allocate(pool.num_free_blocks)  # none left: "a" can only preempt itself
    empty = scheduler.schedule()
    assert empty.is_empty and empty.preempted_request_ids == ("a",)
    pool.free(held)
    out, _ = step(scheduler)
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert out.preempted_request_ids == ("a",)  # applied before the step's own rows
    out, _ = step(scheduler)
    assert out.preempted_request_ids == ()


# --- the decode fast path -------------------------------------------------------------------------


@pytest.mark.parametrize("in_flight", [1, 2])
def test_a_decode_is_scheduled_as_the_general_path_schedules_it(in_flight):
    """The decode row `schedule()` builds in place (field by field, every decoding request every
    step) equals `_scheduled_request(request, 1)`, synchronously (the newest known token) and with
    a step in flight (a placeholder), from the prompt's first sampled token on."""
    scheduler = make_scheduler(max_in_flight_steps=in_flight, enable_prefix_caching=True)
    request = make_request("a", prompt_len=6, max_tokens=12)
    scheduler.add_request(request)
    steps = [scheduler.schedule()]  # the prompt
    for _ in range(8):
        if in_flight == 1 or len(steps) == 2:
            out = steps.pop(0)
            ids = tuple(s.request_id for s in out.scheduled if s.sample)
            scheduler.update(out, ModelRunnerOutput(ids, (NEXT_TOKEN,) * len(ids)))
        start = request.num_computed_tokens + request.num_in_flight_tokens
        pending = request.num_pending_outputs
        assert request.history.num_tokens + pending - start == 1  # decoding
        general = scheduler._scheduled_request(request, 1)
        in_flight_before = request.num_in_flight_tokens
        steps.append(scheduler.schedule())
        (fast,) = steps[-1].scheduled
        assert type(fast) is type(general)
        # With the block its allocation may have added (the general path reads the list as is).
        blocks = scheduler._kv_cache_manager.get_block_ids("a")
        assert fast == general._replace(block_ids=blocks)
        assert request.num_in_flight_tokens == in_flight_before + 1
        assert request.num_pending_outputs == pending + 1


def test_decodes_after_a_prompt_chunk_are_scheduled_by_the_general_loop_alike():
    """The decode loop stops at the first running request that is not a plain decode (here a
    prompt still in chunks); the general loop schedules the rest, decodes included, with the same
    rows, and the update of that mixed step (the general update) emits the decodes' tokens."""
    scheduler = make_scheduler(long_prefill_token_threshold=8)
    for request_id, prompt_len in (("a", 4), ("b", 40), ("c", 4)):
        scheduler.add_request(make_request(request_id, prompt_len=prompt_len, max_tokens=20))
    step(scheduler)  # a and c's prompts, b's first 8 tokens
    out, outputs = step(scheduler)
    rows = {row.request_id: row for row in out.scheduled}
    assert [row.request_id for row in out.scheduled] == ["a", "b", "c"]
    for request_id in "ac":  # decodes, before and after the chunk
        row = rows[request_id]
        assert (row.token_ids, row.start_position, row.sample, row.num_output_tokens) == (
            (NEXT_TOKEN,),
            4,
            True,
            1,
        )
        assert row.block_ids == scheduler.kv_cache_manager.get_block_ids(request_id)
    assert (len(rows["b"].token_ids), rows["b"].start_position, rows["b"].sample) == (8, 8, False)
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", (NEXT_TOKEN,)), ("c", (NEXT_TOKEN,))]
    while rows["b"].start_position + len(rows["b"].token_ids) < 40:
        out, outputs = step(scheduler)
        rows = {row.request_id: row for row in out.scheduled}
    out, outputs = step(scheduler)  # every row a decode now: the decode loop and update's own loop
    assert all(row.sample and len(row.token_ids) == 1 for row in out.scheduled)
    assert [o.request_id for o in outputs] == ["a", "b", "c"]
    assert [r.num_in_flight_tokens + r.num_pending_outputs for r in scheduler._running] == [0, 0, 0]


def test_stopping_tokens_and_length_limit_end_requests_as_the_full_check_does():
    """The update's quick test (request.stopping_token_ids, request.max_num_tokens) before the
    full stop check: a stop token, EOS (not when ignored) and max_tokens each still end it."""
    for params, eos, token, reason in (
        ({"stop_token_ids": [5]}, frozenset(), 5, "stop"),
        ({}, frozenset({9}), 9, "stop"),
        ({"ignore_eos": True}, frozenset({9}), 9, "length"),
        ({}, frozenset(), NEXT_TOKEN, "length"),
    ):
        scheduler = make_scheduler()
        request = make_request("a", prompt_len=5, max_tokens=3, eos=eos, **params)
        scheduler.add_request(request)
        outputs = [out for _ in range(3) for out in step(scheduler, lambda _, t=token: t)[1]]
        if reason == "stop":
            assert outputs[0].finished and outputs[0].finish_reason == "stop"
        else:
            assert [o.finished for o in outputs] == [False, False, True]
            assert outputs[-1].finish_reason == "length"
        assert not scheduler.has_unfinished_requests()
