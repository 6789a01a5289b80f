"""The traceable paged attention and the KV-write op against the reference op, eager and compiled."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx.experimental._config as fx_config

from compiled_engine.kernels import inline_attention
from compiled_engine.kernels.inline_attention import paged_attention_inline
from compiled_engine.kernels.reference import paged_attention_reference
from tests.test_paged_attention import (
    BLOCK_SIZE,
    assert_cache_holds,
    make_sequences,
    make_step,
    naive_attention,
    new_cache,
    run_case,
    tiny_step,
)


def inline(step, kv_cache, scale, sliding_window=-1, softcap=0.0) -> torch.Tensor:
    return paged_attention_inline(
        step.query,
        kv_cache,
        step.block_tables,
        step.seq_lens,
        step.query_start_loc,
        scale,
        sliding_window,
        softcap,
    )


def reference(step, kv_cache, scale, sliding_window=-1, softcap=0.0) -> torch.Tensor:
    return paged_attention_reference(*step.args(kv_cache), scale, sliding_window, softcap)


def check_against_reference(lengths_and_spans, num_q_heads, num_kv_heads, **kwargs):
    """run_case writes the step into the cache and attends with the reference; then read it inline."""
    ref, expected, kv_cache, step = run_case(lengths_and_spans, num_q_heads, num_kv_heads, **kwargs)
    scale = kwargs.get("head_dim", 8) ** -0.5
    out = inline(step, kv_cache, scale, kwargs.get("sliding_window", -1), kwargs.get("softcap", 0.0))
    assert out.shape == step.query.shape and out.dtype == step.query.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, expected.float(), atol=1e-5, rtol=1e-5)
    return out, step


CASES = {
    "prefill": ([(7, 0, 7), (13, 0, 13), (1, 0, 1), (4, 0, 4)], 4, 4, {}),
    "decode": ([(9, 8, 1), (17, 16, 1), (3, 2, 1), (4, 3, 1)], 4, 2, {}),
    "chunked_prefill_and_decode": ([(30, 10, 17), (6, 5, 1), (4, 0, 4)], 8, 2, {}),
    "gqa": ([(11, 5, 6), (6, 5, 1), (5, 0, 5)], 8, 2, {}),
    "mha": ([(11, 5, 6), (6, 5, 1), (5, 0, 5)], 4, 4, {}),
    "mqa": ([(11, 5, 6), (6, 5, 1), (5, 0, 5)], 6, 1, {}),
    "sliding_window": ([(20, 0, 20), (15, 14, 1), (18, 9, 9)], 4, 2, {"sliding_window": 5}),
    # Large-ish head dim so the scores are big enough for the cap to bite.
    "softcap": ([(10, 0, 10), (7, 6, 1)], 4, 2, {"head_dim": 16, "softcap": 0.5}),
    "window_and_softcap": ([(12, 3, 9), (9, 8, 1)], 4, 2, {"sliding_window": 4, "softcap": 1.0}),
    "rows_without_queries": ([(7, 0, 7), (5, 5, 0), (3, 2, 1), (0, 0, 0)], 4, 2, {}),
}


@pytest.mark.parametrize("name", CASES)
def test_matches_reference(name):
    lengths_and_spans, num_q_heads, num_kv_heads, kwargs = CASES[name]
    check_against_reference(lengths_and_spans, num_q_heads, num_kv_heads, **kwargs)


def test_padding_rows_are_zero():
    out, step = check_against_reference([(5, 0, 5), (3, 2, 1)], 4, 2, num_pad_tokens=3)
    assert int(step.query_start_loc[-1]) == 6 and out.shape[0] == 9
    assert torch.equal(out[6:], torch.zeros_like(out[6:]))


def test_bfloat16_cache_and_query():
    lengths_and_spans = [(12, 4, 8), (9, 8, 1), (6, 0, 6)]
    ref, expected, kv_cache, step = run_case(lengths_and_spans, 8, 2, dtype=torch.bfloat16, num_pad_tokens=2)
    out = inline(step, kv_cache, 8**-0.5)
    assert out.dtype == torch.bfloat16
    # Both do the maths in float32 and round once at the end: at most a bf16 ulp or so apart.
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))


def test_inf_and_nan_in_masked_slots_do_not_leak():
    # run_case's cache is NaN wherever nothing was written; make the keys there +inf and the
    # values -inf too, the other garbage a freed block can hold. Causal masking hides them all.
    lengths_and_spans = [(10, 4, 6), (7, 6, 1)]
    ref, expected, kv_cache, step = run_case(lengths_and_spans, 4, 2)
    unwritten = kv_cache.isnan()
    assert unwritten.any()
    kv_cache[0][unwritten[0]] = float("inf")
    kv_cache[1][unwritten[1]] = float("-inf")
    out = inline(step, kv_cache, 8**-0.5)
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_block_tables_with_holes_and_garbage_past_each_sequence():
    num_blocks = 40
    ref, expected, kv_cache, step = run_case([(9, 4, 5), (3, 2, 1), (14, 13, 1)], 4, 2, num_blocks=num_blocks)
    gen = torch.Generator().manual_seed(7)
    # Past each sequence's last block: -1, stale ids (other sequences' blocks), the scratch block
    # and ids out of range, as a table reused across steps may hold. Wider than needed, too.
    tables = torch.randint(
        -1, num_blocks + 5, (step.block_tables.shape[0], 8), generator=gen, dtype=torch.int32
    )
    for row, (seq, _, _) in enumerate(step.spans):
        tables[row, : len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)
    step.block_tables = tables
    out = inline(step, kv_cache, 8**-0.5)
    torch.testing.assert_close(out, expected.float(), atol=1e-5, rtol=1e-5)
    # The reference reads the same table the same way (its write repeats run_case's, harmlessly).
    torch.testing.assert_close(out, reference(step, kv_cache, 8**-0.5), atol=1e-5, rtol=1e-5)


# --- kv_cache_write -----------------------------------------------------------------------------


def fresh_step(spans, num_pad_tokens=0, num_blocks=20, dtype=torch.float32, seed=0):
    """A step over an empty (NaN) cache; spans are (total length, cached before, fed now)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = make_sequences([t for t, _, _ in spans], 2, 8, num_blocks, dtype, gen)
    step = make_step(
        [(s, done, n) for s, (_, done, n) in zip(seqs, spans, strict=True)], 4, num_pad_tokens, gen
    )
    return step, new_cache(num_blocks, 2, 8, dtype)


