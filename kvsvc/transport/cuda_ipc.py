"""`CudaIpcTransport`: the GPU plane. P maps each GPU allocation a D worker on its host exported (CUDA IPC) and
writes D's blocks with device-to-device copies on a copy stream of its own; an event recorded after a write's copies
is its completion future (`kvsvc.transport.streams.completion_future`).

Rules: the contract of `kvsvc.transport.base.Transport`. A write is refused before anything is enqueued unless every
source range lies in registered local memory and every destination range in the peer's published regions, which
P checked at the hello to lie in the allocations D exported (`kvsvc.core.data_planes.check_ipc_handles`): P never writes
outside what D handed it. A session is admitted only by `reachable`, which checks the claimed process against the
kernel and the control connection its hello came on (as the same-host plane does) and then opens D's handles, the
plane's one probe; a pair whose probe fails runs on Mooncake. A write to a process that died, or whose pid now names
another process, fails at once with the dead-peer code (its memory would still take the copy: the mapping keeps it
alive). A failed write's `drained` resolves when the copies it enqueued finished. Mappings are closed once the peer
is removed and its writes finished. Every CUDA call runs on the loop's thread: enqueueing a copy takes microseconds,
and one thread keeps the driver's context handling trivial. Imports the standard library and `kvsvc` modules
without torch or mooncake (the driver is `kvsvc.transport.cuda_driver`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import numpy.typing as npt

from kvsvc.core.data_planes import SameHostAddress, check_ipc_handles
from kvsvc.core.errors import ERR_FAILED, InvalidDescriptor, TransportError
from kvsvc.core.messages import IpcHandle
from kvsvc.core.planner import AddressRanges, Descriptors, Region, checked_table
from kvsvc.transport.base import (
    OwnLoop,
    TransportClosed,
    TransportStatistics,
    WriteFailed,
    WriteLedger,
    Written,
    settled,
)
from kvsvc.transport.completion import wait_uncancellable
from kvsvc.transport.cuda_driver import CudaDriver, CudaError, CudaEvent, LibCuda
from kvsvc.transport.samehost import Endpoint, ProcessWatch, check_peer, own_address, process_gone
from kvsvc.transport.streams import completion_future

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S: Final = 30.0
ERR_GONE: Final = -102  # as Mooncake's probe says of a dead peer


Table = npt.NDArray[np.int64]
"""Descriptors as rows `(src, dst, length)`."""


@dataclass(slots=True)
class _Mapping:
    """D's allocations as mapped here: sorted by D's base, each `(d_base, size, base here)`."""

    spans: list[tuple[int, int, int]]
    handles: list[bytes]
    starts: list[int] = field(default_factory=list)
    _bases: Table = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    _shifts: Table = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def __post_init__(self) -> None:
        self.spans.sort()
        self.starts = [span[0] for span in self.spans]
        self._bases = np.array(self.starts, dtype=np.int64)
        self._shifts = np.array([mapped - d_base for d_base, _, mapped in self.spans], dtype=np.int64)

    def here(self, addr: int) -> int:
        """Where D's `addr` is mapped in this process (the caller checked it lies in a published region)."""
        d_base, _, mapped = self.spans[bisect_right(self.starts, addr) - 1]
        return mapped + (addr - d_base)

    def here_all(self, addr: Table) -> Table:
        """`here` of every address of `addr` (each checked to lie in a published region)."""
        return addr + self._shifts[np.searchsorted(self._bases, addr, side="right") - 1]


@dataclass(slots=True)
class _Peer:
    address: SameHostAddress
    mapping: _Mapping
    watch: ProcessWatch  # asked before each write: a copy into a dead process's memory must not start
    regions: AddressRanges | None = None  # published by add_peer
    in_flight: int = 0
    removed: bool = False


