"""What every driver of the core's objects decides the same way: the service (`kvsvc.service.sending`, `receiving`,
`writing`, `lending`) and the test harness (`kvsvc.testing.pair.PeerPair`) both call these, so they cannot drift apart.

Rules: the commands the core's objects return are carried out through one named protocol per side, `PSide` (what
P's `Sender` and its writes in rounds ask for) and `DSide` (what D's `Receiver` and its lent windows ask for), each
dispatched by one `match` here (`carry_out_p`, `carry_out_d`); the service's roles and the harness implement the
protocols, so a new command is added here once and a driver that lacks its method is a type error. A frame that
arrives is routed here to the core object it is about (`p_frame`, `d_frame`). What P's write in rounds does next is
read from its `FillingWindow` here (`round_step`), the one place where a failed write in rounds ends (its `Fail`).
Whether P takes D's size of a share (`share_refusal`), and whether a request gets a window lent, keeps the one it has
or goes without (`lent_window`), are decided here too. Drivers only do the I/O. Pure module: kvsvc's pure core only,
no asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeAlias

from msgspec.structs import replace

from kvsvc.core.errors import LocalProtocolError
from kvsvc.core.jobs import Notice
from kvsvc.core.layout import Int64Array
from kvsvc.core.messages import Message, TransferRequest, WindowEmptied, Worker
from kvsvc.core.receiver import RecvCommand, SendToSource, ToSource
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

# -- carrying out the core's commands ----------------------------------------------------------------------------

PCommand: TypeAlias = SendCommand | FillCommand
"""What P's core objects ask of their driver: the `Sender`'s and a `FillingWindow`'s commands."""

DCommand: TypeAlias = RecvCommand | WindowCommand
"""What D's core objects ask of their driver: the `Receiver`'s and a `LentWindow`'s commands."""


class PSide(Protocol):
    """What a P worker's driver does for its core objects (`kvsvc.service.sending.SendingRole`, the harness)."""

    def submit(self, command: Submit) -> None:
        """Start the write; its end goes back to `Sender.write_ended` later, never from this call."""

    def reply(self, command: Reply) -> None:
        """Send the answer to D worker `command.dst` on its control connection; dropped when it is closed."""

    def announce(self, command: Announce) -> None:
        """Tell D worker `command.dst` that a round of its window landed; dropped when its connection is closed (the
        write in rounds then fails by `FillingWindow.peer_lost`)."""

    def log(self, notice: Notice) -> None:
        """Log (and count, for a protocol error) what the core noticed."""


class DSide(Protocol):
    """What a D worker's driver does for its core objects (`kvsvc.service.receiving.ReceivingRole`, the harness)."""

    def tell_p(self, engine_id: str, src: Worker, message: ToSource | WindowEmptied) -> None:
        """Send `message` to P worker `src` of `engine_id`, or keep it for the connection being opened; dropped
        when there is neither."""

    def windowed(self, engine_id: str, src: Worker, request: TransferRequest) -> TransferRequest | None:
        """`request` as it goes to P worker `src`: with a window of D's staging region lent for its share (as
        `lent_window` decides), as it is, or None (held back until there is room: the driver sends it then)."""

    def scatter(self, key: WindowKey, command: Scatter) -> None:
        """Start copying a round of window `key` into the blocks; its end goes back to `LentWindows.scattered`."""

    def deliver(self, key: WindowKey, command: Deliver) -> None:
        """Hand P's answer about window `key` to the `Receiver` (`Receiver.receive`)."""

    def log(self, notice: Notice) -> None:
        """Log (and count, for a protocol error) what the core noticed."""


def carry_out_p(commands: Sequence[PCommand], side: PSide) -> None:
    """Carry out what P's `Sender` or a `FillingWindow` decided, in order. A `Fail` needs no carrying out of its own:
    the state it leaves ends the write in rounds at `round_step`, once no round of it is on the wire."""
    for command in commands:
        match command:
            case Submit():
                side.submit(command)
            case Reply():
                side.reply(command)
            case Announce():
                side.announce(command)
            case Fail():
                pass
            case Notice():
                side.log(command)


def carry_out_d(commands: Sequence[DCommand], side: DSide, key: WindowKey | None = None) -> None:
    """Carry out what D's `Receiver` or the window `key` (`LentWindows`) decided, in order. A `TransferRequest` goes
    as `DSide.windowed` makes it.

    Raises:
        LocalProtocolError: a window's command without the window's `key` (a driver bug).
    """
    for command in commands:
        match command:
            case SendToSource(engine_id, src, TransferRequest() as request):
                windowed = side.windowed(engine_id, src, request)
                if windowed is not None:
                    side.tell_p(engine_id, src, windowed)
            case SendToSource(engine_id, src, message):
                side.tell_p(engine_id, src, message)
            case Scatter():
                side.scatter(_window(key, command), command)
            case TellP(message):
                window = _window(key, command)
                side.tell_p(window[1], window[2], message)
            case Deliver():
                side.deliver(_window(key, command), command)
            case Notice():
                side.log(command)


def _window(key: WindowKey | None, command: WindowCommand) -> WindowKey:
    if key is None:
        raise LocalProtocolError(f"{type(command).__name__} carried out without the window it is about")
    return key


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
    "AwaitHalf",
    "DCommand",
    "DSide",
    "GoWithout",
    "LendAt",
    "PCommand",
    "PSide",
    "RoundStep",
    "RoundsFilled",
    "WaitForRoom",
    "WindowChoice",
    "WriteRound",
    "carry_out_d",
    "carry_out_p",
    "d_frame",
    "lent_window",
    "p_frame",
    "round_step",
    "share_refusal",
    "window_choice",
    "with_window",
]
