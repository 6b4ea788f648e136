"""Sub-millisecond sleeps for the completion poller, from a Linux timerfd that the event loop watches.

asyncio's and uvloop's timers count whole milliseconds, and uvloop spins the loop on anything shorter (measured), so
a poller on the loop's timers sees a descriptor up to a millisecond after it landed. A timerfd armed for a few
hundred microseconds turns readable on time and wakes the loop through its selector: no thread, no spinning
(measured on uvloop: a 200 us sleep takes about 250 us and 40 us of CPU). Linux only, through libc with ctypes
(`os.timerfd_create` exists from Python 3.13 on): `FineTimer.open` returns None where it is unavailable, and the
caller keeps the loop's timers. One sleeper or one callback at a time: each user (the Mooncake poller, the CUDA
event poller of `kvsvc.transport.streams`) opens its own.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import sys
from collections.abc import Callable
from functools import cache
from typing import Any, Final

_CLOCK_MONOTONIC: Final = 1
_NS: Final = 1_000_000_000


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


@cache  # loading the process's symbols took most of an open's 18 us; the poller opens a timer per burst
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc's among them
        libc.timerfd_create, libc.timerfd_settime  # noqa: B018 - in glibc and musl since 2008
    except (OSError, AttributeError):
        return None
    return libc


class FineTimer:
    """A one-shot timerfd registered with one event loop. `sleep` arms it and waits until it fires."""

    def __init__(self, loop: asyncio.AbstractEventLoop, libc: Any, fd: int) -> None:
        self._loop, self._libc, self._fd = loop, libc, fd
        self._waiter: asyncio.Future[None] | None = None
        self._callback: Callable[[], object] | None = None
        loop.add_reader(fd, self._fired)

    @classmethod
    def open(cls, loop: asyncio.AbstractEventLoop) -> FineTimer | None:
        """A timer on `loop`, or None where timerfd is unavailable (not Linux, no libc, the call failed)."""
        libc = _libc()
        if libc is None:
            return None
        fd = libc.timerfd_create(_CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return None
        try:
            return cls(loop, libc, fd)
        except (OSError, NotImplementedError, RuntimeError):  # a loop that cannot watch fds
            os.close(fd)
            return None

    async def sleep(self, delay: float) -> None:
        """Return after `delay` seconds (at least 1 us). Cancelling disarms the timer; nothing is left behind.

        Raises:
            RuntimeError: another `sleep` is pending, or the timer is closed or could not be armed (errno named).
        """
        if self._fd < 0:
            raise RuntimeError("FineTimer is closed")
        if self._waiter is not None or self._callback is not None:
            raise RuntimeError("FineTimer.sleep is already pending")
        self._arm(max(1000, int(delay * _NS)))
        self._waiter = waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
            if (not waiter.done() or waiter.cancelled()) and self._fd >= 0:
                self._arm(0)  # cancelled before it fired: disarm, so that it cannot wake a later sleep early

    def call_after(self, delay: float, callback: Callable[[], object]) -> None:
        """Call `callback` on the loop after `delay` seconds (at least 1 us), replacing a callback not yet called
        (the timer is re-armed for the new delay). For callers that keep no task: a poller driven by callbacks.

        Raises:
            RuntimeError: a `sleep` is pending, or the timer is closed or could not be armed (errno named).
        """
        if self._fd < 0:
            raise RuntimeError("FineTimer is closed")
        if self._waiter is not None:
            raise RuntimeError("FineTimer.sleep is pending")
        self._callback = callback
        self._arm(max(1000, int(delay * _NS)))

    def close(self) -> None:
        """Stop watching the fd and close it; a pending `sleep` is cancelled. Idempotent."""
        if self._fd < 0:
            return
        self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd = -1
        self._callback = None
        if self._waiter is not None and not self._waiter.done():
            self._waiter.cancel()

    def _arm(self, ns: int) -> None:
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(ns // _NS, ns % _NS))
        if self._libc.timerfd_settime(self._fd, 0, ctypes.byref(spec), None) != 0:
            raise RuntimeError(f"timerfd_settime failed: errno {ctypes.get_errno()}")

    def _fired(self) -> None:
        try:
            os.read(self._fd, 8)  # the expiry count; reading it makes the fd unreadable again
        except BlockingIOError:
            return
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()


__all__ = ["FineTimer"]
