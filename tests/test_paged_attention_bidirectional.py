"""The paged-attention op with causal=False (encoder bodies of embedding models) against SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import compiled_engine.kernels  # noqa: F401  (registers the op)


def _step(lengths, block_size, num_q_heads, num_kv_heads, head_dim, generator):
    total = sum(lengths)
    query = torch.randn(total, num_q_heads, head_dim, generator=generator)
    key = torch.randn(total, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(total, num_kv_heads, head_dim, generator=generator)
    blocks = [-(-n // block_size) for n in lengths]
    cache = torch.zeros(2, sum(blocks) + 1, block_size, num_kv_heads, head_dim)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    slots, first = [], 0
    for s, (n, width) in enumerate(zip(lengths, blocks, strict=True)):
        tables[s, :width] = torch.arange(first, first + width)
        slots.append(torch.arange(first * block_size, first * block_size + n))
        first += width
    starts = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    return query, key, value, cache, torch.cat(slots), tables, seq_lens, starts


@pytest.mark.parametrize("causal", [False, True])
def test_op_matches_sdpa_per_sequence(causal):
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 19, 1, 33]
    query, key, value, cache, slots, tables, seq_lens, starts = _step(lengths, 16, 4, 2, 8, generator)
    scale = 8**-0.5
    extra = () if causal else (False,)
    out = torch.ops.compiled_engine.paged_attention(
        query, key, value, cache, slots, tables, seq_lens, starts, scale, -1, 0.0, *extra
    )
    for s in range(len(lengths)):
        rows = slice(int(starts[s]), int(starts[s + 1]))
        q, k, v = (t[rows].transpose(0, 1) for t in (query, key, value))  # [H, n, D]
        k, v = k.repeat_interleave(2, dim=0), v.repeat_interleave(2, dim=0)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).transpose(0, 1)
        torch.testing.assert_close(out[rows], want, rtol=1e-5, atol=1e-5)


def test_bidirectional_differs_from_causal():
    # Guards the test above against an op that ignores the flag.
    generator = torch.Generator().manual_seed(1)
    args = _step([7], 16, 2, 2, 8, generator)
    causal = torch.ops.compiled_engine.paged_attention(*args, 0.5, -1, 0.0)
    bidirectional = torch.ops.compiled_engine.paged_attention(*args, 0.5, -1, 0.0, False)
    assert not torch.allclose(causal[:-1], bidirectional[:-1])
    # The last token sees the whole sequence either way.
    torch.testing.assert_close(causal[-1], bidirectional[-1])
