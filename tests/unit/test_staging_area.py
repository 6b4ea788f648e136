"""`StagingArea`'s lending: first come first served, a deadline that fails the lend (not the service), a withdrawn
waiter that lends nothing and lets the next in line through, and room that comes back in any order."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvsvc.service.staging_area import StagingArea, StagingFull

BASE = 0x1000


async def _no_gather(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> None:
    return None


def _area(size: int = 100) -> StagingArea:
    return StagingArea(BASE, size, _no_gather)


async def test_waiters_get_room_in_the_order_they_asked() -> None:
    area = _area()  # chunks of up to 50
    first = await area.lend(50, 1.0)
    second = await area.lend(50, 1.0)
    order: list[int] = []

    async def lend(size: int, tag: int) -> int:
        addr = await area.lend(size, 5.0)
        order.append(tag)
        return addr

    big = asyncio.ensure_future(lend(50, 1))
    await asyncio.sleep(0)
    small = asyncio.ensure_future(lend(10, 2))  # would fit sooner, but waits behind the larger one
    await asyncio.sleep(0)
    area.give_back(first)  # room for the first in line only
    await asyncio.wait_for(big, 1.0)
    await asyncio.sleep(0)
    assert order == [1] and not small.done()
    area.give_back(second)
    await asyncio.wait_for(small, 1.0)
    assert order == [1, 2] and area.waits == 2
    area.give_back(big.result())
    area.give_back(small.result())
    assert area.in_use == 0


async def test_a_lend_that_finds_no_room_in_time_fails_with_staging_full() -> None:
    area = _area()
    held = await area.lend(50, 1.0)
    await area.lend(50, 1.0)
    with pytest.raises(StagingFull, match="no room for 50 bytes"):
        await area.lend(50, 0.01)
    area.give_back(held)
    assert await area.lend(50, 0.01) == held  # the timed-out waiter left nothing behind


async def test_a_cancelled_waiter_lends_nothing_and_lets_the_next_one_through() -> None:
    area = _area()
    held = await area.lend(50, 1.0)
    other = await area.lend(40, 1.0)
    blocked = asyncio.ensure_future(area.lend(50, 5.0))
    await asyncio.sleep(0)
    behind = asyncio.ensure_future(area.lend(10, 5.0))  # fits now, but waits behind `blocked`
    await asyncio.sleep(0)
    assert not behind.done()
    blocked.cancel()
    addr = await asyncio.wait_for(behind, 1.0)
    assert addr == BASE + 90
    for a in (held, other, addr):
        area.give_back(a)
    assert area.in_use == 0


async def test_bad_sizes_and_unknown_returns_are_refused() -> None:
    area = _area()
    with pytest.raises(ValueError, match="exceeds the chunk size 50"):
        await area.lend(51, 1.0)
    with pytest.raises(KeyError):
        area.give_back(BASE + 7)
    with pytest.raises(ValueError, match="at least 2 bytes"):
        StagingArea(BASE, 1, _no_gather)
