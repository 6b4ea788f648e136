"""`SameHostTransport`: writes into a peer process on this host with `process_vm_writev`, one kernel copy per byte,
no socket; and what the kernel says about processes on this host, which this plane and the GPU plane
(`kvsvc.transport.cuda_ipc`) both rest on: this host's identity as a worker publishes it (`host_identity`,
`own_address`), and the checks of what a peer's hello claims (`check_peer`: a live process, the same user, holding the
far end of the control connection).

Rules: the contract of `kvsvc.transport.base.Transport`. A write is refused before anything is copied unless every
source range lies in registered local memory and every destination range in the peer's published regions; many
descriptors go in one call (up to `IOV_MAX` iovecs a side), and so do the writes queued in one loop iteration to one
peer, as the core groups them (`kvsvc.core.planner.coalesce`); the copy runs on the transport's own copy thread,
which it blocks, never on the loop; when a write fails the call has returned, so nothing of it still moves (`drained` is
done); a peer whose process died, or whose pid now names another process, fails the next write (ESRCH) and `peer_gone`
tells so by its process table entry. What a peer claims (pid, start time, user) is checked against the kernel before it
is used, and the process must hold the far end of the control connection its hello came on (`check_peer`): a hello
cannot aim writes at a process that did not send it. Only a session that passed that check (`reachable`) is admitted,
and `add_peer` refuses any other; before each group of copies the target's start time and real uid are read again. The
kernel lets a process write another's memory only as `ptrace` would let it attach (same user, a PID namespace that sees
it, a ptrace policy that allows it): `reachable` asks it once with a one-byte read. The checks run on threads of their
own, never on the copy thread, so a slow /proc read delays no write and a copy delays no hello. Imports the standard
library, numpy and `kvsvc.transport` modules without mooncake (no torch).

Rules of the kernel's answers: every one comes from /proc and the kernel, never from what a peer sent; a process that
is gone, or a file that cannot be read, answers "no" (-1, False or a reason), never raises. Reads only: nothing here
writes or signals a process. Blocking file reads: callers run them off the event loop (`far_end_uid`, one netlink
request, may run on it). The far end of a connection is found with one sock_diag lookup (`kvsvc.transport.sockdiag`),
never a scan of every connection of the host but where the kernel lacks it; `listening_sockets` reads this process's
own sockets.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import ipaddress
import logging
import os
import select
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from kvsvc.core.data_planes import SameHostAddress
from kvsvc.core.errors import ERR_FAILED, InvalidDescriptor
from kvsvc.core.messages import IpcHandle
from kvsvc.core.planner import (
    COALESCE_BYTES,
    COALESCE_DESCRIPTORS,
    AddressRanges,
    Descriptors,
    Region,
    checked_table,
    coalesce,
)
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
from kvsvc.transport.sockdiag import tcp_socket


def host_identity() -> str:
    """This host as the kernel tells it apart: its boot id, and the inodes of this process's PID and network
    namespaces. Two processes with the same identity see each other's pids and the same network; two hosts, or two
    network namespaces standing in for hosts, differ."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    pidns = os.stat("/proc/self/ns/pid").st_ino
    netns = os.stat("/proc/self/ns/net").st_ino
    return f"{boot.replace('-', '')}.{pidns}.{netns}"


def start_time(pid: int) -> int:
    """`pid`'s start time in clock ticks since boot (field 22 of /proc/pid/stat), or -1 when there is no such
    process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[19])


def real_uid(pid: int) -> int:
    """`pid`'s real uid as this process's user namespace sees it (`/proc/pid/status`), or -1 when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return -1
    line = next((x for x in status.splitlines() if x.startswith("Uid:")), "Uid:\t-1")
    return int(line.split()[1])


Endpoint = tuple[str, int]


def _tcp_socket(local: Endpoint, remote: Endpoint) -> tuple[int, int] | None:
    """The owner's uid and the inode of the TCP socket whose end is at `local` talking to `remote`: one exact lookup
    in the kernel's hash (`kvsvc.transport.sockdiag`), or, on a kernel without sock_diag for TCP, a scan of
    `/proc/net/tcp` (which walks the whole hash: slow on a busy host); None when there is none."""
    try:
        return tcp_socket(local, remote)
    except OSError:
        return _scan_proc_net_tcp(local, remote)


def _tcp_inode(local: Endpoint, remote: Endpoint) -> int | None:
    owner = _tcp_socket(local, remote)
    return owner[1] if owner is not None else None


