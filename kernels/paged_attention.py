"""The paged-attention custom op: the single attention primitive every captured graph calls.

`torch.ops.compiled_engine.paged_attention` writes this step's keys/values into the paged cache
at `slot_mapping`, then attends every query token over its own sequence's cached history.
The op is opaque to Dynamo/Inductor; the backend that runs it is chosen per device
(kernels/reference.py is the pure-torch one that runs everywhere).

Shapes (T = tokens this step, S = sequences this step):
  query            [T, Hq, D]
  key, value       [T, Hkv, D]      this step's k/v, after RoPE; Hq % Hkv == 0 (GQA/MQA)
  kv_cache         [2, num_blocks, block_size, Hkv, D]   mutated in place (k at 0, v at 1);
                                    its last block is the scratch block (see below). An int8 or
                                    float8_e4m3fn cache is quantized: its last dimension is a
                                    packed row of codes and a float32 scale per token and head
                                    (kernels/kv_quant.py), written quantized and read dequantized
  slot_mapping     [T] int64        block_id * block_size + offset; -1 = padding
  block_tables     [S, max_blocks] int32   block ids of each sequence, in order
  seq_lens         [S] int32        tokens in the cache for each sequence after this step's write
  query_start_loc  [S+1] int32      cumulative query counts; sequence s owns query rows
                                    query_start_loc[s]:query_start_loc[s+1], which are its last
                                    tokens (positions seq_len - q_len ... seq_len - 1)
  scale            softmax scale applied to q·k
  sliding_window   > 0: a query at position p sees keys at positions > p - sliding_window
  softcap          > 0: scores = softcap * tanh(scores / softcap) before the softmax
  causal           True (generation): a query sees keys up to its own position; False (encoder
                   bodies of embedding models, compiled_engine/pooling/): every query sees its
                   whole sequence (all seq_len keys). Only the torch op takes False: the
                   other backends attend causally and refuse it (select_attention_backend)
Returns [T, Hq, D] in query's dtype (maths in float32 whatever the cache holds).

Padding: rows with slot -1 have their k/v written into the cache's last block, the scratch
block, which the engine never hands to a sequence (worker/kv_cache.py allocates it on top of
the usable blocks). A fixed-shape write keeps the op free of data-dependent shapes, hence of
host syncs, so it can run inside a CUDA graph; no real block is ever touched by padding.
"""

from __future__ import annotations

import torch

from compiled_engine.kernels.source_version import source_version

# Goes into every compile-cache key: a hash of this source (schema, fake impl; kernels/source_version.py).
PAGED_ATTENTION_VERSION = source_version(__name__)


@torch.library.custom_op("compiled_engine::paged_attention", mutates_args=("kv_cache",))
def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = -1,
    softcap: float = 0.0,
    causal: bool = True,
) -> torch.Tensor:
    from compiled_engine.kernels.reference import paged_attention_reference

    return paged_attention_reference(
        query,
        key,
        value,
        kv_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window,
        softcap,
        causal,
    )


@paged_attention.register_fake
def _paged_attention_fake(
    query,
    key,
    value,
    kv_cache,
    slot_mapping,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    sliding_window=-1,
    softcap=0.0,
    causal=True,
):
    # A fresh contiguous tensor: Inductor fails at run time with empty_like of a view.
    return query.new_empty(query.shape)
