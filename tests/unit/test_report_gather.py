"""D's report gathering (`kvsvc.core.receiver.ReportGather`): a burst's loads reach the engine in one report, a
report never waits past its bound or with nothing owed, and every receive is still reported exactly once, byte
exact, when the reports are taken at any time (the `PeerPair` simulator)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsvc.core.receiver import GATHER_STEP_SHARE, Receiver, RecvRequest, ReportGather
from kvsvc.testing.pair import PeerPair
from kvsvc.testing.sim import EngineSpec

P0 = (0, 0)
MB = 1 << 20
STEP_S = 0.05  # the engine's forward: holds last at most a quarter of it


def _receiver(n: int, planned: int = MB, gather_s: float = 0.025, pushed: int = 0) -> Receiver:
    """A D worker receiving `n` transfers of `planned` bytes each from P0, every request asked at 0; the last
    `pushed` of them wait for a pushing P's prefill."""
    receiver = Receiver(report_gather_s=gather_s)
    for i in range(n):
        request = RecvRequest(f"r{i}", f"t{i}", "P", "http://p", (i,), 16, 0, "", push=i >= n - pushed)
        assert receiver.start(request, 0.0, receive=f"x{i}")
        receiver.sources_known(f"t{i}", [P0], [], {P0}, {P0: planned})
    return receiver


def _land(receiver: Receiver, i: int, now: float, error: str | None = None) -> None:
    assert receiver.answer("P", P0, f"t{i}", error) is not None
    receiver.take_landed(now)


def test_a_burst_that_lands_within_a_quarter_step_reaches_the_engine_in_one_report() -> None:
    receiver = _receiver(4)
    _land(receiver, 0, 0.010)
    assert receiver.take_report(0.010, STEP_S).finished == set()  # three more are owed: the first waits
    assert receiver.report_held_until == pytest.approx(0.010 + GATHER_STEP_SHARE * STEP_S)
    _land(receiver, 1, 0.011)
    _land(receiver, 2, 0.012)
    assert receiver.take_report(0.012, STEP_S).finished == set()
    _land(receiver, 3, 0.013)
    assert receiver.take_report(0.013, STEP_S).finished == {"r0", "r1", "r2", "r3"}  # nothing owed: all go
    assert receiver.report_held_until is None
    assert receiver.take_report(0.014, STEP_S).finished == set()


def test_a_report_goes_at_once_from_a_step_that_computes_or_without_gathering() -> None:
    receiver = _receiver(2)
    _land(receiver, 0, 0.010)
    assert receiver.take_report(0.010, 0.0).finished == {"r0"}  # step_s 0: the step computes, holding costs it
    off = _receiver(2, gather_s=0.0)
    _land(off, 0, 0.010)
    assert off.take_report(0.010, STEP_S).finished == {"r0"}


def test_a_held_report_goes_once_its_bound_passes_though_more_is_owed() -> None:
    receiver = _receiver(3)
    _land(receiver, 0, 0.010)
    assert receiver.take_report(0.010, STEP_S).finished == set()
    bound = min(0.025, GATHER_STEP_SHARE * STEP_S)
    assert receiver.take_report(0.010 + bound * 0.99, STEP_S).finished == set()
    assert receiver.take_report(0.010 + bound, STEP_S).finished == {"r0"}


def test_a_report_does_not_wait_for_receives_that_wait_for_a_pushing_ps_prefill() -> None:
    receiver = _receiver(3, pushed=2)
    _land(receiver, 0, 0.010)
    assert receiver.take_report(0.010, STEP_S).finished == {"r0"}  # P's prefill is no landing about to happen


def test_a_hold_needs_a_landed_receive_not_reported_yet() -> None:
    receiver = _receiver(3)
    assert receiver.answer("P", P0, "t0", None) is not None
    assert receiver.take_report(0.010, 0.0).finished == {"r0"}
    receiver.take_landed(0.010)  # its landing is learnt after it was reported
    assert receiver.take_report(0.011, STEP_S).finished == set()
    assert receiver.report_held_until is None  # nothing finished waits: no hold for a waiter to wake at


def test_failures_are_never_held() -> None:
    receiver = _receiver(3)
    _land(receiver, 0, 0.010)
    _land(receiver, 1, 0.011, error="P ran out of time")
    report = receiver.take_report(0.011, STEP_S)
    assert (report.finished, report.failed, report.invalid_block_ids) == (set(), {"r1"}, {1})
    _land(receiver, 2, 0.012)
    assert receiver.take_report(0.012, STEP_S).finished == {"r0", "r2"}


