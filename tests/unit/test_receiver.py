"""Specification of kvsvc.core.receiver: D's receive jobs, deadlines and exactly-once reporting, driven by hand
with a fake clock and no event loop (docs/protocol.md)."""

from __future__ import annotations

import msgspec
import pytest

from kvsvc.cli.plan import synthetic_engine
from kvsvc.core.messages import Abort, Release, TransferDone, TransferRequest, WorkerMetadata
from kvsvc.core.planner import plan_transfer_arrays
from kvsvc.core.receiver import (
    RECONNECT_FIRST_S,
    Backoff,
    LostSources,
    Receiver,
    Recovery,
    RecvRequest,
    SendToSource,
    planned_bytes,
)
from kvsvc.testing.clock import FakeClock

P0, P1, P2 = (0, 0), (0, 1), (0, 2)
BLOCKS = [4, 5, 6]


def _recv(req_id: str, transfer_id: str, engine_id: str, blocks: list[int], tokens: int, first: int = 0) -> RecvRequest:
    return RecvRequest(req_id, transfer_id, engine_id, "http://p", tuple(blocks), tokens, first, "")


def started(
    *, sources: list[tuple[int, int]] | None = None, connected: set[tuple[int, int]] | None = None
) -> tuple[Receiver, FakeClock, list[SendToSource]]:
    receiver, clock = Receiver(recv_timeout_s=60, abort_grace_s=30), FakeClock()
    assert receiver.start(_recv("r1", "t1", "P", BLOCKS, 10, 0), clock())
    srcs = [P0, P1] if sources is None else sources
    out = receiver.sources_known("t1", srcs, [], set(srcs) if connected is None else connected)
    return receiver, clock, out


def kinds(commands: list[SendToSource]) -> list[tuple[tuple[int, int], type]]:
    return [(c.src, type(c.message)) for c in commands]


def test_a_receive_asks_each_connected_source_for_its_share() -> None:
    _, _, out = started()
    request = TransferRequest(transfer_id="t1", block_ids=BLOCKS, num_tokens=10)
    assert out == [SendToSource("P", P0, request), SendToSource("P", P1, request)]


def test_a_receive_tells_the_p_workers_nobody_needs_to_release_their_hold() -> None:
    receiver = Receiver()
    receiver.start(_recv("r1", "t1", "P", BLOCKS, 10, 0), 0.0)
    out = receiver.sources_known("t1", [P0], [P2], {P0})
    assert SendToSource("P", P2, Release(transfer_id="t1")) in out


def test_a_source_not_yet_connected_is_asked_once_its_connection_opens() -> None:
    receiver, _, out = started(connected={P0})
    assert kinds(out) == [(P0, TransferRequest)]
    assert receiver.statistics().jobs_by_state == {"requested": 1, "pending": 1}
    assert kinds(receiver.connected("P", P1)) == [(P1, TransferRequest)]
    assert receiver.connected("P", P1) == []
    assert receiver.statistics().jobs_by_state == {"requested": 2}


def test_a_receive_finishes_once_every_source_answered_done_and_is_reported_once() -> None:
    receiver, _, _ = started()
    assert receiver.answer("P", P0, "t1", None) == []
    assert receiver.take_report().finished == set()
    assert receiver.answer("P", P1, "t1", None) == []
    report = receiver.take_report()
    assert (report.finished, report.failed, report.invalid_block_ids) == ({"r1"}, set(), set())
    assert receiver.take_report().finished == set()
    assert receiver.statistics().receives == 0


def test_one_failed_source_fails_the_receive_with_every_block_invalid() -> None:
    receiver, _, _ = started()
    receiver.answer("P", P0, "t1", None)
    receiver.answer("P", P1, "t1", "TransportError: -1")
    report = receiver.take_report()
    assert report.failed == {"r1"} and report.finished == set()
    assert report.invalid_block_ids == set(BLOCKS)
    assert "TransportError" in report.reasons["r1"]


