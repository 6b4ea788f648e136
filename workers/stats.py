"""The percentile that `kvsvc demo` and `kvsvc bench` report, so a p50 or p99 means the same in both.

Pure: standard library only, so the demo's command can import it without slowing `kvsvc --help`. Rule: nearest
rank, never interpolated: every percentile is one of the observed values, and p99 of fewer than 100 values is the
largest one (an interpolated p99 of few samples lies below the worst latency that was actually seen).
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile of `values` (any order), by nearest rank: the value at index floor(q n / 100) of the n
    values sorted, or the largest for q = 100. That is the smallest value with more than q % of the values at or
    below it, so p50 of an even count is the upper of the middle two.

    Raises:
        ValueError: `values` is empty, or `q` is outside [0, 100].
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    # q n / 100 rather than (q / 100) n: exact for a whole q, so a rank that is a whole number never floors below it.
    return ordered[min(len(ordered) - 1, math.floor(q * len(ordered) / 100))]


__all__ = ["percentile"]
