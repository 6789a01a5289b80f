"""A fixed pool of KV-cache blocks: reference counts and a FIFO free list.

Block ids are indices into the runner's KV-cache tensors, so the pool never creates or
destroys blocks, it only hands ids out and takes them back. Reference counts exist so that
prefix caching can later share one block between several requests.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class BlockPoolExhaustedError(RuntimeError):
    """More blocks were requested than are free; callers check `num_free_blocks` first."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # FIFO: a freed block goes to the back, so the least recently freed block is reused
        # first (a prefix cache wants recently freed blocks to survive as long as possible).
        self._free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """The free list in reuse order (a snapshot, for inspection and tests)."""
        return tuple(self._free_block_ids)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks off the free list, each with reference count 1."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks!r} blocks: need a non-negative int")
        if num_blocks > len(self._free_block_ids):
            raise BlockPoolExhaustedError(
                f"requested {num_blocks} KV blocks but only {len(self._free_block_ids)} of "
                f"{self._num_blocks} are free"
            )
        block_ids = [self._free_block_ids.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per listed id; blocks reaching zero return to the free list.

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
                self._free_block_ids.append(block_id)

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
