"""The `Transport` protocol the asyncio service writes KV through, its values, statistics and errors.

A data-plane fault is a value a write returns (`Written`), never an exception: a plane raises only for the caller's
mistakes (`InvalidDescriptor`) and its owner's close (`TransportClosed`). Invariants: a write is refused before
anything is submitted unless its descriptors pass the core's address rule (`kvsvc.core.planner.checked_table`: every
source range inside registered local memory, every destination range inside the peer's published regions); a write
never returns while a descriptor it submitted may still move data, except with a `WriteFailed` whose `drained` future
says when that is over. Also here: what the planes that finish their own writes share (`WriteLedger`, `OwnLoop`).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

from kvsvc.core.errors import ERR_FAILED, TransportError
from kvsvc.core.planner import Descriptors, Region

if TYPE_CHECKING:
    from kvsvc.core.messages import IpcHandle


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
