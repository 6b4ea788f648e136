"""`SameHostTransport`: writes into a peer process on this host with `process_vm_writev`, one kernel copy per byte,
no socket; and `host_identity`, what a worker publishes so that a peer can tell it shares the host.

Rules: the contract of `kvsvc.transport.base.Transport`. A write is refused before anything is copied unless every
source range lies in registered local memory and every destination range in the peer's published regions; many
descriptors go in one call (up to `IOV_MAX` iovecs a side); the copy runs on the transport's own copy thread, which it
blocks, never on the loop; when a write fails the call has returned, so nothing of it still moves (`drained` is done);
a peer whose process died fails the next write at once (ESRCH) and `peer_gone` tells so by its process table entry.
The kernel lets a process write another's memory only as `ptrace` would let it attach (same user, a PID namespace
that sees it, a ptrace policy that allows it): `reachable` asks the kernel once with a one-byte read, before a peer is
used. Imports the standard library, numpy and `kvsvc.transport.base` only (no mooncake, no torch).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import errno
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from kvsvc.transport.base import (
    ERR_FAILED,
    AddressRanges,
    InvalidDescriptor,
    Region,
    TransportClosed,
    TransportStatistics,
    WriteFailed,
    check_descriptors,
)
from kvsvc.transports import SameHostAddress

IOV_MAX: Final = 1024  # Linux's limit on iovecs per call, each side
GROUP_BYTES: Final = 1 << 20  # writes merged into one call up to about this much, then their completions delivered
ERR_GONE: Final = -102  # as Mooncake's probe says of a dead peer


def host_identity() -> str:
    """This host as the kernel tells it apart: its boot id, and the inodes of this process's PID and network
    namespaces. Two processes with the same identity see each other's pids and the same network; two hosts, or two
    network namespaces standing in for hosts, differ."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    pidns = os.stat("/proc/self/ns/pid").st_ino
    netns = os.stat("/proc/self/ns/net").st_ino
    return f"{boot.replace('-', '')}.{pidns}.{netns}"


def _start_time(pid: int) -> int:
    """`pid`'s start time in clock ticks since boot (field 22 of /proc/pid/stat), or -1 when there is no such
    process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[19])


def own_address() -> SameHostAddress:
    """This process's same-host address."""
    pid = os.getpid()
    return SameHostAddress(host_identity(), os.getuid(), pid, _start_time(pid))


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_IOV_ARRAY = ctypes.POINTER(_IOVec)
for _name in ("process_vm_writev", "process_vm_readv"):
    _fn = getattr(_libc, _name)
    _fn.argtypes = [ctypes.c_int, _IOV_ARRAY, ctypes.c_ulong, _IOV_ARRAY, ctypes.c_ulong, ctypes.c_ulong]
    _fn.restype = ctypes.c_ssize_t


def _iovecs(addr: npt.NDArray[np.int64], length: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """An array laid out as `struct iovec[]`: (base, length) pairs of 64-bit words."""
    table = np.empty((addr.size, 2), dtype=np.uint64)
    table[:, 0], table[:, 1] = addr, length
    return table


def copy_into(pid: int, table: npt.NDArray[np.int64]) -> int:
    """Copy every row `(src, dst, length)` of `table` from this process into process `pid`, `IOV_MAX` rows a call;
    the total bytes. Runs on the copy thread (ctypes releases the GIL for the call).

    Raises:
        OSError: the kernel refused or a row did not land whole (its errno; ESRCH: the process is gone).
    """
    done = 0
    for first in range(0, len(table), IOV_MAX):
        rows = table[first : first + IOV_MAX]
        local, remote = _iovecs(rows[:, 0], rows[:, 2]), _iovecs(rows[:, 1], rows[:, 2])
        want = int(rows[:, 2].sum())
        got = _libc.process_vm_writev(
            pid, local.ctypes.data_as(_IOV_ARRAY), len(rows), remote.ctypes.data_as(_IOV_ARRAY), len(rows), 0
        )
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"process_vm_writev into pid {pid}: {os.strerror(code)}")
        if got != want:  # the kernel stops at the first iovec it cannot copy whole
            raise OSError(errno.EFAULT, f"process_vm_writev into pid {pid} copied {got} of {want} bytes")
        done += got
    return done


def _probe(pid: int, addr: int) -> str:
    """ "" when this process may copy from (and so write into) `addr` of process `pid`, else why not."""
    buffer = ctypes.create_string_buffer(1)
    local = _IOVec(ctypes.cast(buffer, ctypes.c_void_p), 1)
    remote = _IOVec(addr, 1)
    got = _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got == 1:
        return ""
    code = ctypes.get_errno()
    return f"process_vm_readv of pid {pid}: {os.strerror(code)} (errno {code})"


