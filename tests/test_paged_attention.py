"""The paged-attention op against a naive per-sequence attention over contiguous k/v."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import compiled_engine.kernels  # noqa: F401  (registers torch.ops.compiled_engine.paged_attention)
from compiled_engine.kernels import reference
from compiled_engine.kernels.reference import paged_attention_reference

BLOCK_SIZE = 4


@dataclass
class Sequence:
    """One sequence's whole k/v history, and which blocks of the paged cache hold it."""

    keys: torch.Tensor  # [total_len, Hkv, D]
    values: torch.Tensor
    block_ids: list[int]


@dataclass
class Step:
    """Inputs of one op call plus what the naive implementation needs to check it."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    # (sequence, tokens cached before this step, tokens this step) per scheduled sequence
    spans: list[tuple[Sequence, int, int]]

    def args(self, kv_cache: torch.Tensor) -> tuple:
        return (
            self.query,
            self.key,
            self.value,
            kv_cache,
            self.slot_mapping,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
        )


def make_sequences(lengths, num_kv_heads, head_dim, num_blocks, dtype, gen) -> list[Sequence]:
    # Shuffled block ids, so a sequence's blocks are neither contiguous nor in order.
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for length in lengths:
        needed = -(-length // BLOCK_SIZE)
        ids, free = free[:needed], free[needed:]
        assert len(ids) == needed, "test scenario needs more cache blocks"
        k = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        seqs.append(Sequence(k, v, ids))
    return seqs


def make_step(spans, num_q_heads, num_pad_tokens=0, gen=None) -> Step:
    """Feed tokens [done, done + n) of each sequence; pad the token batch with -1 slots."""
    seq0 = spans[0][0]
    num_kv_heads, head_dim = seq0.keys.shape[1:]
    dtype = seq0.keys.dtype
    keys, values, slots, loc = [], [], [], [0]
    for seq, done, n in spans:
        keys.append(seq.keys[done : done + n])
        values.append(seq.values[done : done + n])
        slots += [seq.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(done, done + n)]
        loc.append(loc[-1] + n)
    keys.append(torch.randn(num_pad_tokens, num_kv_heads, head_dim, generator=gen).to(dtype))
    values.append(torch.randn(num_pad_tokens, num_kv_heads, head_dim, generator=gen).to(dtype))
    slots += [-1] * num_pad_tokens
    num_tokens = loc[-1] + num_pad_tokens
    max_blocks = max(len(seq.block_ids) for seq, _, _ in spans) + 1  # one spare column of -1
    tables = torch.full((len(spans), max_blocks), -1, dtype=torch.int32)
    for row, (seq, _, _) in enumerate(spans):
        tables[row, : len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)
    return Step(
        query=torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype),
        key=torch.cat(keys),
        value=torch.cat(values),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor([done + n for _, done, n in spans], dtype=torch.int32),
        query_start_loc=torch.tensor(loc, dtype=torch.int32),
        spans=spans,
    )


def naive_attention(step: Step, scale: float, sliding_window: int = -1, softcap: float = 0.0) -> torch.Tensor:
    """Per-sequence loop, contiguous k/v, repeated kv heads, explicit softmax, float64."""
    out = torch.zeros(step.query.shape, dtype=torch.float64)
    row = 0
    for seq, done, n in step.spans:
        total = done + n
        q = step.query[row : row + n].double()
        group = q.shape[1] // seq.keys.shape[1]
        k = seq.keys[:total].double().repeat_interleave(group, dim=1)
        v = seq.values[:total].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(done, total)[:, None]
        k_pos = torch.arange(total)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window > 0:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[row : row + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        row += n
    return out


def new_cache(num_blocks, num_kv_heads, head_dim, dtype) -> torch.Tensor:
    """`num_blocks` usable blocks (the ids make_sequences hands out) plus the scratch block.

    NaN everywhere: any read of a slot that should be masked or was never written shows up.
    """
    shape = (2, num_blocks + 1, BLOCK_SIZE, num_kv_heads, head_dim)
    return torch.full(shape, float("nan"), dtype=dtype)


def prefill_cache(kv_cache: torch.Tensor, seqs_and_lengths) -> None:
    for seq, length in seqs_and_lengths:
        for p in range(length):
            kv_cache[0, seq.block_ids[p // BLOCK_SIZE], p % BLOCK_SIZE] = seq.keys[p]
            kv_cache[1, seq.block_ids[p // BLOCK_SIZE], p % BLOCK_SIZE] = seq.values[p]


def assert_cache_holds(kv_cache: torch.Tensor, seq: Sequence, upto: int) -> None:
    for p in range(upto):
        block, offset = seq.block_ids[p // BLOCK_SIZE], p % BLOCK_SIZE
        assert torch.equal(kv_cache[0, block, offset], seq.keys[p]), f"key at position {p}"
        assert torch.equal(kv_cache[1, block, offset], seq.values[p]), f"value at position {p}"


def run_case(
    lengths_and_spans,
    num_q_heads,
    num_kv_heads,
    *,
    head_dim=8,
    num_blocks=40,
    dtype=torch.float32,
    sliding_window=-1,
    softcap=0.0,
    num_pad_tokens=0,
    seed=0,
):
    """lengths_and_spans: (total length, cached before, fed now) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    seqs = make_sequences(
        [t for t, _, _ in lengths_and_spans], num_kv_heads, head_dim, num_blocks, dtype, gen
    )
    kv_cache = new_cache(num_blocks, num_kv_heads, head_dim, dtype)
    prefill_cache(kv_cache, [(s, done) for s, (_, done, _) in zip(seqs, lengths_and_spans, strict=True)])
    spans = [(s, done, n) for s, (_, done, n) in zip(seqs, lengths_and_spans, strict=True)]
    step = make_step(spans, num_q_heads, num_pad_tokens, gen)
    scale = head_dim**-0.5
    out = paged_attention_reference(*step.args(kv_cache), scale, sliding_window, softcap)
    expected = naive_attention(step, scale, sliding_window, softcap)
    return out, expected, kv_cache, step