def test_repeated_starts_and_answers_change_nothing() -> None:
    receiver, clock, _ = started()
    assert not receiver.start(_recv("r1", "t1", "P", BLOCKS, 10, 0), clock())
    assert receiver.sources_known("t1", [P0, P1], [], {P0, P1}) == []
    receiver.answer("P", P0, "t1", None)
    assert receiver.answer("P", P0, "t1", None) == []
    assert receiver.answer("P", P0, "t1", "late failure") == []
    receiver.answer("P", P1, "t1", None)
    assert receiver.take_report().finished == {"r1"}


def test_an_answer_for_an_unknown_transfer_or_source_is_refused() -> None:
    receiver, _, _ = started(sources=[P0])
    assert receiver.answer("P", P0, "nope", None) is None
    assert receiver.answer("P", P2, "t1", None) is None
    assert receiver.answer("other", P0, "t1", None) is None


def test_a_receive_times_out_failed_with_all_its_blocks_invalid_and_tells_p_to_stop() -> None:
    receiver, clock, _ = started()
    receiver.answer("P", P0, "t1", None)
    assert receiver.next_deadline() == 60
    assert receiver.expire(clock.advance(59.9)) == []
    out = receiver.expire(clock.advance(0.1))
    assert kinds(out) == [(P1, Abort)]
    assert receiver.take_report().failed == set()  # until P1 confirms or the abort grace (30 s) passed
    receiver.expire(clock.advance(30))
    report = receiver.take_report()
    assert report.failed == {"r1"} and report.invalid_block_ids == set(BLOCKS)
    assert "timed out" in report.reasons["r1"]
    assert receiver.expire(clock.advance(100)) == []
    assert receiver.take_report().failed == set()
    assert receiver.statistics().expired == 1


def test_a_receive_still_waiting_for_its_handshake_times_out_failed() -> None:
    receiver, clock = Receiver(recv_timeout_s=5), FakeClock()
    receiver.start(_recv("r1", "t1", "P", BLOCKS, 10, 0), clock())
    assert receiver.statistics().waiting_for_handshake == 1
    receiver.expire(clock.advance(5))
    assert receiver.take_report().failed == {"r1"}


def test_d_abort_asks_p_to_stop_and_reports_failed_only_after_p_confirmed() -> None:
    receiver, clock, _ = started()
    out = receiver.abort("r1", clock())
    assert kinds(out) == [(P0, Abort), (P1, Abort)]
    assert receiver.abort("r1", clock()) == []
    receiver.answer("P", P0, "t1", "aborted by D")
    assert receiver.take_report().failed == set()
    receiver.answer("P", P1, "t1", None)
    report = receiver.take_report()
    assert report.failed == {"r1"} and report.invalid_block_ids == set(BLOCKS)


def test_d_abort_ends_after_the_grace_when_p_never_confirms() -> None:
    receiver, clock, _ = started()
    receiver.abort("r1", clock())
    assert receiver.next_deadline() == 30
    receiver.expire(clock.advance(29))
    assert receiver.take_report().failed == set()
    receiver.expire(clock.advance(1))
    assert receiver.take_report().failed == {"r1"}
    assert receiver.statistics().expired == 0


def test_d_abort_of_a_receive_whose_sources_are_not_connected_ends_at_once_and_still_tells_them() -> None:
    receiver, clock, out = started(connected=set())
    assert out == []
    # Queued until connected: nothing was asked, but a P that holds the transfer can free it at once.
    assert kinds(receiver.abort("r1", clock())) == [(P0, Abort), (P1, Abort)]
    assert receiver.take_report().failed == {"r1"}


def test_d_abort_before_the_handshake_ends_the_receive_when_the_sources_are_known() -> None:
    receiver, clock = Receiver(), FakeClock()
    receiver.start(_recv("r1", "t1", "P", BLOCKS, 10, 0), clock())
    receiver.abort("r1", clock())
    assert receiver.take_report().failed == set()
    assert kinds(receiver.sources_known("t1", [P0], [], {P0})) == [(P0, Abort)]
    assert receiver.take_report().failed == {"r1"}


