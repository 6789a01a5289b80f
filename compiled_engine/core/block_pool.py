"""A fixed pool of KV-cache blocks: reference counts, an LRU free queue and the prefix-cache index.

Block ids are indices into the runner's KV-cache tensors, so the pool never creates or
destroys blocks, it only hands ids out and takes them back.

Prefix caching lives here as two small additions:
- a block may carry a hash (its chained content key, core/kv_cache_manager.py), registered with
  `cache_block` once its tokens are computed; `cached_block(hash)` finds it again;
- a freed block keeps its hash while it waits in the free queue, so it is both free (counted in
  `num_free_blocks`) and still findable. `take` revives such a block for a new owner; `allocate`
  takes the block at the front of the queue and forgets its hash (eviction).

The free queue is ordered by release time, least recently released first: `allocate` reuses the
blocks that have waited longest, so a recently freed cached block survives as long as possible.
A block with a reference is never in the queue, so nothing a request (or a step in flight) holds
can be evicted.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable


class BlockPoolExhaustedError(RuntimeError):
    """More blocks were requested than are free; callers check `num_free_blocks` first."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # Free blocks in reuse order (front first). An OrderedDict so that a cache hit can take a
        # block out of the middle in O(1).
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        self._cached_blocks: dict[bytes, int] = {}  # hash -> the block holding that content
        self._num_evictable = 0  # blocks both free and cached

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take, cached ones (evicted on reuse) included."""
        return len(self._free_queue)

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """The free queue in reuse order (a snapshot, for inspection and tests)."""
        return tuple(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or free."""
        return len(self._cached_blocks)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks nobody holds: free, yet a cache hit can still revive them."""
        return self._num_evictable

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        self._check_id(block_id)
        return self._block_hashes[block_id]

    def cached_block(self, block_hash: bytes) -> int | None:
        """The block registered under `block_hash`, if it has not been evicted."""
        return self._cached_blocks.get(block_hash)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks off the front of the free queue, each with reference count 1.

        A cached block taken this way is evicted: its hash is forgotten, its content will be
        overwritten.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks!r} blocks: need a non-negative int")
        if num_blocks > len(self._free_queue):
            raise BlockPoolExhaustedError(
                f"requested {num_blocks} KV blocks but only {len(self._free_queue)} of "
                f"{self._num_blocks} are free"
            )
        block_ids = [self._free_queue.popitem(last=False)[0] for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
            block_hash = self._block_hashes[block_id]
            if block_hash is not None:
                del self._cached_blocks[block_hash]
                self._block_hashes[block_id] = None
                self._num_evictable -= 1
        return block_ids

    def take(self, block_ids: Iterable[int]) -> None:
        """Add one reference per listed cached block (a prefix-cache hit), taking free ones back
        out of the free queue."""
        additions = Counter(block_ids)
        for block_id in additions:
            self._check_id(block_id)
            if self._block_hashes[block_id] is None:
                raise ValueError(f"KV block {block_id} is not in the prefix cache")
        for block_id, count in additions.items():
            if self._ref_counts[block_id] == 0:
                del self._free_queue[block_id]
                self._num_evictable -= 1
            self._ref_counts[block_id] += count

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Register an in-use block under `block_hash` (its tokens are computed). False, and no
        change, when another block already holds that content: this one stays uncached."""
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot cache KV block {block_id}: it is free")
        current = self._block_hashes[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"KV block {block_id} is already cached under another hash")
            return True
        if block_hash in self._cached_blocks:
            return False
        self._cached_blocks[block_hash] = block_id
        self._block_hashes[block_id] = block_hash
        return True

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per listed id; blocks reaching zero go to the back of the free
        queue, in the order listed (so list first what should be evicted first).

        Validated as a whole before anything changes, so a bad call leaves the pool intact.
        """
        releases = Counter(block_ids)
        for block_id, count in releases.items():
            self._check_id(block_id)
            if count > self._ref_counts[block_id]:
                raise ValueError(
                    f"double free of KV block {block_id}: released {count} time(s) but it has "
                    f"{self._ref_counts[block_id]} reference(s)"
                )
        for block_id, count in releases.items():
            self._ref_counts[block_id] -= count
            if self._ref_counts[block_id] == 0:
                self._free_queue[block_id] = None
                if self._block_hashes[block_id] is not None:
                    self._num_evictable += 1

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference per listed id; only blocks already in use can be shared."""
        additions = Counter(block_ids)
        for block_id in additions:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"cannot add a reference to KV block {block_id}: it is free")
        for block_id, count in additions.items():
            self._ref_counts[block_id] += count

    def _check_id(self, block_id: int) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise TypeError(f"block ids are ints, got {block_id!r}")
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"KV block id {block_id} is outside the pool [0, {self._num_blocks})")
