"""Transfer latency histograms that a worker keeps itself, so that every engine exports them without help.

Pure: standard library only. Invariants: bucket bounds are fixed at construction and strictly increasing; counts
only grow; `statistics()` is a frozen snapshot (plain tuples, so it pickles and turns into JSON as it is).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import pairwise
from typing import Final

# From a millisecond (a small loopback transfer) to a minute (the default hold timeout): wider than that is a
# hold expiry, which has its own counter.
TRANSFER_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# The parts of a staged write: a GPU's gather or copy takes microseconds, a CPU's a fraction of a millisecond.
STAGE_BUCKETS: Final = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.5, 10.0)


@dataclass(frozen=True, slots=True)
class HistogramStatistics:
    """Observations so far: `counts[i]` fell in (`bounds[i-1]`, `bounds[i]`]; the last count is above every bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float  # the sum of the observations, in seconds

    @property
    def count(self) -> int:
        return sum(self.counts)


class LatencyHistogram:
    """Counts durations in fixed buckets (Prometheus semantics: a value equal to a bound counts in that bucket)."""

    def __init__(self, bounds: tuple[float, ...] = TRANSFER_BUCKETS) -> None:
        """Raises:
        ValueError: `bounds` is empty or not strictly increasing.
        """
        if not bounds or any(b >= c for b, c in pairwise(bounds)):
            raise ValueError(f"histogram bounds must be non-empty and strictly increasing, got {bounds}")
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._total = 0.0

    def observe(self, seconds: float) -> None:
        """Count one duration; a negative one (a clock step) counts as 0."""
        seconds = max(0.0, seconds)
        self._counts[bisect_left(self._bounds, seconds)] += 1
        self._total += seconds

    def statistics(self) -> HistogramStatistics:
        return HistogramStatistics(self._bounds, tuple(self._counts), self._total)


__all__ = ["STAGE_BUCKETS", "TRANSFER_BUCKETS", "HistogramStatistics", "LatencyHistogram"]
