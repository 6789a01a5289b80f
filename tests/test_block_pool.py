"""BlockPool and KVCacheManager: allocation, reference counts, the free list, per-request growth."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_engine.core.block_pool import BlockPool, BlockPoolExhaustedError
from compiled_engine.core.kv_cache_manager import KVCacheManager


def assert_pool_consistent(pool: BlockPool) -> None:
    free = pool.free_block_ids
    assert len(set(free)) == len(free), "a block appears twice in the free list"
    assert pool.num_free_blocks == len(free)
    for block_id in range(pool.num_blocks):
        in_free_list = block_id in free
        assert in_free_list == (pool.ref_count(block_id) == 0), f"block {block_id} refcount/free mismatch"


# --- BlockPool -----------------------------------------------------------------------------


def test_fresh_pool_is_all_free_in_id_order():
    pool = BlockPool(4)
    assert pool.num_blocks == 4
    assert pool.num_free_blocks == 4
    assert pool.free_block_ids == (0, 1, 2, 3)


def test_allocate_takes_from_the_front_with_refcount_one():
    pool = BlockPool(5)
    assert pool.allocate(2) == [0, 1]
    assert pool.ref_count(0) == pool.ref_count(1) == 1
    assert pool.num_free_blocks == 3
    assert pool.allocate(0) == []
    assert_pool_consistent(pool)


def test_freed_blocks_go_to_the_back_of_the_free_list():
    pool = BlockPool(4)
    first = pool.allocate(2)
    pool.free([first[0]])
    # Never-used blocks 2, 3 come before the just-freed 0 (FIFO reuse).
    assert pool.free_block_ids == (2, 3, 0)
    assert pool.allocate(3) == [2, 3, 0]
    assert_pool_consistent(pool)


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(BlockPoolExhaustedError, match="requested 2 KV blocks but only 1"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert_pool_consistent(pool)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_allocate_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="cannot allocate"):
        BlockPool(3).allocate(bad)


@pytest.mark.parametrize("bad", [0, -3, 2.0, True])
def test_pool_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)


def test_double_free_raises_and_leaves_pool_intact():
    pool = BlockPool(3)
    ids = pool.allocate(2)
    pool.free([ids[0]])
    with pytest.raises(ValueError, match="double free of KV block 0"):
        pool.free([ids[1], ids[0]])
    # The valid half of the failed call was not applied either.
    assert pool.ref_count(ids[1]) == 1
    assert_pool_consistent(pool)


def test_same_block_twice_in_one_free_call_is_a_double_free():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    with pytest.raises(ValueError, match="double free"):
        pool.free([block, block])
    assert pool.ref_count(block) == 1


def test_out_of_range_ids_are_rejected():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="outside the pool"):
        pool.free([2])
    with pytest.raises(ValueError, match="outside the pool"):
        pool.incref([-1])


def test_incref_keeps_a_block_out_of_the_free_list_until_every_reference_is_dropped():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.incref([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.ref_count(block) == 1
    assert block not in pool.free_block_ids
    pool.free([block])
    assert pool.ref_count(block) == 0
    assert pool.free_block_ids[-1] == block
    assert_pool_consistent(pool)


def test_incref_of_a_free_block_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="it is free"):
        pool.incref([1])


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(1, 12), ops=st.lists(st.tuples(st.sampled_from("afi"), st.integers(0, 12))))
def test_random_operations_match_a_reference_model(num_blocks, ops):
    pool = BlockPool(num_blocks)
    model: dict[int, int] = {}  # block id -> references held
    for op, arg in ops:
        if op == "a":
            n = arg % (num_blocks + 1)
            if n > pool.num_free_blocks:
                with pytest.raises(BlockPoolExhaustedError):
                    pool.allocate(n)
            else:
                for block_id in pool.allocate(n):
                    assert block_id not in model
                    model[block_id] = 1
        elif model:
            block_id = sorted(model)[arg % len(model)]
            if op == "f":
                pool.free([block_id])
                model[block_id] -= 1
                if model[block_id] == 0:
                    del model[block_id]
            else:
                pool.incref([block_id])
                model[block_id] += 1
        for block_id in range(num_blocks):
            assert pool.ref_count(block_id) == model.get(block_id, 0)
        assert_pool_consistent(pool)


# --- KVCacheManager ------------------------------------------------------------------------


def test_blocks_needed_counts_only_the_extra_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert kv.blocks_needed("a", 0) == 0
    assert kv.blocks_needed("a", 1) == 1
    assert kv.blocks_needed("a", 4) == 1
    assert kv.blocks_needed("a", 5) == 2
    assert kv.allocate_slots("a", 5)
    assert kv.blocks_needed("a", 8) == 0
    assert kv.blocks_needed("a", 9) == 1
    assert kv.blocks_needed("a", 3) == 0  # lists never shrink


def test_allocate_slots_grows_the_list_in_order():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert kv.allocate_slots("a", 3)
    assert kv.get_block_ids("a") == (0,)
    assert kv.allocate_slots("b", 4)
    assert kv.allocate_slots("a", 9)
    assert kv.get_block_ids("a") == (0, 2, 3)
    assert kv.get_block_ids("b") == (1,)
    assert kv.num_free_blocks == 6
    assert kv.usage == pytest.approx(0.4)


def test_allocate_slots_fails_without_partial_allocation():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    assert kv.allocate_slots("a", 2)
    assert not kv.allocate_slots("b", 5)  # needs 3 blocks, 2 free
    assert kv.get_block_ids("b") == ()
    assert kv.num_free_blocks == 2
    assert kv.allocate_slots("b", 4)
    assert kv.num_free_blocks == 0


def test_free_returns_every_block_and_unknown_ids_are_a_no_op():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", 6)
    kv.free("a")
    assert kv.num_free_blocks == 4
    assert kv.get_block_ids("a") == ()
    assert kv.usage == 0.0
    kv.free("a")
    kv.free("never-seen")
    assert kv.num_free_blocks == 4
    assert_pool_consistent(kv.block_pool)


def test_bad_block_size_and_token_counts_are_rejected():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="non-negative"):
        KVCacheManager(num_blocks=4, block_size=2).blocks_needed("a", -1)