def test_prefill_of_sequences_with_different_lengths():
    out, expected, kv_cache, step = run_case([(7, 0, 7), (13, 0, 13), (1, 0, 1), (4, 0, 4)], 4, 4)
    assert out.dtype == torch.float32 and out.shape == step.query.shape
    torch.testing.assert_close(out, expected.float(), atol=1e-5, rtol=1e-5)
    for seq, done, n in step.spans:
        assert_cache_holds(kv_cache, seq, done + n)


def test_decode_batch():
    out, expected, _, _ = run_case([(9, 8, 1), (17, 16, 1), (3, 2, 1), (4, 3, 1)], 4, 2)
    torch.testing.assert_close(out, expected.float(), atol=1e-5, rtol=1e-5)


def test_mixed_chunk_decode_and_prefill_over_two_calls():
    gen = torch.Generator().manual_seed(1)
    num_blocks, hq, hkv, d = 30, 8, 2, 8
    a, b, c = make_sequences([30, 6, 4], hkv, d, num_blocks, torch.float32, gen)
    kv_cache = new_cache(num_blocks, hkv, d, torch.float32)
    scale = 0.3
    # Call 1: the first chunk of A and all of B's prompt. The cache starts empty.
    first = make_step([(a, 0, 10), (b, 0, 5)], hq, gen=gen)
    out1 = torch.ops.compiled_engine.paged_attention(*first.args(kv_cache), scale)
    torch.testing.assert_close(out1, naive_attention(first, scale).float(), atol=1e-5, rtol=1e-5)
    # Call 2: A's next chunk attends to what call 1 cached; B decodes; C prefills from scratch.
    second = make_step([(a, 10, 17), (b, 5, 1), (c, 0, 4)], hq, num_pad_tokens=2, gen=gen)
    out2 = torch.ops.compiled_engine.paged_attention(*second.args(kv_cache), scale)
    torch.testing.assert_close(out2[:-2], naive_attention(second, scale)[:-2].float(), atol=1e-5, rtol=1e-5)
    assert torch.equal(out2[-2:], torch.zeros_like(out2[-2:])), "padding rows must come back as zeros"
    assert_cache_holds(kv_cache, a, 27)
    assert_cache_holds(kv_cache, b, 6)
    assert_cache_holds(kv_cache, c, 4)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(8, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
def test_head_layouts(num_q_heads, num_kv_heads):
    out, expected, _, _ = run_case([(11, 5, 6), (6, 5, 1), (5, 0, 5)], num_q_heads, num_kv_heads)
    torch.testing.assert_close(out, expected.float(), atol=1e-5, rtol=1e-5)


def test_sliding_window():
    out, expected, _, _ = run_case([(20, 0, 20), (15, 14, 1), (18, 9, 9)], 4, 2, sliding_window=5)
    torch.testing.assert_close(out, expected.float(), atol=1e-5, rtol=1e-5)
    # The window must actually change the answer, or the test proves nothing.
    full, _, _, _ = run_case([(20, 0, 20), (15, 14, 1), (18, 9, 9)], 4, 2)
    assert not torch.allclose(out, full, atol=1e-3)


def test_softcap():
    # Large q/k values so the cap is active.
    out, expected, _, _ = run_case([(10, 0, 10), (7, 6, 1)], 4, 2, head_dim=16, softcap=0.5)
    torch.testing.assert_close(out, expected.float(), atol=1e-5, rtol=1e-5)
    uncapped, _, _, _ = run_case([(10, 0, 10), (7, 6, 1)], 4, 2, head_dim=16)
    assert not torch.allclose(out, uncapped, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    out, expected, kv_cache, step = run_case([(12, 4, 8), (9, 8, 1)], 8, 2, dtype=dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    for seq, done, n in step.spans:
        assert_cache_holds(kv_cache, seq, done + n)


def test_padding_slots_write_only_the_scratch_block_and_padding_rows_are_zero():
    num_blocks = 40
    out, expected, kv_cache, step = run_case(
        [(5, 0, 5), (3, 2, 1)], 4, 2, num_blocks=num_blocks, num_pad_tokens=3
    )
    torch.testing.assert_close(out[:6], expected[:6].float(), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[6:], torch.zeros_like(out[6:]))
    used = {
        (blk, p % BLOCK_SIZE)
        for seq, done, n in step.spans
        for p in range(done + n)
        for blk in [seq.block_ids[p // BLOCK_SIZE]]
    }
    for half in kv_cache:
        written = {tuple(x) for x in half.isfinite().all(-1).all(-1).nonzero().tolist()}
        # The scratch block is the one after the usable ones; padding lands in its first slot.
        assert written == used | {(num_blocks, 0)}, "only the real tokens' slots and scratch may be written"


def test_sequence_rows_without_query_tokens():
    # A cached sequence with nothing scheduled in the middle, and an empty padding row
    # (seq_len 0, block table all -1) at the end, as a padded decode bucket would send.
    out, expected, _, step = run_case([(7, 0, 7), (5, 5, 0), (3, 2, 1), (0, 0, 0)], 4, 2)
    assert step.query_start_loc.tolist() == [0, 7, 7, 8, 8]
    torch.testing.assert_close(out, expected.float(), atol=1e-5, rtol=1e-5)


def test_chunking_over_tokens_gives_the_same_answer(monkeypatch):
    case = [(13, 0, 13), (9, 8, 1), (10, 3, 7)]
    whole, expected, _, _ = run_case(case, 4, 2)
    # A budget of a few tokens' worth of gathered k/v forces many chunks.
    monkeypatch.setattr(reference, "_GATHER_BUDGET_BYTES", 3000)
    chunked, _, _, _ = run_case(case, 4, 2)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chunked, expected.float(), atol=1e-5, rtol=1e-5)


def test_non_contiguous_cache_is_written_in_place():
    gen = torch.Generator().manual_seed(3)
    (seq,) = make_sequences([6], 2, 8, 8, torch.float32, gen)
    storage = torch.zeros(2, 9, 2, BLOCK_SIZE, 8)  # [2, blocks + scratch, Hkv, block, D]
    kv_cache = storage.transpose(2, 3)  # the op's layout, as a strided view
    step = make_step([(seq, 0, 6)], 4, gen=gen)
    out = paged_attention_reference(*step.args(kv_cache), 0.35)
    torch.testing.assert_close(out, naive_attention(step, 0.35).float(), atol=1e-5, rtol=1e-5)
    assert_cache_holds(storage.transpose(2, 3), seq, 6)


def test_bad_shapes_raise_clear_errors():
    _, _, kv_cache, step = run_case([(4, 0, 4)], 4, 2)
    args = list(step.args(kv_cache))
    with pytest.raises(ValueError, match="key must be"):
        paged_attention_reference(args[0], args[1][:, :1], *args[2:], 1.0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        bad_cache = torch.zeros(2, 4, BLOCK_SIZE, 3, 8)
        paged_attention_reference(
            args[0], torch.zeros(4, 3, 8), torch.zeros(4, 3, 8), bad_cache, *args[4:], 1.0
        )
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_reference(*args[:7], args[7][:-1], 1.0)
    with pytest.raises(ValueError, match="integer"):
        paged_attention_reference(*args[:6], args[6].float(), args[7], 1.0)


# --- through the registered op and torch.compile -------------------------------------------------


def tiny_step(seed=0, spans=((6, 2, 4), (3, 2, 1))):
    gen = torch.Generator().manual_seed(seed)
    seqs = make_sequences([t for t, _, _ in spans], 2, 8, 12, torch.float32, gen)
    kv_cache = new_cache(12, 2, 8, torch.float32)
    prefill_cache(kv_cache, [(s, done) for s, (_, done, _) in zip(seqs, spans, strict=True)])
    step = make_step([(s, done, n) for s, (_, done, n) in zip(seqs, spans, strict=True)], 4, gen=gen)
    return step, kv_cache


def attention_layer(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc):
    # Some ordinary ops around the custom one, as in a real layer.
    out = torch.ops.compiled_engine.paged_attention(
        query * 1.0,
        key,
        value,
        kv_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        0.25,
        3,
        2.0,
    )
    return out.flatten(1) + 1.0


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_op_under_torch_compile(backend):
    torch._dynamo.reset()
    step, kv_cache = tiny_step()
    compiled = torch.compile(attention_layer, fullgraph=True, backend=backend)
    out = compiled(*step.args(kv_cache))
    expected = naive_attention(step, 0.25, sliding_window=3, softcap=2.0).float().flatten(1) + 1.0
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for seq, done, n in step.spans:
        assert_cache_holds(kv_cache, seq, done + n)


def test_dynamic_compile_mutates_the_real_cache_without_copying(monkeypatch):
    torch._dynamo.reset()
    seen_cache_ptrs = []
    real_impl = reference.paged_attention_reference

    def spy(query, key, value, kv_cache, *rest):
        seen_cache_ptrs.append(kv_cache.data_ptr())
        return real_impl(query, key, value, kv_cache, *rest)

    # The registered op looks the implementation up at call time, so the spy sees what it gets.
    monkeypatch.setattr(reference, "paged_attention_reference", spy)
    compiled = torch.compile(attention_layer, fullgraph=True, backend="inductor", dynamic=True)
    for seed, spans in enumerate([((6, 2, 4), (3, 2, 1)), ((9, 0, 9), (5, 4, 1), (2, 0, 2))]):
        step, kv_cache = tiny_step(seed, spans)
        out = compiled(*step.args(kv_cache))
        expected = naive_attention(step, 0.25, sliding_window=3, softcap=2.0).float().flatten(1) + 1.0
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert seen_cache_ptrs[-1] == kv_cache.data_ptr(), "the op was handed a copy of the cache"
        for seq, done, n in step.spans:
            assert_cache_holds(kv_cache, seq, done + n)
    assert len(seen_cache_ptrs) == 2
