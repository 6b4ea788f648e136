"""`kvsvc.transport.sockdiag`: the kernel names the socket at one end of a real connection by its four-tuple, in
each address family, with the uid of the user who made it, and the answer is the one `/proc/net/tcp` gives (its
slower scan stays the fallback)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvsvc.transport.samehost import _scan_proc_net_tcp, far_end_uid
from kvsvc.transport.sockdiag import tcp_inode, tcp_socket


@contextmanager
def connection(family: int, host: str, dual: bool = False) -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected (client, accepted) pair on loopback."""
    server = socket.create_server((host, 0), family=family, dualstack_ipv6=dual)
    client_host = "127.0.0.1" if dual else host
    with server, socket.create_connection((client_host, server.getsockname()[1])) as client:
        accepted, _ = server.accept()
        with accepted:
            yield client, accepted


@pytest.mark.parametrize(
    ("family", "host", "dual"),
    [(socket.AF_INET, "127.0.0.1", False), (socket.AF_INET6, "::1", False), (socket.AF_INET6, "::", True)],
    ids=["ipv4", "ipv6", "ipv4-mapped"],
)
def test_the_far_end_of_a_connection_is_the_client_s_socket(family: int, host: str, dual: bool) -> None:
    with connection(family, host, dual) as (client, accepted):
        mine, theirs = accepted.getsockname()[:2], accepted.getpeername()[:2]
        assert tcp_inode(theirs, mine) == os.fstat(client.fileno()).st_ino
        assert tcp_inode(mine, theirs) == os.fstat(accepted.fileno()).st_ino
        assert _scan_proc_net_tcp(theirs, mine) == tcp_socket(theirs, mine) == (os.geteuid(), tcp_inode(theirs, mine))
        assert far_end_uid((mine, theirs)) == os.geteuid()


def test_a_socket_is_owned_by_the_user_that_made_it() -> None:
    """The kernel's uid, not the process's word: a socket made under another effective uid reads as that uid."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a socket as another user")
    server = socket.create_server(("127.0.0.1", 0))
    os.seteuid(65534)
    try:
        client = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
    finally:
        os.seteuid(0)
    with server, client:
        accepted, _ = server.accept()
        with accepted:
            mine, theirs = accepted.getsockname()[:2], accepted.getpeername()[:2]
            assert far_end_uid((mine, theirs)) == 65534
            assert far_end_uid((theirs, mine)) == 0


def test_no_such_connection_is_none() -> None:
    with connection(socket.AF_INET, "127.0.0.1") as (_, accepted):
        mine, (host, port) = accepted.getsockname()[:2], accepted.getpeername()[:2]
        assert tcp_inode((host, port + 1 if port < 65535 else port - 1), mine) is None
        assert tcp_inode(("127.0.0.1", 1), ("127.0.0.1", 2)) is None
