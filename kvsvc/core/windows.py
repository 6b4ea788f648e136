"""The window-round protocol, both sides, as sans-IO state machines: D lends a window of its staging region for one
P worker's share, P fills it round by round (`FillingWindow`), D scatters each round into its blocks and empties it
(`LentWindow`, kept per D worker by `LentWindows`).

Rules: transitions live in the tables `FILL_TABLE` (P) and `SCATTER_TABLE` (D), (state, event) -> (next state,
effects), as in `kvsvc.core.jobs`; an event a table lacks is a `LocalProtocolError` naming both. A frame is classified
into an event against the window's round counters before the table is read (a repeat, a round out of order, a
done answer before the last round). D takes P's frames about a window one scatter at a time, in arrival order.
Neither side touches memory, a socket or a clock: each returns commands (`Scatter`, `TellP`, `Deliver`,
`Announce`, `Notice`) that its driver (the service, or `kvsvc.testing.pair.PeerPair`) carries out through the side's
protocol (`kvsvc.core.sender.PSide`, `kvsvc.core.receiver.DSide`), and feeds back how they ended (`scattered`,
`landed`). What every driver decides alike about windows is here too, so the service and the harness cannot drift
apart: which object a frame goes to (`p_frame`, `d_frame`), what a write in rounds does next (`round_step`, the one
place where it fails), whether P takes D's size of a share (`share_refusal`), and whether a request gets a window,
keeps its own or goes without (`lent_window`, `window_choice`). Round k is stream bytes `[k R, (k + 1) R)` in
half `k % 2` of the window (`kvsvc.core.staging_plans.window_round_bytes`); P writes round k once D emptied round k - 2,
so P fills one half while D empties the other. Pure module: standard library, numpy and kvsvc's pure core only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Literal, TypeAlias

from msgspec.structs import replace

from kvsvc.core.errors import LocalProtocolError
from kvsvc.core.jobs import Notice
from kvsvc.core.layout import Int64Array
from kvsvc.core.messages import (
    ErrorMessage,
    Message,
    TransferDone,
    TransferFailed,
    TransferRequest,
    WindowEmptied,
    WindowFilled,
    Worker,
    WorkerRef,
    answers_another_receive,
)
from kvsvc.core.staging_plans import WindowPlan, stream_round, window_round_bytes, window_rounds

if TYPE_CHECKING:  # both import this module for its commands
    from kvsvc.core.receiver import RecvReport
    from kvsvc.core.sender import Submit


def lends_windows(can_scatter: bool, num_kv_groups: int) -> bool:
    """Whether a D worker lends windows at all: it needs a staging region it can scatter from, and a model that
    publishes no KV cache groups (a hybrid model's groups each start at their own token, so P writes their blocks:
    decision 24). A D worker that lends none sends its requests as they are, P's frames going straight to its
    `Receiver`."""
    return can_scatter and num_kv_groups == 0


# -- D: a lent window --------------------------------------------------------------------------------------------


class ScatterState(Enum):
    FILLING = "filling"  # waiting for P's next round, or its answer
    SCATTERING = "scattering"  # a round's scatter runs; P's frames wait behind it
    SCATTERING_LAST = "scattering_last"  # the last round's scatter runs; P's done answer waits behind it
    ANSWERED = "answered"  # P's answer went on to the Receiver; only late frames are left


class ScatterEvent(Enum):
    ROUND = "round"  # P filled the next round
    ROUND_UNWANTED = "round_unwanted"  # the next round, after a scatter failed or once the receive is ending
    ROUND_AGAIN = "round_again"  # a round already emptied (a repeat: P may have missed D's answer)
    ROUND_OUT_OF_ORDER = "round_out_of_order"  # a round ahead of the next one, or the last one announced
    DONE = "done"  # P's done answer, after every round but the last was announced
    DONE_UNWANTED = "done_unwanted"  # the same, after a scatter failed or once the receive is ending
    DONE_EARLY = "done_early"  # P's done answer before every round was announced
    FAILED = "failed"  # P's failed answer, or an error frame about the transfer
    SCATTERED = "scattered"  # the driver's scatter copied its round
    SCATTER_FAILED = "scatter_failed"


class ScatterEffect(Enum):
    SCATTER = "scatter"  # copy the round's half of the window into the blocks
    EMPTY = "empty"  # the next round is done with: tell P its half is free (`WindowEmptied`), if P writes it again
    EMPTY_AGAIN = "empty_again"  # tell P again that a round it repeated is emptied (the same if)
    DELIVER = "deliver"  # hand P's answer on to the `Receiver`
    DELIVER_FAILED = "deliver_failed"  # hand the `Receiver` a failure in the answer's place, saying why
    PROTOCOL_ERROR = "protocol_error"  # log it and count it; the frame is dropped
    LATE = "late"  # log a frame for an answered window at debug level; it is dropped


SS, SV, SF = ScatterState, ScatterEvent, ScatterEffect
_LATE_ROUNDS = (SV.ROUND, SV.ROUND_UNWANTED, SV.ROUND_AGAIN, SV.ROUND_OUT_OF_ORDER)

_scatter_rows: dict[tuple[ScatterState, ScatterEvent], tuple[ScatterState, tuple[ScatterEffect, ...]]] = {
    (SS.FILLING, SV.ROUND): (SS.SCATTERING, (SF.SCATTER,)),
    # Nothing will read the blocks (a scatter failed, the receive is ending): let P's write reach its end quickly.
    (SS.FILLING, SV.ROUND_UNWANTED): (SS.FILLING, (SF.EMPTY,)),
    (SS.FILLING, SV.ROUND_AGAIN): (SS.FILLING, (SF.EMPTY_AGAIN,)),
    # The receive's own deadline ends a window whose rounds went astray.
    (SS.FILLING, SV.ROUND_OUT_OF_ORDER): (SS.FILLING, (SF.PROTOCOL_ERROR,)),
    (SS.FILLING, SV.DONE): (SS.SCATTERING_LAST, (SF.SCATTER,)),
    (SS.FILLING, SV.DONE_UNWANTED): (SS.ANSWERED, (SF.DELIVER_FAILED,)),
    (SS.FILLING, SV.DONE_EARLY): (SS.ANSWERED, (SF.DELIVER_FAILED,)),
    (SS.FILLING, SV.FAILED): (SS.ANSWERED, (SF.DELIVER,)),
    (SS.SCATTERING, SV.SCATTERED): (SS.FILLING, (SF.EMPTY,)),
    # P still gets its half back, so its write ends; the answer becomes a failure (`DONE_UNWANTED`).
    (SS.SCATTERING, SV.SCATTER_FAILED): (SS.FILLING, (SF.EMPTY,)),
    (SS.SCATTERING_LAST, SV.SCATTERED): (SS.ANSWERED, (SF.DELIVER,)),
    (SS.SCATTERING_LAST, SV.SCATTER_FAILED): (SS.ANSWERED, (SF.DELIVER_FAILED,)),
    **{(SS.ANSWERED, event): (SS.ANSWERED, (SF.LATE,)) for event in _LATE_ROUNDS},
    # A repeated answer goes on: the `Receiver` treats repeats as no-ops.
    **{
        (SS.ANSWERED, event): (SS.ANSWERED, (SF.DELIVER,))
        for event in (SV.DONE, SV.DONE_UNWANTED, SV.DONE_EARLY, SV.FAILED)
    },
}

SCATTER_TABLE: Final[Mapping[tuple[ScatterState, ScatterEvent], tuple[ScatterState, tuple[ScatterEffect, ...]]]] = (
    MappingProxyType(_scatter_rows)
)


@dataclass(frozen=True, slots=True)
class Scatter:
    """Copy `length[i]` bytes from window address `src[i]` to block address `dst[i]`, for every i (round `round`),
    then call `LentWindows.scattered` with the outcome."""

    round: int
    src: Int64Array
    dst: Int64Array
    length: Int64Array


@dataclass(frozen=True, slots=True)
class TellP:
    """Send `message` to the window's P worker on its control connection (dropped if there is none)."""

    message: WindowEmptied


