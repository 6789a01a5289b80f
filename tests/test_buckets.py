"""Bucket lists, bucket choice and step padding (pure tensor code, no model)."""

from __future__ import annotations

import pytest
import torch

from compiled_engine.graphs.buckets import (
    DEFAULT_MAX_BUCKET,
    bucket_for,
    bucket_shape,
    check_buckets,
    default_buckets,
    eager_shape,
    pad_step,
)
from compiled_engine.graphs.step_inputs import FrontViews, StepInputs
from compiled_engine.kernels.reference import paged_attention_reference


def test_default_buckets_small_steps_then_multiples_up_to_the_cap():
    assert default_buckets(2048, 256) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 384, 512)
    assert default_buckets(2048, 256, max_bucket=1024)[-1] == 1024
    assert max(default_buckets(2048, 256)) == DEFAULT_MAX_BUCKET


def test_default_buckets_include_budget_and_full_decode_batch():
    assert default_buckets(50, 10) == (1, 2, 4, 8, 10, 16, 24, 32, 48, 50)
    assert default_buckets(3, 256) == (1, 2, 3)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int"):
        default_buckets(64, 0)


def test_check_buckets_rejects_bad_lists():
    assert check_buckets([8, 1, 4], 64) == (1, 4, 8)
    with pytest.raises(ValueError, match="exceeds max_num_batched_tokens=16"):
        check_buckets([1, 32], 16)
    with pytest.raises(ValueError, match="duplicates"):
        check_buckets([1, 1], 16)
    with pytest.raises(ValueError, match="at least one"):
        check_buckets([], 16)
    with pytest.raises(ValueError, match="positive ints"):
        check_buckets([0], 16)


def test_bucket_for_picks_the_smallest_fitting_bucket():
    buckets = (1, 2, 4, 8, 16)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert bucket_for(17, buckets) is None


def test_bucket_shape_caps_sequences_at_max_num_seqs():
    assert bucket_shape(16, 256) == bucket_shape(16, 16)
    assert bucket_shape(16, 4).num_seqs == 4 and bucket_shape(16, 4).num_tokens == 16


def _buffers(max_tokens: int, max_seqs: int, max_blocks: int) -> StepInputs:
    # Filled with junk so the test sees that padding overwrites stale values.
    return StepInputs(
        input_ids=torch.full((1, max_tokens), 77),
        positions=torch.full((1, max_tokens), 77),
        slot_mapping=torch.full((max_tokens,), 77),
        block_tables=torch.full((max_seqs, max_blocks), 77, dtype=torch.int32),
        seq_lens=torch.full((max_seqs,), 77, dtype=torch.int32),
        query_start_loc=torch.full((max_seqs + 1,), 77, dtype=torch.int32),
        logits_indices=torch.full((max_seqs,), 77),
    )


def _fill_step(buffers: StepInputs) -> StepInputs:
    """Two sequences: 2 prefill tokens of a new sequence in block 3, one decode at position 17."""
    b = buffers
    b.input_ids[0, :3] = torch.tensor([5, 6, 7])
    b.positions[0, :3] = torch.tensor([0, 1, 17])
    b.slot_mapping[:3] = torch.tensor([48, 49, 17])
    b.block_tables[:2, :2] = torch.tensor([[3, 0], [0, 1]], dtype=torch.int32)
    b.seq_lens[:2] = torch.tensor([2, 18], dtype=torch.int32)
    b.query_start_loc[:3] = torch.tensor([0, 2, 3], dtype=torch.int32)
    b.logits_indices[:2] = torch.tensor([1, 2])
    return StepInputs(
        b.input_ids[:, :3],
        b.positions[:, :3],
        b.slot_mapping[:3],
        b.block_tables[:2, :2],
        b.seq_lens[:2],
        b.query_start_loc[:3],
        b.logits_indices[:2],
    )


def test_eager_shape_pads_sequences_and_logits_rows_to_their_own_buckets():
    buckets = [1, 2, 4, 8, 16, 32, 48, 64]
    # Three decodes and a 32-token prompt chunk: 35 tokens, 4 sequences, 3 sampled rows.
    assert eager_shape(35, 4, 3, buckets, 256) == (48, 4, 4)
    assert eager_shape(1, 1, 1, buckets, 256) == (1, 1, 1)
    assert eager_shape(64, 64, 64, buckets, 256) == (64, 64, 64)
    assert eager_shape(20, 3, 0, buckets, 256) == (32, 4, 1)  # a chunk that samples nothing
    # Never more sequences than the engine runs (its buffers' room), never fewer than the step's.
    assert eager_shape(35, 3, 3, buckets, 3) == (48, 3, 3)
    assert eager_shape(40, 5, 5, buckets, 6) == (48, 6, 6)
    with pytest.raises(ValueError, match="above the largest bucket"):
        eager_shape(65, 1, 1, buckets, 256)


