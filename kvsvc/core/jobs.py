"""Sans-IO state machines of one transfer's jobs: a send job on P and a receive job on D, each keyed by
(transfer_id, peer worker).

Rules: transitions live in the two tables below, (state, event) -> (next state, effects); an event a table lacks
for a state is a `LocalProtocolError` naming both, never a silent pass. Repeats that the protocol allows (a
repeated request, a repeated done) are explicit rows whose effects are idempotent. Effects are names of commands
("submit", "reply_done", ...): the driver carries them out. Terminal states never change again. Pure module:
standard library only.

Every hold and receive also has a deadline. `Deadlines` keeps a table's deadlines (P's holds, D's receives) so that
the earliest one and the ones that passed are found without a pass over the table: the service asks for the next
deadline after every loop turn that changed something, and with thousands of requests in flight a pass over every
hold or receive each time cost more than handling the requests. The table stays the truth: an entry `(deadline,
key)` counts only while `current(key)` still returns that deadline (the key's entry exists, has not ended, and its
deadline was not moved since), so a table changes a deadline by pushing the new one (`set`) and drops one by doing
nothing. Stale entries are popped when they reach the top, and the heap is rebuilt from the table once it holds more
than twice the entries that were live at the last rebuild, plus `_SLACK`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Final, TypeVar

from kvsvc.core.errors import LocalProtocolError


class _Enum(Enum):
    """An enum whose members hash by identity (they are singletons, so equal means identical). `Enum`'s own hash
    calls Python code, and every request looks its jobs' (state, event) pairs up in the tables several times."""

    __hash__ = object.__hash__


class SendState(_Enum):
    UNASKED = "unasked"  # just made: the D worker has not asked (it asks, aborts first, or its connection broke)
    REQUESTED = "requested"  # D asked; waiting for the KV to be ready
    WRITING = "writing"  # descriptors submitted to the transport
    DRAINING = "draining"  # aborted while writing; waiting for the writes to stop touching memory
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


class SendEvent(_Enum):
    REQUEST = "request"  # D's transfer request (again)
    READY = "ready"  # the KV's completion future resolved
    WRITE_OK = "write_ok"
    WRITE_FAILED = "write_failed"
    ABORT = "abort"  # either side aborted
    EXPIRE = "expire"  # the hold deadline passed
    PEER_LOST = "peer_lost"  # the control connection to D broke


@dataclass(frozen=True, slots=True)
class Notice:
    """A command of either protocol object: log `text` at `level` ("debug" or "warning"), and count a protocol error
    when `protocol_error` (the peer broke the protocol). `from_peer`: the text is what a peer chose to say, logged
    at a bounded rate like protocol errors. The protocol decides what is worth saying; the driver says it."""

    text: str
    level: str = "warning"
    protocol_error: bool = False
    from_peer: bool = False


class Effect(_Enum):
    SUBMIT = "submit"  # plan and hand descriptors to the transport
    REPLY_DONE = "reply_done"  # P -> D TransferDone
    REPLY_FAILED = "reply_failed"  # P -> D TransferFailed
    SEND_REQUEST = "send_request"  # D -> P TransferRequest
    SEND_ABORT = "send_abort"  # D -> P Abort


S, SE, E = SendState, SendEvent, Effect