@dataclass(frozen=True, slots=True)
class Deliver:
    """Hand P's answer `message` to the `Receiver` (`Receiver.receive`); `scattered` when a window's last round was
    scattered into the blocks before it."""

    message: Message
    scattered: bool = False


WindowCommand: TypeAlias = Scatter | TellP | Deliver | Notice
WindowKey: TypeAlias = tuple[str, str, Worker]
"""(transfer_id, P engine id, P worker): one window per receive from one P worker."""


@dataclass(slots=True)
class LentWindow:
    """A window D lent at `addr` for one P worker's share (`plan`), and where its rounds stand (module docstring).

    `req_id` and `block_ids` are the receive's: a failed receive whose scatter still runs is reported only after it.
    """

    transfer_id: str
    src: Worker
    req_id: str
    block_ids: list[int]
    addr: int
    plan: WindowPlan
    state: ScatterState = ScatterState.FILLING
    next_round: int = 0  # the round P fills next
    unwanted: str = ""  # why the rest is not scattered: rounds are only emptied, and the answer becomes a failure
    answer: TransferDone | None = None  # P's done answer, held while the last round is scattered
    queue: deque[WindowFilled | TransferDone | TransferFailed | ErrorMessage] = field(default_factory=deque)
    receive_name: str = ""  # the receive it was lent for (`TransferRequest.receive`): another's answers are not its

    @property
    def round_bytes(self) -> int:
        return window_round_bytes(self.plan.nbytes, self.plan.window_bytes)

    @property
    def rounds(self) -> int:
        return window_rounds(self.plan.nbytes, self.plan.window_bytes)

    @property
    def scattering(self) -> bool:
        """Whether a scatter reads the window now (it must not be given back)."""
        return self.state in (ScatterState.SCATTERING, ScatterState.SCATTERING_LAST)

    def receive(self, message: WindowFilled | TransferDone | TransferFailed | ErrorMessage) -> list[WindowCommand]:
        """P's frame about this window: handled now, or after the scatter that runs (in arrival order)."""
        self.queue.append(message)
        return self._pump()

    def scattered(self, error: str | None) -> list[WindowCommand]:
        """The driver's scatter ended (`error` None: every byte copied); the frames waiting behind it go on.

        Raises:
            LocalProtocolError: no scatter was running (a driver bug).
        """
        if error is not None:
            self.end(f"scatter of D's window into its blocks failed: {error}")
        commands = self._apply(ScatterEvent.SCATTERED if error is None else ScatterEvent.SCATTER_FAILED, None)
        return commands + self._pump()

    def end(self, reason: str) -> None:
        """The receive is ending (aborted, expired, a scatter failed): later rounds are emptied unscattered and P's
        done answer becomes a failure with `reason` (the first reason given stays)."""
        self.unwanted = self.unwanted or reason

    def _pump(self) -> list[WindowCommand]:
        commands: list[WindowCommand] = []
        while self.queue and not self.scattering:
            message = self.queue.popleft()
            commands += self._apply(self._classify(message), message)
        return commands

    def _classify(self, message: WindowFilled | TransferDone | TransferFailed | ErrorMessage) -> ScatterEvent:
        last = self.rounds - 1
        if isinstance(message, WindowFilled):
            if message.round < self.next_round:
                return ScatterEvent.ROUND_AGAIN
            if message.round != self.next_round or message.round >= last:
                return ScatterEvent.ROUND_OUT_OF_ORDER
            return ScatterEvent.ROUND_UNWANTED if self.unwanted else ScatterEvent.ROUND
        if isinstance(message, TransferDone):
            if self.next_round != last:
                return ScatterEvent.DONE_EARLY
            return ScatterEvent.DONE_UNWANTED if self.unwanted else ScatterEvent.DONE
        return ScatterEvent.FAILED

    def _apply(
        self, event: ScatterEvent, message: WindowFilled | TransferDone | TransferFailed | ErrorMessage | None
    ) -> list[WindowCommand]:
        try:
            next_state, effects = SCATTER_TABLE[(self.state, event)]
        except KeyError:
            raise LocalProtocolError(
                f"window of {self.transfer_id!r} from P{self.src}: event {event.value} in state {self.state.value}"
            ) from None
        # The round an effect is about: the frame's own, else the one in turn (a scatter that ended, the last one).
        index = message.round if isinstance(message, WindowFilled) else self.next_round
        self.state = next_state
        if isinstance(message, TransferDone) and next_state is ScatterState.SCATTERING_LAST:
            self.answer = message
        commands: list[WindowCommand] = []
        for effect in effects:
            if effect is SF.SCATTER:
                commands.append(self._scatter(index))
            elif effect is SF.EMPTY:
                self.next_round += 1
                commands += self._tell_emptied(index)
            elif effect is SF.EMPTY_AGAIN:
                commands += self._tell_emptied(index)
            elif effect is SF.DELIVER:  # P's answer; with no frame, the one held while the last round scattered
                answer = message if message is not None else self.answer
                assert answer is not None
                commands.append(Deliver(answer, scattered=message is None))
            elif effect is SF.DELIVER_FAILED:
                cause = "protocol" if event is ScatterEvent.DONE_EARLY else ""  # else the receive's own cause stands
                failed = TransferFailed(transfer_id=self.transfer_id, reason=self._why(event), cause=cause)
                commands.append(Deliver(failed))
            elif effect is SF.PROTOCOL_ERROR:
                what = f"P{self.src} filled round {index} of {self.transfer_id!r}'s window, "
                commands.append(Notice(what + f"expected {self.next_round} of {self.rounds}", protocol_error=True))
            elif effect is SF.LATE:
                commands.append(Notice(f"late round {index} of {self.transfer_id!r} from P{self.src}", "debug"))
        return commands

    def _tell_emptied(self, index: int) -> list[WindowCommand]:
        """`WindowEmptied(index)` for P, when P writes that half again (round index + 2 exists); P's last two rounds
        free halves nobody waits for."""
        if index + 2 >= self.rounds:
            return []
        return [TellP(WindowEmptied(transfer_id=self.transfer_id, round=index))]

    def _why(self, event: ScatterEvent) -> str:
        if event is ScatterEvent.DONE_EARLY:
            return f"P answered done after {self.next_round} of {self.rounds} rounds of its window"
        return self.unwanted or "the receive ended before its window was scattered"

    def _scatter(self, index: int) -> Scatter:
        plan, size = self.plan, self.round_bytes
        dst, offset, length = stream_round(plan.offset, plan.dst, plan.length, index, size)
        return Scatter(index, self.addr + (index % 2) * size + offset, dst, length)


