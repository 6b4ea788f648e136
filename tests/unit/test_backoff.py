"""The reconnect schedule (`kvsvc.core.receiver`): a lost peer is tried again after a delay that doubles per failed try
up to a cap, and starts over once reached or no longer waited on."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsvc.core.receiver import RECONNECT_FIRST_S, RECONNECT_MAX_S, Backoff


def test_the_delay_starts_at_50_ms_and_doubles_up_to_2_s() -> None:
    backoff = Backoff()
    delays = [backoff.delay("p0") for _ in range(8)]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert (RECONNECT_FIRST_S, RECONNECT_MAX_S) == (0.05, 2.0)


def test_each_peer_has_its_own_schedule_and_forgetting_starts_it_over() -> None:
    backoff = Backoff()
    backoff.delay("p0")
    backoff.delay("p0")
    assert backoff.delay("p1") == RECONNECT_FIRST_S
    backoff.forget("p0")
    backoff.forget("never tried")
    assert backoff.delay("p0") == RECONNECT_FIRST_S
    backoff.forget("p0")
    backoff.forget("p1")
    assert len(backoff) == 0  # nothing kept for peers that are not being retried


@given(st.floats(1e-3, 10.0), st.floats(1.0, 100.0), st.integers(1, 60))
def test_delays_never_shrink_and_never_pass_the_cap(first_s: float, factor: float, tries: int) -> None:
    backoff = Backoff(first_s, first_s * factor)
    delays = [backoff.delay("p") for _ in range(tries)]
    assert delays[0] == first_s
    assert all(a <= b <= first_s * factor for a, b in itertools.pairwise(delays))


@pytest.mark.parametrize(("first_s", "max_s"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_a_schedule_that_cannot_wait_or_shrinks_is_refused_naming_both(first_s: float, max_s: float) -> None:
    with pytest.raises(ValueError, match=f"first_s {first_s:g}, max_s {max_s:g}"):
        Backoff(first_s, max_s)
