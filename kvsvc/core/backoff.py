"""`Backoff`: how long a driver waits before it tries again to reach a peer it lost, per peer.

Rules: the first try after a loss waits `first_s`; each try that fails doubles the wait, up to `max_s`; a try that
succeeds, or a peer nothing waits on any more, starts the schedule over (`forget`). The schedule keeps one number per
peer that is being retried and nothing else; the driver sleeps, this module only says how long. Pure module:
standard library only.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Final

RECONNECT_FIRST_S: Final = 0.05
RECONNECT_MAX_S: Final = 2.0


class Backoff:
    """Doubling delays between tries, per key (module docstring).

    Raises (constructor):
        ValueError: `first_s` not above 0, or `max_s` below it.
    """

    def __init__(self, first_s: float = RECONNECT_FIRST_S, max_s: float = RECONNECT_MAX_S) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"backoff needs 0 < first_s <= max_s, got first_s {first_s:g}, max_s {max_s:g}")
        self.first_s, self.max_s = first_s, max_s
        self._next: dict[Hashable, float] = {}

    def __len__(self) -> int:
        return len(self._next)

    def delay(self, key: Hashable) -> float:
        """The wait before the next try for `key`; the try after it (if this one fails) waits twice as long."""
        delay = self._next.get(key, self.first_s)
        self._next[key] = min(2 * delay, self.max_s)
        return delay

    def forget(self, key: Hashable) -> None:
        """`key` was reached, or nothing waits on it: its next loss starts at `first_s` again."""
        self._next.pop(key, None)


__all__ = ["RECONNECT_FIRST_S", "RECONNECT_MAX_S", "Backoff"]