class LentWindows:
    """The windows one D worker lent, keyed (transfer, P engine, P worker): every frame P sends goes through
    `receive` first, so a frame about a window is never mistaken for one about the job (module docstring)."""

    def __init__(self) -> None:
        self._windows: dict[WindowKey, LentWindow] = {}
        self._deferred: dict[str, tuple[str, str, list[int]]] = {}  # held-back failures: req_id -> (why, cause, blocks)

    @property
    def busy(self) -> bool:
        """Whether a window is lent or a failed receive held back (else `tidy` and `hold_back` have nothing to do)."""
        return bool(self._windows or self._deferred)

    def __len__(self) -> int:
        return len(self._windows)

    def __contains__(self, key: WindowKey) -> bool:
        return key in self._windows

    def __iter__(self) -> Iterator[LentWindow]:
        return iter(list(self._windows.values()))

    def get(self, key: WindowKey) -> LentWindow | None:
        return self._windows.get(key)

    def lend(
        self, key: WindowKey, req_id: str, block_ids: list[int], addr: int, plan: WindowPlan, receive: str = ""
    ) -> LentWindow:
        """Record the window lent at `addr` for `plan`, the share of P worker `key[2]` in receive `req_id` (named
        `receive` on the wire).

        Raises:
            LocalProtocolError: a window is lent for `key` already (the driver must give it back first).
        """
        if key in self._windows:
            raise LocalProtocolError(f"a window is lent already for {key[0]!r} from P{key[2]} of {key[1]!r}")
        window = self._windows[key] = LentWindow(key[0], key[2], req_id, block_ids, addr, plan, receive_name=receive)
        return window

    def receive(self, engine_id: str, src: Worker, message: Message) -> list[WindowCommand]:
        """A frame from P worker `src` of `engine_id`: its window's commands when it is about a lent window; else
        delivered to the `Receiver` as it is (which drops a late `WindowFilled` and answers what it does not
        expect). An answer naming another receive than the window's is dropped: an ended receive's, late."""
        if isinstance(message, WindowFilled | TransferDone | TransferFailed | ErrorMessage):
            window = self._windows.get((message.transfer_id, engine_id, src))
            if window is not None:
                if isinstance(message, TransferDone | TransferFailed) and answers_another_receive(
                    message, window.receive_name
                ):
                    return [Notice(f"answer for another receive of {message.transfer_id!r} from P{src}", "debug")]
                return window.receive(message)
        return [Deliver(message)]

    def scattered(self, key: WindowKey, error: str | None) -> list[WindowCommand]:
        """The scatter of `key`'s window ended (see `LentWindow.scattered`).

        Raises:
            LocalProtocolError: no window is lent for `key`, or it was not scattering.
        """
        window = self._windows.get(key)
        if window is None:
            raise LocalProtocolError(f"a scatter ended for {key[0]!r} from P{key[2]}, which has no window")
        return window.scattered(error)

    def tidy(self, waits_on: Callable[[WindowKey], bool], ending: Callable[[str], bool]) -> list[int]:
        """Mark the windows whose receive is ending (`ending(transfer_id)`), and give back those whose receive from
        their P worker ended (`waits_on(key)` false) and that no scatter reads; returns the addresses given back."""
        freed: list[int] = []
        for key, window in list(self._windows.items()):
            if ending(key[0]):
                window.end("the receive ended before its window was scattered")
            if not window.scattering and not waits_on(key):
                del self._windows[key]
                freed.append(window.addr)
        return freed

    def hold_back(self, report: RecvReport) -> RecvReport:
        """`report` (a `Receiver.take_report`) less the failed receives that a scatter still copies into, plus those
        held back earlier whose scatter ended: a receive's blocks go back to the engine only once nothing writes
        them. Changes and returns `report`."""
        busy = {w.req_id: w.block_ids for w in self._windows.values() if w.scattering}
        for req_id in report.failed & busy.keys():
            cause = report.causes.pop(req_id, "transport")
            self._deferred[req_id] = (report.reasons.pop(req_id, ""), cause, busy[req_id])
            report.failed.discard(req_id)
            report.invalid_block_ids.difference_update(busy[req_id])
        for req_id in [r for r in self._deferred if r not in busy]:
            reason, cause, block_ids = self._deferred.pop(req_id)
            report.failed.add(req_id)
            report.reasons[req_id] = reason
            report.causes[req_id] = cause
            report.invalid_block_ids.update(block_ids)
        return report