_send_rows: dict[tuple[SendState, SendEvent], tuple[SendState, tuple[Effect, ...]]] = {
    (S.UNASKED, SE.REQUEST): (S.REQUESTED, ()),
    # D gave up before it asked: nothing was written, and D hears so at once.
    (S.UNASKED, SE.ABORT): (S.ABORTED, (E.REPLY_FAILED,)),
    # The connection broke before D asked: its receive fails with it, so it will never ask.
    (S.UNASKED, SE.PEER_LOST): (S.FAILED, ()),
    (S.REQUESTED, SE.REQUEST): (S.REQUESTED, ()),
    (S.REQUESTED, SE.READY): (S.WRITING, (E.SUBMIT,)),
    (S.REQUESTED, SE.ABORT): (S.ABORTED, (E.REPLY_FAILED,)),
    (S.REQUESTED, SE.EXPIRE): (S.FAILED, (E.REPLY_FAILED,)),
    (S.REQUESTED, SE.PEER_LOST): (S.FAILED, ()),
    (S.WRITING, SE.REQUEST): (S.WRITING, ()),
    (S.WRITING, SE.READY): (S.WRITING, ()),
    (S.WRITING, SE.WRITE_OK): (S.DONE, (E.REPLY_DONE,)),
    (S.WRITING, SE.WRITE_FAILED): (S.FAILED, (E.REPLY_FAILED,)),
    (S.WRITING, SE.ABORT): (S.DRAINING, ()),
    # Expiry and a lost peer cannot cut a write short: the blocks stay held until it drained.
    (S.WRITING, SE.EXPIRE): (S.DRAINING, ()),
    (S.WRITING, SE.PEER_LOST): (S.DRAINING, ()),
    (S.DRAINING, SE.REQUEST): (S.DRAINING, ()),
    (S.DRAINING, SE.READY): (S.DRAINING, ()),
    (S.DRAINING, SE.ABORT): (S.DRAINING, ()),
    (S.DRAINING, SE.EXPIRE): (S.DRAINING, ()),
    (S.DRAINING, SE.PEER_LOST): (S.DRAINING, ()),
    (S.DRAINING, SE.WRITE_OK): (S.ABORTED, (E.REPLY_FAILED,)),
    (S.DRAINING, SE.WRITE_FAILED): (S.ABORTED, (E.REPLY_FAILED,)),
    # A repeated request after the outcome gets the outcome again: D may have missed it.
    (S.DONE, SE.REQUEST): (S.DONE, (E.REPLY_DONE,)),
    (S.FAILED, SE.REQUEST): (S.FAILED, (E.REPLY_FAILED,)),
    (S.ABORTED, SE.REQUEST): (S.ABORTED, (E.REPLY_FAILED,)),
    # A job that ended stays as it is, whatever else happens to its hold.
    **{
        (terminal, event): (terminal, ())
        for terminal in (S.DONE, S.FAILED, S.ABORTED)
        for event in (SE.READY, SE.ABORT, SE.EXPIRE, SE.PEER_LOST)
    },
}

SEND_TABLE: Final[Mapping[tuple[SendState, SendEvent], tuple[SendState, tuple[Effect, ...]]]] = MappingProxyType(
    _send_rows
)

SEND_TERMINAL: Final = frozenset({S.DONE, S.FAILED, S.ABORTED})


class RecvState(_Enum):
    PENDING = "pending"  # waiting for the control connection to the P worker
    REQUESTED = "requested"  # request sent; waiting for done or failed
    ABORTING = "aborting"  # abort sent; waiting for P to confirm its writes stopped
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


class RecvEvent(_Enum):
    CONNECTED = "connected"
    HANDSHAKE_FAILED = "handshake_failed"
    DONE = "done"
    FAILED = "failed"
    PEER_LOST = "peer_lost"
    EXPIRE = "expire"
    ABORT = "abort"
    GONE = "gone"  # the lost P worker's transfer engine is gone (its process died): nothing more can land
    RECONNECTED = "reconnected"  # a new connection reached the same start of the lost P worker


R, RE = RecvState, RecvEvent