@dataclass(frozen=True, slots=True)
class _Queued:
    """One write waiting for the copy thread."""

    peer: str
    pid: int
    table: npt.NDArray[np.int64]
    total: int
    result: asyncio.Future[int]


def _copy_group(pid: int, tables: Sequence[npt.NDArray[np.int64]]) -> list[int | OSError]:
    """Copy the writes `tables` into process `pid` in as few calls as `IOV_MAX` allows (the kernel pins the target's
    pages once per call, which costs more than a 64 KiB piece's copy); each write's bytes or its error. When the
    merged call fails, each write is copied again on its own, so that only the write that cannot land fails (bytes
    that landed twice are the same bytes)."""
    if len(tables) > 1:
        try:
            copy_into(pid, np.concatenate(tables))
        except OSError:
            pass  # found out write by write below
        else:
            return [int(t[:, 2].sum()) for t in tables]
    outcomes: list[int | OSError] = []
    for table in tables:
        try:
            outcomes.append(copy_into(pid, table))
        except OSError as exc:
            outcomes.append(exc)
    return outcomes


def _copy_all(
    writes: Sequence[tuple[int, npt.NDArray[np.int64]]], deliver: Callable[[int, list[int | OSError]], None]
) -> None:
    """Copy one loop iteration's writes (pid, table) in order on the copy thread, in groups of consecutive writes to
    one process of about `GROUP_BYTES`, and `deliver(first, outcomes)` each group's outcomes as soon as it landed: a
    burst of small writes pays few calls and few wake-ups, and a large write completes before the next one starts,
    as the requests of a burst would one after another."""
    first = 0
    while first < len(writes):
        pid, end, nbytes = writes[first][0], first, 0
        while end < len(writes) and writes[end][0] == pid and (end == first or nbytes < GROUP_BYTES):
            nbytes += int(writes[end][1][:, 2].sum())
            end += 1
        deliver(first, _copy_group(pid, [table for _, table in writes[first:end]]))
        first = end


