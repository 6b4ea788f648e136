"""Specification of the P/D protocol end to end: every P worker's `Sender` and every D worker's `Receiver` talk
back to back through `kvsvc.testing.pair.PeerPair`, with simulated KV pools, a fake clock and no event loop
(docs/protocol.md, docs/design.md "Testing")."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsvc.core.auth import harness_secret
from kvsvc.core.messages import Abort, ErrorMessage, Release, TransferDone, TransferFailed, TransferRequest
from kvsvc.core.planner import expected_destinations
from kvsvc.core.receiver import Receiver
from kvsvc.core.sender import Reply, Sender
from kvsvc.testing.clock import FakeClock
from kvsvc.testing.pair import Envelope, PeerPair, Write
from kvsvc.testing.sim import EngineSpec

LAYOUTS = {
    "P tp1 -> D tp2": (EngineSpec(tp_size=1), EngineSpec(tp_size=2)),
    "P tp2 -> D tp1": (EngineSpec(tp_size=2), EngineSpec(tp_size=1)),
    "P pp2 -> D pp1": (EngineSpec(pp_size=2), EngineSpec(pp_size=1)),
    "P pp1 -> D pp2": (EngineSpec(pp_size=1), EngineSpec(pp_size=2)),
    "P pp2 tp2 -> D pp2 tp1, uneven split": (
        EngineSpec(pp_size=2, tp_size=2, num_layers=5),
        EngineSpec(pp_size=2, num_layers=5, layer_split=((0, 1), (1, 5))),
    ),
    "P block 4 -> D block 8, NHD": (EngineSpec(layout="NHD"), EngineSpec(block_size=8, layout="NHD")),
    "P tp4 -> D tp2, block 8 -> 2": (EngineSpec(tp_size=4, block_size=8), EngineSpec(tp_size=2, block_size=2)),
    "MLA P tp2 -> D tp4": (EngineSpec(tp_size=2, is_mla=True), EngineSpec(tp_size=4, is_mla=True)),
}
P_BLOCKS, D_BLOCKS, TOKENS = [3, 0, 9], [5, 11, 2, 7, 1, 4], 11


def transfer(pair: PeerPair, tid: str = "t1", *, recv_first: bool = False) -> None:
    d_blocks = D_BLOCKS[: -(-TOKENS // pair.d.spec.block_size)]
    p_blocks = P_BLOCKS[: -(-TOKENS // pair.p.spec.block_size)]
    if recv_first:
        pair.start_recv(f"d-{tid}", tid, d_blocks, TOKENS)
        pair.start_send(f"p-{tid}", tid, p_blocks, TOKENS)
    else:
        pair.start_send(f"p-{tid}", tid, p_blocks, TOKENS)
        pair.start_recv(f"d-{tid}", tid, d_blocks, TOKENS)


def assert_clean(pair: PeerPair) -> None:
    """Nothing held or waiting on either side, and the harness saw no broken invariant."""
    stats = pair.statistics()
    assert (stats.holds, stats.receives) == (0, 0)
    assert pair.violations == []


def d_outcomes(pair: PeerPair, req_id: str) -> set[str]:
    return {o for (side, _), outs in pair.outcomes(req_id).items() if side == "D" for o in outs}


@pytest.mark.parametrize(("p", "d"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_transfer_lands_byte_exact_and_each_side_reports_it_once_without_any_deadline(
    p: EngineSpec, d: EngineSpec
) -> None:
    pair = PeerPair(p, d)
    transfer(pair)
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_received("t1")
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert d_outcomes(pair, "d-t1") == {"finished"}
    assert all(pair.bytes_written_twice(w) == 0 for w in pair.receivers)
    assert pair.clock() == 0
    assert_clean(pair)


def test_p_workers_that_source_nothing_for_replicated_kv_are_released_and_finish_at_once() -> None:
    pair = PeerPair(EngineSpec(tp_size=8, num_kv_heads=4), EngineSpec(tp_size=2))
    idle = [w for w, m in pair.p.metas.items() if not expected_destinations(m, pair.d.metas)]
    assert idle  # the case needs P workers with nothing to send
    transfer(pair)
    pair.run_until_idle()
    pair.take_reports()
    releases = [e for e in pair.history if e.side == "P" and e.worker in idle]
    assert len(releases) == len(idle)
    assert pair.clock() == 0
    pair.assert_received("t1")
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert_clean(pair)


def test_a_release_is_what_frees_a_p_worker_that_sources_nothing() -> None:
    pair = PeerPair(EngineSpec(tp_size=8, num_kv_heads=4), EngineSpec(tp_size=2))
    pair.drop = lambda e: isinstance(e.message, Release)
    transfer(pair)
    pair.run_until_idle()
    pair.take_reports()
    idle = [w for w, m in pair.p.metas.items() if not expected_destinations(m, pair.d.metas)]
    assert all(("P", w) not in pair.outcomes("p-t1") for w in idle)
    pair.advance(60)
    pair.take_reports()
    pair.assert_reported_once(["p-t1"], ["d-t1"])


def test_duplicated_messages_repeated_calls_and_stray_aborts_change_nothing() -> None:
    pair = PeerPair(EngineSpec(tp_size=2), EngineSpec(tp_size=4))
    pair.duplicate = lambda e: True
    transfer(pair)
    transfer(pair)
    pair.start_send("p-t1", "t1", P_BLOCKS, TOKENS)
    pair.abort_send("unknown")
    pair.abort_recv("unknown")
    pair.run_until_idle()
    pair.take_reports()
    pair.ready("t1")
    pair.run_until_idle()
    pair.take_reports()
    assert pair.statistics().duplicated > 0
    pair.assert_received("t1")
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert d_outcomes(pair, "d-t1") == {"finished"}
    assert all(pair.bytes_written_twice(w) == 0 for w in pair.receivers)
    assert_clean(pair)


def test_repeated_aborts_report_once() -> None:
    pair = PeerPair(EngineSpec(tp_size=2), EngineSpec(tp_size=2))
    pair.start_send("p-t1", "t1", P_BLOCKS, TOKENS, ready=False)
    pair.start_recv("d-t1", "t1", D_BLOCKS, TOKENS)
    pair.run_until_idle()
    for _ in range(3):
        pair.abort_recv("d-t1")
        pair.abort_send("p-t1")
        pair.run_until_idle()
        pair.take_reports()
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert_clean(pair)


def test_a_request_that_arrives_before_p_holds_is_served_once_p_holds() -> None:
    pair = PeerPair(EngineSpec(tp_size=2), EngineSpec(tp_size=1))
    pair.start_recv("d-t1", "t1", D_BLOCKS, TOKENS)
    pair.run_until_idle()
    pair.advance(9)
    assert pair.take_reports() == []
    pair.start_send("p-t1", "t1", P_BLOCKS, TOKENS)
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_received("t1")
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert_clean(pair)


def test_a_request_for_a_transfer_p_never_holds_is_answered_failed_after_the_early_request_timeout() -> None:
    pair = PeerPair(EngineSpec(tp_size=2), EngineSpec(tp_size=1))
    pair.start_recv("d-t1", "t1", D_BLOCKS, TOKENS)
    pair.run_until_idle()
    pair.advance(9.9)
    pair.run_until_idle()
    assert pair.take_reports() == []
    pair.advance(0.1)  # early_request_timeout_s = 10, well before D's own 60 s timeout
    pair.run_until_idle()
    [entry] = pair.take_reports()
    assert (entry.outcome, "not held" in entry.reason) == ("failed", True)
    assert_clean(pair)


def test_hold_expiry_reports_once_and_answers_waiting_d_workers_failed() -> None:
    pair = PeerPair(EngineSpec(tp_size=1), EngineSpec(tp_size=2), receiver=lambda: Receiver(recv_timeout_s=600))
    pair.start_send("p-t1", "t1", P_BLOCKS, TOKENS, ready=False)
    pair.start_recv("d-t1", "t1", D_BLOCKS, TOKENS)
    pair.run_until_idle()
    pair.advance(59)
    assert pair.take_reports() == []
    pair.advance(1)
    pair.run_until_idle()
    pair.take_reports()
    pair.advance(600)
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert d_outcomes(pair, "d-t1") == {"failed"}
    assert all("expired" in e.reason for e in pair.history if e.side == "D")
    assert_clean(pair)


def stalled_pair() -> PeerPair:
    pair = PeerPair(EngineSpec(tp_size=1), EngineSpec(tp_size=1), receiver=lambda: Receiver(recv_timeout_s=600))
    pair.stall_write = lambda w: True
    transfer(pair)
    pair.run_until_idle()
    assert pair.statistics().writes_stalled == 1
    return pair


def test_a_write_in_flight_at_hold_expiry_delays_the_report_until_the_write_result() -> None:
    pair = stalled_pair()
    pair.advance(60)
    pair.run_until_idle()
    assert pair.take_reports() == []
    pair.finish_stalled()
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert d_outcomes(pair, "d-t1") == {"failed"}
    assert_clean(pair)


def test_a_write_in_flight_at_p_abort_delays_the_report_until_the_write_result() -> None:
    pair = stalled_pair()
    pair.abort_send("p-t1")
    pair.run_until_idle()
    assert pair.take_reports() == []
    pair.finish_stalled(error="cancelled")
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert d_outcomes(pair, "d-t1") == {"failed"}
    assert_clean(pair)


def test_a_write_in_flight_at_d_abort_delays_both_reports_until_the_write_result() -> None:
    pair = stalled_pair()
    pair.abort_recv("d-t1")
    pair.run_until_idle()
    assert pair.take_reports() == []
    pair.finish_stalled()
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert d_outcomes(pair, "d-t1") == {"failed"}
    assert_clean(pair)


def test_d_abort_aborts_the_p_job_which_counts_as_served() -> None:
    pair = PeerPair(EngineSpec(tp_size=2), EngineSpec(tp_size=2))
    pair.start_send("p-t1", "t1", P_BLOCKS, TOKENS, ready=False)
    pair.start_recv("d-t1", "t1", D_BLOCKS, TOKENS)
    pair.run_until_idle()
    pair.abort_recv("d-t1")
    pair.run_until_idle()
    pair.take_reports()
    assert all(s.statistics().holds == 0 for s in pair.senders.values())
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert d_outcomes(pair, "d-t1") == {"failed"}
    assert pair.clock() == 0
    assert pair.statistics().writes_done == 0
    assert_clean(pair)


def test_a_d_abort_that_reaches_p_before_p_holds_still_counts_that_d_worker_as_served() -> None:
    pair = PeerPair(EngineSpec(tp_size=1), EngineSpec(tp_size=1))
    pair.start_recv("d-t1", "t1", D_BLOCKS, TOKENS)
    pair.run_until_idle()
    pair.abort_recv("d-t1")
    pair.run_until_idle()
    pair.start_send("p-t1", "t1", P_BLOCKS, TOKENS)
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_reported_once(["p-t1"], ["d-t1"])


def test_p_abort_fails_the_receive_on_d() -> None:
    pair = PeerPair(EngineSpec(tp_size=2), EngineSpec(tp_size=1))
    pair.start_send("p-t1", "t1", P_BLOCKS, TOKENS, ready=False)
    pair.start_recv("d-t1", "t1", D_BLOCKS, TOKENS)
    pair.run_until_idle()
    pair.abort_send("p-t1")
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert d_outcomes(pair, "d-t1") == {"failed"}
    assert_clean(pair)


def test_a_receive_whose_p_never_answers_times_out_failed_with_all_its_blocks_invalid() -> None:
    pair = PeerPair(EngineSpec(tp_size=1), EngineSpec(tp_size=2), sender=lambda: Sender(hold_timeout_s=600))
    pair.hold_back = lambda e: e.to == "D"
    transfer(pair)
    pair.run_until_idle()
    pair.advance(60)
    pair.run_until_idle()
    entries = pair.take_reports()
    # P was told to stop and ends its hold; D waits for P's answer (held back here), bounded by the abort grace.
    assert [e.side for e in entries] == ["P"]
    pair.advance(35)
    pair.run_until_idle()
    entries = pair.take_reports()
    assert {e.outcome for e in entries if e.side == "D"} == {"failed"}
    assert all("timed out" in e.reason for e in entries if e.side == "D")
    assert pair.violations == []  # the harness checked invalid_block_ids covered every block
    pair.hold_back = None
    pair.release_held()
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert_clean(pair)


def test_a_failed_write_fails_the_receive_and_finishes_the_send() -> None:
    pair = PeerPair(EngineSpec(tp_size=2), EngineSpec(tp_size=1))
    pair.fail_write = lambda w: w.p == (0, 1)
    transfer(pair)
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    [entry] = [e for e in pair.history if e.side == "D"]
    assert entry.outcome == "failed" and "injected write failure" in entry.reason
    assert_clean(pair)


def test_a_connection_lost_while_writing_fails_that_receive_and_frees_the_hold_after_the_write() -> None:
    pair = PeerPair(EngineSpec(tp_size=1), EngineSpec(tp_size=2))
    pair.stall_write = lambda w: w.d == (0, 1)
    transfer(pair)
    pair.run_until_idle()
    pair.lose_connection((0, 1), (0, 0))
    pair.run_until_idle()
    # Neither side may give the blocks back while the write may still move: P drains, D waits its abort grace.
    assert [e.worker for e in pair.take_reports()] == [(0, 0)]
    pair.finish_stalled()
    pair.run_until_idle()
    pair.take_reports()
    assert pair.outcomes("p-t1") == {("P", (0, 0)): ["finished_sending"]}
    assert ("D", (0, 1)) not in pair.outcomes("d-t1")
    pair.advance(35)
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert pair.outcomes("d-t1")[("D", (0, 1))] == ["failed"]
    assert pair.outcomes("d-t1")[("D", (0, 0))] == ["finished"]
    pair.assert_received("t1", [(0, 0)])
    assert_clean(pair)


def test_after_a_reconnect_d_frees_its_blocks_once_the_write_the_lost_link_left_has_ended() -> None:
    pair = PeerPair(EngineSpec(tp_size=1), EngineSpec(tp_size=2))
    pair.stall_write = lambda w: w.d == (0, 1)
    transfer(pair)
    pair.run_until_idle()
    pair.lose_connection((0, 1), (0, 0))
    pair.run_until_idle()
    pair.reconnect((0, 1), (0, 0))
    pair.run_until_idle()
    pair.take_reports()
    assert ("D", (0, 1)) not in pair.outcomes("d-t1")  # asked again, but the write may still move: no answer yet
    pair.finish_stalled()
    pair.run_until_idle()
    pair.take_reports()  # long before the abort grace; `violations` would list a report while the write could move
    assert pair.outcomes("d-t1")[("D", (0, 1))] == ["failed"]
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert_clean(pair)


def test_after_a_reconnect_a_request_that_never_arrived_fails_at_once() -> None:
    pair = PeerPair(EngineSpec(tp_size=1), EngineSpec(tp_size=2))
    pair.hold_back = lambda e: e.d == (0, 1)
    transfer(pair)
    pair.run_until_idle()
    pair.lose_connection((0, 1), (0, 0))
    pair.hold_back = None
    pair.reconnect((0, 1), (0, 0))
    pair.run_until_idle()
    pair.take_reports()  # P never had a job for (0, 1): its answer frees D's blocks without the abort grace
    assert pair.outcomes("d-t1") == {("D", (0, 0)): ["finished"], ("D", (0, 1)): ["failed"]}
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert_clean(pair)


def test_a_connection_lost_before_the_request_fails_that_receive_and_ends_the_hold_without_expiry() -> None:
    pair = PeerPair(EngineSpec(tp_size=1), EngineSpec(tp_size=2))
    pair.hold_back = lambda e: e.d == (0, 1)
    transfer(pair)
    pair.run_until_idle()
    pair.lose_connection((0, 1), (0, 0))
    pair.run_until_idle()
    pair.take_reports()
    # P knows from the other D worker's request that (0, 1) would ask; its lost connection means it never will.
    assert pair.outcomes("p-t1") == {("P", (0, 0)): ["finished_sending"]}
    # D cannot tell that its request never arrived: it holds the blocks for the abort grace.
    assert pair.outcomes("d-t1") == {("D", (0, 0)): ["finished"]}
    pair.advance(35)
    pair.run_until_idle()
    pair.take_reports()
    assert pair.outcomes("d-t1") == {("D", (0, 0)): ["finished"], ("D", (0, 1)): ["failed"]}
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert_clean(pair)


def test_a_source_reached_after_a_reconnect_serves_the_receive() -> None:
    pair = PeerPair(EngineSpec(tp_size=1), EngineSpec(tp_size=1))
    pair.lose_connection((0, 0), (0, 0))
    transfer(pair)
    pair.run_until_idle()
    assert pair.take_reports() == []
    pair.reconnect((0, 0), (0, 0))
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_received("t1")
    pair.assert_reported_once(["p-t1"], ["d-t1"])


def test_a_second_d_engine_asking_for_a_transfer_in_progress_gets_an_error_and_changes_nothing() -> None:
    pair = PeerPair(EngineSpec(tp_size=1), EngineSpec(tp_size=1))
    pair.start_send("p-t1", "t1", P_BLOCKS, TOKENS, ready=False)
    pair.start_recv("d-t1", "t1", D_BLOCKS, TOKENS)
    pair.run_until_idle()
    stranger = pair.d.ref((0, 0))._replace(engine_id="D2")
    request = TransferRequest(transfer_id="t1", block_ids=[1], num_tokens=1, secret=harness_secret("t1"))
    [reply] = pair.senders[(0, 0)].request(stranger, frozenset({(0, 0)}), request, pair.clock())
    assert isinstance(reply, Reply) and isinstance(reply.message, ErrorMessage) and reply.dst == stranger
    pair.ready("t1")
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_received("t1")
    pair.assert_reported_once(["p-t1"], ["d-t1"])


@pytest.mark.parametrize("first", ["rogue", "real"])
def test_a_d_engine_that_knows_the_id_but_not_the_secret_gets_nothing_and_the_real_d_gets_every_byte(
    first: str,
) -> None:
    pair = PeerPair(EngineSpec(tp_size=1), EngineSpec(tp_size=1))
    sender = pair.senders[(0, 0)]
    rogue = pair.d.ref((0, 0))._replace(engine_id="D2")
    guess = "x" * 22

    def attack() -> list[object]:
        request = TransferRequest(transfer_id="t1", block_ids=[1], num_tokens=TOKENS, secret=guess)
        abort = Abort(transfer_id="t1", reason="rogue", secret=guess)
        commands = sender.request(rogue, frozenset({(0, 0)}), request, pair.clock())
        return commands + sender.remote_abort(rogue, abort, pair.clock(), frozenset({(0, 0)}))

    if first == "real":
        pair.start_send("p-t1", "t1", P_BLOCKS, TOKENS, ready=False)
    answered = attack()  # before the hold (an early request) or while it is held: the same answers
    assert answered == [
        Reply(rogue, TransferFailed(transfer_id="t1", reason="rogue", cause="aborted"))
    ]  # as for any unknown id
    if first == "rogue":
        pair.start_send("p-t1", "t1", P_BLOCKS, TOKENS, ready=False)
    pair.start_recv("d-t1", "t1", D_BLOCKS, TOKENS)
    pair.ready("t1")
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_received("t1")
    pair.assert_reported_once(["p-t1"], ["d-t1"])
    assert sender.statistics().refused_secrets >= 1
    prober = rogue._replace(engine_id="D3")  # a later probe is parked, as one for a transfer never held
    probe = TransferRequest(transfer_id="t1", block_ids=[1], num_tokens=1, secret=guess)
    assert sender.request(prober, frozenset({(0, 0)}), probe, pair.clock()) == []
    [(dst, reply)] = [(c.dst, c.message) for c in sender.expire(pair.clock.advance(60)) if isinstance(c, Reply)]
    assert dst == prober and isinstance(reply, TransferFailed)
    assert reply.reason == "unknown transfer 't1': not held by P within 10 s"


def test_the_harness_flags_a_send_reported_while_its_write_may_touch_the_blocks() -> None:
    class EagerSender(Sender):
        def take_finished(self) -> set[str]:
            return {"p-t1"}

    pair = PeerPair(EngineSpec(), EngineSpec(), sender=EagerSender)
    pair.stall_write = lambda w: True
    transfer(pair)
    pair.run_until_idle()
    pair.take_reports()
    assert pair.violations and "p-t1" in pair.violations[0]


def test_the_byte_check_catches_a_missing_write() -> None:
    pair = PeerPair(EngineSpec(tp_size=2), EngineSpec(tp_size=1))
    pair.drop = lambda e: isinstance(e.message, TransferDone | TransferFailed)
    pair.fail_write = lambda w: w.p == (0, 1)
    transfer(pair)
    pair.run_until_idle()
    with pytest.raises(AssertionError, match="wrong bytes"):
        pair.assert_received("t1")


# -- random interleavings ----------------------------------------------------------------------------------------

SIDES = st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 1), (1, 2)])  # (tp, pp): 1 to 4 workers


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p_shape=SIDES,
    d_shape=SIDES,
    transfers=st.integers(1, 3),
    rng=st.randoms(use_true_random=False),
    duplicate_rate=st.sampled_from([0.0, 0.3]),
    abort_rate=st.sampled_from([0.0, 0.05]),
)
def test_any_delivery_order_with_duplicates_and_aborts_ends_clean_with_every_req_reported_once(
    p_shape: tuple[int, int],
    d_shape: tuple[int, int],
    transfers: int,
    rng: random.Random,
    duplicate_rate: float,
    abort_rate: float,
) -> None:
    p = EngineSpec(tp_size=p_shape[0], pp_size=p_shape[1], num_kv_heads=2, num_blocks=12)  # tp 4 replicates
    d = EngineSpec(tp_size=d_shape[0], pp_size=d_shape[1], num_kv_heads=2, num_blocks=12)
    pair = PeerPair(p, d)
    pair.duplicate = lambda e: rng.random() < duplicate_rate
    tids = [f"t{i}" for i in range(transfers)]
    actions: list[tuple[str, str]] = [(kind, t) for t in tids for kind in ("send", "recv", "ready")]
    rng.shuffle(actions)
    started: set[tuple[str, str]] = set()
    aborted: set[str] = set()
    while actions or not pair.idle:
        if actions and (pair.idle or rng.random() < 0.3):
            kind, tid = actions.pop()
            i = int(tid[1:])
            if kind == "ready" and ("send", tid) not in started:
                actions.insert(0, (kind, tid))
                continue
            started.add((kind, tid))
            if kind == "send":
                pair.start_send(f"p-{tid}", tid, [4 * i, 4 * i + 1, 4 * i + 2], 10, ready=False)
            elif kind == "recv":
                pair.start_recv(f"d-{tid}", tid, [11 - 4 * i, 10 - 4 * i, 9 - 4 * i], 10)
            else:
                pair.ready(tid)
        else:
            pair.step(rng)
        if rng.random() < abort_rate:
            tid = rng.choice(tids)
            aborted.add(tid)
            if rng.random() < 0.5:
                pair.abort_send(f"p-{tid}")
            else:
                pair.abort_recv(f"d-{tid}")
        if rng.random() < 0.1:
            pair.take_reports()
    pair.run_until_idle(rng)
    pair.take_reports()
    for t in set(tids) - aborted:  # no deadline is needed to finish a transfer nobody aborted
        assert len(pair.outcomes(f"p-{t}")) == len(pair.senders)
        assert len(pair.outcomes(f"d-{t}")) == len(pair.receivers)
    pair.advance(600)  # every deadline passes: nothing may be left behind
    pair.run_until_idle(rng)
    pair.take_reports()
    pair.assert_reported_once([f"p-{t}" for t in tids], [f"d-{t}" for t in tids])
    for t in tids:
        for (side, worker), outcomes in pair.outcomes(f"d-{t}").items():
            if side == "D" and outcomes == ["finished"]:
                pair.assert_received(t, [worker])
    assert all(pair.bytes_written_twice(w) == 0 for w in pair.receivers)
    assert_clean(pair)


def test_envelopes_and_writes_name_both_workers() -> None:
    pair = PeerPair(EngineSpec(tp_size=1), EngineSpec(tp_size=2))
    seen: list[Envelope] = []
    writes: list[Write] = []

    def watch(envelope: Envelope) -> bool:
        seen.append(envelope)
        return False

    def watch_write(write: Write) -> bool:
        writes.append(write)
        return False

    pair.hold_back, pair.stall_write = watch, watch_write
    transfer(pair)
    pair.run_until_idle()
    requests = {(e.d, e.p) for e in seen if isinstance(e.message, TransferRequest)}
    assert requests == {((0, 0), (0, 0)), ((0, 1), (0, 0))}
    assert {w.d for w in writes} == {(0, 0), (0, 1)}
    assert not any(isinstance(e.message, Abort) for e in seen)


def test_the_fake_clock_moves_only_forward_and_only_when_told() -> None:
    clock = FakeClock(5.0)
    assert (clock(), clock.advance(2.5), clock.set(10.0), clock()) == (5.0, 7.5, 10.0, 10.0)
    with pytest.raises(ValueError, match="-1"):
        clock.advance(-1)
    with pytest.raises(ValueError, match="back"):
        clock.set(9.0)
    assert clock.now == 10.0


@pytest.mark.parametrize("names_receives", [True, False], ids=["receives named", "control: unnamed, as old peers"])
@pytest.mark.parametrize(("p", "d"), [LAYOUTS["P tp1 -> D tp2"], LAYOUTS["P tp2 -> D tp1"]], ids=["tp1->2", "tp2->1"])
def test_the_same_params_in_a_later_request_get_nothing_of_the_first_receive(
    p: EngineSpec, d: EngineSpec, names_receives: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not names_receives:  # the negative control: without receive names P cannot tell a replay from a repeat
        start = Receiver.start
        monkeypatch.setattr(Receiver, "start", lambda self, *a, receive="", **k: start(self, *a, **k))
    pair = PeerPair(p, d)
    transfer(pair)
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_received("t1")
    # The params replayed into a second request after the first ended: P's hold is over and it remembers the
    # outcome, but the new request's blocks received nothing and must not be reported loaded.
    pair.start_recv("d-again", "t1", [6, 8, 10, 12, 13, 14][: len(D_BLOCKS)], TOKENS)
    pair.run_until_idle()
    pair.take_reports()
    assert d_outcomes(pair, "d-again") == ({"failed"} if names_receives else {"finished"})
    assert_clean(pair)
