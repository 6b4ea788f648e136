"""The `Transport` protocol the asyncio service writes KV through, its statistics, errors and address checks.

Imports: the standard library, numpy and `kvsvc.core.errors` only (`kvsvc.core.messages` for a type; no asyncio loop
work, no mooncake, no torch), so the pure core, the service and the fakes can all share it. A write's descriptors come
as tuples or as one (N, 3) int64 table (`Descriptors`), the service's form: a plan of thousands of pieces then costs no
Python object per piece on the way to the copy (a 4,032-piece table made tuples and back took 1.3 ms on the CI
machine, where its device copies take microseconds), and is checked whole (`check_table`). Invariants: a write is
refused (`InvalidDescriptor`) before anything is submitted unless every source range lies inside registered local
memory and every destination range inside the peer's published regions; a write never returns or raises while a
descriptor it submitted may still move data, except with a `WriteFailed` whose `drained` future says when that is over.
A data-plane fault is a value a write returns (`Written`), never an exception: a plane raises only for the caller's
mistakes (`InvalidDescriptor`) and its owner's close (`TransportClosed`).
"""

from __future__ import annotations

import asyncio
import os
import threading
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol, TypeAlias, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvsvc.core.errors import TransportError

if TYPE_CHECKING:
    from kvsvc.core.messages import IpcHandle

# Mooncake's own codes (transfer engine `error.h`), reused so every `TransportError.code` reads the same way.
ERR_FAILED: Final = -1  # the engine reported the transfer failed, or refused to submit it
ERR_ADDRESS_NOT_REGISTERED: Final = -3  # a range outside registered (local) or published (peer) memory
ERR_ADDRESS_OVERLAPPED: Final = -7  # a registration overlaps one already registered

Region = tuple[int, int]
"""`(addr, length)` of a registered or published memory range."""

# Up to this many rows a table is checked row by row: the array operations cost about 15 us whatever the rows, a
# row about 0.2 us (a one-block request is the many-small-requests path).
ROWS_CHECKED_ONE_BY_ONE: Final = 48

DescriptorTable = npt.NDArray[np.int64]
"""A write's descriptors as an (N, 3) int64 table, rows `(src_addr, dst_addr, length)`."""

Descriptors = Sequence[tuple[int, int, int]] | DescriptorTable
"""What `Transport.write` takes: `(src_addr, dst_addr, length)` tuples, or the same rows as a table."""


class InvalidDescriptor(TransportError, ValueError):
    """A write was refused before submission: a range lies outside registered or published memory, a length is
    not positive, or the peer is unknown. Nothing was written; the caller's bug or a stale peer table."""


@dataclass(frozen=True, eq=False)
class WriteFailed:
    """How a write the engine failed ends (peer killed or frozen, queue full, target refused an address): the value
    `Transport.write` returns, never an exception. A data-plane fault is an outcome the writer decides on (the core's
    write-failure table, `kvsvc.core.sender.FAULT_WAITS`), not an error to unwind through it.

    `drained` resolves once no descriptor of the write can still move data: it is already done when the write
    ended after every submitted descriptor finished (the usual case), and still pending (`undrained` > 0) only
    when the peer stopped making progress, so the transport gave up waiting (see `MooncakeConfig.drain_timeout_s`).
    Do not reuse or free the source blocks, nor let the peer reuse the destination blocks, before it resolves.
    """

    message: str
    code: int = ERR_FAILED  # Mooncake's codes, as every `TransportError.code`
    peer: str = ""
    undrained: int = 0
    drained: asyncio.Future[None] | None = None

    def __str__(self) -> str:
        return self.message


Written: TypeAlias = int | WriteFailed
"""How a write ends: the bytes written, once every descriptor landed, or the engine's `WriteFailed`."""


class TransportClosed(TransportError):
    """The transport was closed by its owner: no new write or registration is accepted."""


@dataclass(frozen=True)
class TransportStatistics:
    """A snapshot of one transport; every field is a count since the transport was made (or a current level)."""

    bytes_written: int = 0  # bytes of descriptors that landed
    descriptors_written: int = 0  # descriptors that landed
    writes_completed: int = 0  # writes that returned their byte count
    failures: int = 0  # writes that ended in a WriteFailed
    refused: int = 0  # writes refused before submission (InvalidDescriptor, closed transport)
    writes_in_flight: int = 0  # writes that have not ended yet
    descriptors_in_flight: int = 0  # descriptors submitted to the engine and not finished (includes undrained ones)
    peers: int = 0  # peers added and not removed
    registered_bytes: int = 0  # local memory registered with the engine
    polls: int = 0  # status checks made by the completion poller
    fine_polls: int = 0  # poller wake-ups after a sub-millisecond nap (while descriptors keep finishing)