def test_d_abort_before_a_handshake_that_never_ends_is_reported_after_the_abort_grace() -> None:
    receiver, clock = Receiver(abort_grace_s=5), FakeClock()
    receiver.start(_recv("r1", "t1", "P", BLOCKS, 10, 0), clock())
    receiver.abort("r1", clock())
    clock.advance(5)
    receiver.expire(clock())
    assert receiver.take_report().failed == {"r1"}


def test_d_abort_before_the_handshake_still_releases_the_p_workers_it_must_release() -> None:
    receiver, clock = Receiver(), FakeClock()
    receiver.start(_recv("r1", "t1", "P", BLOCKS, 10, 0), clock())
    receiver.abort("r1", clock())
    out = receiver.sources_known("t1", [P0], [P2], {P0})
    assert (P2, Release) in kinds(out)


def test_a_lost_connection_stops_the_other_sources_and_holds_the_blocks_for_the_abort_grace() -> None:
    receiver, clock, _ = started()
    out = receiver.peer_lost("P", P1, "connection reset", clock())
    assert kinds(out) == [(P0, Abort)]  # the receive is lost: P0 need not keep writing
    receiver.answer("P", P0, "t1", "aborted by D")
    assert receiver.take_report().failed == set()  # P1 may still be writing into these blocks
    receiver.expire(clock.advance(30))
    report = receiver.take_report()
    assert report.failed == {"r1"} and "connection reset" in report.reasons["r1"]
    assert report.invalid_block_ids == set(BLOCKS)


def test_a_lost_source_proven_gone_ends_the_wait_once_the_other_sources_stopped() -> None:
    receiver, clock, _ = started()
    assert not receiver.waits_on_lost("P", P1)
    receiver.peer_lost("P", P1, "connection reset", clock())
    assert receiver.waits_on_lost("P", P1) and not receiver.waits_on_lost("P", P0)
    assert receiver.source_gone("P", P1, "connection reset; its transfer engine is gone") == []
    assert receiver.take_report().failed == set()  # P0 was told to abort and has not confirmed: it may still write
    receiver.answer("P", P0, "t1", "aborted by D")
    report = receiver.take_report()  # long before the abort grace
    assert report.failed == {"r1"} and "connection reset" in report.reasons["r1"]
    assert not receiver.waits_on_lost("P", P1)


def test_gone_touches_only_receives_whose_connection_to_that_source_broke() -> None:
    receiver, clock, _ = started(sources=[P0])
    receiver.start(_recv("r2", "t2", "P", [9], 1, 0), clock())
    receiver.sources_known("t2", [P0], [], set())  # not asked yet: its connection never broke after asking
    receiver.source_gone("P", P0, "gone")  # nothing was lost yet: no-op
    assert receiver.take_report().failed == set() and receiver.statistics().receives == 2
    receiver.peer_lost("P", P0, "reset", clock())  # r1 asked (held for the grace), r2 had not (fails at once)
    assert receiver.take_report().failed == {"r2"}
    receiver.source_gone("P", P0, "gone")
    assert receiver.take_report().failed == {"r1"}


def test_a_reconnect_to_the_same_start_asks_again_and_its_answer_ends_the_wait() -> None:
    receiver, clock, _ = started(sources=[P0])
    receiver.peer_lost("P", P0, "connection reset", clock(), incarnation="inc-1")
    assert receiver.reconnected("P", P0, "inc-2") == []  # another start cannot speak for inc-1's writes
    assert kinds(receiver.reconnected("P", P0, "inc-1")) == [(P0, Abort)]
    assert receiver.take_report().failed == set()  # asked, not answered: P may still be writing
    receiver.answer("P", P0, "t1", "connection lost")  # P answers once the job's write ended
    report = receiver.take_report()  # long before the abort grace
    assert report.failed == {"r1"} and not receiver.waits_on_lost("P", P0)
    assert receiver.reconnected("P", P0, "inc-1") == []  # ended: nothing more to ask