_recv_rows: dict[tuple[RecvState, RecvEvent], tuple[RecvState, tuple[Effect, ...]]] = {
    (R.PENDING, RE.CONNECTED): (R.REQUESTED, (E.SEND_REQUEST,)),
    (R.PENDING, RE.HANDSHAKE_FAILED): (R.FAILED, ()),
    (R.PENDING, RE.PEER_LOST): (R.FAILED, ()),
    (R.PENDING, RE.EXPIRE): (R.FAILED, ()),
    # Not asked yet, so nothing can be written; the abort still reaches P once connected, to free its hold early.
    (R.PENDING, RE.ABORT): (R.ABORTED, (E.SEND_ABORT,)),
    (R.REQUESTED, RE.CONNECTED): (R.REQUESTED, ()),
    (R.REQUESTED, RE.DONE): (R.DONE, ()),
    (R.REQUESTED, RE.FAILED): (R.FAILED, ()),
    # P may still write into the blocks after the connection broke: they are held until the abort grace passed.
    (R.REQUESTED, RE.PEER_LOST): (R.ABORTING, ()),
    # P may still be writing (a frozen P resumes and lands queued descriptors): tell it to stop, and give the
    # blocks back only once it confirmed or the abort grace passed, as for an abort.
    (R.REQUESTED, RE.EXPIRE): (R.ABORTING, (E.SEND_ABORT,)),
    (R.REQUESTED, RE.ABORT): (R.ABORTING, (E.SEND_ABORT,)),
    (R.ABORTING, RE.CONNECTED): (R.ABORTING, ()),
    (R.ABORTING, RE.ABORT): (R.ABORTING, ()),
    (R.ABORTING, RE.DONE): (R.ABORTED, ()),
    (R.ABORTING, RE.FAILED): (R.ABORTED, ()),
    # The abort may not have reached P before the connection broke: keep waiting, bounded by the abort grace.
    (R.ABORTING, RE.PEER_LOST): (R.ABORTING, ()),
    (R.ABORTING, RE.EXPIRE): (R.ABORTED, ()),
    (R.ABORTING, RE.GONE): (R.ABORTED, ()),
    # The abort (or the request) may have died with the old connection: ask again. P answers once the job's write
    # ended, which ends the wait long before the abort grace (a fence; docs/decisions.md, "After a lost connection,
    # D's blocks wait for proof").
    (R.ABORTING, RE.RECONNECTED): (R.ABORTING, (E.SEND_ABORT,)),
    # A handshake can fail after a job was requested when a reconnect to a restarted peer is refused.
    (R.REQUESTED, RE.HANDSHAKE_FAILED): (R.ABORTING, ()),
    (R.ABORTING, RE.HANDSHAKE_FAILED): (R.ABORTED, ()),
    # A job that ended stays as it is.
    **{(terminal, event): (terminal, ()) for terminal in (R.DONE, R.FAILED, R.ABORTED) for event in RecvEvent},
}

RECV_TABLE: Final[Mapping[tuple[RecvState, RecvEvent], tuple[RecvState, tuple[Effect, ...]]]] = MappingProxyType(
    _recv_rows
)

RECV_TERMINAL: Final = frozenset({R.DONE, R.FAILED, R.ABORTED})


class SendJob:
    """P's job for one (transfer, D worker): from D's request to the outcome D is told."""

    __slots__ = (
        "block_ids",
        "dst",
        "ended_by",
        "first_token",
        "num_tokens",
        "reason",
        "state",
        "transfer_id",
        "window",
    )

    def __init__(
        self, transfer_id: str, dst: tuple[int, int], block_ids: list[int], num_tokens: int, first_token: int = 0
    ) -> None:
        self.transfer_id = transfer_id
        self.dst = dst
        self.block_ids = block_ids
        self.num_tokens = num_tokens
        self.first_token = first_token
        self.window = (0, 0, 0)  # D's window (address, bytes, share bytes); no bytes: write the blocks
        self.state = SendState.UNASKED
        self.reason = ""
        self.ended_by: SendEvent | None = None  # the event that turned the job away from landing, for D's counters

    @property
    def terminal(self) -> bool:
        return self.state in SEND_TERMINAL

    def handle(self, event: SendEvent, reason: str = "") -> tuple[Effect, ...]:
        """Apply `event`; return the effects the driver must carry out.

        Raises:
            LocalProtocolError: the table has no row for (state, event).
        """
        try:
            next_state, effects = SEND_TABLE[(self.state, event)]
        except KeyError:
            raise LocalProtocolError(
                f"send job {self.transfer_id!r} -> D{self.dst}: event {event.value} in state {self.state.value}"
            ) from None
        if reason and not self.reason and next_state is not self.state:
            self.reason = reason
        if self.ended_by is None and next_state in _AWAY_FROM_LANDING and self.state not in _AWAY_FROM_LANDING:
            self.ended_by = event
        self.state = next_state
        return effects


_AWAY_FROM_LANDING: Final = frozenset({S.DRAINING, S.FAILED, S.ABORTED})