@runtime_checkable
class Transport(Protocol):
    """What the service needs from a data plane: one-sided writes of local registered memory into a peer's.

    A transport lives on one event loop (the one its first `write` runs on). `register` and the peer table
    methods are synchronous and cheap; `write` never blocks the loop.
    """

    @property
    def session_id(self) -> str:
        """The `host:rpc_port` peers use to reach this transport (`WorkerMetadata.transport_addr`)."""
        ...

    @property
    def local_session_id(self) -> str:
        """This worker's same-host session (`WorkerMetadata.samehost_addr`), "" for a transport without the same-host
        plane (`kvsvc.transport.routed.RoutedTransport` has one)."""
        ...

    def register(self, regions: Sequence[Region]) -> None:
        """Register local memory `(addr, length)` in bulk: the whole KV pool, once, before the worker is ready.

        Raises:
            TransportError: a region is empty, overlaps another (code -7), or the engine refused it.
            TransportClosed: after `close`.
        """
        ...

    def add_peer(self, session_id: str, regions: Sequence[Region]) -> None:
        """Publish a peer's KV regions: writes to `session_id` must land inside them. Replaces earlier regions.

        Raises:
            InvalidDescriptor: a region is empty.
        """
        ...

    def remove_peer(self, session_id: str) -> None:
        """Forget a peer (idempotent): later writes to it are refused; writes in flight finish on their own."""
        ...

    async def write(self, peer: str, descriptors: Descriptors) -> Written:
        """Write every `(src_addr, dst_addr, length)` into `peer` (tuples or a table); the bytes written once all
        landed, or the engine's `WriteFailed` (with its code) when it failed a descriptor or refused a submission:
        returned once every submitted descriptor of the write finished, or, if the peer makes no progress, with
        `drained` pending: await it before reusing the blocks.

        Raises:
            InvalidDescriptor: before anything is submitted, when a range is outside registered local memory or
                the peer's regions, a length is not positive, or the peer is unknown.
            TransportClosed: the transport is closed.

        Cancellation stops submitting the remaining descriptors, then waits (shielded from further cancels) until
        the submitted ones finished before re-raising `CancelledError`, so the blocks are safe to reuse after it.
        If the peer stops making progress meanwhile, it re-raises anyway with descriptors left in flight: await
        `drained(peer)` (or watch `statistics().descriptors_in_flight`) before reusing the blocks then.
        """
        ...

    async def drained(self, peer: str | None = None) -> None:
        """Return once no descriptor to `peer` (to any peer when None) is in flight. Cancellation-safe."""
        ...

    def start_write(self, peer: str, descriptors: Descriptors) -> asyncio.Future[Written] | None:
        """Optional fast path for small writes: submit now, from the running loop, without a task, and return a
        future that ends as `write` would (with what it returns, or raising `TransportClosed`); or return None,
        having submitted nothing, whenever `write` would do anything but submit at once. A transport without the
        fast path always returns None. Raises nothing; cancelling the future cancels nothing."""
        ...

    async def reachable(
        self,
        session: str,
        regions: Sequence[Region],
        via: tuple[tuple[str, int], tuple[str, int]] | None = None,
        handles: Sequence[IpcHandle] = (),
    ) -> str:
        """ "" when writes to peer `session`, which publishes `regions`, can go, else why not; asked before
        `add_peer`, so a peer that fails it changes nothing. A same-host plane checks the claimed process against
        the kernel and the control connection `via` (this end, far end) its hello came on, then probes once: the
        kernel's ptrace policy, or for the GPU plane opening the peer's exported allocations `handles`; other planes
        answer "". Raises nothing."""
        ...

    async def peer_gone(self, session: str) -> bool:
        """Optional proof of death: True only when the transfer engine at `session` is certainly gone (its process
        died), so nothing it sent can still land once what was in flight settled. False when alive, frozen,
        unreachable or unknown, and always for a transport that cannot tell. Raises nothing."""
        ...

    def statistics(self) -> TransportStatistics:
        """A snapshot of the counters and levels."""
        ...

    async def close(self) -> None:
        """Refuse new writes, wait (bounded) for in-flight descriptors to finish, then free the engine.
        Idempotent. Writes still in flight at the bound raise `TransportClosed`."""
        ...


