"""The decisions every driver of the core shares (`carry_out_p`, `carry_out_d` and the window decisions of
`kvsvc.core.windows`): how commands reach a side's methods, which object a frame goes to, what a write in rounds does
next, and whether a request gets a window. The service and `PeerPair` both call these."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from msgspec.structs import replace as replace_struct

from kvsvc.core.errors import LocalProtocolError
from kvsvc.core.jobs import Notice
from kvsvc.core.messages import (
    Release,
    TransferDone,
    TransferRequest,
    WindowEmptied,
    WindowFilled,
    Worker,
    WorkerRef,
)
from kvsvc.core.receiver import DSide, SendToSource, ToSource, carry_out_d
from kvsvc.core.sender import PSide, Reply, Submit, carry_out_p
from kvsvc.core.staging_plans import Way, WindowPlan
from kvsvc.core.windows import (
    Announce,
    AwaitHalf,
    Deliver,
    Fail,
    FillEvent,
    FillingWindow,
    GoWithout,
    LendAt,
    LentWindows,
    RoundsFilled,
    Scatter,
    TellP,
    WaitForRoom,
    WindowKey,
    WriteRound,
    d_frame,
    lent_window,
    p_frame,
    round_step,
    share_refusal,
    window_choice,
    with_window,
)

KEY = ("t", "prefill", (0, 0))
D0 = WorkerRef("decode", "i", 0, 0)


@dataclass
class _Calls:
    """A side of either kind that records each call, in order (`PSide` and `DSide`)."""

    calls: list[tuple[str, object]] = field(default_factory=list)
    lend: bool = True  # what `windowed` does: a window's address on the request, or hold it back (None)

    def submit(self, command: Submit) -> None:
        self.calls.append(("submit", command))

    def reply(self, command: Reply) -> None:
        self.calls.append(("reply", command))

    def announce(self, command: Announce) -> None:
        self.calls.append(("announce", command))

    def log(self, notice: Notice) -> None:
        self.calls.append(("log", notice))

    def tell_p(self, engine_id: str, src: Worker, message: ToSource | WindowEmptied) -> None:
        self.calls.append(("tell_p", (engine_id, src, message)))

    def windowed(self, engine_id: str, src: Worker, request: TransferRequest) -> TransferRequest | None:
        self.calls.append(("windowed", request.transfer_id))
        return replace_struct(request, window_addr=5_000) if self.lend else None

    def scatter(self, key: WindowKey, command: Scatter) -> None:
        self.calls.append(("scatter", key))

    def deliver(self, key: WindowKey, command: Deliver) -> None:
        self.calls.append(("deliver", (key, command.message)))


def _p_side(calls: _Calls) -> PSide:
    return calls


def _d_side(calls: _Calls) -> DSide:
    return calls


def _fill(share: int = 400, window: int = 200) -> FillingWindow:
    offset = np.arange(0, share, 100, dtype=np.int64)
    stream = (20_000 + offset, offset, np.full(offset.size, 100, dtype=np.int64))
    return FillingWindow("t", stream, 5_000, window, 5.0, dst=D0)


def _lent() -> LentWindows:
    offset = np.arange(0, 400, 100, dtype=np.int64)
    plan = WindowPlan(400, 200, offset, 10_000 + offset, np.full(offset.size, 100, dtype=np.int64), Way.SCATTER)
    lent = LentWindows()
    lent.lend(KEY, "d-t", [1, 2], 5_000, plan)
    return lent


def test_a_write_in_rounds_writes_waits_then_fills_as_its_window_says() -> None:
    fill = _fill()  # 4 rounds of 100 bytes, two halves
    step = round_step(fill, lambda: True)
    assert isinstance(step, WriteRound) and step.index == 0 and step.dst.tolist() == [5_000]
    fill.landed(0.0)
    fill.landed(0.0)
    assert round_step(fill, lambda: True) == AwaitHalf(5.0)
    fill.emptied(0)
    fill.emptied(1)
    fill.landed(1.0)
    fill.landed(1.0)
    assert round_step(fill, lambda: True) == RoundsFilled()


def test_a_write_the_job_no_longer_wants_fails_at_the_next_rounds_start_never_before_the_first() -> None:
    fill = _fill()
    asked: list[int] = []

    def unwanted() -> bool:
        asked.append(fill.next_round)
        return False

    assert isinstance(round_step(fill, unwanted), WriteRound) and asked == []  # round 0 always goes
    fill.landed(0.0)
    step = round_step(fill, unwanted)
    assert step == Fail("'t' aborted after 1 of 4 rounds of D's window", FillEvent.STOP)


def test_a_write_that_lost_d_ends_with_the_fail_its_window_returned_and_the_fail_is_not_carried_out_twice() -> None:
    fill = _fill()
    assert fill.peer_lost("gone") == []  # round 0 is on the wire
    landed = fill.landed(0.0)
    assert landed == [Fail("gone", FillEvent.PEER_LOST)]
    side = _Calls()
    carry_out_p(landed, _p_side(side))
    assert side.calls == []
    assert round_step(fill, lambda: True) == Fail("gone", FillEvent.PEER_LOST)


def test_p_routes_window_emptied_to_its_write_and_everything_else_to_the_sender() -> None:
    fill = _fill()
    fill.landed(0.0)
    fill.landed(0.0)
    assert p_frame(WindowEmptied(transfer_id="t", round=0), {"t": fill}, "D0") == []
    assert fill.next_round == 2 and isinstance(round_step(fill, lambda: True), WriteRound)
    [late] = p_frame(WindowEmptied(transfer_id="u", round=0), {"t": fill}, "D0") or []
    assert isinstance(late, Notice) and late.level == "debug" and "'u'" in late.text and "D0" in late.text
    assert p_frame(Release(transfer_id="t", secret="s"), {"t": fill}, "D0") is None


def test_d_routes_every_frame_through_its_windows_first() -> None:
    lent = _lent()
    key, [scatter] = d_frame(lent, "prefill", (0, 0), WindowFilled(transfer_id="t", round=0))
    assert key == KEY and isinstance(scatter, Scatter)
    done = TransferDone(transfer_id="other", bytes=1, descriptors=1)
    assert d_frame(lent, "prefill", (0, 0), done) == (("other", "prefill", (0, 0)), [Deliver(done)])


def test_a_request_keeps_its_window_asks_for_one_or_goes_without() -> None:
    lent = _lent()
    window = lent.get(KEY)
    assert window is not None
    assert lent_window(lent, KEY, "d-t") is window
    assert lent_window(lent, KEY, "d-again") is None  # an earlier receive of the transfer id still holds it
    assert lent_window(lent, ("u", "prefill", (0, 0)), "d-u") == "lend"
    assert lent_window(lent, ("u", "prefill", (0, 0)), None) is None  # the receive ended
    # A repeat while the same receive's request waits for room is held back; another receive's wait is replaced.
    assert lent_window(lent, ("u", "prefill", (0, 0)), "d-u", waiting="d-u") == "hold"
    assert lent_window(lent, ("u", "prefill", (0, 0)), "d-u", waiting="d-old") == "lend"
    request = TransferRequest(transfer_id="t", block_ids=[0, 1], num_tokens=8, secret="s")
    sized = with_window(request, window)
    assert (sized.window_addr, sized.window_bytes, sized.share_bytes) == (5_000, 200, 400)


def test_p_commands_reach_the_sides_methods_in_order_and_a_fail_is_left_to_round_step() -> None:
    submit = Submit("t", D0, [0], [0], 4)
    reply = Reply(D0, TransferDone(transfer_id="t", bytes=1, descriptors=1))
    announce = Announce(D0, WindowFilled(transfer_id="t", round=0))
    notice = Notice("n")
    side = _Calls()
    carry_out_p([submit, Fail("gone", FillEvent.PEER_LOST), reply, announce, notice], _p_side(side))
    assert side.calls == [("submit", submit), ("reply", reply), ("announce", announce), ("log", notice)]


def test_d_commands_reach_the_sides_methods_and_a_request_goes_as_windowed_makes_it() -> None:
    request = TransferRequest(transfer_id="t", block_ids=[0, 1], num_tokens=8, secret="s")
    release = Release(transfer_id="t", secret="s")
    side = _Calls()
    carry_out_d([SendToSource("prefill", (0, 0), request), SendToSource("prefill", (0, 1), release)], _d_side(side))
    assert side.calls == [
        ("windowed", "t"),
        ("tell_p", ("prefill", (0, 0), replace_struct(request, window_addr=5_000))),
        ("tell_p", ("prefill", (0, 1), release)),
    ]
    held = _Calls(lend=False)  # held back for room: nothing goes now
    carry_out_d([SendToSource("prefill", (0, 0), request)], _d_side(held))
    assert held.calls == [("windowed", "t")]


def test_a_windows_commands_go_to_the_window_they_are_about_and_need_its_key() -> None:
    emptied = WindowEmptied(transfer_id="t", round=0)
    done = TransferDone(transfer_id="t", bytes=1, descriptors=1)
    scatter = Scatter(0, np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.int64))
    side = _Calls()
    carry_out_d([scatter, TellP(emptied), Deliver(done)], _d_side(side), KEY)
    assert side.calls == [("scatter", KEY), ("tell_p", ("prefill", (0, 0), emptied)), ("deliver", (KEY, done))]
    with pytest.raises(LocalProtocolError, match="TellP carried out without the window"):
        carry_out_d([TellP(emptied)], _d_side(_Calls()))


def test_p_refuses_a_share_size_its_own_plan_does_not_make_naming_both() -> None:
    submit = Submit("t", D0, [0], [0], 4, window_addr=5_000, window_bytes=200)
    assert share_refusal(submit, 200) is None  # no share size: the window's
    rounds = replace(submit, share_bytes=400)
    assert share_refusal(rounds, 400) is None
    assert share_refusal(rounds, 399) == (
        "D planned a share of 400 bytes for 't' (window of 200); this P worker writes it 399"
    )


def test_a_request_the_rule_windows_lends_at_once_waits_for_room_or_goes_without() -> None:
    assert window_choice(True, 4_096, 0.5) == LendAt(4_096)
    assert window_choice(True, None, 0.5) == WaitForRoom(0.5)
    assert isinstance(window_choice(True, None, 0.0), GoWithout)  # no wait configured: P writes the blocks
    assert window_choice(False, 4_096, 0.5) == GoWithout("the staging rule writes this share into D's blocks")
