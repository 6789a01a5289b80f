"""Automatic prefix caching at unit level: chained block keys, the pool's LRU of cached free blocks,
the scheduler's hits (last token always computed, same-step sharing, preemption), and random
workloads whose outputs must not depend on caching or on the async loop."""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_engine.core.block_pool import BlockPool
from compiled_engine.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from compiled_engine.core.scheduler import Scheduler
from compiled_engine.core.scheduler_config import SchedulerConfig
from compiled_engine.errors import InvalidRequestError
from compiled_engine.records.request import Request, RequestStatus
from compiled_engine.records.runner_output import ModelRunnerOutput
from compiled_engine.records.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from compiled_engine.sampling_params import SamplingParams

VOCAB, EOS, STOP = 50, 2, 3


def make_scheduler(in_flight: int = 1, caching: bool = True, **overrides: int) -> Scheduler:
    fields = dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=4, num_kv_blocks=64
    )
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields, max_in_flight_steps=in_flight, enable_prefix_caching=caching))


def make_request(request_id: str, prompt: list[int], max_tokens: int = 4, salt: str | None = None) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens), cache_salt=salt)


def sample_all(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    ids = tuple(s.request_id for s in out.scheduled if s.sample)
    return ModelRunnerOutput(ids, (token,) * len(ids))


def step(scheduler: Scheduler) -> SchedulerOutput:
    out = scheduler.schedule()
    scheduler.update(out, sample_all(out))
    return out


def run_to_completion(scheduler: Scheduler) -> None:
    for _ in range(1000):
        if not scheduler.has_unfinished_requests():
            return
        step(scheduler)
    pytest.fail("requests did not finish")


def scheduled_of(out: SchedulerOutput, request_id: str):
    (found,) = [s for s in out.scheduled if s.request_id == request_id]
    return found


PROMPT = list(range(100, 112))  # 3 full blocks of 4


# --- chained block keys ----------------------------------------------------------------------


def test_block_keys_chain_the_parent_and_cover_extra_keys():
    same_tokens = (5, 6, 7, 8)
    root = hash_block_tokens(None, (1, 2, 3, 4))
    other_root = hash_block_tokens(None, (1, 2, 3, 9))
    assert hash_block_tokens(root, same_tokens) != hash_block_tokens(other_root, same_tokens)
    assert hash_block_tokens(root, same_tokens) == hash_block_tokens(root, same_tokens)
    assert len(root) == 32
    assert hash_block_tokens(None, (1, 2, 3, 4), ("salt",)) != root
    assert hash_block_tokens(None, (1, 2, 3, 4), ("a",)) != hash_block_tokens(None, (1, 2, 3, 4), ("b",))
    # The encoding is unambiguous: an empty salt is not "no salt", and ids do not run together.
    assert hash_block_tokens(None, (1, 2, 3, 4), ("",)) != root
    assert hash_block_tokens(None, (1, 23)) != hash_block_tokens(None, (12, 3))
    assert hash_block_tokens(None, (256,)) != hash_block_tokens(None, (1, 0))


def test_request_keys_cover_full_known_blocks_and_depend_on_everything_before():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_request("a", [1, 2, 3, 4, 9, 9, 9, 9, 5])
    b = make_request("b", [0, 2, 3, 4, 9, 9, 9, 9])
    salted = make_request("s", [1, 2, 3, 4, 9, 9, 9, 9], salt="tenant-1")
    a_keys, b_keys, salted_keys = (list(kv.block_hashes(r)) for r in (a, b, salted))
    assert len(a_keys) == 2  # the 9th token is a partial block: no key
    assert a_keys[1] != b_keys[1]  # same tokens, different parent
    assert salted_keys[0] != a_keys[0] and salted_keys[1] != a_keys[1]  # the salt reaches every block
    for token_id in (1, 1, 1):  # generated tokens fill the third block
        a.history.append(token_id)
    assert len(kv.block_hashes(a)) == 3 and kv.block_hashes(a)[:2] == a_keys


# --- the block pool ------------------------------------------------------------------------


def test_a_hit_raises_the_refcount_and_takes_a_free_block_back_out_of_the_queue():
    pool = BlockPool(4)
    block, other = pool.allocate(2)
    assert pool.cache_block(block, b"k" * 32)
    pool.take([block])  # a second request shares it
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.ref_count(block) == 1 and block not in pool.free_block_ids
    pool.free([block])
    # Free, still cached: counted free and evictable, still found by its key.
    assert pool.free_block_ids[-1] == block
    assert pool.cached_block(b"k" * 32) == block and pool.block_hash(block) == b"k" * 32
    assert (pool.num_free_blocks, pool.num_cached_blocks, pool.num_evictable_blocks) == (3, 1, 1)
    pool.take([block])  # hit again: back out of the free queue, refcount 1
    assert pool.ref_count(block) == 1 and block not in pool.free_block_ids
    assert (pool.num_free_blocks, pool.num_evictable_blocks) == (2, 0)
    pool.free([block, other])
    assert pool.free_block_ids[-2:] == (block, other)


def test_eviction_takes_the_least_recently_freed_block_and_forgets_its_key():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for index, block in enumerate(blocks):
        pool.cache_block(block, bytes([index]) * 32)
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    assert pool.num_evictable_blocks == 3
    (evicted,) = pool.allocate(1)
    assert evicted == blocks[1]  # freed first, evicted first
    assert pool.cached_block(bytes([1]) * 32) is None and pool.block_hash(evicted) is None
    assert pool.cached_block(bytes([0]) * 32) == blocks[0]  # the others survive
    assert (pool.num_cached_blocks, pool.num_evictable_blocks) == (2, 2)
    assert pool.allocate(1) == [blocks[0]]


def test_a_block_in_use_is_never_evicted_and_a_key_has_one_block():
    pool = BlockPool(3)
    first, second = pool.allocate(2)
    assert pool.cache_block(first, b"a" * 32)
    assert not pool.cache_block(second, b"a" * 32)  # same content twice: the copy stays uncached
    assert pool.block_hash(second) is None
    pool.free([second])
    assert pool.allocate(2) == [2, second]  # the cached block in use is never handed out
    assert pool.cached_block(b"a" * 32) == first
    with pytest.raises(ValueError, match="not in the prefix cache"):
        pool.take([second])
    pool.free([2])
    with pytest.raises(ValueError, match="it is free"):
        pool.cache_block(2, b"b" * 32)


# --- the scheduler ------------------------------------------------------------------------


def test_a_fully_cached_prompt_still_computes_its_last_token():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("first", PROMPT, max_tokens=1))
    run_to_completion(scheduler)
    second = make_request("second", PROMPT, max_tokens=1)
    scheduler.add_request(second)
    out = scheduler.schedule()
    chunk = scheduled_of(out, "second")
    # Blocks 0 and 1 come from the cache; block 2 holds the last prompt token and is recomputed.
    assert (chunk.start_position, chunk.token_ids, chunk.sample) == (8, tuple(PROMPT[8:]), True)
    assert scheduler.num_prefix_cache_hits == 8 and scheduler.num_prefix_cache_queries == 24
    # One token past the cached blocks: only that token is computed.
    scheduler.update(out, sample_all(out))
    third = make_request("third", PROMPT + [1], max_tokens=1)
    scheduler.add_request(third)
    assert scheduled_of(scheduler.schedule(), "third").token_ids == (1,)