# -- P: filling a window ------------------------------------------------------------------------------------------


class FillState(Enum):
    FILLING = "filling"  # the next round may be written, or is on the wire
    WAITING = "waiting"  # the next round's half still holds a round D has not emptied
    FILLED = "filled"  # every round landed: the write has ended (P's job answers done)
    FAILED = "failed"  # the connection closed, the wait passed its deadline, or the job stopped wanting it


class FillEvent(Enum):
    LANDED = "landed"  # the round on the wire landed, and the next one's half is free
    LANDED_WAIT = "landed_wait"  # it landed, and the next one's half is not emptied yet
    LANDED_LAST = "landed_last"  # the last round landed
    EMPTIED_AWAITED = "emptied_awaited"  # D emptied the half the waiting round needs
    EMPTIED = "emptied"  # D emptied an announced round, not the one a round waits for
    EMPTIED_AGAIN = "emptied_again"  # a repeat
    EMPTIED_UNANNOUNCED = "emptied_unannounced"  # a round P never announced: D broke the protocol
    PEER_LOST = "peer_lost"  # the control connection to D closed
    EXPIRE = "expire"  # the wait for a half passed its deadline
    STOP = "stop"  # the job no longer wants the write (aborted, expired): stop at the next round


class FillEffect(Enum):
    ANNOUNCE = "announce"  # tell D the round landed (`WindowFilled`)
    FAIL = "fail"  # the write fails now, with the reason
    PROTOCOL_ERROR = "protocol_error"