def written_slots(kv_cache: torch.Tensor) -> set[tuple[int, int]]:
    written = kv_cache.isfinite().all(-1).all(-1)  # [2, blocks, block]
    assert torch.equal(written[0], written[1]), "keys and values must land in the same slots"
    return {tuple(x) for x in written[0].nonzero().tolist()}


def test_write_stores_real_slots_and_sends_padding_to_scratch_only():
    num_blocks = 20
    step, kv_cache = fresh_step([(5, 0, 5), (6, 0, 6)], num_pad_tokens=3, num_blocks=num_blocks)
    torch.ops.compiled_engine.kv_cache_write(step.key, step.value, kv_cache, step.slot_mapping)
    used = set()
    for seq, done, n in step.spans:
        assert_cache_holds(kv_cache, seq, done + n)
        used |= {(seq.block_ids[p // BLOCK_SIZE], p % BLOCK_SIZE) for p in range(done + n)}
    # The scratch block is the one after the usable ones; padding lands in its first slot.
    assert written_slots(kv_cache) == used | {(num_blocks, 0)}


def test_write_casts_to_the_cache_dtype():
    step, _ = fresh_step([(6, 0, 6)])
    kv_cache = new_cache(20, 2, 8, torch.bfloat16)
    torch.ops.compiled_engine.kv_cache_write(step.key, step.value, kv_cache, step.slot_mapping)
    seq = step.spans[0][0]
    block, offset = seq.block_ids[1], 1  # position 5
    assert kv_cache.dtype == torch.bfloat16
    assert torch.equal(kv_cache[0, block, offset], seq.keys[5].to(torch.bfloat16))
    assert torch.equal(kv_cache[1, block, offset], seq.values[5].to(torch.bfloat16))


def test_write_into_a_non_contiguous_cache_lands_in_place():
    step, _ = fresh_step([(6, 0, 6)], num_blocks=8)
    storage = torch.zeros(2, 9, 2, BLOCK_SIZE, 8)  # [2, blocks + scratch, Hkv, block, D]
    kv_cache = storage.transpose(2, 3)  # the op's layout, as a strided view
    torch.ops.compiled_engine.kv_cache_write(step.key, step.value, kv_cache, step.slot_mapping)
    assert_cache_holds(storage.transpose(2, 3), step.spans[0][0], 6)


def test_write_rejects_bad_shapes():
    step, kv_cache = fresh_step([(4, 0, 4)])
    with pytest.raises(ValueError, match="key must be"):
        torch.ops.compiled_engine.kv_cache_write(step.key[:, :1], step.value, kv_cache, step.slot_mapping)
    with pytest.raises(ValueError, match="value must be"):
        torch.ops.compiled_engine.kv_cache_write(step.key, step.value[:3], kv_cache, step.slot_mapping)
    with pytest.raises(ValueError, match="kv_cache must be"):
        torch.ops.compiled_engine.kv_cache_write(step.key, step.value, kv_cache[0], step.slot_mapping)
    with pytest.raises(ValueError, match="integer"):
        torch.ops.compiled_engine.kv_cache_write(step.key, step.value, kv_cache, step.slot_mapping.float())


# --- under torch.compile --------------------------------------------------------------------------

SCALE, WINDOW, SOFTCAP = 0.25, 3, 2.0


def attention_layer(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc):
    # Ordinary ops around the pair, as in a real layer: Inductor may fuse into them.
    torch.ops.compiled_engine.kv_cache_write(key, value, kv_cache, slot_mapping)
    out = paged_attention_inline(
        query * 1.0, kv_cache, block_tables, seq_lens, query_start_loc, SCALE, WINDOW, SOFTCAP
    )
    return out.flatten(1) + 1.0


# Extern GEMMs would make Inductor materialise the gathered keys/values: none may reach the graph.
_GEMM_TARGETS = {
    torch.matmul,
    torch.bmm,
    torch.einsum,
    torch.nn.functional.scaled_dot_product_attention,
    torch.Tensor.matmul,
    torch.Tensor.bmm,
    operator.matmul,
}


def test_compiled_dynamic_matches_eager_writes_in_place_and_compiles_once(monkeypatch):
    from torch._inductor.compile_fx import compile_fx

    torch._dynamo.reset()
    graphs = []

    def counting_inductor(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    seen_cache_ptrs = []
    real_write = inline_attention._write_kv

    def spy(key, value, kv_cache, slot_mapping):
        seen_cache_ptrs.append(kv_cache.data_ptr())
        real_write(key, value, kv_cache, slot_mapping)

    # The op's body looks _write_kv up at call time, so the spy sees the cache it is handed.
    monkeypatch.setattr(inline_attention, "_write_kv", spy)
    compiled = torch.compile(attention_layer, fullgraph=True, dynamic=True, backend=counting_inductor)
    # Different token counts (5, 9), sequence counts (2, 3) and table widths (3, 5); all >= 2,
    # since Dynamo specialises sizes 0 and 1 whatever `dynamic` says.
    for seed, spans in enumerate([((6, 2, 4), (3, 2, 1)), ((9, 0, 5), (5, 4, 1), (13, 10, 3))]):
        step, kv_cache = tiny_step(seed, spans)
        eager_cache = kv_cache.clone()
        # As graphs/compiled_step.py traces: without this, S = 2 = Hkv in the first step would
        # tie the two sizes together in a guard and the second step would recompile.
        with fx_config.patch(use_duck_shape=False):
            out = compiled(*step.args(kv_cache))
        assert seen_cache_ptrs[-1] == kv_cache.data_ptr(), "the write op was handed a copy of the cache"
        expected = attention_layer(*step.args(eager_cache))
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        naive = naive_attention(step, SCALE, sliding_window=WINDOW, softcap=SOFTCAP).float().flatten(1) + 1.0
        torch.testing.assert_close(out, naive, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv_cache, eager_cache, equal_nan=True, atol=0, rtol=0)
        for seq, done, n in step.spans:
            assert_cache_holds(kv_cache, seq, done + n)

    assert len(graphs) == 1, f"expected one dynamic graph for both steps, compiled {len(graphs)}"
    targets = {node.target for node in graphs[0].graph.nodes}
    assert any("kv_cache_write" in str(t) for t in targets)
    assert not targets & _GEMM_TARGETS, f"GEMM-like ops in the attention graph: {targets & _GEMM_TARGETS}"
