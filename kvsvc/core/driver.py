"""What every driver of the core's objects decides the same way: the service (`kvsvc.service.sending`, `receiving`,
`writing`, `lending`) and the test harness (`kvsvc.testing.pair.PeerPair`) both call these, so they cannot drift apart.

Rules: a frame that arrives is routed here to the core object it is about (`p_frame`, `d_frame`); the commands those
objects return are dispatched by type here (`carry_out_send`, `carry_out_recv`, `carry_out_fill`,
`carry_out_windows`) to callbacks the driver injects, so a new command type is added here once and each driver's
missing callback is a type error;
what P's write in rounds does next is read from its `FillingWindow` here (`round_step`), the one place where a failed
write in rounds ends (its `Fail`). Whether P takes D's size of a share (`share_refusal`), and whether a request gets a
window lent, keeps the one it has or goes without (`lent_window`), are decided here too. Drivers only do the I/O.
Pure module: kvsvc's pure core only, no asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

from msgspec.structs import replace

from kvsvc.core.coalesce import Int64Array
from kvsvc.core.jobs import Notice
from kvsvc.core.messages import Message, TransferRequest, WindowEmptied, WindowFilled, Worker
from kvsvc.core.receiver import RecvCommand, ToSource
from kvsvc.core.sender import Reply, SendCommand, Submit
from kvsvc.core.windows import (
    Announce,
    Deliver,
    Fail,
    FillCommand,
    FillingWindow,
    FillState,
    LentWindow,
    LentWindows,
    Scatter,
    TellP,
    WindowCommand,
    WindowKey,
)

# -- the job tables' commands ------------------------------------------------------------------------------------


def carry_out_send(
    commands: Sequence[SendCommand],
    submit: Callable[[Submit], None],
    reply: Callable[[Reply], None],
    log: Callable[[Notice], None],
) -> None:
    """Carry out what P's `Sender` decided, in order: start a write, answer a D worker, log."""
    for command in commands:
        if isinstance(command, Submit):
            submit(command)
        elif isinstance(command, Reply):
            reply(command)
        else:
            log(command)


def carry_out_recv(
    commands: Sequence[RecvCommand],
    send: Callable[[str, Worker, ToSource], None],
    windowed: Callable[[str, Worker, TransferRequest], TransferRequest | None],
    log: Callable[[Notice], None],
) -> None:
    """Carry out what D's `Receiver` decided, in order: send a frame to P worker `src` of `engine_id`, a
    `TransferRequest` as `windowed` makes it (with a window lent for its share; None: held back until there is
    room, the driver sends it then), or log."""
    for command in commands:
        if isinstance(command, Notice):
            log(command)
            continue
        message: ToSource | None = command.message
        if isinstance(message, TransferRequest):
            message = windowed(command.engine_id, command.src, message)
        if message is not None:
            send(command.engine_id, command.src, message)


# -- P: frames from D, and the write in rounds -------------------------------------------------------------------


def p_frame(message: Message, fills: Mapping[str, FillingWindow], d: str) -> list[FillCommand] | None:
    """A frame from D worker `d` at P: the commands of the write in rounds it is about (`WindowEmptied`; a debug
    notice when no write of that transfer fills a window, a late one); None when it is the `Sender`'s (any other
    frame): round frames pass beside the job tables."""
    if not isinstance(message, WindowEmptied):
        return None
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
    they leave ends the write here (`carry_out_fill` drops them)."""
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


def carry_out_fill(
    commands: Sequence[FillCommand], announce: Callable[[WindowFilled], None], log: Callable[[Notice], None]
) -> None:
    """Carry out a `FillingWindow`'s commands: a round's announcement to D, a notice; a `Fail` is left to
    `round_step`, which ends the write once no round of it is on the wire."""
    for command in commands:
        if isinstance(command, Announce):
            announce(command.message)
        elif isinstance(command, Notice):
            log(command)


# -- D: frames from P, and the windows ----------------------------------------------------------------------------


def d_frame(
    windows: LentWindows, engine_id: str, src: Worker, message: Message
) -> tuple[WindowKey, list[WindowCommand]]:
    """A frame from P worker `src` of `engine_id` at D: the window protocol takes it first (`LentWindows.receive`);
    returns the window it is about and the commands."""
    key = (getattr(message, "transfer_id", ""), engine_id, src)
    return key, windows.receive(engine_id, src, message)


def carry_out_windows(
    commands: Sequence[WindowCommand],
    scatter: Callable[[Scatter], None],
    tell_p: Callable[[WindowEmptied], None],
    deliver: Callable[[Deliver], None],
    log: Callable[[Notice], None],
) -> None:
    """Carry out D's window commands for one window, in order: start a scatter, tell P, hand P's answer to the
    `Receiver`, log."""
    for command in commands:
        if isinstance(command, Scatter):
            scatter(command)
        elif isinstance(command, TellP):
            tell_p(command.message)
        elif isinstance(command, Deliver):
            deliver(command)
        else:
            log(command)


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


def with_window(request: TransferRequest, window: LentWindow) -> TransferRequest:
    """`request` carrying `window`: where P writes its share, the window's size and the share's."""
    return replace(
        request, window_addr=window.addr, window_bytes=window.plan.window_bytes, share_bytes=window.plan.nbytes
    )


__all__ = [
    "AwaitHalf",
    "RoundStep",
    "RoundsFilled",
    "WriteRound",
    "carry_out_fill",
    "carry_out_recv",
    "carry_out_send",
    "carry_out_windows",
    "d_frame",
    "lent_window",
    "p_frame",
    "round_step",
    "share_refusal",
    "with_window",
]
