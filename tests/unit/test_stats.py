"""`workers.stats.percentile`: the nearest-rank percentile that the demo and the bench both report."""

from __future__ import annotations

import pytest

from workers.stats import percentile


def test_percentile_is_the_nearest_rank_never_an_interpolation() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 99) == 4.0
    assert percentile([7.0], 99) == 7.0


def test_p99_of_fewer_than_a_hundred_values_is_the_largest_and_of_a_hundred_and_one_is_not() -> None:
    assert percentile([float(v) for v in range(99)], 99) == 98.0
    assert percentile([float(v) for v in range(101)], 99) == 99.0


def test_the_index_is_floor_of_q_n_over_100_capped_at_the_last_value() -> None:
    for n in range(1, 1000):
        values = [float(v) for v in range(n)]
        assert percentile(values, 99) == min(n - 1, 99 * n // 100)
        assert percentile(values, 50) == min(n - 1, n // 2)


@pytest.mark.parametrize("q", [-1, 100.5])
def test_percentile_refuses_q_outside_0_to_100(q: float) -> None:
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], q)


def test_percentile_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