class CudaIpcTransport:
    """One worker's GPU plane (see module docstring). `driver`: the CUDA driver (`LibCuda` when None)."""

    def __init__(self, driver: CudaDriver | None = None, close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self._driver: CudaDriver = driver if driver is not None else LibCuda()
        self._me = own_address()
        self._gpu = ""
        self._local = AddressRanges()
        self._exports: dict[int, IpcHandle] = {}  # D's side: allocation base -> handle
        self._unexportable = ""  # why this worker's memory cannot be offered (logged once)
        self._peers: dict[str, _Peer] = {}  # admitted sessions
        self._opened: dict[bytes, list[int]] = {}  # handle -> [base here, sessions using it]
        self._stream = 0
        self._checker: concurrent.futures.ThreadPoolExecutor | None = None
        self._own = OwnLoop()
        self._ledger = WriteLedger()
        self._closed = False
        self._closing: asyncio.Future[None] | None = None
        self._close_timeout_s = close_timeout_s

    # -- what this worker offers ---------------------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self.local_session_id

    @property
    def local_session_id(self) -> str:
        """`cudaipc:host:uid:pid:start:GPU-uuid` once registered memory was exported, else "" (nothing offered)."""
        if not self._exports or self._unexportable:
            return ""
        return str(SameHostAddress(self._me.host, self._me.uid, self._me.pid, self._me.start, self._gpu))

    @property
    def unexportable(self) -> str:
        """Why this worker offers no GPU plane ("" when it does, or before `register`)."""
        return self._unexportable

    def exported(self) -> list[IpcHandle]:
        """The IPC handles of every allocation holding registered memory (what D's hello carries to a P whose pair
        takes this plane); empty when the memory cannot be exported."""
        return [] if self._unexportable else list(self._exports.values())

    def register(self, regions: Sequence[Region]) -> None:
        """As `Transport.register`; also exports the allocations the regions lie in. Memory CUDA IPC cannot export
        (expandable segments, host memory) leaves the plane unoffered, with the reason logged once, and is still
        registered (the bound on what P may send).

        Raises:
            TransportError: a region is empty or overlaps another. TransportClosed: after `close`.
        """
        if self._closed:
            raise TransportClosed("the GPU plane is closed")
        for addr, length in regions:
            self._local.add(addr, length)
        if self._unexportable:
            return
        try:
            for addr, length in regions:
                self._export(addr, length)
        except CudaError as exc:
            self._unexportable = f"CUDA IPC cannot export this worker's KV memory: {exc}"
            log.warning("no GPU plane offered: %s; writes into this worker go over Mooncake", self._unexportable)

    def _export(self, addr: int, length: int) -> None:
        uuid = self._driver.gpu_uuid(addr)
        if self._gpu and uuid != self._gpu:
            raise CudaError(f"registered memory lies on two GPUs ({self._gpu}, {uuid})", ERR_FAILED)
        self._gpu = uuid
        base, size = self._driver.allocation(addr)
        if addr + length > base + size:
            raise CudaError(f"region [{addr:#x}, +{length}) spans two allocations", ERR_FAILED)
        if base not in self._exports:
            self._exports[base] = IpcHandle(handle=self._driver.export(base), base=base, size=size)

    # -- P's side: admitting a peer --------------------------------------------------------------------------------

    def admits(self, session_id: str) -> bool:
        """Whether `session_id` passed `reachable` (and was not removed since): the only sessions this plane writes."""
        peer = self._peers.get(session_id)
        return peer is not None and not peer.removed

    async def reachable(
        self,
        session: str,
        regions: Sequence[Region],
        via: tuple[Endpoint, Endpoint] | None = None,
        handles: Sequence[IpcHandle] = (),
    ) -> str:
        """ "" when writes into the peer `session` (publishing `regions`, exporting `handles`) may go, else why not.
        In order: the handles cover the regions (`check_ipc_handles`); the claimed process is alive, of this user,
        and holds the far end of the control connection `via` (`check_peer`, on a thread of its own); its handles
        open here (the probe), each as large as D claimed. Passed, the session is admitted with its mappings.
        Raises nothing. Cancelled (the caller's deadline) during the process check, it admits nothing."""
        if self._closed:
            return "the GPU plane is closed"
        try:
            address = SameHostAddress.parse(session)
        except ValueError as exc:
            return str(exc)
        if not address.gpu:
            return f"{session!r} names no GPU plane"
        if not self._gpu:
            return "this worker offers no GPU plane (no GPU memory registered)"
        refused = check_ipc_handles(session, regions, handles)
        if refused:
            return refused
        if self._checker is None:
            self._checker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvsvc-gpu-check")
        refused = await asyncio.get_running_loop().run_in_executor(self._checker, check_peer, address, via)
        if refused or self._closed:
            return refused or "the GPU plane is closed"
        opened: list[bytes] = []
        spans: list[tuple[int, int, int]] = []
        try:
            for h in handles:
                mapped = self._open(h.handle)
                opened.append(h.handle)
                _, size = self._driver.allocation(mapped)
                if size < h.size:
                    raise CudaError(f"the allocation at {h.base:#x} maps {size} bytes, D claims {h.size}", ERR_FAILED)
                spans.append((h.base, h.size, mapped))
        except Exception as exc:  # the driver's CudaError, or a binding's surprise: "raises nothing" holds
            for handle in opened:
                self._unref(handle)
            why = str(exc) if isinstance(exc, CudaError) else f"{type(exc).__name__}: {exc}"
            return f"D's GPU memory ({address.gpu}) does not open here: {why}"
        old = self._peers.pop(session, None)
        if old is not None:
            self._retire(old)
        self._peers[session] = _Peer(address, _Mapping(spans, opened), ProcessWatch(address))
        return ""

    def _open(self, handle: bytes) -> int:
        """Map `handle` once per process (the driver refuses a second mapping of one allocation)."""
        entry = self._opened.get(handle)
        if entry is None:
            entry = self._opened[handle] = [self._driver.open(handle), 0]
        entry[1] += 1
        return entry[0]

    def _unref(self, handle: bytes) -> None:
        entry = self._opened[handle]
        entry[1] -= 1
        if entry[1] == 0:
            del self._opened[handle]
            try:
                self._driver.close(entry[0])
            except Exception as exc:  # the driver's CudaError, or a surprise: the other mappings still close
                log.warning("closing a GPU plane mapping: %s", exc)

    def _retire(self, peer: _Peer) -> None:
        """Close `peer`'s mappings once its writes finished (now, or when the last one ends)."""
        peer.removed = True
        peer.watch.close()
        if peer.in_flight == 0:
            for handle in peer.mapping.handles:
                self._unref(handle)
            peer.mapping.handles = []

    def add_peer(self, session_id: str, regions: Sequence[Region]) -> None:
        """As `Transport.add_peer`; `session_id` must have been admitted by `reachable` first.

        Raises:
            InvalidDescriptor: `session_id` was not admitted, a region is empty or lies outside the allocations the
                peer exported.
        """
        peer = self._peers.get(session_id)
        if peer is None or peer.removed:
            self._ledger.refused += 1
            raise InvalidDescriptor(
                f"GPU session {session_id!r} was not admitted: only a peer whose process passed the check and whose "
                "IPC handles opened is written",
                ERR_FAILED,
            )
        spans = peer.mapping.spans
        handles = [IpcHandle(handle=bytes(64), base=base, size=size) for base, size, _ in spans]
        refused = check_ipc_handles(session_id, regions, handles)
        if refused:
            raise InvalidDescriptor(refused, ERR_FAILED)
        try:
            peer.regions = AddressRanges(regions)
        except TransportError as exc:
            raise InvalidDescriptor(str(exc), ERR_FAILED) from None

    def remove_peer(self, session_id: str) -> None:
        peer = self._peers.pop(session_id, None)
        if peer is not None:
            self._retire(peer)

    def peer_pointer(self, session: str, addr: int) -> int:
        """Where the peer's device address `addr` is mapped in this process (for baselines that copy with torch).

        Raises:
            InvalidDescriptor: unknown session, or `addr` outside the regions it published.
        """
        peer = self._peers.get(session)
        if peer is None or peer.regions is None or not peer.regions.contains(addr, 1):
            raise InvalidDescriptor(f"{addr:#x} is not in a region {session!r} published here", ERR_FAILED)
        return peer.mapping.here(addr)

    # -- writes ----------------------------------------------------------------------------------------------------

    async def write(self, peer: str, descriptors: Descriptors) -> Written:
        """As `Transport.write`: every byte copied on the device, or a `WriteFailed` when the driver refused a copy
        (its `drained` resolves when the copies enqueued before it finished) or the peer's process is gone (code
        -102, nothing enqueued).

        Raises:
            InvalidDescriptor: before anything is enqueued (ranges, lengths, an unknown peer).
            TransportClosed: the transport is closed.

        Cancellation waits for the copies already enqueued (the device cannot take them back) before re-raising.
        """
        future = self._submit(peer, descriptors)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await wait_uncancellable(future)
            raise

    def start_write(self, peer: str, descriptors: Descriptors) -> asyncio.Future[Written] | None:
        """As `Transport.start_write`: the copies are enqueued now. None when `write` would refuse."""
        try:
            return self._submit(peer, descriptors)
        except (InvalidDescriptor, TransportClosed):
            return None

    def _submit(self, session: str, descriptors: Descriptors) -> asyncio.Future[Written]:
        if self._closed:
            self._ledger.refused += 1
            raise TransportClosed("the GPU plane is closed")
        peer = self._peers.get(session)
        try:
            table, total = checked_table(
                descriptors, self._local, peer.regions if peer and not peer.removed else None, session
            )
        except InvalidDescriptor:
            self._ledger.refused += 1
            raise
        assert peer is not None
        src, dst, length = table[:, 0], table[:, 1], table[:, 2]
        loop = self._own.current()
        result: asyncio.Future[Written] = loop.create_future()
        if peer.watch.gone():
            self._ledger.failures += 1
            message = f"GPU write to {session}: process {peer.address.pid} is gone"
            result.set_result(WriteFailed(message, ERR_GONE, peer=session, drained=settled(loop)))
            return result
        pieces = np.stack([src, peer.mapping.here_all(dst), length], axis=1)
        self._ledger.started(len(pieces))
        peer.in_flight += 1
        failure: CudaError | None = None
        try:
            if not self._stream:
                self._stream = self._driver.new_stream()
            self._driver.copy(self._stream, pieces)
        except CudaError as exc:
            failure = exc
        try:
            event: CudaEvent | None = self._driver.record(self._stream) if self._stream else None
        except CudaError as exc:  # nothing left to wait on: the stream is broken, its copies with it
            failure, event = failure or exc, None
        landed = completion_future(event, loop=loop)
        landed.add_done_callback(lambda f: self._finish(session, peer, len(pieces), total, event, failure, f, result))
        return result

    def _finish(
        self,
        session: str,
        peer: _Peer,
        pieces: int,
        total: int,
        event: CudaEvent | None,
        failure: CudaError | None,
        landed: asyncio.Future[None],
        result: asyncio.Future[Written],
    ) -> None:
        if event is not None:
            self._driver.release(event)
        peer.in_flight -= 1
        if peer.removed:
            self._retire(peer)
        error = failure or (None if landed.cancelled() else landed.exception())
        ok = error is None and not landed.cancelled()
        self._ledger.ended(pieces, total if ok else None)
        if ok:
            if not result.done():
                result.set_result(total)
            return
        # The event fired or failed: nothing of this write still moves.
        message = f"GPU write to {session}: {error or 'cancelled'}"
        failed = WriteFailed(message, ERR_FAILED, peer=session, drained=settled(landed.get_loop()))
        if not result.done():
            result.set_result(failed)

    async def drained(self, peer: str | None = None) -> None:
        """Return once no copy is in flight (to any peer: they share one stream). Cancellation-safe."""
        await self._ledger.drained()

    async def peer_gone(self, session: str) -> bool:
        """True when the process `session` names no longer exists (or its pid belongs to a later process)."""
        return process_gone(session, self._me.host)

    def statistics(self) -> TransportStatistics:
        peers = sum(1 for p in self._peers.values() if not p.removed)
        return self._ledger.statistics(peers, self._local.total_bytes)

    async def close(self) -> None:
        """Refuse new writes, wait up to `close_timeout_s` for the copies in flight, then close every mapping and the
        copy stream. Idempotent: every call waits for the one close; cancelling a caller leaves it running to its
        (bounded) end. Mappings of copies still running at the bound stay open (unmapping them could fault the GPU)."""
        if self._closing is None:
            self._closed = True
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        try:
            await asyncio.wait_for(self.drained(), self._close_timeout_s)
        except TimeoutError:
            log.warning("closing the GPU plane with %d write(s) still copying", self._ledger.in_flight)
            return
        for session in list(self._peers):
            self.remove_peer(session)
        if self._stream:
            self._driver.destroy_stream(self._stream)
            self._stream = 0
        if self._checker is not None:
            self._checker.shutdown(wait=False)
            self._checker = None


__all__ = ["CudaIpcTransport"]
