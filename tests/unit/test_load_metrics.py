"""What D learns of each load for the engine's metrics (`kvsvc.core.receiver.LoadTimes`, `RecvReport.causes`): a
landed receive's phases add up to its time and P's own timing of its write rides its done answer; a failed one is
counted under the cause of its first failure; and with the `PeerPair` simulator, taken at any time, every landed
receive is timed once, byte exact."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsvc.core.messages import FAILURE_CAUSES, ErrorMessage, TransferDone, TransferFailed, TransferRequest, WorkerRef
from kvsvc.core.receiver import Receiver, RecvRequest
from kvsvc.core.sender import Landed, Reply, Sender, SendRequest
from kvsvc.testing.pair import PeerPair
from kvsvc.testing.sim import EngineSpec

P0 = (0, 0)
PLANNED = 1 << 20


def _receiving(timeout_s: float = 60.0) -> Receiver:
    receiver = Receiver(recv_timeout_s=timeout_s, abort_grace_s=1.0)
    assert receiver.start(RecvRequest("r", "t", "P", "http://p", (1,), 16, 0, ""), 10.0, receive="x")
    return receiver


def _asked(receiver: Receiver) -> Receiver:
    receiver.sources_known("t", [P0], [], {P0}, {P0: PLANNED})
    return receiver


def test_a_landed_receive_is_timed_in_phases_that_add_up_to_its_time() -> None:
    receiver = _asked(_receiving())
    receiver.asked("t", 10.2)
    receiver.asked("t", 10.4)  # a repeat (another source, a reconnect) does not move the handshake's end
    receiver.receive(
        "P", P0, TransferDone(transfer_id="t", bytes=PLANNED, descriptors=1, receive="x", write_us=300_000)
    )
    [times] = receiver.take_landed(11.0)
    assert (times.req_id, times.engine_id, times.sources, times.nbytes) == ("r", "P", (P0,), PLANNED)
    assert times.total_s == pytest.approx(1.0)
    assert (times.handshake_s, times.queue_s, times.write_s) == pytest.approx((0.2, 0.5, 0.3))
    assert times.gbps == pytest.approx(PLANNED / 0.3 / 1e9)
    assert receiver.take_landed(12.0) == []  # once


def test_p_timing_more_than_ds_wait_is_cut_to_it_and_a_receive_never_asked_has_no_handshake_phase() -> None:
    receiver = _asked(_receiving())
    receiver.receive("P", P0, TransferDone(transfer_id="t", bytes=PLANNED, descriptors=1, receive="x", write_us=9**9))
    [times] = receiver.take_landed(10.5)
    assert (times.handshake_s, times.queue_s, times.write_s, times.total_s) == pytest.approx((0.0, 0.0, 0.5, 0.5))


def test_ps_write_time_reaches_d_in_its_done_answer() -> None:
    sender = Sender()

    dst = WorkerRef("D", "1", 0, 0)
    sender.hold(SendRequest("r", "t", (1,), 16, "s" * 32), 0.0)
    sender.ready("t")
    request = TransferRequest(transfer_id="t", block_ids=[2], num_tokens=16, secret="s" * 32, receive="x")
    sender.request(dst, frozenset({(0, 0)}), request, 0.0)
    [reply] = [c for c in sender.write_ended("t", (0, 0), Landed(64, 1, write_s=0.25)) if isinstance(c, Reply)]
    assert isinstance(reply.message, TransferDone) and reply.message.write_us == 250_000


@pytest.mark.parametrize(("end", "cause"), [("abort", "aborted"), ("expire", "expired"), ("serve", "refused")])
def test_a_request_after_the_hold_ended_is_told_why_it_ended(end: str, cause: str) -> None:
    sender = Sender(hold_timeout_s=1.0)
    d0, d1 = WorkerRef("D", "1", 0, 0), WorkerRef("D", "1", 0, 1)
    sender.hold(SendRequest("r", "t", (1,), 16, "s" * 32), 0.0)
    sender.ready("t")
    request = TransferRequest(transfer_id="t", block_ids=[2], num_tokens=16, secret="s" * 32, receive="x")
    if end == "abort":
        sender.abort("r")
    elif end == "expire":
        sender.expire(2.0)
    else:
        sender.request(d0, frozenset({(0, 0)}), request, 0.0)
        sender.write_ended("t", (0, 0), Landed(64, 1))
    assert sender.take_finished() == {"r"}
    [reply] = sender.request(d1, frozenset({(0, 1)}), request, 3.0)
    assert isinstance(reply, Reply) and isinstance(reply.message, TransferFailed)
    assert reply.message.cause == cause, reply.message


def _failed(receiver: Receiver) -> str:
    report = receiver.take_report()
    assert report.failed == {"r"}, report
    return report.causes["r"]


@pytest.mark.parametrize("cause", ["transport", "expired", "refused", "p_lost", "aborted"])
def test_a_failure_p_names_is_counted_under_ps_cause(cause: str) -> None:
    receiver = _asked(_receiving())
    receiver.receive("P", P0, TransferFailed(transfer_id="t", reason="why", receive="x", cause=cause))
    assert _failed(receiver) == cause


@pytest.mark.parametrize("cause", ["", "handshake", "no such cause"])
def test_a_failure_p_names_no_cause_of_its_own_for_is_a_transport_failure(cause: str) -> None:
    receiver = _asked(_receiving())
    receiver.receive("P", P0, TransferFailed(transfer_id="t", reason="why", receive="x", cause=cause))
    assert _failed(receiver) == "transport"


def test_ds_own_failures_are_counted_under_their_cause() -> None:
    expired = _asked(_receiving(timeout_s=1.0))
    expired.expire(11.5)
    expired.expire(13.0)  # the abort grace too: nothing confirmed the writes stopped
    assert _failed(expired) == "expired"

    aborted = _asked(_receiving())
    aborted.abort("r", 11.0)
    aborted.receive("P", P0, TransferFailed(transfer_id="t", reason="aborted by D", receive="x", cause="aborted"))
    assert _failed(aborted) == "aborted"

    lost = _asked(_receiving())
    lost.peer_lost("P", P0, "connection reset", 11.0)
    lost.expire(13.0)
    assert _failed(lost) == "p_lost"

    handshake = _receiving()
    handshake.engine_failed("P", "metadata fetch failed")
    assert _failed(handshake) == "handshake"

    refused_hello = _asked(_receiving())
    refused_hello.peer_lost("P", P0, "hello refused", 11.0, cause="handshake")
    refused_hello.expire(13.0)
    assert _failed(refused_hello) == "handshake"

    wrong_bytes = _asked(_receiving())
    wrong_bytes.receive("P", P0, TransferDone(transfer_id="t", bytes=PLANNED + 1, descriptors=1, receive="x"))
    assert _failed(wrong_bytes) == "protocol"

    error = _asked(_receiving())
    error.receive("P", P0, ErrorMessage(reason="bad frame", transfer_id="t"))
    assert _failed(error) == "protocol"


def test_the_first_cause_is_the_one_counted() -> None:
    receiver = _asked(_receiving())
    receiver.peer_lost("P", P0, "connection reset", 11.0)
    receiver.receive("P", P0, TransferFailed(transfer_id="t", reason="late", receive="x", cause="expired"))
    receiver.expire(13.0)
    assert _failed(receiver) == "p_lost"


SIDES = st.sampled_from([(1, 1), (2, 1), (1, 2)])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p_shape=SIDES,
    d_shape=SIDES,
    transfers=st.integers(1, 4),
    aborted=st.integers(0, 4),
    rng=st.randoms(use_true_random=False),
)
def test_every_landed_receive_is_timed_once_byte_exact_and_every_failure_has_a_known_cause(
    p_shape: tuple[int, int], d_shape: tuple[int, int], transfers: int, aborted: int, rng: random.Random
) -> None:
    p = EngineSpec(tp_size=p_shape[0], pp_size=p_shape[1], num_kv_heads=2, num_blocks=16)
    d = EngineSpec(tp_size=d_shape[0], pp_size=d_shape[1], num_kv_heads=2, num_blocks=16)
    pair = PeerPair(p, d)
    tids = [f"t{i}" for i in range(transfers)]
    for i, tid in enumerate(tids):
        pair.start_send(f"p-{tid}", tid, [3 * i, 3 * i + 1, 3 * i + 2], 10)
        pair.start_recv(f"d-{tid}", tid, [15 - 3 * i, 14 - 3 * i, 13 - 3 * i], 10)
    doomed = set(rng.sample(tids, min(aborted, transfers)))
    while pair.step(rng):
        pair.clock.advance(rng.choice([0.0, 0.001, 0.004]))
        if doomed and rng.random() < 0.2:
            pair.abort_recv(f"d-{doomed.pop()}")
    for _ in range(3):
        pair.advance(40.0)  # past every abort grace
        pair.run_until_idle(rng)
    for worker, receiver in pair.receivers.items():
        report = receiver.take_report()  # everything since the start: the pair took no report
        timed = [times for w, times in pair.loads if w == worker]
        assert sorted(t.req_id for t in timed) == sorted(report.finished), "a landed receive not timed once"
        assert set(report.causes) == report.failed and set(report.causes.values()) <= set(FAILURE_CAUSES)
        for times in timed:
            assert min(times.handshake_s, times.queue_s, times.write_s) >= 0 and times.nbytes > 0
            assert times.handshake_s + times.queue_s + times.write_s == pytest.approx(times.total_s)
            pair.assert_received(times.transfer_id, [worker])
    assert pair.violations == []