def far_end_uid(via: tuple[Endpoint, Endpoint]) -> int | None:
    """The uid owning the far end of the TCP connection `via` (this end, the far end) by the kernel's word, or None
    when no socket of this network namespace is that far end (a peer on another host or namespace)."""
    mine, theirs = via
    owner = _tcp_socket(theirs, mine)
    return owner[0] if owner is not None else None


def listening_sockets(pid: int | str = "self") -> set[tuple[str, int]]:
    """The TCP addresses process `pid` listens on (`(host, port)`; "0.0.0.0" or "::" for every interface), by its
    file descriptors' socket inodes in this network namespace's `/proc/net/tcp` and `tcp6`; empty when they cannot be
    read. What an operator must firewall, and what a test of which listeners run reads."""
    inodes: set[int] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    found: set[tuple[str, int]] = set()
    for fields in _proc_tcp_rows(f"/proc/{pid}/net"):
        if fields[3] == "0A" and int(fields[9]) in inodes:  # TCP_LISTEN
            ip, port = _proc_endpoint(fields[1])
            found.add((str(ip), port))
    return found


def _scan_proc_net_tcp(local: Endpoint, remote: Endpoint) -> tuple[int, int] | None:
    """`_tcp_socket` from this network namespace's `/proc/net/tcp` and `tcp6`."""
    want = (_plain(local[0]), local[1], _plain(remote[0]), remote[1])
    for fields in _proc_tcp_rows("/proc/net"):
        (lip, lport), (rip, rport) = (_proc_endpoint(f) for f in fields[1:3])
        if (lip, lport, rip, rport) == want:
            return int(fields[7]), int(fields[9])
    return None


def _proc_tcp_rows(directory: str) -> Iterator[list[str]]:
    """The fields of each socket row of `directory`'s `tcp` and `tcp6` tables (a network namespace's `/proc/net`);
    a table that cannot be read has none."""
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"{directory}/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            yield line.split()