FS, FV, FE = FillState, FillEvent, FillEffect
_EMPTIES = (FV.EMPTIED, FV.EMPTIED_AGAIN, FV.EMPTIED_AWAITED)

_fill_rows: dict[tuple[FillState, FillEvent], tuple[FillState, tuple[FillEffect, ...]]] = {
    (FS.FILLING, FV.LANDED): (FS.FILLING, (FE.ANNOUNCE,)),
    (FS.FILLING, FV.LANDED_WAIT): (FS.WAITING, (FE.ANNOUNCE,)),
    (FS.FILLING, FV.LANDED_LAST): (FS.FILLED, ()),
    (FS.FILLING, FV.EMPTIED): (FS.FILLING, ()),
    (FS.FILLING, FV.EMPTIED_AWAITED): (FS.FILLING, ()),
    (FS.FILLING, FV.EMPTIED_AGAIN): (FS.FILLING, ()),
    (FS.FILLING, FV.EMPTIED_UNANNOUNCED): (FS.FILLING, (FE.PROTOCOL_ERROR,)),
    # A round on the wire still lands or fails: the write fails once it ended (`landed`).
    (FS.FILLING, FV.PEER_LOST): (FS.FAILED, ()),
    (FS.FILLING, FV.STOP): (FS.FAILED, ()),
    (FS.WAITING, FV.EMPTIED_AWAITED): (FS.FILLING, ()),
    (FS.WAITING, FV.EMPTIED): (FS.WAITING, ()),
    (FS.WAITING, FV.EMPTIED_AGAIN): (FS.WAITING, ()),
    (FS.WAITING, FV.EMPTIED_UNANNOUNCED): (FS.WAITING, (FE.PROTOCOL_ERROR,)),
    (FS.WAITING, FV.PEER_LOST): (FS.FAILED, (FE.FAIL,)),
    (FS.WAITING, FV.EXPIRE): (FS.FAILED, (FE.FAIL,)),
    (FS.WAITING, FV.STOP): (FS.FAILED, (FE.FAIL,)),
    # The round that was on the wire when the write failed has ended: now the write can fail.
    **{(FS.FAILED, event): (FS.FAILED, (FE.FAIL,)) for event in (FV.LANDED, FV.LANDED_WAIT, FV.LANDED_LAST)},
    **{
        (state, event): (state, ())
        for state in (FS.FILLED, FS.FAILED)
        for event in (*_EMPTIES, FV.EMPTIED_UNANNOUNCED, FV.PEER_LOST, FV.EXPIRE, FV.STOP)
    },
}

