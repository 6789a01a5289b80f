"""Per-request KV block lists on top of a `BlockPool`.

A request's blocks are an ordered list: token at position p lives in block
`block_ids[p // block_size]`, slot `p % block_size`. Lists only grow until the request is
freed (finished or preempted), which returns every block at once.
"""

from __future__ import annotations

from compiled_engine.core.block_pool import BlockPool


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self._block_pool = BlockPool(num_blocks)
        self._block_size = block_size
        self._request_blocks: dict[str, list[int]] = {}

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0.0 (empty) to 1.0 (full)."""
        return 1.0 - self._block_pool.num_free_blocks / self._block_pool.num_blocks

    @property
    def block_pool(self) -> BlockPool:
        return self._block_pool

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"token count must be non-negative, got {num_tokens}")
        return -(-num_tokens // self._block_size)

    def blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        """Extra blocks the request needs so that its list holds `num_total_tokens` tokens."""
        owned = len(self._request_blocks.get(request_id, ()))
        return max(0, self.num_blocks_for_tokens(num_total_tokens) - owned)

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Grow the request's list to cover `num_total_tokens`; False (and no change) if the pool
        lacks the blocks."""
        needed = self.blocks_needed(request_id, num_total_tokens)
        if needed > self._block_pool.num_free_blocks:
            return False
        if needed:
            self._request_blocks.setdefault(request_id, []).extend(self._block_pool.allocate(needed))
        return True

    def get_block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's blocks in position order; empty if it holds none."""
        return tuple(self._request_blocks.get(request_id, ()))

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks to the pool (no-op if it holds none)."""
        block_ids = self.release(request_id)
        if block_ids:
            self._block_pool.free(block_ids)

    def release(self, request_id: str) -> list[int]:
        """Forget the request's blocks without returning them to the pool: the caller frees them
        later (once no step in flight reads them) with `block_pool.free`."""
        return self._request_blocks.pop(request_id, [])
