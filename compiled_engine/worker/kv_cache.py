"""Sizing and allocating the paged KV cache: one tensor per layer, allocated once."""

from __future__ import annotations

import logging
import math

import torch

from compiled_engine.kernels import kv_quant

logger = logging.getLogger(__name__)

# On CPU the cache lives in host RAM next to everything else; 1 GiB serves hundreds of
# concurrent sequences of a small model without starving the rest of the process.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# On CUDA, the fraction of the memory still free after a profiling forward that the cache takes.
CUDA_KV_CACHE_FRACTION = 0.9
# Blocks allocated beyond the usable ones: the last is where padded rows write their k/v.
SCRATCH_BLOCKS = 1


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes one block costs across all layers (keys and values); for a quantized cache (int8 or
    fp8 `dtype`) its codes and their per-token, per-head scales (kernels/kv_quant.py)."""
    element = torch.empty((), dtype=dtype).element_size()
    row = kv_quant.row_width(head_dim, dtype)
    return 2 * num_layers * block_size * num_kv_heads * row * element


def blocks_for_memory(memory_bytes: int, block_bytes: int) -> int:
    """Usable blocks that fit in `memory_bytes` next to the scratch block."""
    return int(memory_bytes // block_bytes) - SCRATCH_BLOCKS


def useful_block_limit(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """More blocks than every sequence at full length can never be used."""
    return max_num_seqs * math.ceil(max_model_len / block_size)


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One [2, num_blocks + 1, block_size, Hkv, D] tensor per layer (keys at 0, values at 1).

    `num_blocks` are the blocks sequences use (ids 0..num_blocks-1, the block pool's); the
    extra last one is the scratch block padded rows write to (kernels/paged_attention.py).
    An int8 or fp8 `dtype` makes a quantized cache, whose last dimension is a packed row of
    codes and scale instead of D (kernels/kv_quant.py).
    Zero-filled so a padded or stale slot never holds NaN/Inf that a masked-out score could
    still turn into NaN through 0 * inf.
    """
    row = kv_quant.row_width(head_dim, dtype)
    return [
        torch.zeros(2, num_blocks + SCRATCH_BLOCKS, block_size, num_kv_heads, row, dtype=dtype, device=device)
        for _ in range(num_layers)
    ]


def log_cache_capacity(
    num_blocks: int, block_size: int, max_model_len: int, kv_cache_dtype: str = "auto"
) -> None:
    tokens = num_blocks * block_size
    logger.info(
        "KV cache (%s): %d blocks x %d tokens = %d tokens; max concurrency at %d tokens per request: %.2fx",
        kv_cache_dtype,
        num_blocks,
        block_size,
        tokens,
        max_model_len,
        tokens / max_model_len,
    )
