"""Which socket is one end of a TCP connection, asked of the kernel by the connection's four-tuple (sock_diag).

The same-host plane checks that a claimed process holds the far end of the control connection a hello came on; that
needs the far end's socket inode; without a control token a worker checks who owns that socket, its uid.
`/proc/net/tcp` gives both too, but reading it walks the kernel's whole connection hash, every bucket of every
network namespace, on each read: 15 ms on an idle 2-core host with seven sockets in this namespace, 40 ms at
13,000, and seconds on a loaded host with many connections (the engines' own HTTP polls leave thousands in
TIME_WAIT). A `SOCK_DIAG_BY_FAMILY` request for one exact four-tuple is one hash lookup.

Rules: standard library only; one netlink socket per call, closed before return; every answer is parsed with
bounds checked, and anything unexpected reads as "no such socket" or `OSError`, never as another socket's inode.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from typing import Final

NETLINK_SOCK_DIAG: Final = 4
SOCK_DIAG_BY_FAMILY: Final = 20
NLMSG_ERROR: Final = 2
NLM_F_REQUEST: Final = 1
ALL_STATES: Final = 0xFFFFFFFF
NO_COOKIE: Final = 0xFFFFFFFF
# struct nlmsghdr; struct inet_diag_req_v2 is (family, protocol, ext, pad, states) then struct inet_diag_sockid:
# two big-endian ports, two 16-byte addresses, the interface and a two-word cookie.
_HEADER = struct.Struct("=IHHII")
_REQUEST_HEAD = struct.Struct("=BBBBI")
_PORTS = struct.Struct(">HH")
_REQUEST_TAIL = struct.Struct("=III")
# struct inet_diag_msg after the header: family, state, timer, retrans, sockid (48 bytes), expires, rqueue, wqueue,
# uid, inode.
_UID_OFFSET: Final = _HEADER.size + 4 + 48 + 12
_INODE_OFFSET: Final = _UID_OFFSET + 4

Endpoint = tuple[str, int]
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def tcp_inode(local: Endpoint, remote: Endpoint, timeout_s: float = 1.0) -> int | None:
    """The inode of the TCP socket whose own end is `local` and whose peer is `remote`, in this network namespace;
    None when there is none. An IPv4-mapped IPv6 address is looked up both ways (the two ends of one connection may
    be of either family).

    Raises:
        OSError: the kernel has no sock_diag for TCP (a module not loaded), or did not answer within `timeout_s`.
    """
    owner = tcp_socket(local, remote, timeout_s)
    return owner[1] if owner is not None else None


def tcp_socket(local: Endpoint, remote: Endpoint, timeout_s: float = 1.0) -> tuple[int, int] | None:
    """The owner's uid and the inode of the TCP socket whose own end is `local` and whose peer is `remote`, in this
    network namespace; None when there is none (as `tcp_inode`). The uid is the kernel's: the user whose process
    made the socket (for an accepted one, the listener's), whatever that process claims.

    Raises:
        OSError: as `tcp_inode`.
    """
    mine, theirs = _address(local[0]), _address(remote[0])
    for family, src, dst in _forms(mine, theirs):
        owner = _ask(family, src, local[1], dst, remote[1], timeout_s)
        if owner is not None:
            return owner
    return None


def _address(host: str) -> Address:
    return ipaddress.ip_address(host.split("%")[0])


def _forms(a: Address, b: Address) -> list[tuple[int, bytes, bytes]]:
    """The (family, local, remote) forms a connection between `a` and `b` can take, as 16-byte fields."""
    forms: list[tuple[int, bytes, bytes]] = []
    a4 = a if isinstance(a, ipaddress.IPv4Address) else a.ipv4_mapped
    b4 = b if isinstance(b, ipaddress.IPv4Address) else b.ipv4_mapped
    if a4 is not None and b4 is not None:
        forms.append((socket.AF_INET, a4.packed.ljust(16, b"\0"), b4.packed.ljust(16, b"\0")))
    a6 = a if isinstance(a, ipaddress.IPv6Address) else ipaddress.IPv6Address(f"::ffff:{a}")
    b6 = b if isinstance(b, ipaddress.IPv6Address) else ipaddress.IPv6Address(f"::ffff:{b}")
    forms.append((socket.AF_INET6, a6.packed, b6.packed))
    return forms


def _ask(family: int, src: bytes, sport: int, dst: bytes, dport: int, timeout_s: float) -> tuple[int, int] | None:
    """One exact lookup: the owner's uid and the inode of the socket of `family` at (src, sport) connected to
    (dst, dport), or None."""
    body = (
        _REQUEST_HEAD.pack(family, socket.IPPROTO_TCP, 0, 0, ALL_STATES)
        + _PORTS.pack(sport, dport)
        + src
        + dst
        + _REQUEST_TAIL.pack(0, NO_COOKIE, NO_COOKIE)
    )
    message = _HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + body
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as link:
        link.settimeout(timeout_s)
        link.sendto(message, (0, 0))
        answer = link.recv(8192)
    if len(answer) < _HEADER.size:
        raise OSError(f"sock_diag answered {len(answer)} bytes, less than a netlink header")
    length, kind, _, _, _ = _HEADER.unpack_from(answer)
    if kind == NLMSG_ERROR:
        (code,) = struct.unpack_from("=i", answer, _HEADER.size)
        if code in (0, -2):  # ENOENT: no such socket
            return None
        raise OSError(-code, f"sock_diag refused the lookup: errno {-code}")
    if kind != SOCK_DIAG_BY_FAMILY or length < _INODE_OFFSET + 4 or len(answer) < _INODE_OFFSET + 4:
        raise OSError(f"sock_diag answered message type {kind} of {length} bytes")
    uid, inode = struct.unpack_from("=II", answer, _UID_OFFSET)
    return int(uid), int(inode)


__all__ = ["tcp_inode", "tcp_socket"]