class RecvJob:
    """D's job for one (transfer, P worker): from the request it sends to P's answer."""

    __slots__ = ("reason", "src", "state", "transfer_id")

    def __init__(self, transfer_id: str, src: tuple[int, int]) -> None:
        self.transfer_id = transfer_id
        self.src = src
        self.state = RecvState.PENDING
        self.reason = ""

    @property
    def terminal(self) -> bool:
        return self.state in RECV_TERMINAL

    def handle(self, event: RecvEvent, reason: str = "") -> tuple[Effect, ...]:
        """Apply `event`; return the effects the driver must carry out.

        Raises:
            LocalProtocolError: the table has no row for (state, event).
        """
        try:
            next_state, effects = RECV_TABLE[(self.state, event)]
        except KeyError:
            raise LocalProtocolError(
                f"recv job {self.transfer_id!r} <- P{self.src}: event {event.value} in state {self.state.value}"
            ) from None
        if reason and not self.reason and next_state is not self.state:
            self.reason = reason
        self.state = next_state
        return effects


_State = TypeVar("_State", bound=Enum)
_Event = TypeVar("_Event", bound=Enum)
_Effect = TypeVar("_Effect", bound=Enum)


def table_markdown(table: Mapping[tuple[_State, _Event], tuple[_State, tuple[_Effect, ...]]]) -> str:
    """A transition table as a markdown table, one row per (state, next state, effects) with its events: what
    docs/protocol.md shows (a test checks that it matches the tables here and in `kvsvc.core.windows`)."""
    grouped: dict[tuple[_State, _State, tuple[_Effect, ...]], list[_Event]] = {}
    for (state, event), (next_state, effects) in table.items():
        grouped.setdefault((state, next_state, effects), []).append(event)
    states = list(type(next(iter(table))[0]))
    rows = ["| state | events | next state | effects |", "|---|---|---|---|"]
    for (state, next_state, effects), events in sorted(grouped.items(), key=lambda kv: states.index(kv[0][0])):
        what = ", ".join(e.value for e in effects) or "—"
        rows.append(f"| {state.value} | {', '.join(e.value for e in events)} | {next_state.value} | {what} |")
    return "\n".join(rows)


# Stale entries tolerated before a rebuild, beyond twice the live ones: a small table never pays for rebuilds, and a
# large one pays one pass per as many pushes as it has entries.
_SLACK: Final = 1024


class Deadlines:
    """A lazy min-heap of `(deadline, key)` over a table whose live deadline of `key` is `current(key)` (None: it
    has none)."""

    def __init__(self, current: Callable[[str], float | None]) -> None:
        self._current = current
        self._heap: list[tuple[float, int, str]] = []
        self._seq = 0  # breaks ties, so keys are never compared
        self._live = 0  # live entries at the last rebuild

    def __len__(self) -> int:
        """Entries held, stale ones included (what the heap costs in memory)."""
        return len(self._heap)

    def set(self, key: str, deadline: float) -> None:
        """`key`'s deadline is now `deadline` (new, or moved either way)."""
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, key))
        if len(self._heap) > 2 * self._live + _SLACK:
            self._rebuild()

    def earliest(self) -> float | None:
        """The earliest live deadline, or None."""
        heap = self._heap
        while heap:
            deadline, _, key = heap[0]
            if self._current(key) == deadline:
                return deadline
            heapq.heappop(heap)
        return None

    def due(self, now: float) -> Iterator[str]:
        """The keys whose live deadline is at or before `now`, earliest first, each once. An entry leaves the heap
        once the caller has handled its key (ended it or moved its deadline, which makes the entry stale), so a
        caller that raises leaves that key and the rest due for the next call, as a pass over the table would."""
        heap = self._heap
        given: set[tuple[str, float]] = set()  # a key pushed twice with one deadline comes once
        while heap and heap[0][0] <= now:
            deadline, _, key = heap[0]
            if self._current(key) != deadline or (key, deadline) in given:
                heapq.heappop(heap)
                continue
            given.add((key, deadline))
            yield key

    def _rebuild(self) -> None:
        live: dict[str, float] = {}
        for _, _, key in self._heap:
            if key not in live:
                deadline = self._current(key)
                if deadline is not None:
                    live[key] = deadline
        self._heap = []
        for key, deadline in live.items():
            self._seq += 1
            self._heap.append((deadline, self._seq, key))
        heapq.heapify(self._heap)
        self._live = len(self._heap)
