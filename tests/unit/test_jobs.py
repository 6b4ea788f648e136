"""Specification of kvsvc.core.jobs: the send and receive state tables, what a missing row does, terminal states
(docs/protocol.md §3: transitions are data)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.core.errors import LocalProtocolError
from kvsvc.core.jobs import (
    RECV_TABLE,
    RECV_TERMINAL,
    SEND_TABLE,
    SEND_TERMINAL,
    Effect,
    RecvEvent,
    RecvJob,
    RecvState,
    SendEvent,
    SendJob,
    SendState,
)

S, SE, R, RE, E = SendState, SendEvent, RecvState, RecvEvent, Effect


def send_job(state: SendState) -> SendJob:
    job = SendJob("t1", (0, 1), [1, 2], 8)
    job.state = state
    return job


def recv_job(state: RecvState) -> RecvJob:
    job = RecvJob("t1", (1, 0))
    job.state = state
    return job


SEND_ROWS = sorted(SEND_TABLE.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value))
RECV_ROWS = sorted(RECV_TABLE.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value))
SEND_MISSING = [(s, e) for s in SendState for e in SendEvent if (s, e) not in SEND_TABLE]
RECV_MISSING = [(s, e) for s in RecvState for e in RecvEvent if (s, e) not in RECV_TABLE]


def _id(row: object) -> str:
    key = row[0] if isinstance(row, tuple) and isinstance(row[0], tuple) else row
    assert isinstance(key, tuple)
    return f"{key[0].value}-{key[1].value}"


@pytest.mark.parametrize(("key", "outcome"), SEND_ROWS, ids=[_id(r) for r in SEND_ROWS])
def test_every_send_row_moves_the_job_to_its_next_state_and_returns_its_effects(
    key: tuple[SendState, SendEvent], outcome: tuple[SendState, tuple[Effect, ...]]
) -> None:
    job = send_job(key[0])
    assert job.handle(key[1], "why") == outcome[1]
    assert job.state is outcome[0]
    assert job.reason == ("why" if outcome[0] is not key[0] else "")


@pytest.mark.parametrize(("key", "outcome"), RECV_ROWS, ids=[_id(r) for r in RECV_ROWS])
def test_every_recv_row_moves_the_job_to_its_next_state_and_returns_its_effects(
    key: tuple[RecvState, RecvEvent], outcome: tuple[RecvState, tuple[Effect, ...]]
) -> None:
    job = recv_job(key[0])
    assert job.handle(key[1], "why") == outcome[1]
    assert job.state is outcome[0]
    assert job.reason == ("why" if outcome[0] is not key[0] else "")


# The protocol's key decisions, written out independently of the table so a change to one shows in the other.
SEND_SPEC = {
    (S.REQUESTED, SE.READY): (S.WRITING, (E.SUBMIT,)),
    (S.REQUESTED, SE.REQUEST): (S.REQUESTED, ()),
    (S.REQUESTED, SE.ABORT): (S.ABORTED, (E.REPLY_FAILED,)),
    (S.REQUESTED, SE.EXPIRE): (S.FAILED, (E.REPLY_FAILED,)),
    (S.WRITING, SE.WRITE_OK): (S.DONE, (E.REPLY_DONE,)),
    (S.WRITING, SE.WRITE_FAILED): (S.FAILED, (E.REPLY_FAILED,)),
    (S.WRITING, SE.READY): (S.WRITING, ()),
    (S.WRITING, SE.REQUEST): (S.WRITING, ()),
    (S.WRITING, SE.ABORT): (S.DRAINING, ()),
    (S.WRITING, SE.EXPIRE): (S.DRAINING, ()),
    (S.WRITING, SE.PEER_LOST): (S.DRAINING, ()),
    (S.DRAINING, SE.WRITE_OK): (S.ABORTED, (E.REPLY_FAILED,)),
    (S.DRAINING, SE.WRITE_FAILED): (S.ABORTED, (E.REPLY_FAILED,)),
    (S.DONE, SE.REQUEST): (S.DONE, (E.REPLY_DONE,)),
    (S.FAILED, SE.REQUEST): (S.FAILED, (E.REPLY_FAILED,)),
    (S.ABORTED, SE.REQUEST): (S.ABORTED, (E.REPLY_FAILED,)),
}
RECV_SPEC = {
    (R.PENDING, RE.CONNECTED): (R.REQUESTED, (E.SEND_REQUEST,)),
    (R.PENDING, RE.ABORT): (R.ABORTED, (E.SEND_ABORT,)),
    (R.PENDING, RE.EXPIRE): (R.FAILED, ()),
    (R.REQUESTED, RE.CONNECTED): (R.REQUESTED, ()),
    (R.REQUESTED, RE.DONE): (R.DONE, ()),
    (R.REQUESTED, RE.FAILED): (R.FAILED, ()),
    (R.REQUESTED, RE.EXPIRE): (R.ABORTING, (E.SEND_ABORT,)),
    (R.REQUESTED, RE.ABORT): (R.ABORTING, (E.SEND_ABORT,)),
    (R.REQUESTED, RE.PEER_LOST): (R.ABORTING, ()),
    (R.ABORTING, RE.DONE): (R.ABORTED, ()),
    (R.ABORTING, RE.FAILED): (R.ABORTED, ()),
    (R.ABORTING, RE.EXPIRE): (R.ABORTED, ()),
    (R.ABORTING, RE.RECONNECTED): (R.ABORTING, (E.SEND_ABORT,)),
}


def test_send_table_keeps_the_protocols_key_decisions() -> None:
    assert {k: SEND_TABLE[k] for k in SEND_SPEC} == SEND_SPEC


def test_recv_table_keeps_the_protocols_key_decisions() -> None:
    assert {k: RECV_TABLE[k] for k in RECV_SPEC} == RECV_SPEC


def test_a_write_result_is_meaningless_before_a_write_so_those_rows_are_missing() -> None:
    assert (S.REQUESTED, SE.WRITE_OK) in SEND_MISSING
    assert (S.REQUESTED, SE.WRITE_FAILED) in SEND_MISSING


@pytest.mark.parametrize(("state", "event"), SEND_MISSING, ids=[_id(k) for k in SEND_MISSING])
def test_a_send_event_missing_from_the_table_raises_naming_state_and_event(state: SendState, event: SendEvent) -> None:
    job = send_job(state)
    with pytest.raises(LocalProtocolError, match=rf"{event.value}.*{state.value}"):
        job.handle(event)
    assert job.state is state


@pytest.mark.parametrize(("state", "event"), RECV_MISSING, ids=[_id(k) for k in RECV_MISSING])
def test_a_recv_event_missing_from_the_table_raises_naming_state_and_event(state: RecvState, event: RecvEvent) -> None:
    job = recv_job(state)
    with pytest.raises(LocalProtocolError, match=rf"{event.value}.*{state.value}"):
        job.handle(event)
    assert job.state is state


@pytest.mark.parametrize("state", sorted(SEND_TERMINAL, key=lambda s: s.value), ids=lambda s: str(s.value))
def test_a_terminal_send_job_never_changes_state(state: SendState) -> None:
    for event in SendEvent:
        job = send_job(state)
        if (state, event) in SEND_TABLE:
            job.handle(event, "late")
        assert job.state is state
        assert job.terminal


@pytest.mark.parametrize("state", sorted(RECV_TERMINAL, key=lambda s: s.value), ids=lambda s: str(s.value))
def test_a_terminal_recv_job_never_changes_state_and_asks_for_nothing(state: RecvState) -> None:
    for event in RecvEvent:
        job = recv_job(state)
        assert job.handle(event, "late") == ()
        assert job.state is state


def test_only_a_repeated_request_to_a_finished_send_job_has_an_effect() -> None:
    for state in SEND_TERMINAL:
        for event in SendEvent:
            if (state, event) in SEND_TABLE and event is not SE.REQUEST:
                assert SEND_TABLE[(state, event)] == (state, ())


def test_the_reason_of_the_transition_that_ended_a_job_is_kept() -> None:
    job = send_job(S.REQUESTED)
    job.handle(SE.EXPIRE, "hold expired")
    job.handle(SE.REQUEST, "asked again")
    assert job.reason == "hold expired"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list(SendEvent)), max_size=30))
def test_random_send_event_sequences_never_leave_a_terminal_state(events: list[SendEvent]) -> None:
    job = SendJob("t", (0, 0), [0], 1)
    ended: SendState | None = None
    for event in events:
        before = job.state
        if (before, event) in SEND_TABLE:
            job.handle(event)
        else:
            with pytest.raises(LocalProtocolError):
                job.handle(event)
            assert job.state is before
        if ended is not None:
            assert job.state is ended
        elif job.terminal:
            ended = job.state


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list(RecvEvent)), max_size=30))
def test_random_recv_event_sequences_never_leave_a_terminal_state(events: list[RecvEvent]) -> None:
    job = RecvJob("t", (0, 0))
    ended: RecvState | None = None
    for event in events:
        before = job.state
        if (before, event) in RECV_TABLE:
            job.handle(event)
        else:
            with pytest.raises(LocalProtocolError):
                job.handle(event)
            assert job.state is before
        if ended is not None:
            assert job.state is ended
        elif job.terminal:
            ended = job.state
