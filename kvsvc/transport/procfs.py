"""What the kernel says about processes on this host, for the same-host plane (`kvsvc.transport.samehost`): this
host's identity as a worker publishes it (`host_identity`, `own_address`), and the checks of what a peer's hello
claims (`check_peer`: a live process, the same user, holding the far end of the control connection).

Rules: every answer comes from /proc and the kernel, never from what a peer sent; a process that is gone, or a file
that cannot be read, answers "no" (-1, False or a reason), never raises. Reads only: nothing here writes or signals a
process. Blocking file reads: callers run them off the event loop (`far_end_uid`, one netlink request, may run on
it). The far end of a connection is found with one sock_diag lookup (`kvsvc.transport.sockdiag`), never a scan of
every connection of the host but where the kernel lacks it; `listening_sockets` reads this process's own sockets.
Imports the standard library, `kvsvc.transport.sockdiag` and `kvsvc.core.data_planes` only.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import select
import struct
from pathlib import Path

from kvsvc.core.data_planes import SameHostAddress
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
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[9]) in inodes:  # TCP_LISTEN
                ip, port = _proc_endpoint(fields[1])
                found.add((str(ip), port))
    return found


def _scan_proc_net_tcp(local: Endpoint, remote: Endpoint) -> tuple[int, int] | None:
    """`_tcp_socket` from this network namespace's `/proc/net/tcp` and `tcp6`."""
    want = (_plain(local[0]), local[1], _plain(remote[0]), remote[1])
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            (lip, lport), (rip, rport) = (_proc_endpoint(f) for f in fields[1:3])
            if (lip, lport, rip, rport) == want:
                return int(fields[7]), int(fields[9])
    return None


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