def test_a_reconnect_leaves_receives_that_never_lost_that_source_alone() -> None:
    receiver, clock, _ = started(sources=[P0])
    assert receiver.reconnected("P", P0, "") == []  # connected all along: nothing to fence
    receiver.peer_lost("P", P1, "reset", clock(), incarnation="")  # not a source of r1
    assert receiver.reconnected("P", P1, "") == [] and receiver.take_report().failed == set()


def test_a_lost_connection_before_the_request_fails_the_job_at_once() -> None:
    receiver, clock, _ = started(sources=[P0], connected=set())
    assert receiver.peer_lost("P", P0, "connection refused", clock()) == []
    report = receiver.take_report()
    assert report.failed == {"r1"} and "connection refused" in report.reasons["r1"]


def test_a_lost_connection_during_an_abort_still_waits_for_the_abort_grace() -> None:
    receiver, clock, _ = started(sources=[P0])
    receiver.abort("r1", clock())
    receiver.peer_lost("P", P0, "connection reset", clock())
    assert receiver.take_report().failed == set()
    receiver.expire(clock.advance(30))
    assert receiver.take_report().failed == {"r1"}


def test_an_incompatible_or_unreachable_engine_fails_the_receives_that_wait_for_its_handshake() -> None:
    receiver = Receiver()
    receiver.start(_recv("r1", "t1", "P", BLOCKS, 10, 0), 0.0)
    receiver.start(_recv("r2", "t2", "P", [9], 1, 0), 0.0)
    receiver.start(_recv("r3", "t3", "other", [8], 1, 0), 0.0)
    receiver.sources_known("t2", [P0], [], set())  # routed already: its connection decides its fate
    receiver.engine_failed("P", "P tp_size 3 does not divide D tp_size 4")
    report = receiver.take_report()
    assert report.failed == {"r1"} and report.invalid_block_ids == {4, 5, 6}
    assert receiver.req_of("t2") == "r2" and receiver.req_of("t3") == "r3"  # not waiting on P's handshake: alive


def test_statistics_count_receives_by_state() -> None:
    receiver, _, _ = started(connected={P0})
    stats = receiver.statistics()
    assert (stats.receives, stats.jobs_by_state) == (1, {"requested": 1, "pending": 1})


def test_a_timed_out_receive_keeps_its_blocks_until_the_sources_confirm_they_stopped() -> None:
    receiver, clock, _ = started()
    out = receiver.expire(clock.advance(60))
    assert sorted(kinds(out)) == [(P0, Abort), (P1, Abort)]
    assert receiver.take_report().failed == set()  # a frozen P could still land bytes in these blocks
    receiver.answer("P", P0, "t1", "aborted by D")
    receiver.answer("P", P1, "t1", None)
    report = receiver.take_report()
    assert report.failed == {"r1"} and report.invalid_block_ids == set(BLOCKS)
    assert "timed out after 60 s" in report.reasons["r1"]


def test_a_timed_out_receive_whose_sources_never_confirm_ends_after_the_abort_grace() -> None:
    receiver, clock, _ = started()
    receiver.expire(clock.advance(60))
    assert receiver.expire(clock.advance(29)) == [] and receiver.take_report().failed == set()
    receiver.expire(clock.advance(1))
    assert receiver.take_report().failed == {"r1"}
    assert receiver.statistics().expired == 1


def test_receiving_a_transfer_twice_for_another_request_is_refused() -> None:
    receiver, clock, _ = started()
    with pytest.raises(ValueError, match="'t1' is already received for request 'r1', not 'r2'"):
        receiver.start(_recv("r2", "t1", "P", [9], 1, 0), clock())


