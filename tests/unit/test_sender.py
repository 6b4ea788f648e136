"""Specification of kvsvc.core.sender: P's holds, send jobs, deadlines and exactly-once reporting, driven by hand
with a fake clock and no event loop (docs/protocol.md)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.core.messages import (
    Abort,
    ErrorMessage,
    Release,
    TransferDone,
    TransferFailed,
    TransferRequest,
    WorkerMetadata,
    WorkerRef,
)
from kvsvc.core.sender import (
    BLOCK_ID_BYTES,
    EARLY_ENTRY_BYTES,
    FAULT_WAITS,
    FaultKind,
    FaultWait,
    Landed,
    Reply,
    SendCommand,
    Sender,
    SendRequest,
    Submit,
    WriteFault,
    fault_wait,
    streams_by_layer,
    streams_during_forward,
)
from kvsvc.testing.clock import FakeClock

S = "s" * 22  # the transfer secret of every hold here
D0 = WorkerRef("D", "1", 0, 0)
D1 = WorkerRef("D", "1", 0, 1)
BOTH = frozenset({D0.worker, D1.worker})
ONLY_D0 = frozenset({D0.worker})


def request(transfer_id: str = "t1", blocks: tuple[int, ...] = (7, 8)) -> TransferRequest:
    return TransferRequest(transfer_id=transfer_id, block_ids=list(blocks), num_tokens=6, secret=S)


def make(clock: FakeClock | None = None) -> tuple[Sender, FakeClock]:
    return Sender(hold_timeout_s=60, early_request_timeout_s=10), clock or FakeClock()


def replies(commands: list[SendCommand]) -> list[tuple[WorkerRef, type]]:
    return [(c.dst, type(c.message)) for c in commands if isinstance(c, Reply)]


def submits(commands: list[SendCommand]) -> list[Submit]:
    return [c for c in commands if isinstance(c, Submit)]


def test_a_request_for_ready_kv_submits_one_write_with_both_sides_blocks() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1, 2), 6, S), clock())
    sender.ready("t1")
    assert sender.request(D0, ONLY_D0, request(), clock()) == [Submit("t1", D0, [1, 2], [7, 8], 6)]


def test_a_request_waits_for_the_kv_to_be_ready() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1, 2), 6, S), clock())
    assert sender.request(D0, ONLY_D0, request(), clock()) == []
    assert len(submits(sender.ready("t1"))) == 1


def test_a_landed_write_answers_done_with_its_figures_and_reports_the_send_once() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1, 2), 6, S), clock())
    sender.ready("t1")
    sender.request(D0, ONLY_D0, request(), clock())
    assert sender.take_finished() == set()
    out = sender.write_ended("t1", D0.worker, Landed(4096, 3))
    assert out == [Reply(D0, TransferDone(transfer_id="t1", bytes=4096, descriptors=3))]
    assert sender.take_finished() == {"r1"}
    assert sender.take_finished() == set()
    assert not sender.holds("t1")


def test_the_send_is_reported_only_after_every_expected_d_worker_was_served() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.ready("t1")
    sender.request(D0, BOTH, request(), clock())
    sender.write_ended("t1", D0.worker, Landed(0, 0))
    assert sender.take_finished() == set()
    sender.request(D1, BOTH, request(), clock())
    sender.write_ended("t1", D1.worker, Landed(0, 0))
    assert sender.take_finished() == {"r1"}


def test_a_failed_write_answers_failed_with_the_transport_error() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.ready("t1")
    sender.request(D0, ONLY_D0, request(), clock())
    out = sender.write_ended("t1", D0.worker, WriteFault("TransportError: -1"))
    assert out == [Reply(D0, TransferFailed(transfer_id="t1", reason="TransportError: -1", cause="transport"))]
    assert sender.take_finished() == {"r1"}


def test_repeated_holds_ready_and_requests_change_nothing() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    assert sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock()) == []
    assert len(submits(sender.ready("t1") + sender.request(D0, ONLY_D0, request(), clock()))) == 1
    assert sender.ready("t1") == []
    assert sender.request(D0, ONLY_D0, request(), clock()) == []
    assert sender.statistics().jobs_by_state == {"writing": 1}


def test_a_repeated_request_after_the_outcome_gets_the_outcome_again_and_no_second_report() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.ready("t1")
    sender.request(D0, ONLY_D0, request(), clock())
    sender.write_ended("t1", D0.worker, Landed(10, 1))
    assert sender.take_finished() == {"r1"}
    again = sender.request(D0, ONLY_D0, request(), clock())
    assert again == [Reply(D0, TransferDone(transfer_id="t1", bytes=10, descriptors=1))]
    assert sender.take_finished() == set()
    assert sender.write_ended("t1", D0.worker, Landed(0, 0)) == []


def test_an_early_request_is_served_once_p_holds() -> None:
    sender, clock = make()
    assert sender.request(D0, ONLY_D0, request(), clock()) == []
    assert sender.statistics().early_requests == 1
    clock.advance(5)
    sender.hold(SendRequest("r1", "t1", (1, 2), 6, S), clock())
    assert submits(sender.ready("t1")) == [Submit("t1", D0, [1, 2], [7, 8], 6)]
    assert sender.statistics().early_requests == 0


def test_an_early_request_is_answered_failed_once_if_p_never_holds() -> None:
    sender, clock = make()
    sender.request(D0, ONLY_D0, request(), clock())
    assert sender.next_deadline() == 10
    assert sender.expire(clock.advance(9.9)) == []
    out = sender.expire(clock.advance(0.1))
    assert replies(out) == [(D0, TransferFailed)]
    assert "not held" in out[0].message.reason  # type: ignore[union-attr]
    assert sender.expire(clock.advance(100)) == []
    assert sender.next_deadline() is None


def test_a_withdrawn_transfer_answers_its_early_requests_failed_now_and_later_ones_at_once() -> None:
    """A pushing P's request aborted mid-prefill: D's fetches that wait early end now, not at their deadline; one
    with another secret is no answer to an attacker and keeps waiting; a held transfer is not withdrawn."""
    sender, clock = make()
    other = TransferRequest(transfer_id="t1", block_ids=[9], num_tokens=6, secret="x" * 22)
    assert sender.request(D0, ONLY_D0, request(), clock()) == []
    assert sender.request(D1, ONLY_D0, other, clock()) == []
    assert replies(sender.remote_abort(D1, Abort(transfer_id="t1", reason="x", secret=S), clock(), BOTH)) == [
        (D1, TransferFailed)
    ]  # answered when it came, never again
    out = sender.withdraw("t1", S, "P's request 'r1' was aborted")
    assert out == [Reply(D0, TransferFailed(transfer_id="t1", reason="P's request 'r1' was aborted", cause="aborted"))]
    late = sender.request(D0, ONLY_D0, request(), clock())
    assert replies(late) == [(D0, TransferFailed)]
    assert "no longer held by P: P's request 'r1' was aborted" in late[0].message.reason  # type: ignore[union-attr]
    assert sender.statistics().early_requests == 1  # D1's, with another secret, still waits
    assert replies(sender.expire(clock.advance(10))) == [(D1, TransferFailed)]
    sender.hold(SendRequest("r2", "t2", (1,), 6, S), clock())
    assert sender.withdraw("t2", S, "aborted") == [] and sender.holds("t2")
    sender.hold(SendRequest("r1b", "t1", (1, 2), 6, S), clock())  # the transfer held after all: a request is served
    sender.ready("t1")
    assert submits(sender.request(D0, ONLY_D0, request(), clock())) == [Submit("t1", D0, [1, 2], [7, 8], 6)]
    with pytest.raises(ValueError, match="secret"):
        sender.withdraw("t3", "short", "aborted")


def test_an_early_request_table_that_is_full_answers_busy_at_once() -> None:
    sender = Sender(max_early_requests=1)
    sender.request(D0, BOTH, request("t1"), 0.0)
    out = sender.request(D0, BOTH, request("t2"), 0.0)
    assert replies(out) == [(D0, TransferFailed)]


def test_hold_expiry_reports_once_and_answers_waiting_d_workers_failed() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.request(D0, BOTH, request(), clock())  # not ready: D0 waits
    assert sender.next_deadline() == 60
    assert sender.expire(clock.advance(59)) == []
    out = sender.expire(clock.advance(1))
    assert replies(out) == [(D0, TransferFailed)]
    assert "expired" in out[0].message.reason  # type: ignore[union-attr]
    assert sender.take_finished() == {"r1"}
    assert sender.expire(clock.advance(60)) == []
    assert sender.take_finished() == set()
    assert sender.statistics().expired_holds == 1


def test_a_hold_nobody_asks_for_expires_and_is_reported_once() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.expire(clock.advance(60))
    assert sender.take_finished() == {"r1"}
    assert sender.statistics().holds == 0 and not sender.holds("t1")


def test_a_write_in_flight_at_expiry_delays_the_report_until_its_result() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.ready("t1")
    sender.request(D0, ONLY_D0, request(), clock())
    assert sender.expire(clock.advance(60)) == []
    assert sender.take_finished() == set()
    assert sender.holds("t1")
    out = sender.write_ended("t1", D0.worker, Landed(0, 0))
    assert replies(out) == [(D0, TransferFailed)]
    assert sender.take_finished() == {"r1"}


def test_a_write_in_flight_at_p_abort_delays_the_report_until_its_result() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.ready("t1")
    sender.request(D0, ONLY_D0, request(), clock())
    assert sender.abort("r1") == []
    assert sender.take_finished() == set()
    assert replies(sender.write_ended("t1", D0.worker, WriteFault("cancelled"))) == [(D0, TransferFailed)]
    assert sender.take_finished() == {"r1"}


def test_p_abort_answers_waiting_d_workers_failed_and_reports_at_once() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.request(D0, BOTH, request(), clock())
    assert replies(sender.abort("r1")) == [(D0, TransferFailed)]
    assert sender.take_finished() == {"r1"}
    assert sender.abort("r1") == []
    assert sender.take_finished() == set()
    assert sender.statistics().aborted_holds == 1


def test_shutting_down_answers_every_waiting_d_request_failed_and_reports_every_hold() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())  # asked, KV never ready
    sender.request(D0, ONLY_D0, request("t1"), clock())
    sender.request(D1, ONLY_D0, request("t2"), clock())  # early: t2 is never held
    sender.hold(SendRequest("r3", "t3", (3,), 6, S), clock())  # nobody asked
    sender.hold(SendRequest("r4", "t4", (4,), 6, S), clock())  # writing: answered once its write ends, as for an abort
    sender.ready("t4")
    sender.request(D0, ONLY_D0, request("t4"), clock())
    out = sender.shut_down("P worker shutting down")
    failed = {(c.dst, c.message.transfer_id) for c in out if isinstance(c, Reply)}
    assert failed == {(D0, "t1"), (D1, "t2")}
    assert all(isinstance(c, Reply) and "shutting down" in c.message.reason for c in out)  # type: ignore[union-attr]
    assert sender.take_finished() == {"r1", "r3"}
    assert replies(sender.write_ended("t4", D0.worker, WriteFault("cancelled"))) == [(D0, TransferFailed)]
    assert sender.take_finished() == {"r4"}
    assert sender.statistics().early_requests == 0
    assert sender.shut_down("again") == []


def test_a_request_after_p_aborted_is_answered_failed() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.request(D0, BOTH, request(), clock())
    sender.abort("r1")
    assert replies(sender.request(D0, BOTH, request(), clock())) == [(D0, TransferFailed)]


def test_d_abort_before_asking_counts_that_d_worker_as_served() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.ready("t1")
    sender.request(D0, BOTH, request(), clock())
    sender.write_ended("t1", D0.worker, Landed(0, 0))
    # Answered at once: no write for D1 ever ran, so D may free its blocks (the fence of docs/decisions.md, "After a
    # lost connection, D's blocks wait for proof").
    assert replies(sender.remote_abort(D1, Abort(transfer_id="t1", reason="aborted by D", secret=S))) == [
        (D1, TransferFailed)
    ]
    assert sender.take_finished() == {"r1"}


def test_an_abort_of_an_ended_job_repeats_its_outcome() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.ready("t1")
    sender.request(D0, BOTH, request(), clock())
    sender.write_ended("t1", D0.worker, Landed(64, 2))
    (reply,) = sender.remote_abort(D0, Abort(transfer_id="t1", reason="connection lost", secret=S))
    assert isinstance(reply, Reply) and reply.dst == D0
    assert reply.message == TransferDone(transfer_id="t1", bytes=64, descriptors=2)
    assert submits(sender.request(D1, BOTH, request(), clock()))
    sender.peer_lost(D1)  # D1's write drains, then fails; D1 reconnects and aborts its job
    sender.write_ended("t1", D1.worker, WriteFault("connection reset"))
    assert replies(sender.remote_abort(D1, Abort(transfer_id="t1", reason="connection lost", secret=S))) == [
        (D1, TransferFailed)
    ]


def test_an_abort_after_a_lost_connection_is_answered_only_once_the_write_drained() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.ready("t1")
    assert submits(sender.request(D0, ONLY_D0, request(), clock()))
    sender.peer_lost(D0)
    assert (
        sender.remote_abort(D0, Abort(transfer_id="t1", reason="connection lost", secret=S)) == []
    )  # still writing: no answer yet
    assert replies(sender.write_ended("t1", D0.worker, WriteFault("cancelled"))) == [(D0, TransferFailed)]


def test_d_abort_of_a_writing_job_answers_failed_after_the_write_drained() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.ready("t1")
    sender.request(D0, ONLY_D0, request(), clock())
    assert sender.remote_abort(D0, Abort(transfer_id="t1", reason="aborted by D", secret=S)) == []
    assert sender.take_finished() == set()
    assert replies(sender.write_ended("t1", D0.worker, Landed(0, 0))) == [(D0, TransferFailed)]
    assert sender.take_finished() == {"r1"}


def test_d_abort_of_an_early_request_is_answered_at_once_and_counts_d_as_served_later() -> None:
    sender, clock = make()
    sender.request(D0, ONLY_D0, request(), clock())
    assert replies(
        sender.remote_abort(D0, Abort(transfer_id="t1", reason="aborted by D", secret=S), clock(), ONLY_D0)
    ) == [(D0, TransferFailed)]
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    assert sender.take_finished() == {"r1"}
    assert sender.statistics().early_requests == 0


def test_a_remembered_early_abort_expires_without_an_answer() -> None:
    sender, clock = make()
    sender.remote_abort(D0, Abort(transfer_id="t1", reason="aborted by D", secret=S), clock(), ONLY_D0)
    assert sender.expire(clock.advance(10)) == []
    assert sender.statistics().early_requests == 0


def test_a_release_finishes_a_hold_this_p_worker_sources_nothing_for_at_once() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    assert sender.release(D0, frozenset(), Release(transfer_id="t1", secret=S), clock()) == []
    assert sender.take_finished() == {"r1"}
    assert sender.release(D0, frozenset(), Release(transfer_id="t1", secret=S), clock()) == []
    assert sender.take_finished() == set()


def test_an_early_release_finishes_the_hold_when_it_arrives() -> None:
    sender, clock = make()
    sender.release(D0, frozenset(), Release(transfer_id="t1", secret=S), clock())
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock.advance(1))
    assert sender.take_finished() == {"r1"}


def test_a_request_from_a_second_d_engine_for_the_same_transfer_gets_an_error_message() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.request(D0, ONLY_D0, request(), clock())
    stranger = WorkerRef("D2", "9", 0, 0)
    out = sender.request(stranger, ONLY_D0, request(), clock())
    assert replies(out) == [(stranger, ErrorMessage)]
    assert "'D2'" in out[0].message.reason and "'D'" in out[0].message.reason  # type: ignore[union-attr]
    assert sender.statistics().jobs_by_state == {"requested": 1}


def test_a_restarted_d_engine_is_another_engine_for_a_held_transfer() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.request(D0, ONLY_D0, request(), clock())
    restarted = D0._replace(incarnation="2")
    assert replies(sender.request(restarted, ONLY_D0, request(), clock())) == [(restarted, ErrorMessage)]


def test_peer_lost_fails_a_waiting_job_and_the_hold_can_finish() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.request(D0, ONLY_D0, request(), clock())
    assert sender.peer_lost(D0) == []
    assert sender.take_finished() == {"r1"}


def test_peer_lost_during_a_write_waits_for_the_write_to_drain() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.ready("t1")
    sender.request(D0, ONLY_D0, request(), clock())
    sender.peer_lost(D0)
    assert sender.take_finished() == set()
    sender.write_ended("t1", D0.worker, Landed(0, 0))
    assert sender.take_finished() == {"r1"}


def test_peer_lost_of_another_incarnation_leaves_the_job_alone() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.request(D0, ONLY_D0, request(), clock())
    sender.peer_lost(D0._replace(incarnation="0"))
    assert sender.statistics().jobs_by_state == {"requested": 1}


def test_peer_lost_forgets_early_requests_of_that_peer() -> None:
    sender, clock = make()
    sender.request(D0, ONLY_D0, request(), clock())
    sender.peer_lost(D0)
    assert sender.expire(clock.advance(10)) == []


def test_statistics_count_what_is_held_and_pending() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1, 2, 3), 9, S), clock())
    sender.request(D0, BOTH, msgspec.structs.replace(request("t2"), receive="r" * 16), clock())
    stats = sender.statistics()
    early_bytes = EARLY_ENTRY_BYTES + 2 * BLOCK_ID_BYTES + 4 * len("t2" + S + "r" * 16)  # two block ids, its text
    assert (stats.holds, stats.early_requests, stats.early_request_bytes) == (1, 1, early_bytes)


def test_an_abort_from_another_d_engine_leaves_the_transfer_alone() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.ready("t1")
    sender.request(D0, ONLY_D0, request(), clock())
    sender.remote_abort(WorkerRef("D2", "9", 0, 0), Abort(transfer_id="t1", reason="not yours", secret=S))
    assert sender.write_ended("t1", D0.worker, Landed(0, 0)) == [
        Reply(D0, TransferDone(transfer_id="t1", bytes=0, descriptors=0))
    ]


def test_a_request_for_a_transfer_p_already_aborted_is_answered_failed_at_once() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.abort("r1")
    assert replies(sender.request(D0, ONLY_D0, request(), clock())) == [(D0, TransferFailed)]


def test_holding_a_held_transfer_for_another_request_is_refused() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    with pytest.raises(ValueError, match="'t1' is already held for request 'r1', not 'r2'"):
        sender.hold(SendRequest("r2", "t1", (2,), 6, S), clock())


def test_a_request_p_cannot_serve_is_answered_failed_once_and_counts_d_as_served() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    assert replies(sender.refuse(D0, request(), "block ids [99] outside the pool", clock(), ONLY_D0)) == [
        (D0, TransferFailed)
    ]
    assert sender.take_finished() == {"r1"}


def test_a_bad_repeat_of_a_request_leaves_the_running_job_alone() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    sender.ready("t1")
    sender.request(D0, ONLY_D0, request(), clock())
    assert replies(sender.refuse(D0, request(), "block ids [99] outside the pool", clock(), ONLY_D0)) == [
        (D0, ErrorMessage)
    ]
    assert sender.write_ended("t1", D0.worker, Landed(0, 0)) == [
        Reply(D0, TransferDone(transfer_id="t1", bytes=0, descriptors=0))
    ]


def test_every_frame_from_d_goes_through_receive_which_refuses_blocks_outside_d_pool() -> None:
    from kvsvc.core.jobs import Notice
    from kvsvc.core.messages import Ping, Pong, WorkerMetadata

    sender, clock = make()
    d_meta = WorkerMetadata(
        engine_id="D", incarnation="1", pp_rank=0, pp_size=1, tp_rank=0, tp_size=1, start_layer=0, end_layer=1,
        num_kv_heads=1, head_size=8, dtype="float16", block_size=4, num_blocks=16, layout="HND", is_mla=False,
        base_addrs=[0],
    )  # fmt: skip
    sender.hold(SendRequest("p1", "t1", (1, 2), 6, S), clock())
    sender.ready("t1")
    assert submits(sender.receive(D0, d_meta, ONLY_D0, request(), clock())) == [Submit("t1", D0, [1, 2], [7, 8], 6)]
    bad = sender.receive(D1, d_meta, BOTH, request(blocks=(7, 99)), clock())
    assert replies(bad) == [(D1, TransferFailed)] and "99" in bad[0].message.reason  # type: ignore[union-attr]
    assert sender.receive(D0, d_meta, ONLY_D0, Ping(nonce=5), clock()) == [Reply(D0, Pong(nonce=5))]
    odd = sender.receive(D0, d_meta, ONLY_D0, TransferDone(transfer_id="t1", bytes=0, descriptors=0), clock())
    assert isinstance(odd[0], Notice) and odd[0].protocol_error and replies(odd) == [(D0, ErrorMessage)]
    told = sender.receive(D0, d_meta, ONLY_D0, ErrorMessage(reason="bad frame"), clock())
    assert told == [Notice("D worker D[pp0,tp0] reports a protocol error: bad frame", from_peer=True)]


# -- the transfer secret ------------------------------------------------------------------------------------------

ROGUE = WorkerRef("R", "7", 0, 0)  # another D engine with a valid hello, which learnt the transfer id
WRONG_SECRETS = ["", "t" * 22, S[:-1], S + "x", "é" * 22, "s" * 21 + "\udc80"]


def rogue_message(kind: str, secret: str) -> TransferRequest | Abort | Release:
    if kind == "request":
        return TransferRequest(transfer_id="t1", block_ids=[7, 8], num_tokens=6, secret=secret)
    if kind == "abort":
        return Abort(transfer_id="t1", reason="rogue", secret=secret)
    return Release(transfer_id="t1", secret=secret)


def d_meta() -> WorkerMetadata:
    return WorkerMetadata(
        engine_id="R", incarnation="7", pp_rank=0, pp_size=1, tp_rank=0, tp_size=1, start_layer=0, end_layer=1,
        num_kv_heads=1, head_size=8, dtype="float16", block_size=4, num_blocks=16, layout="HND", is_mla=False,
        base_addrs=[0],
    )  # fmt: skip


_step = st.one_of(
    st.tuples(st.just("rogue"), st.sampled_from(["request", "abort", "release"]), st.sampled_from(WRONG_SECRETS)),
    st.tuples(st.just("real"), st.sampled_from(["request", "release"]), st.just(S)),
    st.tuples(st.just("hold"), st.just(""), st.just("")),
    st.tuples(st.just("advance"), st.sampled_from(["1", "11", "61"]), st.just("")),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_step, max_size=12))
def test_a_d_engine_without_the_secret_hears_exactly_what_it_would_for_a_transfer_never_held(
    steps: list[tuple[str, str, str]],
) -> None:
    """Sender `held` holds t1 and serves the real D alongside; `never` sees only the rogue's frames and never holds:
    every answer the rogue gets, early or late, while held or after, is the same from both, and none is a write."""
    held, clock = make()
    never, _ = make(clock)
    meta = d_meta()
    for who, kind, secret in steps:
        if who == "rogue":
            message = rogue_message(kind, secret)
            got = held.receive(ROGUE, meta, ONLY_D0, message, clock())
            assert got == never.receive(ROGUE, meta, ONLY_D0, message, clock())
            assert not submits(got)
        elif who == "real":
            held.receive(D0, meta, ONLY_D0, rogue_message(kind, secret), clock())
        elif who == "hold" and not held.holds("t1"):
            held.hold(SendRequest("r1", "t1", (1, 2), 6, S), clock())
            held.ready("t1")
        elif who == "advance":
            clock.advance(float(kind))
            to_rogue = [c for c in held.expire(clock()) if isinstance(c, Reply) and c.dst == ROGUE]
            assert to_rogue == never.expire(clock())


@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("secret", WRONG_SECRETS)
def test_a_request_without_the_secret_is_never_served_and_the_real_d_still_is(early: bool, secret: str) -> None:
    sender, clock = make()
    impostor = D0  # the very identity of the real D worker, claimed by another process
    bad = TransferRequest(transfer_id="t1", block_ids=[9, 9], num_tokens=6, secret=secret)
    if not early:
        sender.hold(SendRequest("r1", "t1", (1, 2), 6, S), clock())
    assert sender.request(impostor, ONLY_D0, bad, clock()) == []
    if early:
        sender.hold(SendRequest("r1", "t1", (1, 2), 6, S), clock())
    assert submits(sender.ready("t1")) == []
    assert sender.statistics().refused_secrets == 1
    assert submits(sender.request(D0, ONLY_D0, request(), clock())) == [Submit("t1", D0, [1, 2], [7, 8], 6)]


def test_an_abort_or_release_without_the_secret_leaves_the_hold_to_the_real_d() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1, 2), 6, S), clock())
    sender.ready("t1")
    for message in (rogue_message("abort", "x" * 22), rogue_message("release", "")):
        sender.receive(D0, d_meta(), ONLY_D0, message, clock())
    assert sender.holds("t1") and sender.take_finished() == set()
    assert sender.statistics().refused_secrets == 2
    assert len(submits(sender.request(D0, ONLY_D0, request(), clock()))) == 1


def test_after_the_transfer_ended_only_its_secret_hears_the_outcome() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1, 2), 6, S), clock())
    sender.ready("t1")
    sender.request(D0, ONLY_D0, request(), clock())
    sender.write_ended("t1", D0.worker, Landed(10, 1))
    assert sender.request(D0, ONLY_D0, request(), clock()) == [
        Reply(D0, TransferDone(transfer_id="t1", bytes=10, descriptors=1))
    ]
    wrong = TransferRequest(transfer_id="t1", block_ids=[7, 8], num_tokens=6, secret="w" * 22)
    assert sender.request(D0, ONLY_D0, wrong, clock()) == []  # parked, as for an id never held
    [reply] = sender.expire(clock.advance(10))
    assert reply == Reply(
        D0, TransferFailed(transfer_id="t1", reason="unknown transfer 't1': not held by P within 10 s", cause="expired")
    )


def test_a_request_for_more_tokens_than_held_is_refused_naming_both_counts() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1, 2), 5, S), clock())
    sender.ready("t1")
    out = sender.request(D0, ONLY_D0, request(), clock())  # 6 tokens
    assert out == [
        Reply(
            D0,
            TransferFailed(
                transfer_id="t1",
                reason="D worker D[pp0,tp0] asks for 6 tokens of transfer 't1', P holds 5",
                cause="refused",
            ),
        )
    ]
    assert sender.take_finished() == {"r1"}  # the only D worker is served (failed): nothing waits for the expiry


def test_for_a_model_that_keeps_state_a_request_for_fewer_tokens_than_held_is_refused_too() -> None:
    # P's state holds every token it saw: D taking it for an earlier token's would decode from a wrong state.
    sender = Sender(hold_timeout_s=60, early_request_timeout_s=10, exact_tokens=True)
    clock = FakeClock()
    sender.hold(SendRequest("r1", "t1", (1, 2), 7, S), clock())
    sender.ready("t1")
    out = sender.request(D0, ONLY_D0, request(), clock())  # 6 tokens
    reason = "D worker D[pp0,tp0] asks for 6 tokens of transfer 't1', P holds 7 and a state as of its last token"
    assert out == [Reply(D0, TransferFailed(transfer_id="t1", reason=reason, cause="refused"))]
    plain, _ = make()  # attention alone: D may load fewer tokens than P holds
    plain.hold(SendRequest("r1", "t1", (1, 2), 7, S), clock())
    plain.ready("t1")
    assert [type(c) for c in plain.request(D0, ONLY_D0, request(), clock())] == [Submit]


def test_an_early_request_for_more_tokens_than_held_is_refused_when_the_hold_comes() -> None:
    sender, clock = make()
    assert sender.request(D0, ONLY_D0, request(), clock()) == []
    out = sender.hold(SendRequest("r1", "t1", (1, 2), 4, S), clock())
    assert [c.message for c in out if isinstance(c, Reply)] == [
        TransferFailed(
            transfer_id="t1",
            reason="D worker D[pp0,tp0] asks for 6 tokens of transfer 't1', P holds 4",
            cause="refused",
        )
    ]
    assert submits(sender.ready("t1")) == []


def test_a_repeated_hold_with_another_secret_is_refused() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1,), 6, S), clock())
    with pytest.raises(ValueError, match="another secret"):
        sender.hold(SendRequest("r1", "t1", (1,), 6, "o" * 22), clock())


def test_a_job_serves_one_receive_of_its_d_worker_while_held_and_once_ended() -> None:
    sender, clock = make()
    first, again = msgspec.structs.replace(request(), receive="a"), msgspec.structs.replace(request(), receive="b")
    sender.hold(SendRequest("r1", "t1", (1, 2), 6, S), clock())
    sender.ready("t1")
    assert submits(sender.request(D0, BOTH, first, clock())) == [Submit("t1", D0, [1, 2], [7, 8], 6)]
    done = TransferDone(transfer_id="t1", bytes=64, descriptors=1, receive="a")  # D drops it for another receive
    assert sender.write_ended("t1", D0.worker, Landed(64, 1)) == [Reply(D0, done)]
    # Held still (D1 has not asked): another receive of D0 is refused and changes nothing; a repeat is re-answered.
    [refused] = sender.request(D0, BOTH, again, clock())
    assert isinstance(refused, Reply) and isinstance(refused.message, TransferFailed)
    assert "another receive" in refused.message.reason and refused.message.receive == "b"
    abort = Abort(transfer_id="t1", reason="gone", secret=S, receive="b")
    assert replies(sender.remote_abort(D0, abort, clock(), BOTH)) == [(D0, TransferFailed)]
    assert sender.request(D0, BOTH, first, clock()) == [Reply(D0, done)]
    # Ended (D1 served): the outcome goes to the receive it was for, never to a later one with the same params.
    sender.request(D1, BOTH, msgspec.structs.replace(request(), receive="c"), clock())
    sender.write_ended("t1", D1.worker, Landed(64, 1))
    assert sender.take_finished() == {"r1"}
    assert sender.request(D0, BOTH, first, clock()) == [Reply(D0, done)]
    [late] = sender.request(D0, BOTH, again, clock())
    assert isinstance(late, Reply) and isinstance(late.message, TransferFailed) and late.message.receive == "b"
    # Peers that name no receive (older ones) are answered as before: the outcome to any repeat.
    legacy = msgspec.structs.replace(request(), receive="")
    sender.hold(SendRequest("r2", "t2", (1, 2), 6, S), clock())
    sender.ready("t2")
    sender.request(D0, ONLY_D0, msgspec.structs.replace(legacy, transfer_id="t2"), clock())
    sender.write_ended("t2", D0.worker, Landed(64, 1))
    again_t2 = sender.request(D0, ONLY_D0, msgspec.structs.replace(legacy, transfer_id="t2"), clock())
    assert replies(again_t2) == [(D0, TransferDone)]


def test_two_receives_waiting_early_are_kept_apart_and_only_the_first_is_served() -> None:
    sender, clock = make()
    first, again = msgspec.structs.replace(request(), receive="a"), msgspec.structs.replace(request(), receive="b")
    assert sender.request(D0, BOTH, first, clock()) == []
    assert sender.request(D0, BOTH, again, clock()) == []  # kept, not taken for a repeat of the first
    # The second receive's abort is answered and leaves the first one's request waiting.
    abort = Abort(transfer_id="t1", reason="gone", secret=S, receive="b")
    [answer] = sender.remote_abort(D0, abort, clock(), BOTH)
    assert isinstance(answer, Reply) and isinstance(answer.message, TransferFailed) and answer.message.receive == "b"
    sender.hold(SendRequest("r1", "t1", (1, 2), 6, S), clock())
    assert submits(sender.ready("t1")) == [Submit("t1", D0, [1, 2], [7, 8], 6)]
    assert sender.request(D0, BOTH, again, clock()) == [Reply(D0, _another(again))]


def _another(message: TransferRequest) -> TransferFailed:
    reason = (
        f"transfer {message.transfer_id!r} serves another receive of D worker {D0}; this one gets none of it (the "
        "same params in a second request)"
    )
    return TransferFailed(transfer_id=message.transfer_id, reason=reason, receive=message.receive, cause="refused")


def test_a_job_a_lost_connection_ended_tells_its_reason_to_the_receive_that_asks_later() -> None:
    sender, clock = make()
    sender.hold(SendRequest("r1", "t1", (1, 2), 6, S), clock())
    sender.ready("t1")
    assert submits(sender.request(D0, BOTH, msgspec.structs.replace(request(), receive="a"), clock()))
    sender.peer_lost(D1)  # D1 never asked: its job ends with no receive named
    late = msgspec.structs.replace(request(), receive="x")
    lost = TransferFailed(transfer_id="t1", reason=f"control connection to {D1} lost", cause="p_lost")
    assert sender.request(D1, BOTH, late, clock()) == [Reply(D1, lost)]  # while held
    sender.write_ended("t1", D0.worker, Landed(64, 1))
    assert sender.take_finished() == {"r1"}
    assert sender.request(D1, BOTH, late, clock()) == [Reply(D1, lost)]  # and once ended, the same reason


@given(st.lists(st.booleans(), max_size=8))
def test_a_layer_wise_write_streams_only_while_a_layer_is_not_computed_well(computed: list[bool]) -> None:
    assert streams_by_layer(computed) == (False in computed)


def test_the_write_failure_table_has_a_row_for_every_failure_and_holds_blocks_while_part_may_move() -> None:
    """The write-failure contract as a table (`FAULT_WAITS`): every way a write can fail, with or without a plane
    asked, has a rule; a plane's `WriteFailed` waits for its own `drained`; a failure outside the contract waits for
    the plane to settle whenever a plane was asked (part of the write may still move), and for nothing otherwise; one
    the contract allows waits for nothing."""
    assert set(FAULT_WAITS) == {(kind, asked) for kind in FaultKind for asked in (True, False)}
    assert {fault_wait(FaultKind.PLANE, asked) for asked in (True, False)} == {FaultWait.DRAINED}
    assert fault_wait(FaultKind.OUTSIDE_CONTRACT, True) is FaultWait.SETTLED
    assert fault_wait(FaultKind.OUTSIDE_CONTRACT, False) is FaultWait.NOTHING
    assert {fault_wait(FaultKind.WITHIN_CONTRACT, asked) for asked in (True, False)} == {FaultWait.NOTHING}


def test_a_pushing_p_streams_during_its_forward_only_from_the_length_configured_and_by_default_never() -> None:
    """The default writes after the forward (the sweep on two cores: streaming stretched the forward it shares the
    cores with); a length configured streams from there on, 0 every prompt."""
    assert not any(streams_during_forward(n) for n in (1, 1536, 4000, 1 << 20))
    assert [streams_during_forward(n, 2048) for n in (2047, 2048, 4000)] == [False, True, True]
    assert streams_during_forward(1, 0)
