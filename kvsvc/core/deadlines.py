"""`Deadlines`: the deadlines of one table of the pure core (P's holds, D's receives), kept so that the earliest one
and the ones that passed are found without a pass over the table.

The service asks for the next deadline after every loop turn that changed something; with thousands of requests in
flight a pass over every hold or receive each time cost more than handling the requests. Rules: the table stays the
truth. An entry here is `(deadline, key)`; it counts only while `current(key)` still returns that deadline (the
key's entry exists, has not ended, and its deadline was not moved since), so a table changes a deadline by pushing
the new one (`set`) and drops one by doing nothing. Stale entries are popped when they reach the top, and the heap
is rebuilt from the table once it holds more than twice the entries that were live at the last rebuild, plus
`_SLACK`. Pure module: standard library only.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Final

# Stale entries tolerated before a rebuild, beyond twice the live ones: a small table never pays for rebuilds, and a
# large one pays one pass per as many pushes as it has entries.
_SLACK: Final = 1024


class Deadlines:
    """A lazy min-heap of `(deadline, key)` over a table whose live deadline of `key` is `current(key)` (None: it
    has none)."""

    def __init__(self, current: Callable[[str], float | None]) -> None:
        self._current = current
        self._heap: list[tuple[float, int, str]] = []
        self._seq = 0  # breaks ties, so keys are never compared
        self._live = 0  # live entries at the last rebuild

    def __len__(self) -> int:
        """Entries held, stale ones included (what the heap costs in memory)."""
        return len(self._heap)

    def set(self, key: str, deadline: float) -> None:
        """`key`'s deadline is now `deadline` (new, or moved either way)."""
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, key))
        if len(self._heap) > 2 * self._live + _SLACK:
            self._rebuild()

    def earliest(self) -> float | None:
        """The earliest live deadline, or None."""
        heap = self._heap
        while heap:
            deadline, _, key = heap[0]
            if self._current(key) == deadline:
                return deadline
            heapq.heappop(heap)
        return None

    def due(self, now: float) -> Iterator[str]:
        """The keys whose live deadline is at or before `now`, earliest first, each once. An entry leaves the heap
        once the caller has handled its key (ended it or moved its deadline, which makes the entry stale), so a
        caller that raises leaves that key and the rest due for the next call, as a pass over the table would."""
        heap = self._heap
        given: set[tuple[str, float]] = set()  # a key pushed twice with one deadline comes once
        while heap and heap[0][0] <= now:
            deadline, _, key = heap[0]
            if self._current(key) != deadline or (key, deadline) in given:
                heapq.heappop(heap)
                continue
            given.add((key, deadline))
            yield key

    def _rebuild(self) -> None:
        live: dict[str, float] = {}
        for _, _, key in self._heap:
            if key not in live:
                deadline = self._current(key)
                if deadline is not None:
                    live[key] = deadline
        self._heap = []
        for key, deadline in live.items():
            self._seq += 1
            self._heap.append((deadline, self._seq, key))
        heapq.heapify(self._heap)
        self._live = len(self._heap)