def test_pad_step_writes_inert_padding():
    buffers = _buffers(max_tokens=16, max_seqs=8, max_blocks=4)
    step = _fill_step(buffers)
    padded = pad_step(buffers, step, num_tokens=8, num_seqs=8, num_logits=8, width=3)

    assert padded.input_ids.shape == (1, 8) and padded.block_tables.shape == (8, 3)
    assert padded.input_ids.data_ptr() == buffers.input_ids.data_ptr()  # views of the same storage
    assert padded.input_ids[0].tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert padded.positions[0].tolist() == [0, 1, 17, 0, 0, 0, 0, 0]
    assert padded.slot_mapping.tolist() == [48, 49, 17, -1, -1, -1, -1, -1]
    assert padded.seq_lens.tolist() == [2, 18, 0, 0, 0, 0, 0, 0]
    assert padded.query_start_loc.tolist() == [0, 2, 3, 3, 3, 3, 3, 3, 3]
    assert padded.block_tables.tolist() == [[3, 0, 0], [0, 1, 0]] + [[0, 0, 0]] * 6
    assert padded.logits_indices.tolist() == [1, 2, 0, 0, 0, 0, 0, 0]
    # Beyond the padded shape nothing is touched.
    assert buffers.slot_mapping[8:].eq(77).all() and buffers.block_tables[:, 3].eq(77).all()


def test_pad_step_through_cached_views_pads_the_same_and_reuses_the_views():
    plain = _buffers(max_tokens=16, max_seqs=8, max_blocks=4)
    cached = _buffers(max_tokens=16, max_seqs=8, max_blocks=4)
    views = FrontViews(cached)
    shape = {"num_tokens": 8, "num_seqs": 8, "num_logits": 8, "width": 3}
    expected = pad_step(plain, _fill_step(plain), **shape)
    padded = pad_step(cached, _fill_step(cached), **shape, views=views)
    for want, got in zip(expected, padded, strict=True):
        assert torch.equal(want, got)
    assert torch.equal(plain.slot_mapping, cached.slot_mapping)  # same writes past the views too
    # The next step of that shape gets the same view objects, reading the buffers' new values.
    again = pad_step(cached, _fill_step(cached), **shape, views=views)
    assert all(a is b for a, b in zip(again, padded, strict=True))
    cached.input_ids[0, 0] = 42
    assert again.input_ids[0, 0].item() == 42
    with pytest.raises(ValueError, match="views must be views of the buffers it pads"):
        pad_step(plain, _fill_step(plain), **shape, views=views)


def test_front_views_cache_is_bounded():
    buffers = _buffers(max_tokens=16, max_seqs=8, max_blocks=4)
    views = FrontViews(buffers, max_entries=2)
    first = views(4, 2, 2, 1)
    assert views(4, 2, 2, 1) is first and views(8, 2, 2, 1).slot_mapping.shape == (8,)
    views(16, 8, 8, 4)  # a third size empties the cache
    assert views(4, 2, 2, 1) is not first
    assert views(4, 2, 2, 1).block_tables.shape == (2, 1)


def test_padding_changes_neither_attention_nor_any_usable_block():
    torch.manual_seed(0)
    buffers = _buffers(max_tokens=16, max_seqs=8, max_blocks=4)
    step = _fill_step(buffers)
    heads, kv_heads, dim = 4, 2, 8
    cache = torch.randn(2, 6, 16, kv_heads, dim)
    q, k, v = torch.randn(8, heads, dim), torch.randn(8, kv_heads, dim), torch.randn(8, kv_heads, dim)

    real_cache = cache.clone()
    real = paged_attention_reference(q[:3], k[:3], v[:3], real_cache, *step[2:6], scale=0.3)
    padded = pad_step(buffers, step, num_tokens=8, num_seqs=8, num_logits=8, width=3)
    padded_cache = cache.clone()
    out = paged_attention_reference(q, k, v, padded_cache, *padded[2:6], scale=0.3)

    torch.testing.assert_close(out[:3], real, rtol=0, atol=0)
    assert out[3:].eq(0).all()
    # Every usable block is as the unpadded step left it; only the scratch block (last) differs.
    assert torch.equal(padded_cache[:, :-1], real_cache[:, :-1])
    assert not torch.equal(padded_cache[:, -1], real_cache[:, -1])


def test_pad_step_refuses_shapes_that_do_not_fit():
    buffers = _buffers(max_tokens=16, max_seqs=8, max_blocks=4)
    step = _fill_step(buffers)
    with pytest.raises(ValueError, match="cannot pad num_tokens from 3 to 32"):
        pad_step(buffers, step, num_tokens=32, num_seqs=8, num_logits=8, width=2)
    with pytest.raises(ValueError, match="cannot pad num_seqs from 2 to 1"):
        pad_step(buffers, step, num_tokens=4, num_seqs=1, num_logits=1, width=2)
    with pytest.raises(ValueError, match="num_logits=4 exceeds num_seqs=2"):
        pad_step(buffers, step, num_tokens=4, num_seqs=2, num_logits=4, width=2)
