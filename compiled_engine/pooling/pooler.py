"""From a step's hidden-state rows to one embedding per input: pooling, truncation, normalization.

The captured graph returns only the rows the pooling type reads (`pooled_row_indices`): each
input's last token (LAST), its first (CLS) or all of its tokens (MEAN). Reductions run in float32.
Matryoshka truncation (`dimensions`) keeps the first values and happens before normalization,
so a truncated embedding of a normalizing model has unit length (vLLM's order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from compiled_engine.pooler_config import PoolingSpec
from compiled_engine.pooling_params import PoolingParams


def pooled_row_indices(pooling_type: str, lengths: Sequence[int]) -> torch.Tensor:
    """[K] int64: the step's token rows the pooler reads, inputs packed back to back."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    ends = torch.cumsum(lens, 0)
    if pooling_type == "LAST":
        return ends - 1
    if pooling_type == "CLS":
        return ends - lens
    return torch.arange(int(ends[-1]), dtype=torch.int64)


def pool_rows(rows: torch.Tensor, pooling_type: str, lengths: Sequence[int]) -> torch.Tensor:
    """[K, H] rows (from `pooled_row_indices`) -> [S, H] float32, one per input."""
    rows = rows.float()
    if pooling_type != "MEAN":
        return rows
    lens = torch.tensor(lengths, dtype=torch.int64, device=rows.device)
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=rows.device), lens)
    sums = rows.new_zeros(len(lengths), rows.shape[1]).index_add_(0, owner, rows)
    return sums / lens[:, None].to(rows.dtype)


def finish_embedding(pooled: torch.Tensor, spec: PoolingSpec, params: PoolingParams) -> list[float]:
    """One pooled [H] vector -> the request's embedding: truncated to `dimensions`, then normalized."""
    if params.dimensions is not None:
        pooled = pooled[: params.dimensions]
    normalize = spec.normalize if params.normalize is None else params.normalize
    if normalize:
        pooled = F.normalize(pooled, p=2, dim=-1)
    return pooled.tolist()
