"""In-process fakes of kvsvc's I/O for unit tests of the service logic: `LoopbackTransport`.

Imports: stdlib, `kvsvc.core.errors`, `kvsvc.core.planner` (the address rule), `kvsvc.transport.base` (no mooncake, no
torch). Invariants: the fake keeps the real transport's contract (same address checks before anything is written, same
errors, same statistics, `write` never returns while a copy is under way); faults are switched on explicitly and never
happen by chance.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
from collections.abc import Sequence

from kvsvc.core.errors import ERR_FAILED
from kvsvc.core.messages import IpcHandle
from kvsvc.core.planner import AddressRanges, Descriptors, Region, as_rows, check_descriptors
from kvsvc.transport.base import TransportClosed, TransportStatistics, WriteFailed, Written

_session_ids = itertools.count(1)


class LoopbackTransport:
    """A `Transport` whose peers live in this process: `write` copies with `ctypes.memmove`.

    Fault switches: `fail_next_writes(code, count, after_descriptors)` makes the next writes end in a `WriteFailed`
    (optionally after copying some descriptors, like a peer dying mid-write); `stall()` holds every write before it
    copies anything until `release()`. A write cancelled while stalled copied nothing and re-raises at once.
    """

    def __init__(self, session_id: str | None = None) -> None:
        self._session_id = session_id or f"loopback:{next(_session_ids)}"
        self._local = AddressRanges()
        self._peers: dict[str, AddressRanges] = {}
        self._closed = False
        self._released = asyncio.Event()
        self._released.set()
        self._fail_code = ERR_FAILED
        self._fail_count = 0
        self._fail_after = 0
        self._bytes = self._descriptors = self._completed = self._failures = self._refused = 0
        self._in_flight = 0
        self.writes: list[tuple[str, list[tuple[int, int, int]]]] = []  # every write attempted past the checks

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def local_session_id(self) -> str:
        return ""  # no same-host plane (`kvsvc.transport.routed.RoutedTransport` adds one)

    # -- fault switches ---------------------------------------------------------------------------------------

    def fail_next_writes(self, code: int = ERR_FAILED, count: int = 1, after_descriptors: int = 0) -> None:
        """Make the next `count` writes end in `WriteFailed(code)` after copying `after_descriptors` descriptors."""
        self._fail_code, self._fail_count, self._fail_after = code, count, after_descriptors

    def stall(self) -> None:
        """Hold every write (before it copies anything) until `release`."""
        self._released.clear()

    def release(self) -> None:
        """Let stalled and later writes proceed."""
        self._released.set()

    # -- the Transport protocol -----------------------------------------------------------------------------------

    def register(self, regions: Sequence[Region]) -> None:
        """Raises TransportError on an empty or overlapping region (nothing registered), TransportClosed if closed."""
        if self._closed:
            raise TransportClosed("transport closed")
        staged = AddressRanges(self._local.regions())
        for addr, length in regions:
            staged.add(addr, length)
        self._local = staged

    def add_peer(self, session_id: str, regions: Sequence[Region]) -> None:
        self._peers[session_id] = AddressRanges(regions)

    def remove_peer(self, session_id: str) -> None:
        self._peers.pop(session_id, None)

    async def write(self, peer: str, descriptors: Descriptors) -> Written:
        """Copy the descriptors into the peer's memory; a `WriteFailed` when `fail_next_writes` switched it on.
        Raises InvalidDescriptor (before copying anything), TransportClosed. Cancellation while stalled leaves
        nothing copied; the copy itself is synchronous, so it cannot be interrupted halfway."""
        descriptors = as_rows(descriptors)
        if self._closed:
            self._refused += 1
            raise TransportClosed(f"transport closed; write to {peer} refused")
        try:
            total = check_descriptors(descriptors, self._local, self._peers.get(peer), peer)
        except Exception:
            self._refused += 1
            raise
        self.writes.append((peer, [(d[0], d[1], d[2]) for d in descriptors]))
        self._in_flight += 1
        try:
            await self._released.wait()
            if self._closed:
                raise TransportClosed(f"transport closed during a write to {peer}")
            failing = self._fail_count > 0
            if failing:
                self._fail_count -= 1
            copied = 0
            for i, (src, dst, length) in enumerate(descriptors):
                if failing and i >= self._fail_after:
                    break
                ctypes.memmove(dst, src, length)
                copied += length
                self._descriptors += 1
            self._bytes += copied
            if failing:
                self._failures += 1
                done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                done.set_result(None)
                return WriteFailed(f"injected failure of a write to {peer}", self._fail_code, peer=peer, drained=done)
            self._completed += 1
            return total
        finally:
            self._in_flight -= 1

    async def drained(self, peer: str | None = None) -> None:
        """Nothing ever moves in the background here: returns at once."""

    def start_write(self, peer: str, descriptors: Descriptors) -> asyncio.Future[Written] | None:
        """No fast path: every write goes through `write` (the service then runs it as a task)."""
        return None

    async def reachable(
        self,
        session: str,
        regions: Sequence[Region],
        via: tuple[tuple[str, int], tuple[str, int]] | None = None,
        handles: Sequence[IpcHandle] = (),
    ) -> str:
        """Writes to any added peer can go as far as this transport knows: "" always."""
        return ""

    async def peer_gone(self, session: str) -> bool:
        """Cannot tell: a lost peer keeps its receives waiting for the abort grace."""
        return False

    def statistics(self) -> TransportStatistics:
        return TransportStatistics(
            bytes_written=self._bytes,
            descriptors_written=self._descriptors,
            writes_completed=self._completed,
            failures=self._failures,
            refused=self._refused,
            writes_in_flight=self._in_flight,
            descriptors_in_flight=0,
            peers=len(self._peers),
            registered_bytes=self._local.total_bytes,
        )

    async def close(self) -> None:
        """Refuse new writes; stalled writes are released and raise TransportClosed. Idempotent."""
        self._closed = True
        self._released.set()
