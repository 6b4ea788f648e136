"""Specification of kvsvc.engine.scheduler: what an aggregated KV report means for the engine's scheduler."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.core.outputs import KVConnectorOutput
from kvsvc.engine.scheduler import RequestTracker, SchedulerUpdate


def test_no_report_is_an_empty_update() -> None:
    assert RequestTracker().update(None).is_empty()
    assert RequestTracker().update(KVConnectorOutput()).is_empty()


def test_p_frees_blocks_once_sending_finished() -> None:
    tracker = RequestTracker()
    tracker.track_send("a", [1, 2])
    tracker.track_send("b", [3])
    update = tracker.update(KVConnectorOutput(finished_sending={"a"}))
    assert update.sends_finished == {"a": (1, 2)}
    assert tracker.sending() == {"b": (3,)}
    assert tracker.update(KVConnectorOutput(finished_sending={"a"})).unknown_sending == {"a"}


def test_d_finished_recv_becomes_runnable_and_keeps_its_blocks() -> None:
    tracker = RequestTracker()
    tracker.track_recv("r", [4, 5])
    update = tracker.update(KVConnectorOutput(finished_recving={"r"}))
    assert update.recvs_finished == {"r": (4, 5)}
    assert not update.recvs_failed and not update.recompute_block_ids
    assert tracker.receiving() == {}


def test_failed_recv_goes_to_recompute_with_invalid_blocks() -> None:
    tracker = RequestTracker()
    tracker.track_recv("bad", [1, 2, 3])
    tracker.track_recv("good", [7])
    kv = KVConnectorOutput(finished_recving={"bad", "good"}, failed_recving={"bad"}, invalid_block_ids={2, 9})
    update = tracker.update(kv)
    assert update.recvs_failed == {"bad": (1, 2, 3)}
    assert update.recvs_finished == {"good": (7,)}
    assert update.recompute_block_ids == {1, 2, 3, 9}


def test_failed_only_in_failed_recving_also_counts() -> None:
    tracker = RequestTracker()
    tracker.track_recv("x", [0])
    assert tracker.update(KVConnectorOutput(failed_recving={"x"})).recvs_failed == {"x": (0,)}


def test_blocks_reported_invalid_early_fail_the_receive_when_it_ends() -> None:
    tracker = RequestTracker()
    tracker.track_recv("r", [10, 11])
    first = tracker.update(KVConnectorOutput(invalid_block_ids={11}))
    assert first.recompute_block_ids == {11} and tracker.statistics().receiving_tainted == 1
    second = tracker.update(KVConnectorOutput(finished_recving={"r"}))
    assert second.recvs_failed == {"r": (10, 11)} and not second.recvs_finished
    assert tracker.statistics().receiving_tainted == 0


def test_unknown_ids_are_reported_not_raised() -> None:
    update = RequestTracker().update(
        KVConnectorOutput(finished_sending={"s"}, finished_recving={"r"}, failed_recving={"f"})
    )
    assert update.unknown_sending == {"s"} and update.unknown_recving == {"r", "f"}
    assert not update.is_empty()


def test_one_id_may_be_a_send_and_a_receive() -> None:
    tracker = RequestTracker()
    tracker.track_send("both", [1])
    tracker.track_recv("both", [2])
    update = tracker.update(KVConnectorOutput(finished_sending={"both"}))
    assert update.sends_finished == {"both": (1,)} and tracker.receiving() == {"both": (2,)}


def test_tracking_again_with_other_blocks_is_refused() -> None:
    tracker = RequestTracker()
    tracker.track_recv("r", [1])
    tracker.track_recv("r", (1,))  # a repeat is a no-op
    with pytest.raises(ValueError, match="already tracked as a receive"):
        tracker.track_recv("r", [2])
    tracker.track_send("s", [1])
    with pytest.raises(ValueError, match="already tracked as a send"):
        tracker.track_send("s", [])


def test_update_does_not_mutate_the_report() -> None:
    tracker = RequestTracker()
    tracker.track_recv("r", [1])
    kv = KVConnectorOutput(finished_recving={"r"}, failed_recving={"r"}, invalid_block_ids={1})
    before = copy.deepcopy(kv)
    tracker.update(kv)
    assert kv == before


ids = st.sampled_from([f"r{i}" for i in range(8)])
blocks = st.lists(st.integers(0, 31), max_size=4, unique=True)


@settings(max_examples=200, deadline=None)
@given(
    sends=st.dictionaries(ids, blocks),
    recvs=st.dictionaries(ids, blocks),
    reports=st.lists(
        st.builds(
            KVConnectorOutput,
            finished_sending=st.none() | st.sets(ids),
            finished_recving=st.none() | st.sets(ids),
            failed_recving=st.none() | st.sets(ids),
            invalid_block_ids=st.sets(st.integers(0, 40)),
        ),
        max_size=5,
    ),
)
def test_every_tracked_id_leaves_exactly_once_in_exactly_one_outcome(
    sends: dict[str, list[int]], recvs: dict[str, list[int]], reports: list[KVConnectorOutput]
) -> None:
    tracker = RequestTracker()
    for req_id, b in sends.items():
        tracker.track_send(req_id, b)
    for req_id, b in recvs.items():
        tracker.track_recv(req_id, b)
    seen_sends: list[str] = []
    seen_recvs: list[str] = []
    invalid_so_far: set[int] = set()
    for kv in reports:
        invalid_so_far |= kv.invalid_block_ids
        update: SchedulerUpdate = tracker.update(kv)
        assert set(update.recvs_finished).isdisjoint(update.recvs_failed)
        assert update.recompute_block_ids >= kv.invalid_block_ids
        for failed_blocks in update.recvs_failed.values():
            assert set(failed_blocks) <= update.recompute_block_ids
        for req_id, kept in update.recvs_finished.items():
            assert req_id not in (kv.failed_recving or set())
            assert invalid_so_far.isdisjoint(kept)  # a runnable request has all its KV
            assert recvs[req_id] == list(kept)
        named_recv = (kv.finished_recving or set()) | (kv.failed_recving or set())
        assert set(update.recvs_finished) | set(update.recvs_failed) | update.unknown_recving == named_recv
        assert set(update.sends_finished) | update.unknown_sending == (kv.finished_sending or set())
        seen_sends += update.sends_finished
        seen_recvs += [*update.recvs_finished, *update.recvs_failed]
    assert len(seen_sends) == len(set(seen_sends)) and set(seen_sends) <= set(sends)
    assert len(seen_recvs) == len(set(seen_recvs)) and set(seen_recvs) <= set(recvs)
    assert set(tracker.sending()) == set(sends) - set(seen_sends)
    assert set(tracker.receiving()) == set(recvs) - set(seen_recvs)