FILL_TABLE: Final[Mapping[tuple[FillState, FillEvent], tuple[FillState, tuple[FillEffect, ...]]]] = MappingProxyType(
    _fill_rows
)


@dataclass(frozen=True, slots=True)
class Announce:
    """Send `message` to D worker `dst`, whose window this is (a round landed)."""

    dst: WorkerRef
    message: WindowFilled


@dataclass(frozen=True, slots=True)
class Fail:
    """The write in rounds failed with `reason`, once no round of it is on the wire; `cause` says whose doing it was
    (`PEER_LOST`: the connection; `EXPIRE`: D emptied no half in time; `STOP`: P's job no longer wanted it)."""

    reason: str
    cause: FillEvent


FillCommand: TypeAlias = Announce | Fail | Notice


class FillingWindow:
    """P's write of one share into D's window in rounds (module docstring): which round goes next, when it may go,
    and the frames that announce it. The stream is P's share as `(source, stream offset, length)` columns
    (`kvsvc.core.staging_plans.window_plan` at window address 0); `round_pieces` cuts it to one round at its place in
    the window.

    The driver writes `next_round` while `state` is FILLING, calls `landed` once it landed, waits while WAITING (until
    `deadline`, then `expire`), and stops on FILLED (done) or FAILED (`reason`).

    Raises (constructor):
        ValueError: an empty share, or a window too small for any round (`window_round_bytes`).
    """

    __slots__ = (
        "cause",
        "deadline",
        "dst",
        "emptied_rounds",
        "next_round",
        "reason",
        "round_bytes",
        "rounds",
        "state",
        "stream",
        "timeout_s",
        "transfer_id",
        "window_addr",
    )

    def __init__(
        self,
        transfer_id: str,
        stream: tuple[Int64Array, Int64Array, Int64Array],
        window_addr: int,
        window_bytes: int,
        timeout_s: float,
        *,
        dst: WorkerRef,
    ) -> None:
        self.transfer_id = transfer_id
        self.dst = dst
        self.stream = stream
        share = int(stream[2].sum())
        self.round_bytes = window_round_bytes(share, window_bytes)
        self.rounds = window_rounds(share, window_bytes)
        self.window_addr = window_addr
        self.timeout_s = timeout_s
        self.state = FillState.FILLING
        self.next_round = 0
        self.emptied_rounds: set[int] = set()
        self.deadline: float | None = None  # while WAITING: when the wait fails
        self.reason = ""  # why it failed, and the event that failed it
        self.cause: FillEvent | None = None

    def round_pieces(self, index: int) -> tuple[Int64Array, Int64Array, Int64Array]:
        """Round `index`'s pieces as (source, window address, length) columns: its part of the stream, written at
        its half of the window."""
        src, offset, length = self.stream
        r_src, r_offset, r_length = stream_round(offset, src, length, index, self.round_bytes)
        return r_src, self.window_addr + (index % 2) * self.round_bytes + r_offset, r_length

    def landed(self, now: float) -> list[FillCommand]:
        """Round `next_round` landed in D's window."""
        index = self.next_round
        if index == self.rounds - 1:
            event = FillEvent.LANDED_LAST
        else:
            event = FillEvent.LANDED if self._free(index + 1) else FillEvent.LANDED_WAIT
        commands = self._apply(event, f"{self.transfer_id!r}'s write ended after round {index}")
        if self.state is not FillState.FAILED:
            self.next_round = index + 1
        if self.state is FillState.WAITING:
            self.deadline = now + self.timeout_s
        return commands

    def emptied(self, index: int) -> list[FillCommand]:
        """D emptied round `index` (`WindowEmptied`)."""
        if index in self.emptied_rounds:
            event = FillEvent.EMPTIED_AGAIN
        elif index >= self.next_round or index < 0:
            event = FillEvent.EMPTIED_UNANNOUNCED
        else:
            self.emptied_rounds.add(index)
            event = FillEvent.EMPTIED_AWAITED if self._free(self.next_round) else FillEvent.EMPTIED
        commands = self._apply(event, "", index)
        if self.state is not FillState.WAITING:
            self.deadline = None
        return commands

    def peer_lost(self, reason: str) -> list[FillCommand]:
        """The control connection to D closed: D will not empty a round any more."""
        return self._apply(FillEvent.PEER_LOST, reason)

    def stop(self, reason: str) -> list[FillCommand]:
        """The job no longer wants the write: no further round starts."""
        return self._apply(FillEvent.STOP, reason)

    def expire(self, now: float) -> list[FillCommand]:
        """Fail the wait for a half if its deadline passed."""
        if self.deadline is None or now < self.deadline:
            return []
        why = f"D emptied no round {self.next_round - 2} of {self.transfer_id!r}'s window within {self.timeout_s:g} s"
        return self._apply(FillEvent.EXPIRE, why)

    def _free(self, index: int) -> bool:
        """Whether round `index`'s half of the window is free: its first use, or D emptied round index - 2."""
        return index < 2 or index - 2 in self.emptied_rounds

    def _apply(self, event: FillEvent, reason: str, index: int | None = None) -> list[FillCommand]:
        try:
            next_state, effects = FILL_TABLE[(self.state, event)]
        except KeyError:
            raise LocalProtocolError(
                f"filling {self.transfer_id!r}'s window: event {event.value} in state {self.state.value}"
            ) from None
        if next_state is FillState.FAILED and self.cause is None:
            self.reason, self.cause = reason, event
        self.state = next_state
        commands: list[FillCommand] = []
        for effect in effects:
            if effect is FE.ANNOUNCE:
                commands.append(Announce(self.dst, WindowFilled(transfer_id=self.transfer_id, round=self.next_round)))
            elif effect is FE.FAIL:
                assert self.cause is not None
                commands.append(Fail(self.reason, self.cause))
            elif effect is FE.PROTOCOL_ERROR:
                what = f"D emptied round {index} of {self.transfer_id!r}'s window, which P has not announced"
                commands.append(Notice(what, protocol_error=True))
        return commands


