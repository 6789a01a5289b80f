"""`compiled_engine::prefill_attention`: attention over packed whole sequences, with no KV cache.

A pooling model's step (compiled_engine/pooling/) is prefill only: every sequence is in the step
whole, from its first token, and nothing is kept for later steps. So its attention needs no
paged cache: each sequence attends over its own rows of the step's keys and values. This op does
exactly that, one `scaled_dot_product_attention` call per sequence (a [1, H, n, D] view of its
rows; GQA through `enable_gqa`), which on the CPU runs torch's blocked flash kernel: matrix
products over blocks of queries and keys. The paged op's CPU kernel walks one query row at a
time (decode's shape), which on 512-token prefills ran ~25x slower per FLOP.

Shapes (T = tokens this step, S = sequences this step):
  query            [T, Hq, D]
  key, value       [T, Hkv, D]      Hq % Hkv == 0
  query_start_loc  [S+1] int        sequence s owns rows query_start_loc[s]:query_start_loc[s+1],
                                    positions 0 ... n-1 of that sequence
  scale            softmax scale applied to q·k
  causal           True: a row sees its sequence's rows up to itself; False (encoder bodies):
                   its whole sequence
Returns [T, Hq, D] in query's dtype; rows past query_start_loc[-1] are zeros.

The boundaries are read to the host (one small copy): the per-sequence loop needs them as ints.
No sliding window and no soft-capping: a pooling graph whose attention has either keeps the
paged op (compiled_engine/pooling/prefill_attention_pass.py decides).
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

from compiled_engine.kernels.source_version import source_version

# Goes into any compile-cache key a graph calling this op gets.
PREFILL_ATTENTION_VERSION = source_version(__name__)


@torch.library.custom_op("compiled_engine::prefill_attention", mutates_args=())
def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool = True,
) -> torch.Tensor:
    _check_inputs(query, key, value, query_start_loc)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    bounds = query_start_loc.tolist()
    end = bounds[-1] if bounds else 0
    out[end:].zero_()
    group = query.shape[1] // key.shape[1]
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        if stop <= start:
            continue
        # [n, H, D] rows -> [1, H, n, D] views; SDPA reads the strides as they are.
        q = query[start:stop].transpose(0, 1).unsqueeze(0)
        k = key[start:stop].transpose(0, 1).unsqueeze(0)
        v = value[start:stop].transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=group > 1
        )
        out[start:stop] = attended[0].transpose(0, 1)
    return out


@prefill_attention.register_fake
def _prefill_attention_fake(query, key, value, query_start_loc, scale, causal=True):
    # A fresh contiguous tensor, as the real op returns.
    return query.new_empty(query.shape)


def _check_inputs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_start_loc: torch.Tensor
) -> None:
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(
            "query, key and value must be [T, H, D], got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.shape != value.shape or key.shape[0] != query.shape[0] or key.shape[2] != query.shape[2]:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must match query "
            f"{tuple(query.shape)} in tokens and head size"
        )
    if query.shape[1] % key.shape[1] != 0:
        raise ValueError(f"{query.shape[1]} query heads do not group over {key.shape[1]} key heads")
    if query_start_loc.dim() != 1:
        raise ValueError(f"query_start_loc must be [S+1], got {tuple(query_start_loc.shape)}")


@torch.library.custom_op("compiled_engine::prefill_attention_rows", mutates_args=())
def prefill_attention_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    causal: bool = True,
) -> torch.Tensor:
    """`prefill_attention(...)[rows]`, attending only those query rows: [K, Hq, D].

    A pooling graph that reads one row per sequence (last-token or CLS pooling) needs its last
    layer's attention only there (compiled_engine/pooling/pooled_rows_pass.py). Each row attends
    over its own sequence's keys: up to itself when `causal`, else all of them.
    """
    _check_inputs(query, key, value, query_start_loc)
    bounds = query_start_loc.tolist()
    out = torch.empty((rows.shape[0], *query.shape[1:]), dtype=query.dtype, device=query.device)
    group = query.shape[1] // key.shape[1]
    for index, row in enumerate(rows.tolist()):
        sequence = bisect.bisect_right(bounds, row) - 1
        if not 0 <= sequence < len(bounds) - 1:
            raise ValueError(f"row {row} is in no sequence of query_start_loc {bounds}")
        start = bounds[sequence]
        stop = row + 1 if causal else bounds[sequence + 1]
        q = query[row : row + 1].transpose(0, 1).unsqueeze(0)  # [1, Hq, 1, D]
        k = key[start:stop].transpose(0, 1).unsqueeze(0)
        v = value[start:stop].transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=group > 1)
        out[index] = attended[0, :, 0]
    return out


@prefill_attention_rows.register_fake
def _prefill_attention_rows_fake(query, key, value, query_start_loc, rows, scale, causal=True):
    return query.new_empty((rows.shape[0], *query.shape[1:]))