class AddressRanges:
    """Sorted, non-overlapping `[start, end)` ranges, with containment and overlap checks in O(log n)."""

    def __init__(self, regions: Iterable[Region] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._arrays: tuple[DescriptorTable, DescriptorTable] | None = None  # for `holds`, built when first asked
        for addr, length in regions:
            self.add(addr, length)

    def add(self, addr: int, length: int) -> None:
        """Add a range. Raises `TransportError` (code -7) when it overlaps one already there, or on length <= 0."""
        if length <= 0 or addr < 0:
            raise TransportError(f"region ({addr:#x}, {length}) is empty or negative", ERR_FAILED)
        i = bisect_right(self._starts, addr)
        if (i > 0 and self._ends[i - 1] > addr) or (i < len(self._starts) and self._starts[i] < addr + length):
            raise TransportError(
                f"region [{addr:#x}, {addr + length:#x}) overlaps a registered one", ERR_ADDRESS_OVERLAPPED
            )
        self._starts.insert(i, addr)
        self._ends.insert(i, addr + length)
        self._arrays = None

    def contains(self, addr: int, length: int) -> bool:
        """True when `[addr, addr + length)` lies inside one range."""
        i = bisect_right(self._starts, addr) - 1
        return i >= 0 and addr + length <= self._ends[i]

    def holds(self, addr: DescriptorTable, length: DescriptorTable) -> bool:
        """`contains` of every `[addr[i], addr[i] + length[i])` at once (lengths taken as positive)."""
        if self._arrays is None:
            self._arrays = (np.array(self._starts, dtype=np.int64), np.array(self._ends, dtype=np.int64))
        starts, ends = self._arrays
        i = np.searchsorted(starts, addr, side="right") - 1
        return bool(np.all(i >= 0) and np.all(addr + length <= ends[np.maximum(i, 0)]))

    def regions(self) -> list[Region]:
        return [(s, e - s) for s, e in zip(self._starts, self._ends, strict=True)]

    @property
    def total_bytes(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    def __len__(self) -> int:
        return len(self._starts)


class WriteLedger:
    """The counters and in-flight level of a plane that finishes its own writes (the same-host and GPU planes): what
    their `statistics` and `drained` read. A write is `started` once it passed its checks and `ended` exactly once."""

    def __init__(self) -> None:
        self.bytes = self.descriptors = self.completed = self.failures = self.refused = 0
        self.in_flight = 0  # writes started and not ended
        self.descriptors_in_flight = 0
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()

    def started(self, descriptors: int) -> None:
        self.in_flight += 1
        self.descriptors_in_flight += descriptors
        self._idle.clear()

    def ended(self, descriptors: int, nbytes: int | None) -> None:
        """A started write ended: its `nbytes` landed, or it failed (`nbytes` None)."""
        self.in_flight -= 1
        self.descriptors_in_flight -= descriptors
        if not self.in_flight:
            self._idle.set()
        if nbytes is None:
            self.failures += 1
        else:
            self.bytes += nbytes
            self.descriptors += descriptors
            self.completed += 1

    async def drained(self) -> None:
        """Return once no write is in flight. Cancellation-safe."""
        while self.in_flight:
            await self._idle.wait()

    def statistics(self, peers: int, registered_bytes: int) -> TransportStatistics:
        return TransportStatistics(
            bytes_written=self.bytes,
            descriptors_written=self.descriptors,
            writes_completed=self.completed,
            failures=self.failures,
            refused=self.refused,
            writes_in_flight=self.in_flight,
            descriptors_in_flight=self.descriptors_in_flight,
            peers=peers,
            registered_bytes=registered_bytes,
        )


def settled(loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
    """A `WriteFailed.drained` for a write of which nothing can still move."""
    done: asyncio.Future[None] = loop.create_future()
    done.set_result(None)
    return done


# Forks seen by this process: a child forked from a loop's thread keeps its memory but runs no loop.
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


class OwnLoop:
    """The event loop a transport is used from, found cheaply on the hot path. asyncio's `get_running_loop` asks the
    kernel for the process id on every call (to notice a fork); with thousands of one-block writes a second that
    syscall alone took about 6 % of a P worker's loop. A thread id and a fork count cost none: `current` answers
    from them. It relies on a loop running in one thread for its whole life, as kvsvc's do."""

    __slots__ = ("_forks", "_thread", "loop")

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0
        self._forks = -1

    def current(self) -> asyncio.AbstractEventLoop:
        """The running loop of the calling thread (the bound one when it is running there, without a syscall).

        Raises:
            RuntimeError: no event loop runs in this thread.
        """
        loop = self.loop
        if loop is not None and self._thread == threading.get_ident() and self._forks == _forks and loop.is_running():
            return loop
        loop = asyncio.get_running_loop()
        self.loop, self._thread, self._forks = loop, threading.get_ident(), _forks
        return loop


def as_table(descriptors: Descriptors) -> DescriptorTable:
    """`descriptors` as an (N, 3) int64 table: a table is returned as it is, tuples are copied into one.

    Raises:
        InvalidDescriptor: they are not rows of three integers.
    """
    try:
        table = np.asarray(descriptors, dtype=np.int64)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidDescriptor(f"descriptors must be (src, dst, length) rows of integers: {exc}", ERR_FAILED) from None
    if table.size == 0:
        return table.reshape(0, 3)
    if table.ndim != 2 or table.shape[1] != 3:
        raise InvalidDescriptor(
            f"descriptors must be (src, dst, length) rows of integers, not of shape {table.shape}", ERR_FAILED
        )
    return table


def as_rows(descriptors: Descriptors) -> Sequence[tuple[int, int, int]]:
    """`descriptors` as `(src, dst, length)` tuples of Python ints, for an engine whose calls take them one by one."""
    if not isinstance(descriptors, np.ndarray):
        return descriptors
    src, dst, length = descriptors.reshape(-1, 3).T.tolist()
    return list(zip(src, dst, length, strict=True))


def check_table(table: DescriptorTable, local: AddressRanges, remote: AddressRanges | None, peer: str) -> int:
    """`check_descriptors` of a whole table at once: a handful of array operations whatever its length, then, only
    when something is wrong, the row by row check that names the first offending descriptor.

    Raises:
        InvalidDescriptor: as `check_descriptors`.
    """
    if remote is None or not len(table):
        return check_descriptors([], local, remote, peer)
    if len(table) <= ROWS_CHECKED_ONE_BY_ONE:
        return check_descriptors(table.tolist(), local, remote, peer)
    src, dst, length = table[:, 0], table[:, 1], table[:, 2]
    if bool(np.all(length > 0)) and local.holds(src, length) and remote.holds(dst, length):
        return int(length.sum())
    return check_descriptors(as_rows(table), local, remote, peer)


def checked_table(
    descriptors: Descriptors, local: AddressRanges, remote: AddressRanges | None, peer: str
) -> tuple[DescriptorTable, int]:
    """`descriptors` as a table and their total length, checked as `check_descriptors` does (tuples one by one, a
    table whole): what a plane that copies from a table does first.

    Raises:
        InvalidDescriptor: as `check_descriptors`, or rows that are not three integers.
    """
    if isinstance(descriptors, np.ndarray):
        table = as_table(descriptors)
        return table, check_table(table, local, remote, peer)
    total = check_descriptors(descriptors, local, remote, peer)
    return as_table(descriptors), total


def check_descriptors(
    descriptors: Sequence[tuple[int, int, int]],
    local: AddressRanges,
    remote: AddressRanges | None,
    peer: str,
) -> int:
    """Return the total length of `descriptors` if every one may be written to `peer`.

    Raises:
        InvalidDescriptor: unknown peer (`remote` is None), a length <= 0, a source range outside `local`, or a
            destination range outside `remote`; the message names the first offending descriptor.
    """
    if remote is None:
        raise InvalidDescriptor(f"unknown peer {peer!r}: add_peer it first", ERR_FAILED)
    total = 0
    for i, (src, dst, length) in enumerate(descriptors):
        if length <= 0:
            raise InvalidDescriptor(f"descriptor {i} to {peer}: length {length} is not positive", ERR_FAILED)
        if not local.contains(src, length):
            raise InvalidDescriptor(
                f"descriptor {i} to {peer}: source [{src:#x}, +{length}) is outside registered local memory",
                ERR_ADDRESS_NOT_REGISTERED,
            )
        if not remote.contains(dst, length):
            raise InvalidDescriptor(
                f"descriptor {i} to {peer}: destination [{dst:#x}, +{length}) is outside the peer's regions",
                ERR_ADDRESS_NOT_REGISTERED,
            )
        total += length
    return total