# -- P: frames from D, and the write in rounds -------------------------------------------------------------------


def p_frame(message: Message, fills: Mapping[str, FillingWindow], d: str) -> list[FillCommand] | None:
    """A frame from D worker `d` at P: the commands of the write in rounds it is about (`WindowEmptied`, as
    `round_emptied`); None when it is the `Sender`'s (any other frame): round frames pass beside the job tables."""
    return round_emptied(message, fills, d) if isinstance(message, WindowEmptied) else None


def round_emptied(message: WindowEmptied, fills: Mapping[str, FillingWindow], d: str) -> list[FillCommand]:
    """D worker `d` emptied a round of a window at P: the commands of the write in rounds filling it, or a debug
    notice when no write of that transfer fills a window (a late frame)."""
    fill = fills.get(message.transfer_id)
    if fill is None:
        return [Notice(f"late WindowEmptied({message.round}) for {message.transfer_id!r} from {d}", "debug")]
    return fill.emptied(message.round)


def share_refusal(command: Submit, nbytes: int) -> str | None:
    """Why P refuses to write `command` into D's window when its own plan of the share comes to `nbytes` (D planned
    another size: the rounds and D's scatter would not match what lands), or None. D's `share_bytes` is D's claim."""
    share = command.share_bytes or command.window_bytes
    if nbytes == share:
        return None
    return (
        f"D planned a share of {share} bytes for {command.transfer_id!r} (window of {command.window_bytes}); "
        f"this P worker writes it {nbytes}"
    )


@dataclass(frozen=True, slots=True)
class WriteRound:
    """Write round `index`: `length[i]` bytes from `src[i]` to window address `dst[i]`; then call `landed`."""

    index: int
    src: Int64Array
    dst: Int64Array
    length: Int64Array


@dataclass(frozen=True, slots=True)
class AwaitHalf:
    """Wait until D empties the half the next round needs, or `deadline` (then call `FillingWindow.expire`)."""

    deadline: float


@dataclass(frozen=True, slots=True)
class RoundsFilled:
    """Every round landed: the write succeeded."""


RoundStep: TypeAlias = WriteRound | AwaitHalf | RoundsFilled | Fail
"""What the driver of a write in rounds does next; a `Fail` ends the write with its reason and cause."""