def test_hits_share_blocks_by_reference_and_free_them_back_as_evictable():
    scheduler = make_scheduler()
    pool = scheduler.kv_cache_manager.block_pool
    scheduler.add_request(make_request("a", PROMPT + [1], max_tokens=4))
    step(scheduler)
    scheduler.add_request(make_request("b", PROMPT + [2], max_tokens=1))
    out = step(scheduler)
    a_blocks = scheduler.kv_cache_manager.get_block_ids("a")
    b_chunk = scheduled_of(out, "b")
    assert b_chunk.block_ids[:3] == a_blocks[:3] and b_chunk.block_ids[3] != a_blocks[3]
    assert b_chunk.start_position == 12
    assert [pool.ref_count(b) for b in a_blocks[:3]] == [1, 1, 1]  # b already finished (max_tokens=1)
    run_to_completion(scheduler)
    assert pool.num_free_blocks == 64
    # a's 3 prompt blocks and its 4th, full of prompt and output tokens computed (its last output
    # is never fed back); b's 4th block is partial.
    assert pool.num_cached_blocks == pool.num_evictable_blocks == 4


def test_salted_requests_share_only_with_the_same_salt():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("plain", PROMPT, max_tokens=1))
    run_to_completion(scheduler)
    for request_id, salt, expected_start in [("salted", "x", 0), ("same-salt", "x", 8), ("other", "y", 0)]:
        scheduler.add_request(make_request(request_id, PROMPT, max_tokens=1, salt=salt))
        out = step(scheduler)
        assert scheduled_of(out, request_id).start_position == expected_start, request_id
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        scheduler.add_request(make_request("bad", PROMPT, salt=3))  # type: ignore[arg-type]


