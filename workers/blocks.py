"""A free list of one engine's KV block ids: every worker of an engine stores a request in the same block ids.

Pure module (standard library only). Invariants: a block is either free or allocated, never both; a double free is
refused whole, so a caller's bug cannot hand one block to two requests.
"""

from __future__ import annotations

from collections.abc import Sequence


class NoFreeBlocks(RuntimeError):
    """The engine's pool has too few free blocks for a request."""


class BlockAllocator:
    """A free list of an engine's block ids (every worker of an engine uses the same ids for a request)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: low ids first, in runs
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` free block ids.

        Raises:
            NoFreeBlocks: fewer than `count` are free (nothing is allocated then).
        """
        if count > len(self._free):
            raise NoFreeBlocks(f"{count} blocks wanted, {len(self._free)} of {self.num_blocks} free")
        ids = [self._free.pop() for _ in range(count)]
        self._used.update(ids)
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Return blocks to the free list.

        Raises:
            ValueError: a block is not allocated (a double free); nothing is freed then.
        """
        stray = [b for b in block_ids if b not in self._used]
        if stray or len(set(block_ids)) != len(block_ids):
            raise ValueError(f"blocks {stray or list(block_ids)} are not allocated (double free?)")
        self._used.difference_update(block_ids)
        self._free.extend(sorted(block_ids, reverse=True))