def round_step(fill: FillingWindow, wanted: Callable[[], bool]) -> RoundStep:
    """What P's write in rounds does next, asked whenever no round of it is on the wire. `wanted` says whether the
    job still wants the write (`Sender.writing`): a write it no longer wants stops here, at a round's start, once
    earlier rounds landed. The `Fail` commands `FillingWindow` returns need no carrying out of their own: the state
    they leave ends the write here (`carry_out_p` drops them)."""
    if fill.state is FillState.FILLING and fill.next_round and not wanted():
        fill.stop(f"{fill.transfer_id!r} aborted after {fill.next_round} of {fill.rounds} rounds of D's window")
    if fill.state is FillState.FILLED:
        return RoundsFilled()
    if fill.state is FillState.FAILED:
        assert fill.cause is not None
        return Fail(fill.reason, fill.cause)
    if fill.state is FillState.WAITING:
        assert fill.deadline is not None
        return AwaitHalf(fill.deadline)
    return WriteRound(fill.next_round, *fill.round_pieces(fill.next_round))


# -- D: frames from P, and the windows ----------------------------------------------------------------------------


def d_frame(
    windows: LentWindows, engine_id: str, src: Worker, message: Message
) -> tuple[WindowKey, list[WindowCommand]]:
    """A frame from P worker `src` of `engine_id` at D: the window protocol takes it first (`LentWindows.receive`);
    returns the window it is about and the commands."""
    key = (getattr(message, "transfer_id", ""), engine_id, src)
    return key, windows.receive(engine_id, src, message)


def lent_window(
    windows: LentWindows, key: WindowKey, req_id: str | None, waiting: str | None = None
) -> LentWindow | Literal["lend", "hold"] | None:
    """Whether D's `TransferRequest` for `key` goes with the window lent for it (a repeat), asks for a new one
    ("lend": plan it, and lend it if the rule picks one and there is room), is held back ("hold": a repeat while the
    request of the same receive, `waiting`, waits for room: that one goes out), or goes without (None: the receive
    ended, or an earlier receive of the same transfer id still holds the window). A wait for room of another receive
    (`waiting` not `req_id`) is the driver's to cancel unless this says "hold"."""
    if waiting is not None and waiting == req_id:
        return "hold"
    window = windows.get(key)
    if window is None:
        return "lend" if req_id is not None else None
    return window if window.req_id == req_id else None


@dataclass(frozen=True, slots=True)
class LendAt:
    """Lend the window at `addr` of D's staging region (room was found for it)."""

    addr: int


@dataclass(frozen=True, slots=True)
class WaitForRoom:
    """Hold the request back up to `wait_s` for room, then send it with the window or without one."""

    wait_s: float


@dataclass(frozen=True, slots=True)
class GoWithout:
    """Send the request without a window: P writes D's blocks (directly, or gathered in its own region)."""

    reason: str


WindowChoice: TypeAlias = LendAt | WaitForRoom | GoWithout


def window_choice(planned: bool, addr: int | None, wait_s: float) -> WindowChoice:
    """Once `lent_window` said "lend": whether the request gets its window now, waits for room, or goes without.
    `planned`: the staging rule sends P's share through a window (`plan_window` returned a plan); `addr`: the room
    the region had for it at once (None: none); `wait_s`: `window_wait_s`."""
    if not planned:
        return GoWithout("the staging rule writes this share into D's blocks")
    if addr is not None:
        return LendAt(addr)
    if wait_s > 0:
        return WaitForRoom(wait_s)
    return GoWithout("no room in D's staging region, and window_wait_s is 0")


def with_window(request: TransferRequest, window: LentWindow) -> TransferRequest:
    """`request` carrying `window`: where P writes its share, the window's size and the share's."""
    return replace(
        request, window_addr=window.addr, window_bytes=window.plan.window_bytes, share_bytes=window.plan.nbytes
    )


__all__ = [
    "FILL_TABLE",
    "SCATTER_TABLE",
    "Announce",
    "AwaitHalf",
    "Deliver",
    "Fail",
    "FillCommand",
    "FillEffect",
    "FillEvent",
    "FillState",
    "FillingWindow",
    "GoWithout",
    "LendAt",
    "LentWindow",
    "LentWindows",
    "RoundStep",
    "RoundsFilled",
    "Scatter",
    "ScatterEffect",
    "ScatterEvent",
    "ScatterState",
    "TellP",
    "WaitForRoom",
    "WindowChoice",
    "WindowCommand",
    "WindowKey",
    "WriteRound",
    "d_frame",
    "lends_windows",
    "lent_window",
    "p_frame",
    "round_emptied",
    "round_step",
    "share_refusal",
    "window_choice",
    "with_window",
]