def test_two_requests_with_one_prompt_added_together_share_it_from_the_next_step():
    # The n samples of one prompt arrive together: the second waits one step for the first
    # to compute the prompt's blocks, then takes them instead of computing them again.
    scheduler = make_scheduler()
    scheduler.add_request(make_request("0", PROMPT + [5], max_tokens=2))
    scheduler.add_request(make_request("1", PROMPT + [5], max_tokens=2))
    first = step(scheduler)
    assert [s.request_id for s in first.scheduled] == ["0"]
    second = step(scheduler)
    assert scheduled_of(second, "1").start_position == 12
    assert scheduled_of(second, "1").block_ids[:3] == scheduled_of(first, "0").block_ids[:3]
    assert scheduler.num_prefix_cache_hits == 12


def test_with_two_steps_in_flight_sharing_waits_for_the_update_of_the_computing_step():
    scheduler = make_scheduler(in_flight=2)
    scheduler.add_request(make_request("0", PROMPT + [5], max_tokens=3))
    first = scheduler.schedule()
    scheduler.add_request(make_request("1", PROMPT + [5], max_tokens=3))
    second = scheduler.schedule()  # "0"'s blocks are still being computed by step 1
    assert [s.request_id for s in second.scheduled] == ["0"]
    assert scheduler.kv_cache_manager.block_pool.num_cached_blocks == 0
    scheduler.update(first, sample_all(first))  # registers "0"'s three prompt blocks
    assert scheduler.kv_cache_manager.block_pool.num_cached_blocks == 3
    third = scheduler.schedule()
    assert scheduled_of(third, "1").start_position == 12
    # A block that ends on the placeholder is not registered before its step is updated.
    assert scheduled_of(third, "0").token_ids == (PLACEHOLDER_TOKEN_ID,)


def test_without_prefix_caching_nothing_is_shared_or_waited_for():
    scheduler = make_scheduler(caching=False)
    scheduler.add_request(make_request("0", PROMPT, max_tokens=1))
    scheduler.add_request(make_request("1", PROMPT, max_tokens=1))
    out = step(scheduler)
    assert [s.start_position for s in out.scheduled] == [0, 0]
    run_to_completion(scheduler)
    scheduler.add_request(make_request("2", PROMPT, max_tokens=1))
    assert step(scheduler).scheduled[0].start_position == 0
    pool = scheduler.kv_cache_manager.block_pool
    assert (pool.num_cached_blocks, scheduler.num_prefix_cache_queries) == (0, 0)


