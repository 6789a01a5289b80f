"""Per-request KV block lists on top of a `BlockPool`, and the prefix cache's keys.

A request's blocks are an ordered list: token at position p lives in block
`block_ids[p // block_size]`, slot `p % block_size`. Lists only grow until the request is
freed (finished or preempted), which returns every block at once.

Prefix caching (`enable_caching=True`): every FULL block of a request's known tokens gets a
chained key, `hash_block_tokens(key of the block before, the block's token ids, extra keys)`, so
a key names the whole token prefix up to the block's end (the KV of a position depends on every
token before it), plus the request's cache salt. A block is registered under its key once its
tokens are computed (`cache_computed_blocks`, called from the scheduler's update); a new request
then looks its keys up (`find_cached_prefix`) and starts with those blocks shared
(`allocate_slots(..., cached_block_ids=...)`), computing only the rest.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence

from compiled_engine.core.block_pool import BlockPool
from compiled_engine.records.request import Request

# The "key of the block before" the first block: a fixed 32 bytes like every other key, so the
# encoding below has no special case. The version string changes if the encoding ever does.
_ROOT_PARENT_HASH = hashlib.sha256(b"compiled_engine prefix cache v1").digest()


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> bytes:
    """SHA-256 over a canonical encoding of (parent key, token ids, extra keys).

    The encoding is injective: the parent key is always 32 bytes, the token count comes first and
    each token is 8 bytes, and each extra key is length-prefixed UTF-8, so two different inputs
    never hash the same bytes. Two different prefixes can then share a key only through a SHA-256
    collision: with n cached blocks the chance is about n² / 2²⁵⁷ (below 1e-60 even at a billion
    blocks), far less likely than a hardware memory error, so a hit is trusted without comparing
    tokens.
    """
    digest = hashlib.sha256(_ROOT_PARENT_HASH if parent_hash is None else parent_hash)
    digest.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    for key in extra_keys:
        data = key.encode("utf-8")
        digest.update(struct.pack("<I", len(data)))
        digest.update(data)
    return digest.digest()


def token_range(request: Request, start: int, end: int) -> tuple[int, ...]:
    """Tokens [start, end) of prompt + outputs, without building the concatenated list."""
    prompt = request.prompt_token_ids
    num_prompt = len(prompt)
    if end <= num_prompt:
        return tuple(prompt[start:end])
    outputs = request.output_token_ids
    if start >= num_prompt:
        return tuple(outputs[start - num_prompt : end - num_prompt])
    return tuple(prompt[start:]) + tuple(outputs[: end - num_prompt])


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self._block_pool = BlockPool(num_blocks)
        self._block_size = block_size
        self._enable_caching = enable_caching
        # Tuples, replaced when a request gains blocks (once per block_size tokens), so every
        # step's `get_block_ids` hands out the record itself, not a copy.
        self._request_blocks: dict[str, tuple[int, ...]] = {}
        # Per request: how many of its leading blocks are settled for the prefix cache (registered
        # by it, taken as hits, or found to duplicate a block already cached).
        self._num_settled_blocks: dict[str, int] = {}

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def enable_caching(self) -> bool:
        return self._enable_caching

    @property
    def num_blocks(self) -> int:
        return self._block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks new work can take, evictable cached blocks included."""
        return self._block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0.0 (empty) to 1.0 (full)."""
        return 1.0 - self._block_pool.num_free_blocks / self._block_pool.num_blocks

    @property
    def block_pool(self) -> BlockPool:
        return self._block_pool

    @property
    def owned_blocks(self) -> Mapping[str, tuple[int, ...]]:
        """Each request's blocks in position order (live, read-only: `blocks_for` and
        `allocate_slots` change it). The scheduler's decode loop reads it for every running
        request every step, where most rows need only this lookup, not a `blocks_for` call."""
        return self._request_blocks

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"token count must be non-negative, got {num_tokens}")
        return -(-num_tokens // self._block_size)

    def blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        """Extra blocks the request needs so that its list holds `num_total_tokens` tokens."""
        owned = len(self._request_blocks.get(request_id, ()))
        return max(0, self.num_blocks_for_tokens(num_total_tokens) - owned)

    def block_hashes(self, request: Request) -> list[bytes]:
        """Keys of every full block of the request's known tokens (extended as tokens arrive).

        Known tokens only: a token a step in flight is still sampling (a placeholder) is never part
        of a key.
        """
        hashes = request.block_hashes
        size = self._block_size
        while len(hashes) < request.num_tokens // size:
            index = len(hashes)
            extra_keys = (request.cache_salt,) if index == 0 and request.cache_salt is not None else ()
            tokens = token_range(request, index * size, (index + 1) * size)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens, extra_keys))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks holding the request's longest known prefix, in order.

        Stops one token short of the known tokens: the last one is always computed, since its
        logits are what the request samples from (so a fully cached prompt recomputes its last
        block).
        """
        if not self._enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self._block_size
        hits = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block_id = self._block_pool.cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(
        self, request_id: str, num_total_tokens: int, cached_block_ids: Sequence[int] = ()
    ) -> bool:
        """Grow the request's list to cover `num_total_tokens`; False (and no change) if the pool
        lacks the blocks.

        `cached_block_ids` (a new request's prefix-cache hits, from `find_cached_prefix`) start the
        list, shared; a hit waiting in the free queue is taken back out of it, so it counts
        against the free blocks like a new one.
        """
        if not cached_block_ids:
            return self.blocks_for(request_id, num_total_tokens) is not None
        if request_id in self._request_blocks:
            raise ValueError(f"request {request_id!r} already holds blocks: cache hits start a new list")
        return self._grow(request_id, num_total_tokens, cached_block_ids)

    def blocks_for(self, request_id: str, num_total_tokens: int) -> tuple[int, ...] | None:
        """`allocate_slots(request_id, num_total_tokens)` then `get_block_ids(request_id)` in one
        call; None, and no change, when the pool lacks the blocks."""
        blocks = self._request_blocks.get(request_id)
        if blocks is not None and 0 <= num_total_tokens <= len(blocks) * self._block_size:
            # Most calls, once per running request every step: it mostly owns enough already.
            return blocks
        if not self._grow(request_id, num_total_tokens, ()):
            return None
        return self._request_blocks.get(request_id, ())

    def _grow(self, request_id: str, num_total_tokens: int, cached_block_ids: Sequence[int]) -> bool:
        """The slow path of both: new blocks from the pool (and the hits taken), or False."""
        owned = len(self._request_blocks.get(request_id, ())) + len(cached_block_ids)
        num_new = max(0, self.num_blocks_for_tokens(num_total_tokens) - owned)
        num_revived = sum(1 for block_id in cached_block_ids if self._block_pool.ref_count(block_id) == 0)
        if num_new + num_revived > self._block_pool.num_free_blocks:
            return False
        if cached_block_ids:
            # Before allocating: the new blocks must not evict the hits.
            self._block_pool.take(cached_block_ids)
            self._request_blocks[request_id] = tuple(cached_block_ids)
            self._num_settled_blocks[request_id] = len(cached_block_ids)
        if num_new:
            self._request_blocks[request_id] = (
                *self._request_blocks.get(request_id, ()),
                *self._block_pool.allocate(num_new),
            )
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose tokens are all computed
        (`request.num_computed_tokens`) in the prefix cache."""
        if not self._enable_caching:
            return
        request_id = request.request_id
        settled = self._num_settled_blocks.get(request_id, 0)
        if request.num_computed_tokens // self._block_size <= settled:
            return  # most calls: no block was completed since the last one
        block_ids = self._request_blocks.get(request_id, ())
        num_full = min(request.num_computed_tokens // self._block_size, len(block_ids))
        if settled >= num_full:
            return
        hashes = self.block_hashes(request)
        for index in range(settled, num_full):
            # False when an identical block is cached already: this copy stays out of the index.
            self._block_pool.cache_block(block_ids[index], hashes[index])
        self._num_settled_blocks[request_id] = num_full

    def get_block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's blocks in position order; empty if it holds none."""
        return self._request_blocks.get(request_id, ())

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks to the pool (no-op if it holds none)."""
        block_ids = self.release(request_id)
        if block_ids:
            self._block_pool.free(block_ids)

    def release(self, request_id: str) -> list[int]:
        """Forget the request's blocks without returning them to the pool: the caller frees them
        later (once no step in flight reads them) with `block_pool.free`.

        Listed last block first: freed in that order, a request's tail is evicted before its
        prefix, which other requests are likelier to share.
        """
        self._num_settled_blocks.pop(request_id, None)
        return list(reversed(self._request_blocks.pop(request_id, ())))
