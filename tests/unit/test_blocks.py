"""An engine's block allocator hands each block to one request at a time and refuses double frees."""

from __future__ import annotations

import pytest

from workers.blocks import BlockAllocator, NoFreeBlocks


def test_allocated_blocks_are_distinct_until_freed() -> None:
    allocator = BlockAllocator(6)
    first, second = allocator.allocate(4), allocator.allocate(2)
    assert sorted(first + second) == list(range(6)) and allocator.num_free == 0
    allocator.free(first)
    assert sorted(allocator.allocate(4)) == sorted(first)


def test_too_large_a_request_allocates_nothing() -> None:
    allocator = BlockAllocator(3)
    with pytest.raises(NoFreeBlocks, match="4 blocks wanted, 3 of 3 free"):
        allocator.allocate(4)
    assert allocator.num_free == 3


def test_a_double_free_is_refused_whole() -> None:
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2)
    allocator.free(blocks[:1])
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free(blocks)
    assert allocator.num_free == 3
