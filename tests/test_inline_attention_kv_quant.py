"""The inline attention path (kv_cache_write + paged_attention_inline, the maths Inductor fuses into
CPU decode buckets) on a quantized KV cache: against the reference op on the same cache, eager and
compiled by Inductor."""

from __future__ import annotations

import pytest
import torch

import compiled_engine.kernels  # noqa: F401  (registers the ops)
from compiled_engine.kernels.inline_attention import paged_attention_inline
from compiled_engine.kernels.reference import paged_attention_reference
from tests.attention_batches import make_attention_batch, quantized_cache

QUANTIZED = [pytest.param(torch.int8, id="int8"), pytest.param(torch.float8_e4m3fn, id="fp8")]
SCALE, WINDOW, SOFTCAP = 0.3, 5, 2.0


def inline_layer(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc):
    torch.ops.compiled_engine.kv_cache_write(key, value, kv_cache, slot_mapping)
    return paged_attention_inline(
        query, kv_cache, block_tables, seq_lens, query_start_loc, SCALE, WINDOW, SOFTCAP
    )


def make_batch(dtype: torch.dtype):
    # Odd head count and head dim (padding before each row's scale), GQA, a padding row.
    batch = make_attention_batch(
        [(9, 1), (14, 1), (3, 1)], num_q_heads=6, num_kv_heads=3, head_dim=12, block_size=4, num_pad_rows=1
    )
    cache = quantized_cache(batch.kv_cache, dtype)
    expected_cache = cache.clone()
    expected = paged_attention_reference(*batch.args(expected_cache), SCALE, WINDOW, SOFTCAP)
    return batch, cache, expected, expected_cache


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_eager_matches_the_reference(dtype):
    batch, cache, expected, reference_cache = make_batch(dtype)
    eager = inline_layer(*batch.args(cache))
    torch.testing.assert_close(eager, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.view(torch.uint8), reference_cache.view(torch.uint8))


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.int8, id="int8"),
        pytest.param(torch.float8_e4m3fn, id="fp8", marks=pytest.mark.slow),
    ],
)
def test_compiled_matches_the_reference(dtype):
    batch, compiled_cache, expected, reference_cache = make_batch(dtype)
    torch._dynamo.reset()
    compiled = torch.compile(inline_layer, fullgraph=True, dynamic=False, backend="inductor")
    out = compiled(*batch.args(compiled_cache))
    assert not out.isnan().any(), "a never-written row (NaN scale) reached an output"
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(compiled_cache.view(torch.uint8), reference_cache.view(torch.uint8)), (
        "the compiled graph must write the real cache, with the reference's codes"
    )


def test_write_refuses_a_quantized_cache_of_the_wrong_row_width():
    batch = make_attention_batch([(3, 2)], head_dim=16)
    cache = torch.zeros(2, *batch.kv_cache.shape[1:4], 16, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"do not hold torch.int8 heads of dim 16 \(want 20"):
        torch.ops.compiled_engine.kv_cache_write(batch.key, batch.value, cache, batch.slot_mapping)