def test_a_preempted_request_recomputes_from_its_own_cached_blocks():
    # 4 blocks of 4: "old" and "new" take 2 each; "old"'s first decode needs a fifth block.
    scheduler = make_scheduler(num_kv_blocks=4, max_model_len=16)
    old = make_request("old", list(range(100, 108)), max_tokens=4)
    new = make_request("new", list(range(200, 207)), max_tokens=4)
    scheduler.add_request(old)
    scheduler.add_request(new)
    step(scheduler)
    out = step(scheduler)
    assert out.preempted_request_ids == ("new",)
    while old.status == RequestStatus.RUNNING:
        step(scheduler)
    known = tuple(new.all_token_ids)
    out = step(scheduler)
    # "new"'s first block (full, computed) survived in the free queue: the recompute starts after it.
    chunk = scheduled_of(out, "new")
    assert (chunk.start_position, chunk.token_ids, chunk.sample) == (4, known[4:], True)


def test_admission_counts_evictable_blocks_as_free():
    scheduler = make_scheduler(num_kv_blocks=4)
    scheduler.add_request(make_request("a", list(range(100, 116)), max_tokens=1))  # all 4 blocks
    run_to_completion(scheduler)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_evictable_blocks == 4 and pool.num_free_blocks == 4
    scheduler.add_request(make_request("b", list(range(200, 216)), max_tokens=1))
    assert scheduled_of(step(scheduler), "b").start_position == 0  # evicts all four
    probe = make_request("probe", list(range(100, 116)))
    assert all(pool.cached_block(h) is None for h in scheduler.kv_cache_manager.block_hashes(probe))
    assert pool.num_cached_blocks == 4  # b's blocks


