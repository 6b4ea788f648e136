"""A fake monotonic clock for deadline logic: time moves only when a test moves it.

Rules: a `FakeClock` is a zero-argument callable returning the current fake time in seconds, so it fits wherever
kvsvc takes a clock (`KVTransferService(clock=...)`) and its value is what `Sender`/`Receiver` methods take as
`now`. Time never goes backwards: `advance` rejects negative steps and `set` rejects earlier times, as a monotonic
clock would. Pure module: standard library only.
"""

from __future__ import annotations


class FakeClock:
    """A monotonic clock that a test drives by hand.

    >>> clock = FakeClock(100.0)
    >>> clock.advance(2.5)
    102.5
    >>> clock()
    102.5
    """

    __slots__ = ("_now",)

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def __call__(self) -> float:
        """The current fake time, in seconds."""
        return self._now

    @property
    def now(self) -> float:
        """The current fake time, in seconds (same as calling the clock)."""
        return self._now

    def advance(self, seconds: float) -> float:
        """Move time forward by `seconds` and return the new time.

        Raises:
            ValueError: `seconds` is negative (a monotonic clock never goes back).
        """
        if seconds < 0:
            raise ValueError(f"cannot advance a monotonic clock by {seconds} s")
        self._now += seconds
        return self._now

    def set(self, t: float) -> float:
        """Jump to time `t` (not earlier than now) and return it.

        Raises:
            ValueError: `t` lies before the current time.
        """
        if t < self._now:
            raise ValueError(f"cannot set a monotonic clock back from {self._now} to {t}")
        self._now = float(t)
        return self._now

    def __repr__(self) -> str:
        return f"FakeClock({self._now!r})"
