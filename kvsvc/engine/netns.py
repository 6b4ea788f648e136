"""Joining a named Linux network namespace (one made by `ip netns add`) from the calling thread.

Standard library only (ctypes for `setns(2)`, which Python's `os` gains only in 3.12). Rules: a network namespace is a
per-thread attribute, so a thread that joins one creates every socket after it there, and threads it starts later
inherit it; join before the first socket (a worker process joins first thing, the endpoint thread before its loop
binds). Used by the multi-host test fixture and `kvsvc demo --hosts netns`; a production engine never calls it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Final

NETNS_DIR: Final = "/var/run/netns"
_CLONE_NEWNET: Final = 0x40000000


class NetnsError(OSError):
    """The namespace does not exist, or this process may not join it (joining needs CAP_SYS_ADMIN)."""


def join(name: str) -> None:
    """Move the calling thread into network namespace `name` (a file under /var/run/netns).

    Raises:
        NetnsError: no such namespace, or setns(2) refused (its errno and message are in the text).
    """
    path = os.path.join(NETNS_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise NetnsError(exc.errno, f"network namespace {name!r}: cannot open {path}: {exc.strerror}") from None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise NetnsError(errno, f"network namespace {name!r}: setns failed: {os.strerror(errno)}")
    finally:
        os.close(fd)