def _plain(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """`host` as an address, an IPv4-mapped IPv6 one as the IPv4 address it maps."""
    address = ipaddress.ip_address(host.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _proc_endpoint(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """An address of `/proc/net/tcp*`: the IP as host-order 32-bit words in hex, then the port in hex."""
    ip_hex, port_hex = text.split(":")
    words = [int(ip_hex[i : i + 8], 16) for i in range(0, len(ip_hex), 8)]
    return _plain(str(ipaddress.ip_address(struct.pack(f"={len(words)}I", *words)))), int(port_hex, 16)


def holds_connection(pid: int, local: Endpoint, remote: Endpoint) -> bool:
    """Whether process `pid` holds the TCP connection's end at `local` (talking to `remote`): one of its file
    descriptors is that socket. Needs the right to read `pid`'s fd table (the same user)."""
    inode = _tcp_inode(local, remote)
    if inode is None:
        return False
    target = f"socket:[{inode}]"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
    return False


def check_peer(address: SameHostAddress, via: tuple[Endpoint, Endpoint] | None) -> str:
    """ "" when `address` names a live process of this user that holds the far end of the control connection `via`
    (this end, the far end), else why not. What a hello claims is checked against the kernel: its start time (a
    reused pid is another process), its real uid, and that it holds the connection the hello came on, so a hello
    cannot aim P's writes at a process that did not send it."""
    if start_time(address.pid) != address.start:
        return f"pid {address.pid} is not the process that published {address} (gone, or its pid reused)"
    uid = real_uid(address.pid)
    if uid != os.getuid():
        return f"pid {address.pid} runs as uid {uid}, this worker as uid {os.getuid()}"
    if via is None:
        return "no control connection to check the claimed process against"
    mine, theirs = via
    if not holds_connection(address.pid, theirs, mine):
        return f"pid {address.pid} does not hold the control connection {theirs[0]}:{theirs[1]} the hello came on"
    return ""


def process_gone(session: str, host: str) -> bool:
    """True when the same-host session `session` names a process of host `host` that no longer exists (or whose pid
    now belongs to a later process); False for a live one, another host's or no same-host session."""
    try:
        address = SameHostAddress.parse(session)
    except ValueError:
        return False
    return address.host == host and start_time(address.pid) != address.start


class ProcessWatch:
    """Whether the process `address` names has exited, asked before every write of a plane that cannot see it die
    itself (the GPU plane). A pidfd polled without waiting answers in about a microsecond, where `process_gone`'s
    /proc read costs tens: one per write showed in a GPU plane's profile. Where pidfds are missing (before Linux
    5.3) each call reads /proc as `process_gone` does. `close` is idempotent; a closed watch answers gone."""

    def __init__(self, address: SameHostAddress) -> None:
        self._address = address
        self._fd = -1
        self._poll: select.poll | None = None
        self._closed = False
        try:
            fd = os.pidfd_open(address.pid)
        except (AttributeError, OSError):  # no pidfds here, or no such process: `gone` reads /proc
            return
        self._fd = fd
        # Checked after the open: the pid may have named a later process by then, and the pidfd would watch that.
        if start_time(address.pid) != address.start:
            self.close()
            return
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def gone(self) -> bool:
        if self._closed:
            return True
        if self._poll is None:
            return start_time(self._address.pid) != self._address.start
        return bool(self._poll.poll(0))

    def close(self) -> None:
        self._closed = True
        self._poll = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def own_address() -> SameHostAddress:
    """This process's same-host address."""
    pid = os.getpid()
    return SameHostAddress(host_identity(), os.getuid(), pid, start_time(pid))


__all__ = [
    "Endpoint",
    "ProcessWatch",
    "check_peer",
    "holds_connection",
    "host_identity",
    "own_address",
    "process_gone",
    "real_uid",
    "start_time",
]


log = logging.getLogger(__name__)

IOV_MAX: Final = COALESCE_DESCRIPTORS  # Linux's limit on iovecs per call, each side: a merged group is one call
CLOSE_TIMEOUT_S: Final = 30.0  # a kernel copy of a whole KV pool ends well within it
_ADDRESS_END: Final = 1 << 63  # a user-space address past this is no address (and no int64)
CHECK_THREADS: Final = 2  # /proc reads of peer checks; a check stuck in the kernel leaves the other for the next
SLOW_CHECK_S: Final = 0.25  # a check this slow is logged with where its time went (about 1 ms on an idle host)
ERR_GONE: Final = -102  # as Mooncake's probe says of a dead peer


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


@dataclass(slots=True)
class _Queued:
    """One write waiting for the copy thread, or copying."""

    peer: str
    pid: int
    start: int  # the target's start time: a pid reused by another process is not written
    uid: int  # the target's real uid when it was admitted: a process that changed user is not written
    table: npt.NDArray[np.int64]
    total: int
    result: asyncio.Future[Written]
    finished: bool = False


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
    writes: Sequence[tuple[int, int, int, npt.NDArray[np.int64]]],
    deliver: Callable[[int, list[int | OSError]], None],
    max_bytes: int = COALESCE_BYTES,
    max_descriptors: int = COALESCE_DESCRIPTORS,
) -> None:
    """Copy one loop iteration's writes (pid, start time, real uid, table) in order on the copy thread, in the groups
    the core merges into one call each (`kvsvc.core.planner.coalesce`), and `deliver(first, outcomes)` each
    group's outcomes as soon as it landed: a burst's requests land together, in one call and one wake-up, and a
    large write goes alone (the bounds are the core's unless a test asks for others). Before each group the target's
    start time and real uid are read again: a pid that now names another process is not written (ESRCH), nor a
    process that now runs as another user (EPERM)."""
    sizes = [((pid, start, uid), int(table[:, 2].sum()), len(table)) for pid, start, uid, table in writes]
    for group in coalesce(sizes, max_bytes, max_descriptors):
        pid, start, uid = writes[group.start][:3]
        if start_time(pid) != start:
            gone = OSError(errno.ESRCH, f"process {pid} (started at {start}) is gone")
            deliver(group.start, [gone] * len(group))
        elif (now := real_uid(pid)) != uid:
            other = OSError(errno.EPERM, f"process {pid} runs as uid {now}, not uid {uid} as when it was admitted")
            deliver(group.start, [other] * len(group))
        else:
            deliver(group.start, _copy_group(pid, [writes[i][3] for i in group]))


class SameHostTransport:
    """One worker's same-host data plane (see module docstring). `session_id` is its `SameHostAddress`."""

    def __init__(self, close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self._address = own_address()
        self._local = AddressRanges()
        self._peers: dict[str, tuple[AddressRanges, SameHostAddress]] = {}  # session -> (published regions, address)
        self._admitted: dict[str, int] = {}  # sessions that passed `reachable` -> the real uid then
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        self._checker: concurrent.futures.ThreadPoolExecutor | None = None
        self._ledger = WriteLedger()
        self._own = OwnLoop()
        self._queue: list[_Queued] = []  # submitted in this loop iteration, not yet handed to the copy thread
        self._closed = False
        self._closing: asyncio.Future[None] | None = None
        self._close_timeout_s = close_timeout_s

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

    def exported(self) -> list[IpcHandle]:
        """Nothing: the kernel copy needs no handle from this worker."""
        return []

    def admits(self, session_id: str) -> bool:
        """Whether `session_id` passed `reachable` (and was not removed since): the only sessions this plane writes."""
        return session_id in self._admitted

    def add_peer(self, session_id: str, regions: Sequence[Region]) -> None:
        """As `Transport.add_peer`; `session_id` is the peer's `SameHostAddress`, admitted by `reachable` first.

        Raises:
            InvalidDescriptor: `session_id` was not admitted (no check of the process behind it passed), is not a
                same-host session, or a region is empty or ends past the address space.
        """
        if session_id not in self._admitted:
            self._ledger.refused += 1
            raise InvalidDescriptor(
                f"same-host session {session_id!r} was not admitted: only a peer whose process passed the check "
                "against its control connection is written",
                ERR_FAILED,
            )
        try:
            address = SameHostAddress.parse(session_id)
            for addr, length in regions:
                if addr < 0 or addr + length > _ADDRESS_END:
                    raise ValueError(f"region [{addr:#x}, +{length}) of {session_id!r} is outside the address space")
            ranges = AddressRanges(regions)
        except ValueError as exc:
            raise InvalidDescriptor(str(exc), ERR_FAILED) from None
        self._peers[session_id] = (ranges, address)

    def remove_peer(self, session_id: str) -> None:
        self._peers.pop(session_id, None)
        self._admitted.pop(session_id, None)

    async def reachable(
        self,
        session: str,
        regions: Sequence[Region],
        via: tuple[Endpoint, Endpoint] | None = None,
        handles: Sequence[IpcHandle] = (),
    ) -> str:
        """ "" when writes into the peer `session` (publishing `regions`) may go, else why not. First what the peer
        claims is checked against the kernel (`check_peer`: a live process, this user, holding the far end of the
        control connection `via` = (this end, far end)), then the kernel is asked (a one-byte read of the first
        region): another PID namespace, a ptrace policy. Passed, the session is admitted (`add_peer` takes it).
        Asked before `add_peer`, so a hello that fails it leaves a peer added by another hello as it was. Raises
        nothing. Cancelled (the caller's deadline), it admits nothing; the /proc reads may still end on their
        thread. `handles` are for the GPU plane: unused here."""
        if self._closed:
            return "the same-host transport is closed"
        try:
            address = SameHostAddress.parse(session)
        except ValueError as exc:
            return str(exc)
        if not regions:
            return f"no regions published by {session!r}"
        addr = regions[0][0]

        def ask() -> tuple[str, int]:
            began = time.monotonic()
            refused = check_peer(address, via)
            checked = time.monotonic()
            refused = refused or _probe(address.pid, addr)
            if (took := time.monotonic() - began) > SLOW_CHECK_S:  # the hello's budget is at stake: say where
                log.warning(
                    "the same-host check of pid %d took %.2f s (/proc reads %.2f s, kernel probe %.2f s)",
                    address.pid,
                    took,
                    checked - began,
                    took - (checked - began),
                )
            return refused, real_uid(address.pid)

        if self._checker is None:
            self._checker = concurrent.futures.ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="kvsvc-check")
        refused, uid = await asyncio.get_running_loop().run_in_executor(self._checker, ask)
        if not refused and not self._closed:
            self._admitted[session] = uid
        return refused

    async def write(self, peer: str, descriptors: Descriptors) -> Written:
        """As `Transport.write`: every byte copied by the kernel, or a `WriteFailed` with nothing left moving when
        the kernel refused the copy or the peer died (code -102 when its process is gone).

        Raises:
            InvalidDescriptor: before anything is copied (ranges, lengths, an unknown peer).
            TransportClosed: the transport is closed.

        Cancellation waits for the copy the kernel is doing (it cannot be cut short) before re-raising.
        """
        future = self._submit(peer, descriptors)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await wait_uncancellable(future)
            raise

    def start_write(self, peer: str, descriptors: Descriptors) -> asyncio.Future[Written] | None:
        """As `Transport.start_write`: the copy is handed to the copy thread at the end of this loop iteration. None
        when `write` would refuse (it raises the reason then)."""
        try:
            return self._submit(peer, descriptors)
        except (InvalidDescriptor, TransportClosed):
            return None

    def _submit(self, peer: str, descriptors: Descriptors) -> asyncio.Future[Written]:
        if self._closed:
            self._ledger.refused += 1
            raise TransportClosed("same-host transport is closed")
        known = self._peers.get(peer)
        try:
            table, total = checked_table(descriptors, self._local, known[0] if known else None, peer)
        except InvalidDescriptor:
            self._ledger.refused += 1
            raise
        assert known is not None
        loop = self._own.current()
        result: asyncio.Future[Written] = loop.create_future()
        self._ledger.started(len(table))
        self._queue.append(_Queued(peer, known[1].pid, known[1].start, self._admitted[peer], table, total, result))
        if len(self._queue) == 1:
            # Writes submitted in this loop iteration ride one hop to the copy thread: a burst of one-block
            # requests pays the hop (and its wake-up back) once, not once per request.
            loop.call_soon(self._flush)
        return result

    def _flush(self) -> None:
        batch, self._queue = self._queue, []
        if not batch:
            return
        loop = self._own.current()

        def landed(first: int, outcomes: list[int | OSError]) -> None:
            for queued, outcome in zip(batch[first:], outcomes, strict=False):
                self._finish(queued, outcome, loop)

        def deliver(first: int, outcomes: list[int | OSError]) -> None:
            loop.call_soon_threadsafe(landed, first, outcomes)

        def ended(done: asyncio.Future[None]) -> None:
            failure = RuntimeError("the copy thread was cancelled") if done.cancelled() else done.exception()
            if failure is not None:  # the executor itself failed: what did not land fails
                for queued in batch:
                    self._finish(queued, failure, loop)

        writes = [(q.pid, q.start, q.uid, q.table) for q in batch]
        try:
            copies = loop.run_in_executor(self._executor(), _copy_all, writes, deliver)
        except RuntimeError as exc:  # the executor is shut down (the interpreter is exiting)
            for queued in batch:
                self._finish(queued, exc, loop)
            return
        copies.add_done_callback(ended)

    def _finish(self, queued: _Queued, outcome: int | BaseException, loop: asyncio.AbstractEventLoop) -> None:
        if queued.finished:
            return
        queued.finished = True
        landed = not isinstance(outcome, BaseException)
        self._ledger.ended(len(queued.table), queued.total if landed else None)
        if landed:
            if not queued.result.done():
                queued.result.set_result(queued.total)
            return
        code = ERR_GONE if isinstance(outcome, OSError) and outcome.errno == errno.ESRCH else ERR_FAILED
        # The call returned: nothing of this write still moves.
        failure = WriteFailed(
            f"same-host write to {queued.peer}: {outcome}", code, peer=queued.peer, drained=settled(loop)
        )
        if not queued.result.done():
            queued.result.set_result(failure)

    async def drained(self, peer: str | None = None) -> None:
        """Return once no copy is in flight (to any peer: copies run one at a time). Cancellation-safe."""
        await self._ledger.drained()

    async def peer_gone(self, session: str) -> bool:
        """True when the process `session` names no longer exists (or its pid belongs to a later process)."""
        return process_gone(session, self._address.host)

    def statistics(self) -> TransportStatistics:
        return self._ledger.statistics(len(self._peers), self._local.total_bytes)

    async def close(self) -> None:
        """Refuse new writes, wait up to `close_timeout_s` for the copies in flight, stop the copy thread.

        Idempotent: every call waits for the one close; cancelling a caller leaves it running to its (bounded) end.
        A copy still running at the bound is left to its thread, which ends with it.
        """
        if self._closing is None:
            self._closed = True
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        try:
            await asyncio.wait_for(self.drained(), self._close_timeout_s)
        except TimeoutError:
            log.warning("closing the same-host transport with %d write(s) still copying", self._ledger.in_flight)
        for pool in (self._copier, self._checker):
            if pool is not None:
                pool.shutdown(wait=False)
        self._copier = self._checker = None

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._copier is None:
            self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvsvc-samehost")
        return self._copier


__all__ = ["SameHostTransport", "check_peer", "copy_into", "host_identity", "own_address"]
