"""`kvsvc.core.histogram`: the workers' own latency histograms (Prometheus bucket semantics, snapshots, bad bounds)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsvc.core.histogram import TRANSFER_BUCKETS, LatencyHistogram


def test_a_value_on_a_bound_counts_in_that_bucket_and_negatives_count_as_zero() -> None:
    hist = LatencyHistogram((0.1, 1.0))
    for seconds in (0.1, 0.5, 1.0, 7.0, -3.0):
        hist.observe(seconds)
    snap = hist.statistics()
    assert snap.bounds == (0.1, 1.0)
    assert snap.counts == (2, 2, 1)  # (.., 0.1]: 0.1 and -3 -> 0; (0.1, 1]: 0.5, 1.0; above: 7
    assert snap.count == 5
    assert snap.total == pytest.approx(8.6)


def test_snapshots_do_not_change_afterwards() -> None:
    hist = LatencyHistogram()
    before = hist.statistics()
    hist.observe(0.003)
    assert before.count == 0 and hist.statistics().count == 1
    assert len(hist.statistics().counts) == len(TRANSFER_BUCKETS) + 1


@pytest.mark.parametrize("bounds", [(), (1.0, 1.0), (2.0, 1.0)])
def test_bounds_must_increase_strictly(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        LatencyHistogram(bounds)


@given(st.lists(st.floats(min_value=0, max_value=120, allow_nan=False), max_size=50))
def test_cumulative_counts_match_a_direct_count(values: list[float]) -> None:
    hist = LatencyHistogram()
    for v in values:
        hist.observe(v)
    snap = hist.statistics()
    running = 0
    for bound, count in zip(snap.bounds, snap.counts, strict=False):
        running += count
        assert running == sum(1 for v in values if v <= bound)
    assert snap.count == len(values)
    assert snap.total == pytest.approx(sum(values))
