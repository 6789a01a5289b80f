"""How many KV cache blocks the engine allocates, given a byte budget (worker/kv_cache.py allocates)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from compiled_engine.config import EngineConfig
from compiled_engine.kernels import kv_quant
from compiled_engine.model_loader.loader import LoadedModel
from compiled_engine.worker import kv_cache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheLayout:
    """One rank's KV cache but for its block count: what a block costs and how to allocate n."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # this rank's share (all of them without tensor parallelism)
    head_dim: int
    dtype: torch.dtype  # the cache's storage: the model's dtype, or int8 / fp8 codes (kernels/kv_quant.py)
    device: torch.device

    @classmethod
    def of(cls, loaded: LoadedModel, config: EngineConfig) -> KVCacheLayout:
        mc = loaded.model_config
        kv_heads = loaded.tensor_parallel.local_kv_heads if loaded.tensor_parallel else mc.num_kv_heads
        dtype = kv_quant.storage_dtype(config.kv_cache_dtype, mc.dtype)
        return cls(mc.num_layers, config.block_size, kv_heads, mc.head_dim, dtype, config.device)

    @property
    def block_bytes(self) -> int:
        return kv_cache.bytes_per_block(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    def allocate(self, num_blocks: int) -> list[torch.Tensor]:
        shape = (self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return kv_cache.allocate_kv_caches(*shape, self.dtype, self.device)


def blocks_for_budget(
    memory: int,
    layout: KVCacheLayout,
    config: EngineConfig,
    agree_min: Callable[[int], int] | None = None,
) -> int:
    """The blocks `memory` bytes hold, never more than `max_num_seqs` sequences at full length can
    use. `agree_min` (tensor parallelism) makes every rank take the smallest count that fits on all."""
    block_bytes = layout.block_bytes
    num_blocks = min(
        kv_cache.blocks_for_memory(memory, block_bytes),
        kv_cache.useful_block_limit(config.max_num_seqs, config.max_model_len, config.block_size),
    )
    if agree_min is not None:
        num_blocks = agree_min(num_blocks)
    if num_blocks < 1:
        raise ValueError(f"{memory} bytes of KV cache memory do not hold one block ({block_bytes} bytes)")
    return num_blocks


def cuda_free_memory_after(run_largest_step: Callable[[], None], device: torch.device) -> int:
    """Bytes left for the KV cache after the largest step has run once, on CUDA."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        run_largest_step()
    torch.cuda.synchronize(device)
    _, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    return max(0, int(total * kv_cache.CUDA_KV_CACHE_FRACTION) - peak)


def report_capacity(num_blocks: int, config: EngineConfig) -> None:
    if num_blocks * config.block_size < config.max_model_len:
        logger.warning(
            "KV cache holds %d tokens, less than max_model_len=%d: longer requests are rejected",
            num_blocks * config.block_size,
            config.max_model_len,
        )
    kv_cache.log_cache_capacity(num_blocks, config.block_size, config.max_model_len, config.kv_cache_dtype)