def test_once_the_landing_rate_is_known_a_report_does_not_wait_for_bytes_that_cannot_land_in_time() -> None:
    receiver = _receiver(3, planned=MB)
    _land(receiver, 0, 0.010)
    _land(receiver, 1, 0.011)  # 1 MiB a millisecond after the first: ~1 GB/s
    _land(receiver, 2, 0.012)
    assert receiver.take_report(0.012, STEP_S).finished == {"r0", "r1", "r2"}
    request = RecvRequest("big", "tbig", "P", "http://p", (9,), 16, 0, "")
    assert receiver.start(request, 0.012, receive="xbig")
    receiver.sources_known("tbig", [P0], [], {P0}, {P0: 200 * MB})  # ~0.2 s at that rate
    small = RecvRequest("small", "tsmall", "P", "http://p", (8,), 16, 0, "")
    assert receiver.start(small, 0.012, receive="xsmall")
    receiver.sources_known("tsmall", [P0], [], {P0}, {P0: MB})
    assert receiver.answer("P", P0, "tsmall", None) is not None
    receiver.take_landed(0.013)
    assert receiver.take_report(0.013, STEP_S).finished == {"small"}  # the big one would hold it past the bound


def test_a_negative_bound_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"max_hold_s must be >= 0 .*got -0\.1"):
        ReportGather(-0.1)


@settings(max_examples=300, deadline=None)
@given(
    max_hold_s=st.sampled_from([0.0, 0.005, 0.025, 1.0]),
    events=st.lists(
        st.tuples(
            st.sampled_from(["land", "hold", "report"]),
            st.floats(0.0, 0.02),  # time since the previous event
            st.integers(0, 4),  # in flight
            st.integers(0, 64 * MB),  # bytes in flight, or the landing's bytes
            st.sampled_from([0.0, 0.004, 0.05, 0.4]),  # step_s
        ),
        max_size=40,
    ),
)
def test_a_hold_never_outlasts_its_bound_and_needs_something_owed_and_an_idle_engine(
    max_hold_s: float, events: list[tuple[str, float, int, int, float]]
) -> None:
    gather, now, first = ReportGather(max_hold_s), 0.0, None
    for kind, dt, in_flight, nbytes, step_s in events:
        now += dt
        if kind == "land":
            gather.landed(now, max(0.0, now - 0.03), nbytes)
            first = now if first is None else first
        elif kind == "report":
            gather.reported()
            first = None
        elif gather.holds(now, in_flight, nbytes, step_s):
            bound = min(max_hold_s, GATHER_STEP_SHARE * step_s)
            assert first is not None and in_flight > 0 and step_s > 0
            assert now < first + bound
            assert gather.until == pytest.approx(first + bound)
            if gather.rate is not None:
                assert now + nbytes / gather.rate <= first + bound
        else:
            assert gather.until is None


SIDES = st.sampled_from([(1, 1), (2, 1), (1, 2)])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p_shape=SIDES,
    d_shape=SIDES,
    transfers=st.integers(1, 4),
    rng=st.randoms(use_true_random=False),
    step_s=st.sampled_from([0.0, 0.01, 0.05]),
)
def test_reports_taken_at_any_time_with_gathering_report_every_receive_once_and_byte_exact(
    p_shape: tuple[int, int], d_shape: tuple[int, int], transfers: int, rng: random.Random, step_s: float
) -> None:
    p = EngineSpec(tp_size=p_shape[0], pp_size=p_shape[1], num_kv_heads=2, num_blocks=16)
    d = EngineSpec(tp_size=d_shape[0], pp_size=d_shape[1], num_kv_heads=2, num_blocks=16)
    pair = PeerPair(p, d, receiver=lambda: Receiver(report_gather_s=0.025))
    tids = [f"t{i}" for i in range(transfers)]
    for i, tid in enumerate(tids):
        pair.start_send(f"p-{tid}", tid, [3 * i, 3 * i + 1, 3 * i + 2], 10)
        pair.start_recv(f"d-{tid}", tid, [15 - 3 * i, 14 - 3 * i, 13 - 3 * i], 10)
    while pair.step(rng):
        pair.clock.advance(rng.choice([0.0, 0.001, 0.004]))
        if rng.random() < 0.3:
            pair.take_reports(step_s)
    pair.take_reports(step_s)  # nothing is owed any more: nothing may stay held
    pair.assert_reported_once([f"p-{t}" for t in tids], [f"d-{t}" for t in tids])
    for tid in tids:
        assert {o for (side, _), outs in pair.outcomes(f"d-{tid}").items() if side == "D" for o in outs} == {"finished"}
        pair.assert_received(tid, list(pair.receivers))
    assert pair.violations == []