class SameHostTransport:
    """One worker's same-host data plane (see module docstring). `session_id` is its `SameHostAddress`."""

    def __init__(self) -> None:
        self._address = own_address()
        self._local = AddressRanges()
        self._peers: dict[str, tuple[AddressRanges, int]] = {}  # session -> (published regions, pid)
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        self._in_flight: set[asyncio.Future[int]] = set()
        self._queue: list[_Queued] = []  # submitted in this loop iteration, not yet handed to the copy thread
        self._closed = False
        self._counts = {"bytes": 0, "descriptors": 0, "completed": 0, "failures": 0, "refused": 0, "inflight_desc": 0}

    @property
    def session_id(self) -> str:
        return str(self._address)

    @property
    def local_session_id(self) -> str:
        return str(self._address)

    def register(self, regions: Sequence[Region]) -> None:
        """As `Transport.register` (the kernel needs nothing registered: this only bounds what may be sent).

        Raises:
            TransportError: a region is empty or overlaps another. TransportClosed: after `close`.
        """
        if self._closed:
            raise TransportClosed("same-host transport is closed")
        for addr, length in regions:
            self._local.add(addr, length)

    def add_peer(self, session_id: str, regions: Sequence[Region]) -> None:
        """As `Transport.add_peer`; `session_id` is the peer's `SameHostAddress`.

        Raises:
            InvalidDescriptor: a region is empty, or `session_id` is not a same-host session.
        """
        try:
            pid = SameHostAddress.parse(session_id).pid
            ranges = AddressRanges(regions)
        except ValueError as exc:
            raise InvalidDescriptor(str(exc), ERR_FAILED) from None
        self._peers[session_id] = (ranges, pid)

    def remove_peer(self, session_id: str) -> None:
        self._peers.pop(session_id, None)

    async def reachable(self, session: str) -> str:
        """ "" when the kernel lets this process write into the peer `session` (it reads one byte of the peer's first
        published region), else why not: another user, another PID namespace, a ptrace policy, a process gone.
        Raises nothing; the peer must have been added."""
        peer = self._peers.get(session)
        if peer is None or not len(peer[0]):
            return f"no regions published by {session!r}"
        addr = peer[0].regions()[0][0]
        return await asyncio.get_running_loop().run_in_executor(self._executor(), _probe, peer[1], addr)

    async def write(self, peer: str, descriptors: Sequence[tuple[int, int, int]]) -> int:
        """As `Transport.write`: every byte copied by the kernel, or `WriteFailed` with nothing left moving.

        Raises:
            InvalidDescriptor: before anything is copied (ranges, lengths, an unknown peer).
            WriteFailed: the kernel refused the copy or the peer died (code -102 when its process is gone).
            TransportClosed: the transport is closed.

        Cancellation waits for the copy the kernel is doing (it cannot be cut short) before re-raising.
        """
        future = self._submit(peer, descriptors)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                await asyncio.wait([future])
            raise

    def start_write(self, peer: str, descriptors: Sequence[tuple[int, int, int]]) -> asyncio.Future[int] | None:
        """As `Transport.start_write`: the copy is handed to the copy thread at once. None when `write` would refuse
        (it raises the reason then)."""
        try:
            return self._submit(peer, descriptors)
        except (InvalidDescriptor, TransportClosed):
            return None

    def _submit(self, peer: str, descriptors: Sequence[tuple[int, int, int]]) -> asyncio.Future[int]:
        if self._closed:
            self._counts["refused"] += 1
            raise TransportClosed("same-host transport is closed")
        known = self._peers.get(peer)
        try:
            total = check_descriptors(descriptors, self._local, known[0] if known else None, peer)
        except InvalidDescriptor:
            self._counts["refused"] += 1
            raise
        assert known is not None
        table = np.asarray(descriptors, dtype=np.int64).reshape(-1, 3)
        loop = asyncio.get_running_loop()
        result: asyncio.Future[int] = loop.create_future()
        self._in_flight.add(result)
        self._counts["inflight_desc"] += len(table)
        self._queue.append(_Queued(peer, known[1], table, total, result))
        if len(self._queue) == 1:
            # Writes submitted in this loop iteration ride one hop to the copy thread: a burst of one-block
            # requests pays the hop (and its wake-up back) once, not once per request.
            loop.call_soon(self._flush)
        return result

    def _flush(self) -> None:
        batch, self._queue = self._queue, []
        if not batch:
            return
        loop = asyncio.get_running_loop()

        def landed(first: int, outcomes: list[int | OSError]) -> None:
            for queued, outcome in zip(batch[first:], outcomes, strict=False):
                self._finish(queued, outcome, loop)

        def deliver(first: int, outcomes: list[int | OSError]) -> None:
            loop.call_soon_threadsafe(landed, first, outcomes)

        copies = loop.run_in_executor(self._executor(), _copy_all, [(q.pid, q.table) for q in batch], deliver)

        def ended(done: asyncio.Future[None]) -> None:
            failure = RuntimeError("the copy thread was cancelled") if done.cancelled() else done.exception()
            if failure is not None:  # the executor itself failed (shut down): what did not land fails
                for queued in batch:
                    self._finish(queued, failure, loop)

        copies.add_done_callback(ended)

    def _finish(self, queued: _Queued, outcome: int | BaseException, loop: asyncio.AbstractEventLoop) -> None:
        if queued.result not in self._in_flight:
            return  # already finished
        self._in_flight.discard(queued.result)
        self._counts["inflight_desc"] -= len(queued.table)
        if not isinstance(outcome, BaseException):
            self._counts["bytes"] += queued.total
            self._counts["descriptors"] += len(queued.table)
            self._counts["completed"] += 1
            if not queued.result.done():
                queued.result.set_result(queued.total)
            return
        self._counts["failures"] += 1
        code = ERR_GONE if isinstance(outcome, OSError) and outcome.errno == errno.ESRCH else ERR_FAILED
        drained: asyncio.Future[None] = loop.create_future()
        drained.set_result(None)  # the call returned: nothing of this write still moves
        failure = WriteFailed(f"same-host write to {queued.peer}: {outcome}", code, peer=queued.peer, drained=drained)
        if not queued.result.done():
            queued.result.set_exception(failure)

    async def drained(self, peer: str | None = None) -> None:
        """Return once no copy is in flight (to any peer: copies run one at a time). Cancellation-safe."""
        while self._in_flight:
            await asyncio.wait(list(self._in_flight))

    async def peer_gone(self, session: str) -> bool:
        """True when the process `session` names no longer exists (or its pid belongs to a later process)."""
        try:
            address = SameHostAddress.parse(session)
        except ValueError:
            return False
        return address.host == self._address.host and _start_time(address.pid) != address.start

    def statistics(self) -> TransportStatistics:
        c = self._counts
        return TransportStatistics(
            bytes_written=c["bytes"],
            descriptors_written=c["descriptors"],
            writes_completed=c["completed"],
            failures=c["failures"],
            refused=c["refused"],
            writes_in_flight=len(self._in_flight),
            descriptors_in_flight=c["inflight_desc"],
            peers=len(self._peers),
            registered_bytes=self._local.total_bytes,
        )

    async def close(self) -> None:
        """Refuse new writes, wait for the copies in flight, stop the copy thread. Idempotent."""
        self._closed = True
        await self.drained()
        if self._copier is not None:
            copier, self._copier = self._copier, None
            copier.shutdown(wait=False)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._copier is None:
            self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvsvc-samehost")
        return self._copier


__all__ = ["SameHostTransport", "copy_into", "host_identity", "own_address"]