def test_every_frame_from_p_goes_through_receive() -> None:
    from kvsvc.core.jobs import Notice
    from kvsvc.core.messages import ErrorMessage, Pong, TransferDone, TransferFailed

    receiver, _, _ = started()
    assert receiver.receive("P", P0, TransferDone(transfer_id="t1", bytes=1, descriptors=1)) == []
    assert receiver.receive("P", P1, TransferFailed(transfer_id="t1", reason="no")) == []
    assert receiver.take_report().failed == {"r1"}
    late = receiver.receive("P", P1, TransferDone(transfer_id="t1", bytes=1, descriptors=1))
    assert late == [Notice("late or unknown answer for 't1' from P(0, 1)", level="debug")]
    assert receiver.receive("P", P0, Pong(nonce=1)) == []
    odd = receiver.receive("P", P0, TransferRequest(transfer_id="t9", block_ids=[], num_tokens=0))
    assert isinstance(odd[0], Notice) and odd[0].protocol_error
    assert kinds([c for c in odd if isinstance(c, SendToSource)]) == [(P0, ErrorMessage)]


def test_a_window_round_no_window_took_is_dropped_at_debug_level_and_never_answered() -> None:
    """A round for a window D gave back, or never lent (D lends none without a region to scatter from), reaches the
    `Receiver`: it is late, not an attack on the receive, and leaves the receive as it was."""
    from kvsvc.core.jobs import Notice
    from kvsvc.core.messages import WindowFilled

    receiver, _, _ = started()
    late = receiver.receive("P", P0, WindowFilled(transfer_id="t1", round=0))
    assert late == [Notice("late round 0 of 't1' from P(0, 0)", level="debug")]
    assert receiver.statistics().jobs_by_state == {"requested": 2}


def test_a_done_answer_with_other_bytes_than_d_planned_fails_the_receive_naming_both_counts() -> None:
    receiver, clock = Receiver(recv_timeout_s=60, abort_grace_s=30), FakeClock()
    assert receiver.start(_recv("r1", "t1", "P", BLOCKS, 10, 0), clock())
    receiver.sources_known("t1", [P0, P1], [], {P0, P1}, planned={P0: 4096, P1: 4096})
    receiver.receive("P", P0, TransferDone(transfer_id="t1", bytes=4096, descriptors=2))
    receiver.receive("P", P1, TransferDone(transfer_id="t1", bytes=0, descriptors=0))  # wrote nothing
    report = receiver.take_report()
    assert report.failed == {"r1"} and set(BLOCKS) <= report.invalid_block_ids
    assert "reports 0 bytes written for 't1'; D's plan has it write 4096" in report.reasons["r1"]