def test_a_shared_512_token_prefix_is_computed_once_for_32_requests():
    block_size, prefix_len, num_requests = 16, 512, 32
    scheduler = make_scheduler(
        block_size=block_size, num_kv_blocks=32 * 4 + 64, max_num_seqs=32, max_num_batched_tokens=2048,
        max_model_len=1024,
    )  # fmt: skip
    rng = random.Random(0)
    prefix = [rng.randrange(3, 4000) for _ in range(prefix_len)]
    requests = [
        make_request(str(i), prefix + [rng.randrange(3, 4000) for _ in range(rng.randint(1, 40))])
        for i in range(num_requests)
    ]
    for request in requests:  # all at once: the first computes the prefix, the others wait a step
        scheduler.add_request(request)
    hit_blocks: dict[str, int] = {}
    computed_tokens = 0
    while scheduler.has_unfinished_requests():
        out = step(scheduler)
        for s in out.scheduled:
            hit_blocks.setdefault(s.request_id, s.start_position // block_size)
            computed_tokens += len(s.token_ids)
    full_prefix_blocks = prefix_len // block_size
    later = [hit_blocks[r.request_id] for r in requests[1:]]
    assert sum(later) >= 0.9 * full_prefix_blocks * (num_requests - 1)
    assert all(hits == full_prefix_blocks for hits in later)
    assert hit_blocks["0"] == 0
    # The prefix was computed once, not 32 times.
    assert computed_tokens < prefix_len + sum(r.num_tokens - prefix_len for r in requests)
    assert scheduler.num_prefix_cache_hits == full_prefix_blocks * block_size * (num_requests - 1)


# --- random workloads --------------------------------------------------------------------------


def token_for(request_id: str, num_outputs: int) -> int:
    """The fake model: the next token depends only on the request and how far it has got."""
    return random.Random(f"{request_id}/{num_outputs}").randrange(VOCAB)


class FakeDevice:
    """Runs steps in order. Each slot holds the token prefix its k/v stands for (k/v at position p is
    a function of tokens 0..p) with the writer's cache salt, and the step that wrote it. Every
    context read is checked against the reader's own tokens and salt, and a read of another
    request's write must come from a step already updated: a block is shared only once computed."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.block_size = config.block_size
        # slot -> ((salt, token prefix), writer, step that wrote it)
        self.slots: dict[int, tuple[tuple, str, int]] = {}
        self.tokens: dict[str, list[int]] = {}  # prompt + every token sampled, device side
        self.last_samples: dict[str, int] = {}
        self.num_steps_run = 0
        self.num_steps_updated = 0

    def slot(self, block_ids: tuple[int, ...], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def run(self, out: SchedulerOutput, requests: dict[str, Request]) -> ModelRunnerOutput:
        samples: dict[str, int] = {}
        for s in out.scheduled:
            assert s.token_ids, "a scheduled request computes at least one token"
            known = self.tokens.setdefault(s.request_id, list(requests[s.request_id].prompt_token_ids))
            salt = requests[s.request_id].cache_salt
            tokens = list(s.token_ids)
            if PLACEHOLDER_TOKEN_ID in tokens:
                assert tokens.index(PLACEHOLDER_TOKEN_ID) == len(tokens) - 1, "placeholder not last"
                tokens[-1] = self.last_samples[s.request_id]
            for position in range(s.start_position):
                content, writer, step_index = self.slots[self.slot(s.block_ids, position)]
                assert content == (salt, tuple(known[: position + 1])), "context holds another prefix"
                if writer != s.request_id:
                    assert step_index < self.num_steps_updated, "read a block before it was computed"
            for offset, token in enumerate(tokens):
                position = s.start_position + offset
                assert position >= len(known) or known[position] == token
                if position == len(known):
                    known.append(token)
                content = (salt, tuple(known[: position + 1]))
                self.slots[self.slot(s.block_ids, position)] = (content, s.request_id, self.num_steps_run)
            if s.sample:
                samples[s.request_id] = token_for(s.request_id, s.num_output_tokens)
                known.append(samples[s.request_id])
        self.last_samples = samples
        self.num_steps_run += 1
        return ModelRunnerOutput(tuple(samples), tuple(samples.values()))


def block_roles(out: SchedulerOutput, block_size: int) -> list[tuple[int, str, bool]]:
    """(block, request, written this step) for every block a step touches."""
    roles = []
    for s in out.scheduled:
        end = s.start_position + len(s.token_ids)
        for index, block in enumerate(s.block_ids):
            written = index * block_size < end and (index + 1) * block_size > s.start_position
            roles.append((block, s.request_id, written))
    return roles


def check_pool(scheduler: Scheduler, live: dict[str, Request], deferred: list[int]) -> None:
    """Refcounts = holders (requests' lists + blocks deferred until a step in flight is updated);
    the free queue holds exactly the unheld blocks; the cache index and the blocks agree."""
    kv, pool = scheduler.kv_cache_manager, scheduler.kv_cache_manager.block_pool
    holders = Counter(deferred)
    for request_id, request in live.items():
        blocks = kv.get_block_ids(request_id)
        if request.status != RequestStatus.RUNNING:
            assert blocks == ()
        holders.update(blocks)
        assert len(set(blocks)) == len(blocks)
    free = set(pool.free_block_ids)
    evictable = 0
    for block in range(pool.num_blocks):
        assert pool.ref_count(block) == holders[block], f"block {block} refcount"
        assert (block in free) == (holders[block] == 0)
        block_hash = pool.block_hash(block)
        if block_hash is not None:
            assert pool.cached_block(block_hash) == block
            evictable += block in free
    assert pool.num_evictable_blocks == evictable


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    config = dict(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(4, 40)),
        block_size=block_size,
        # From a cache one long request fills (eviction, preemption) to one that holds them all.
        num_kv_blocks=draw(st.integers(16 // block_size, 96 // block_size)),
        max_model_len=48,
    )
    # Prompts start with one of a few shared prefixes, so requests hit each other's blocks.
    prefixes = [[draw(st.integers(10, 13)) for _ in range(draw(st.integers(1, 16)))] for _ in range(3)]
    specs = []
    for _ in range(draw(st.integers(2, 12))):
        suffix = [draw(st.integers(10, 13)) for _ in range(draw(st.integers(0, 8)))]
        specs.append(
            dict(
                arrival=draw(st.integers(0, 8)),
                prompt=prefixes[draw(st.integers(0, 2))] + suffix,
                max_tokens=draw(st.integers(1, 16)),
                stop=draw(st.booleans()),
                salt=draw(st.sampled_from([None, None, None, "a"])),
                abort_after=draw(st.one_of(st.none(), st.integers(0, 6))),
            )
        )
    return config, specs


def run_workload(config: dict, specs: list[dict], in_flight: int, caching: bool) -> tuple[dict, Scheduler]:
    scheduler_config = SchedulerConfig(**config, max_in_flight_steps=in_flight, enable_prefix_caching=caching)
    scheduler = Scheduler(scheduler_config)
    device = FakeDevice(scheduler_config)
    live: dict[str, Request] = {}
    produced: dict[str, list[int]] = {}
    # (step, runner output, the blocks it touches)
    pending: deque[tuple[SchedulerOutput, ModelRunnerOutput, list]] = deque()
    pool = scheduler.kv_cache_manager.block_pool
    block_size = config["block_size"]

    def deferred_blocks() -> list[int]:
        return [b for step in scheduler._in_flight for b in step.deferred_blocks]

    def collect_oldest() -> None:
        out, result, _ = pending.popleft()
        device.num_steps_updated += 1
        for output in scheduler.update(out, result):
            produced[output.request_id].extend(output.new_token_ids)
            spec = specs[int(output.request_id)]
            if spec["abort_after"] is not None and len(produced[output.request_id]) >= spec["abort_after"]:
                scheduler.abort_requests([output.request_id])
        read = {block for _, _, roles in pending for block, _, _ in roles}
        assert read.isdisjoint(pool.free_block_ids), "a block a step in flight reads was freed"
        check_pool(scheduler, live, deferred_blocks())

    for step_index in range(3000):
        for i, spec in enumerate(specs):
            if spec["arrival"] == step_index:
                total = len(spec["prompt"]) + spec["max_tokens"]
                if total > 48 or total - 1 > config["num_kv_blocks"] * block_size:
                    continue
                request = Request(
                    str(i),
                    list(spec["prompt"]),
                    SamplingParams(
                        max_tokens=spec["max_tokens"], stop_token_ids=[STOP] if spec["stop"] else None
                    ),
                    eos_token_ids=frozenset({EOS}),
                    cache_salt=spec["salt"],
                )
                scheduler.add_request(request)
                live[str(i)], produced[str(i)] = request, []
        out = scheduler.schedule()
        if out.waiting_for_in_flight:
            assert pending, "waiting for a step although none is in flight"
            collect_oldest()
            out = scheduler.schedule()
            assert not out.waiting_for_in_flight
        roles = block_roles(out, block_size)
        # A block some request writes is touched by no other request, in this step or in flight.
        touching = [r for _, _, held in pending for r in held] + roles
        for block, request_id, written in roles:
            for other_block, other_id, other_written in touching:
                if block == other_block and request_id != other_id:
                    assert not (written or other_written), f"block {block} written while shared"
        check_pool(scheduler, live, deferred_blocks())
        if not out.is_empty:
            pending.append((out, device.run(out, live), roles))
        if len(pending) == in_flight or (out.is_empty and pending):
            collect_oldest()
        if step_index > max(s["arrival"] for s in specs) and not scheduler.has_unfinished_requests():
            while pending:
                collect_oldest()
            break
    else:
        pytest.fail("workload did not finish")
    assert pool.num_free_blocks == config["num_kv_blocks"]
    assert pool.num_cached_blocks == pool.num_evictable_blocks
    assert all(r.status.finished for r in live.values())
    for request_id, request in live.items():
        assert produced[request_id] == request.output_token_ids
    return {rid: tuple(tokens) for rid, tokens in produced.items()}, scheduler


@settings(max_examples=80, deadline=None)
@given(workloads())
def test_prefix_caching_changes_no_output_sync_or_async_under_eviction_and_preemption(workload):
    config, specs = workload
    results = {
        (in_flight, caching): run_workload(config, specs, in_flight, caching)
        for in_flight in (1, 2)
        for caching in (False, True)
    }
    expected, _ = results[(1, False)]
    for (in_flight, caching), (outputs, scheduler) in results.items():
        assert outputs == expected, f"in_flight={in_flight} caching={caching}"
        if not caching:
            assert scheduler.num_prefix_cache_hits == 0
    for request_id, tokens in expected.items():
        assert all(t == token_for(request_id, n) for n, t in enumerate(tokens))
