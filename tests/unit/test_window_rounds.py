"""The window-round protocol (`kvsvc.core.windows`) as docs/protocol.md states it, with no event loop: D's lent window
and P's filling window alone, then both back to back in `PeerPair` with the round frames on its wire. A late, repeated,
early or out-of-order `WindowFilled`, `WindowEmptied` or `TransferDone` is handled as the doc says; whatever the
order, every byte lands once or the receive fails, each side reports once and every window goes back."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.core.errors import LocalProtocolError
from kvsvc.core.jobs import Notice
from kvsvc.core.messages import ErrorMessage, TransferDone, TransferFailed, WindowEmptied, WindowFilled, WorkerRef
from kvsvc.core.staging_plans import StagingRule, Way, WindowPlan
from kvsvc.core.windows import (
    Announce,
    Deliver,
    Fail,
    FillEvent,
    FillingWindow,
    FillState,
    LentWindows,
    Scatter,
    ScatterState,
    TellP,
    lends_windows,
)
from kvsvc.testing.pair import Envelope, PeerPair
from kvsvc.testing.sim import EngineSpec

D0 = WorkerRef("decode", "i", 0, 0)  # the D worker whose window P fills

ALWAYS = StagingRule(gather_cost_s_per_byte=0.0, scatter_cost_s_per_byte=0.0)
KEY = ("t", "prefill", (0, 0))


def _lent(share: int = 400, window: int = 200) -> LentWindows:
    """A D worker that lent one window of `window` bytes for a `share`-byte share: rounds of 100 bytes when the share
    is larger (one scatter piece per 100 bytes of stream, into blocks at 10,000)."""
    offset = np.arange(0, share, 100, dtype=np.int64)
    plan = WindowPlan(share, window, offset, 10_000 + offset, np.full(offset.size, 100, dtype=np.int64), Way.SCATTER)
    lent = LentWindows()
    lent.lend(KEY, "d-t", [1, 2], 5_000, plan)
    return lent


def _filled(r: int) -> WindowFilled:
    return WindowFilled(transfer_id="t", round=r)


def _kinds(commands: list[object]) -> list[str]:
    out = []
    for c in commands:
        if isinstance(c, Scatter):
            out.append(f"scatter {c.round}")
        elif isinstance(c, TellP):
            out.append(f"emptied {c.message.round}")
        elif isinstance(c, Deliver):
            out.append(f"deliver {type(c.message).__name__}")
        elif isinstance(c, Notice):
            out.append("protocol error" if c.protocol_error else f"notice {c.level}")
    return out


DONE = TransferDone(transfer_id="t", bytes=400, descriptors=4)


# -- D: a lent window ----------------------------------------------------------------------------------------------


def test_rounds_are_scattered_one_at_a_time_in_order_and_the_done_answer_waits_for_the_last() -> None:
    lent = _lent()  # 4 rounds of 100 bytes through a 200-byte window
    assert _kinds(lent.receive("prefill", (0, 0), _filled(0))) == ["scatter 0"]
    assert lent.receive("prefill", (0, 0), _filled(1)) == []  # waits behind round 0's scatter
    assert _kinds(lent.scattered(KEY, None)) == ["emptied 0", "scatter 1"]
    assert _kinds(lent.scattered(KEY, None)) == ["emptied 1"]
    assert _kinds(lent.receive("prefill", (0, 0), _filled(2))) == ["scatter 2"]
    assert _kinds(lent.scattered(KEY, None)) == []  # P writes no round 4 into round 2's half: it is not told
    assert _kinds(lent.receive("prefill", (0, 0), DONE)) == ["scatter 3"]
    last = lent.scattered(KEY, None)
    assert _kinds(last) == ["deliver TransferDone"] and last[0] == Deliver(DONE, scattered=True)


def test_each_round_is_scattered_from_its_half_of_the_window() -> None:
    lent = _lent()
    first = lent.receive("prefill", (0, 0), _filled(0))[0]
    lent.scattered(KEY, None)
    second = lent.receive("prefill", (0, 0), _filled(1))[0]
    assert isinstance(first, Scatter) and isinstance(second, Scatter)
    assert first.src.tolist() == [5_000] and first.dst.tolist() == [10_000]
    assert second.src.tolist() == [5_100] and second.dst.tolist() == [10_100]  # half 1, stream bytes 100..200


def test_a_repeated_round_is_emptied_again_without_a_second_scatter() -> None:
    lent = _lent()
    lent.receive("prefill", (0, 0), _filled(0))
    lent.scattered(KEY, None)
    assert _kinds(lent.receive("prefill", (0, 0), _filled(0))) == ["emptied 0"]


@pytest.mark.parametrize("r", [2, 3, 7])
def test_a_round_out_of_order_or_the_last_one_announced_is_a_protocol_error_and_dropped(r: int) -> None:
    lent = _lent()
    commands = lent.receive("prefill", (0, 0), _filled(r))
    assert _kinds(commands) == ["protocol error"]
    assert f"round {r}" in commands[0].text and "expected 0 of 4" in commands[0].text  # type: ignore[union-attr]
    assert _kinds(lent.receive("prefill", (0, 0), _filled(0))) == ["scatter 0"]  # the window goes on


def test_a_done_answer_before_every_round_was_announced_fails_the_receive_naming_the_counts() -> None:
    lent = _lent()
    commands = lent.receive("prefill", (0, 0), DONE)
    assert _kinds(commands) == ["deliver TransferFailed"]
    assert "after 0 of 4 rounds" in commands[0].message.reason  # type: ignore[union-attr]


def test_after_a_scatter_failed_rounds_are_only_emptied_and_done_becomes_a_failure() -> None:
    lent = _lent()
    lent.receive("prefill", (0, 0), _filled(0))
    assert _kinds(lent.scattered(KEY, "RuntimeError: copy broke")) == ["emptied 0"]  # P's write still ends
    assert _kinds(lent.receive("prefill", (0, 0), _filled(1))) == ["emptied 1"]
    assert _kinds(lent.receive("prefill", (0, 0), _filled(2))) == []  # emptied, but no later round needs its half
    answer = lent.receive("prefill", (0, 0), DONE)
    assert _kinds(answer) == ["deliver TransferFailed"] and "copy broke" in answer[0].message.reason  # type: ignore[union-attr]


def test_once_the_receive_is_ending_rounds_are_emptied_unscattered() -> None:
    lent = _lent()
    lent.tidy(lambda key: True, lambda transfer_id: True)  # the receive is being aborted
    assert _kinds(lent.receive("prefill", (0, 0), _filled(0))) == ["emptied 0"]
    assert _kinds(lent.receive("prefill", (0, 0), _filled(1))) == ["emptied 1"]
    lent.receive("prefill", (0, 0), _filled(2))
    [answer] = lent.receive("prefill", (0, 0), DONE)
    assert isinstance(answer, Deliver) and isinstance(answer.message, TransferFailed)
    assert "ended before its window was scattered" in answer.message.reason


def test_p_failure_during_a_scatter_waits_behind_it_and_goes_on_as_it_is() -> None:
    lent = _lent()
    lent.receive("prefill", (0, 0), _filled(0))
    failed = TransferFailed(transfer_id="t", reason="write failed")
    assert lent.receive("prefill", (0, 0), failed) == []
    assert _kinds(lent.scattered(KEY, None)) == ["emptied 0", "deliver TransferFailed"]


def test_frames_after_the_answer_are_late_rounds_or_repeats_for_the_receiver() -> None:
    lent = _lent(share=100, window=200)  # one round: P's done answer is all
    lent.receive("prefill", (0, 0), DONE)
    lent.scattered(KEY, None)
    assert lent.get(KEY).state is ScatterState.ANSWERED  # type: ignore[union-attr]
    assert _kinds(lent.receive("prefill", (0, 0), _filled(0))) == ["notice debug"]
    assert _kinds(lent.receive("prefill", (0, 0), DONE)) == ["deliver TransferDone"]  # the Receiver drops repeats


def test_a_late_round_for_a_window_given_back_or_never_lent_goes_to_the_receiver_which_drops_it() -> None:
    empty = LentWindows()  # this D worker lent no window at all
    assert _kinds(empty.receive("prefill", (0, 0), _filled(3))) == ["deliver WindowFilled"]
    lent = _lent()
    assert lent.tidy(lambda key: False, lambda transfer_id: False) == [5_000]  # its receive ended: given back
    assert _kinds(lent.receive("prefill", (0, 0), _filled(1))) == ["deliver WindowFilled"]


def test_an_answer_for_another_receive_of_the_transfer_leaves_the_window_as_it_was() -> None:
    """An ended receive's late answer (the same params received again) must neither fail the window's receive nor,
    on a one-round window, end it with bytes P never wrote for it; one naming no receive (an older P) counts."""
    offset = np.arange(0, 100, 100, dtype=np.int64)
    plan = WindowPlan(100, 200, offset, 10_000 + offset, np.full(1, 100, dtype=np.int64), Way.SCATTER)
    lent = LentWindows()
    lent.lend(KEY, "d-t", [1], 5_000, plan, receive="second")
    done = TransferDone(transfer_id="t", bytes=100, descriptors=1)
    for stale in (
        msgspec.structs.replace(done, receive="first"),
        TransferFailed(transfer_id="t", reason="x", receive="first"),
    ):
        assert _kinds(lent.receive("prefill", (0, 0), stale)) == ["notice debug"]
    # P's own answer for this receive: the last (only) round is scattered, then the answer goes on.
    answer = msgspec.structs.replace(done, receive="second")
    assert _kinds(lent.receive("prefill", (0, 0), answer)) == ["scatter 0"]
    assert _kinds(lent.scattered(KEY, None)) == ["deliver TransferDone"]


def test_frames_about_no_window_go_to_the_receiver_as_they_are() -> None:
    lent = _lent()
    for message in (TransferDone(transfer_id="other", bytes=1, descriptors=1), ErrorMessage(reason="x")):
        assert lent.receive("prefill", (0, 0), message) == [Deliver(message)]


def test_a_window_that_scatters_is_not_given_back_and_its_failed_receive_is_held_back() -> None:
    from kvsvc.core.receiver import RecvReport

    lent = _lent()
    lent.receive("prefill", (0, 0), _filled(0))
    assert lent.tidy(lambda key: False, lambda transfer_id: True) == []  # a scatter reads it
    report = lent.hold_back(RecvReport(set(), {"d-t"}, {1, 2}, {"d-t": "aborted"}))
    assert report.failed == set() and report.invalid_block_ids == set()
    lent.scattered(KEY, None)
    assert lent.tidy(lambda key: False, lambda transfer_id: True) == [5_000]
    later = lent.hold_back(RecvReport(set(), set(), set(), {}))
    assert later.failed == {"d-t"} and later.invalid_block_ids == {1, 2} and later.reasons == {"d-t": "aborted"}


def test_a_scatter_end_without_a_scatter_is_a_local_protocol_error() -> None:
    with pytest.raises(LocalProtocolError, match="scattered in state filling"):
        _lent().scattered(KEY, None)


# -- P: filling a window -------------------------------------------------------------------------------------------


def _fill(share: int = 400, window: int = 200, timeout_s: float = 5.0) -> FillingWindow:
    offset = np.arange(0, share, 100, dtype=np.int64)
    stream = (20_000 + offset, offset, np.full(offset.size, 100, dtype=np.int64))
    return FillingWindow("t", stream, 5_000, window, timeout_s, dst=D0)


def test_p_fills_both_halves_then_waits_for_d_to_empty_the_older_round() -> None:
    fill = _fill()  # 4 rounds of 100 bytes
    assert fill.round_pieces(0)[1].tolist() == [5_000] and fill.round_pieces(1)[1].tolist() == [5_100]
    assert fill.round_pieces(2)[1].tolist() == [5_000]  # round 2 reuses round 0's half
    assert fill.landed(0.0) == [Announce(D0, _filled(0))] and fill.state is FillState.FILLING
    assert fill.landed(0.0) == [Announce(D0, _filled(1))] and fill.state is FillState.WAITING
    assert fill.deadline == 5.0
    assert fill.emptied(1) == [] and fill.state is FillState.WAITING  # not the half round 2 needs
    assert fill.emptied(0) == [] and fill.state is FillState.FILLING and fill.next_round == 2
    fill.landed(1.0)
    assert fill.state is FillState.FILLING  # round 3's half (round 1's) is free already
    assert fill.landed(1.0) == [] and fill.state is FillState.FILLED  # the last round is answered by done


def test_repeated_and_unannounced_emptied_frames_change_nothing() -> None:
    fill = _fill()
    fill.landed(0.0)
    fill.landed(0.0)
    notice = fill.emptied(3)
    assert len(notice) == 1 and isinstance(notice[0], Notice) and notice[0].protocol_error
    assert fill.state is FillState.WAITING
    fill.emptied(0)
    assert fill.emptied(0) == [] and fill.next_round == 2


def test_a_lost_connection_fails_a_waiting_write_at_once_and_a_writing_one_once_its_round_ended() -> None:
    waiting = _fill()
    waiting.landed(0.0)
    waiting.landed(0.0)
    assert waiting.peer_lost("gone") == [Fail("gone", FillEvent.PEER_LOST)]
    writing = _fill()
    assert writing.peer_lost("gone") == []  # round 0 is on the wire
    assert writing.landed(0.0) == [Fail("gone", FillEvent.PEER_LOST)] and writing.state is FillState.FAILED


def test_a_wait_for_a_half_fails_at_its_deadline() -> None:
    fill = _fill(timeout_s=5.0)
    fill.landed(10.0)
    fill.landed(10.0)
    assert fill.expire(14.9) == []
    [failed] = fill.expire(15.0)
    assert isinstance(failed, Fail) and failed.cause is FillEvent.EXPIRE and "within 5 s" in failed.reason


def test_a_stopped_write_fails_and_ignores_what_comes_after() -> None:
    fill = _fill()
    fill.landed(0.0)
    assert fill.stop("aborted") == [] and fill.state is FillState.FAILED  # the driver stops before the next round
    assert fill.emptied(0) == [] and fill.expire(1e9) == []


# -- both sides back to back ---------------------------------------------------------------------------------------


def _pair(tokens: int = 64, staging_bytes: int = 8 << 10) -> PeerPair:
    """P tp2 -> D tp1, whose shares go through D's windows; a small region makes each share take several rounds."""
    p, d = EngineSpec(tp_size=2, num_blocks=64), EngineSpec(tp_size=1, num_blocks=64)
    pair = PeerPair(p, d, staging=ALWAYS, staging_bytes=staging_bytes, windows=True)
    blocks = -(-tokens // p.block_size)
    pair.start_send("p-t", "t", list(range(blocks)), tokens)
    pair.start_recv("d-t", "t", list(range(30, 30 + blocks)), tokens)
    return pair


def _finish(pair: PeerPair, rng: random.Random | None = None) -> None:
    pair.run_until_idle(rng)
    pair.advance(1000.0)
    pair.run_until_idle(rng)
    pair.advance(1000.0)
    pair.run_until_idle(rng)
    pair.take_reports()
    pair.assert_reported_once(["p-t"], ["d-t"])
    assert pair.violations == []
    assert pair.statistics().windows_lent == 0 and pair.statistics().scatters_pending == 0


def test_a_share_moves_through_its_window_in_rounds_with_the_frames_on_the_wire() -> None:
    pair = _pair()
    seen: list[str] = []
    pair.hold_back = lambda e: seen.append(type(e.message).__name__) and False  # type: ignore[func-returns-value]
    _finish(pair)
    pair.assert_received("t")
    # Per share: a WindowFilled for every round but the last, a WindowEmptied for every half P writes again.
    filled = seen.count("WindowFilled")
    assert filled >= 4 and seen.count("WindowEmptied") == filled - 2
    assert pair.outcomes("d-t") == {("D", (0, 0)): ["finished"]}
    assert not [n for n in pair.notices if n.protocol_error]


def test_duplicated_round_frames_in_both_directions_change_nothing() -> None:
    pair = _pair()
    pair.duplicate = lambda e: isinstance(e.message, WindowFilled | WindowEmptied | TransferDone)
    _finish(pair)
    pair.assert_received("t")
    assert pair.outcomes("d-t") == {("D", (0, 0)): ["finished"]}
    assert not [n for n in pair.notices if n.protocol_error]
    assert all(pair.bytes_written_twice(w) == 0 for w in pair.receivers)


def test_a_round_announced_out_of_order_is_dropped_and_the_receive_fails_by_its_deadline() -> None:
    pair = _pair()
    first = [True]

    def delay_round_zero(e: Envelope) -> bool:
        if isinstance(e.message, WindowFilled) and e.message.round == 0 and first[0]:
            first[0] = False
            return True
        return False

    pair.hold_back = delay_round_zero
    pair.run_until_idle()  # round 1 reaches D before round 0: an out-of-order round
    assert [n for n in pair.notices if n.protocol_error and "expected 0" in n.text]
    pair.release_held()
    _finish(pair)
    assert pair.outcomes("d-t") == {("D", (0, 0)): ["failed"]}
    assert pair.outcomes("p-t") == {("P", (0, 0)): ["finished_sending"], ("P", (0, 1)): ["finished_sending"]}


def test_a_lost_round_answer_ends_ps_wait_at_its_deadline_and_nothing_leaks() -> None:
    pair = _pair()
    pair.drop = lambda e: isinstance(e.message, WindowEmptied)
    _finish(pair)
    assert pair.outcomes("d-t") == {("D", (0, 0)): ["failed"]}


def test_a_failed_scatter_fails_the_receive_and_ps_writes_still_end() -> None:
    pair = _pair()
    pair.fail_scatter = lambda copy: copy.command.round == 1
    _finish(pair)
    [entry] = [e for e in pair.history if e.side == "D"]
    assert entry.outcome == "failed" and "injected scatter failure" in entry.reason
    assert pair.statistics().writes_failed == 0  # every round was emptied: P's writes ended as written


def test_a_round_that_arrives_after_the_receive_was_aborted_is_dropped_quietly() -> None:
    pair = _pair()
    pair.hold_back = lambda e: isinstance(e.message, WindowFilled)
    pair.run_until_idle()
    pair.abort_recv("d-t")
    pair.advance(1000.0)  # the abort grace: D gives the windows back without P's answer
    pair.run_until_idle()
    assert pair.statistics().windows_lent == 0
    pair.hold_back = None
    pair.release_held()  # the rounds P announced long ago
    _finish(pair)
    assert not [n for n in pair.notices if n.protocol_error]
    assert [n for n in pair.notices if n.level == "debug" and "late round" in n.text]


def test_a_write_in_rounds_ps_job_no_longer_wants_stops_at_the_next_round_and_p_reports_once() -> None:
    pair = _pair()
    while not any(isinstance(e.message, WindowFilled) for e in pair._wire):  # a round landed, more to come
        assert pair.step()
    pair.abort_send("p-t")  # P's jobs drain: the write in rounds stops at its next round's start
    _finish(pair)
    assert pair.statistics().writes_pending == 0 and pair.statistics().writes_failed >= 1
    assert pair.outcomes("p-t") == {("P", (0, 0)): ["finished_sending"], ("P", (0, 1)): ["finished_sending"]}
    assert pair.outcomes("d-t") == {("D", (0, 0)): ["failed"]}


@given(st.integers(0, 10_000), st.sampled_from([4 << 10, 8 << 10, 64 << 10]), st.integers(1, 80))
@settings(max_examples=60, deadline=None)
def test_any_order_of_steps_that_keeps_each_link_in_order_lands_every_byte_once(
    seed: int, staging_bytes: int, tokens: int
) -> None:
    pair = _pair(tokens, staging_bytes)
    pair.fifo = True  # the control connection is a TCP stream; writes and scatters still interleave freely
    _finish(pair, random.Random(seed))
    pair.assert_received("t")
    assert pair.outcomes("d-t") == {("D", (0, 0)): ["finished"]}
    assert all(pair.bytes_written_twice(w) == 0 for w in pair.receivers)


@given(st.integers(0, 10_000), st.sampled_from([4 << 10, 8 << 10]), st.integers(1, 80))
@settings(max_examples=60, deadline=None)
def test_reordered_round_frames_fail_the_receive_never_finish_it_with_wrong_bytes(
    seed: int, staging_bytes: int, tokens: int
) -> None:
    pair = _pair(tokens, staging_bytes)  # messages of one link may overtake each other
    _finish(pair, random.Random(seed))
    if pair.outcomes("d-t") == {("D", (0, 0)): ["finished"]}:
        pair.assert_received("t")
    else:
        assert pair.outcomes("d-t") == {("D", (0, 0)): ["failed"]}


def test_negative_control_rounds_written_into_one_half_corrupt_the_kv() -> None:
    pair = _pair()
    original = FillingWindow.round_pieces

    def one_half(self: FillingWindow, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src, dst, length = original(self, index)
        return src, dst - (index % 2) * self.round_bytes, length

    FillingWindow.round_pieces = one_half  # type: ignore[method-assign]
    try:
        _finish(pair)
    finally:
        FillingWindow.round_pieces = original  # type: ignore[method-assign]
    with pytest.raises(AssertionError):
        pair.assert_received("t")


def test_d_lends_windows_only_with_a_region_to_scatter_from_and_no_kv_cache_groups() -> None:
    assert lends_windows(True, 0)
    assert not lends_windows(False, 0)  # no region, or one it cannot scatter from: requests go out as they are
    assert not lends_windows(True, 2)  # a hybrid model: P writes each group's blocks