def test_d_plans_the_bytes_p_plans_to_write_whatever_p_s_block_ids() -> None:
    p = synthetic_engine(
        "P", pp_size=1, tp_size=2, num_layers=4, num_kv_heads=4, head_size=8, block_size=16, num_blocks=64
    )
    d = synthetic_engine(
        "D", pp_size=1, tp_size=1, num_layers=4, num_kv_heads=4, head_size=8, block_size=8, num_blocks=64
    )
    for tokens, first in ((50, 0), (50, 16), (7, 0), (64, 64)):
        d_ids = list(range(3, 3 + -(-tokens // 8)))
        for src in p.values():
            p_ids = list(range(40, 40 + -(-tokens // 16)))
            *_, lengths = plan_transfer_arrays(src, d[(0, 0)], p_ids, d_ids, tokens, first_token=first)
            assert planned_bytes(src, d[(0, 0)], d_ids, tokens, first) == int(lengths.sum())


def test_an_answer_for_an_earlier_receive_of_the_same_transfer_is_dropped() -> None:
    """The same params started again after the first receive ended here: P's late answer to the first, which names
    it, must not finish the second, whose blocks P never wrote. An answer naming no receive (an older P) counts."""
    from kvsvc.core.jobs import Notice

    receiver, clock = Receiver(recv_timeout_s=60, abort_grace_s=30), FakeClock()
    assert receiver.start(_recv("r1", "t1", "P", BLOCKS, 10, 0), clock(), receive="second")
    receiver.sources_known("t1", [P0, P1], [], {P0, P1})
    stale = TransferDone(transfer_id="t1", bytes=1, descriptors=1, receive="first")
    assert receiver.receive("P", P0, stale) == [
        Notice("answer for another receive of 't1' from P(0, 0)", level="debug")
    ]
    assert receiver.statistics().jobs_by_state == {"requested": 2}
    receiver.receive("P", P0, TransferDone(transfer_id="t1", bytes=1, descriptors=1, receive="second"))
    receiver.receive("P", P1, TransferDone(transfer_id="t1", bytes=1, descriptors=1))
    assert receiver.take_report().finished == {"r1"}


# -- a lost P worker: probe and reconnect (`LostSources`) ------------------------------------------------------


def _p_meta(transport_addr: str, samehost_addr: str) -> WorkerMetadata:
    meta = synthetic_engine(
        "P", pp_size=1, tp_size=1, num_layers=2, num_kv_heads=1, head_size=8, block_size=16, num_blocks=8
    )[(0, 0)]
    return msgspec.structs.replace(meta, transport_addr=transport_addr, samehost_addr=samehost_addr)


def test_a_lost_p_worker_is_probed_once_per_process_and_retried_after_doubling_delays_while_receives_wait() -> None:
    lost = LostSources(Backoff(first_s=0.05, max_s=0.3))
    p0, p1 = _p_meta("10.0.0.1:7000", "host-a:42"), _p_meta("10.0.0.1:7000", "host-a:42")  # one process, two workers
    # The kernel's word first, then Mooncake's; the next try after the first delay.
    assert lost.lost(("P", P0), p0, waiting=True, closing=False) == Recovery(("host-a:42", "10.0.0.1:7000"), 0.05)
    # Another worker of the same process while its probe runs: no second probe, its own first delay.
    assert lost.lost(("P", P1), p1, waiting=True, closing=False) == Recovery((), 0.05)
    # P0's try failed: its connection is lost again, each delay twice the last, up to the bound.
    assert [lost.lost(("P", P0), p0, waiting=True, closing=False).retry_after_s for _ in range(4)] == [
        0.1, 0.2, 0.3, 0.3,
    ]  # fmt: skip
    lost.probe_ended(p0)
    assert lost.lost(("P", P1), p1, waiting=True, closing=False).probe == ("host-a:42", "10.0.0.1:7000")
    # Reached: its next loss starts at the first delay again.
    lost.reached(("P", P0))
    assert lost.lost(("P", P0), p0, waiting=True, closing=False).retry_after_s == 0.05


def test_nothing_is_probed_or_retried_when_nothing_waits_on_the_lost_p_worker_or_the_service_closes() -> None:
    lost = LostSources()
    p0 = _p_meta("", "host-a:42")  # a P whose engine published no Mooncake session: the same-host word alone
    assert lost.lost(("P", P0), p0, waiting=False, closing=False) == Recovery()
    assert lost.lost(("P", P0), p0, waiting=True, closing=True) == Recovery()
    assert lost.lost(("P", P0), p0, waiting=True, closing=False).probe == ("host-a:42",)
    assert lost.lost(("P", P1), _p_meta("", ""), waiting=True, closing=False).probe == ()  # nothing to ask
    # After the wait: try again only while receives wait, the service is open and no connection is being opened.
    assert lost.retry(("P", P0), waiting=True, closing=False, connecting=False)
    assert not lost.retry(("P", P0), waiting=True, closing=False, connecting=True)
    assert not lost.retry(("P", P0), waiting=True, closing=True, connecting=False)
    assert not lost.retry(("P", P0), waiting=False, closing=False, connecting=False)
    # Nothing waited: the delays start over.
    assert lost.lost(("P", P0), p0, waiting=True, closing=False).retry_after_s == RECONNECT_FIRST_S
