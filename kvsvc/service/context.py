"""What the two roles of one worker's service share, handed to each explicitly: `ServiceContext`.

Rules: the P role (`kvsvc.service.sending`) and the D role (`kvsvc.service.receiving`) never import or call each
other; everything they both need is here, built by `KVTransferService` and injected, so a test can pass fakes.
Only `metadata` ever changes, once, when `start` fills in the bound addresses. Imports types and values, and the
kernel's word on a connection's far end (`unkeyed_peer_check`, one sock_diag lookup).

`TaskGroup` is the one owner of every task a worker's service starts, so `close` leaves nothing running: a task is
started through `spawn` (or, when asyncio made it for us, such as a connection handler, registered with `adopt`) and
leaves the group when it ends; a task that fails is logged, never lost; `cancel` cancels every task at once and
`wait` returns when all have ended. Unlike `asyncio.TaskGroup`, one task's failure cancels nothing else: one broken
connection must not take the worker's other transfers down.

`ControlChannel` is one control connection between a D worker and a P worker: length-prefixed msgspec frames over
asyncio streams. `receive` returns whole messages or raises `MalformedFrame` (the peer sent garbage; close) or
`PeerLost` (EOF, reset, or closed by us). `send` never blocks: frames queue and go out together at the end of the
current loop iteration (one socket write for every frame sent meanwhile, in order), once `BATCH_FRAMES` are queued, or
at `close`. Closing flushes what was queued and is idempotent. Both ways keep a burst moving through the pair: a long
run of sends (D starting thousands of receives in one engine call) reaches P while it is still running, and `receive`
lets the loop turn after every `BATCH_FRAMES` messages it hands out from one read, so completions and answers flow
while a burst is handled. A connection may idle, but a frame once begun must end within `frame_timeout_s`: a peer
cannot hold the buffer of a partial frame for good, and P's end of a new connection may be held to a first byte
within about a second, so a connection that never speaks frees its slot soon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import traceback
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from kvsvc.core.auth import unkeyed_peer_refusal
from kvsvc.core.errors import MalformedFrame, PeerLost
from kvsvc.core.histogram import STAGE_BUCKETS, LatencyHistogram
from kvsvc.core.jobs import Notice
from kvsvc.core.messages import HEADER_BYTES, MAX_FRAME_BYTES, FrameReader, Message, Worker, WorkerMetadata, encode
from kvsvc.service.config import ServiceConfig
from kvsvc.service.staging_area import StagingArea
from kvsvc.transport.base import Transport
from kvsvc.transport.samehost import Endpoint, far_end_uid

log = logging.getLogger("kvsvc.service")
_T = TypeVar("_T")


class TaskGroup:
    """The tasks of one service (see module docstring)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, _T], name: str | None = None) -> asyncio.Task[_T]:
        """Run `coro` as a task of this group (on the running loop)."""
        task = asyncio.create_task(coro, name=name)
        self.adopt(task)
        return task

    def adopt(self, task: asyncio.Task[Any]) -> None:
        """Make a task asyncio started for us (a connection handler) a member: `cancel` reaches it too."""
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def cancel(self) -> None:
        """Cancel every member (the current task excepted: a member may be the one closing the service)."""
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    async def wait(self) -> None:
        """Return once every member but the current task has ended. Cancelling this wait leaves the members alone."""
        current = asyncio.current_task()
        while pending := [t for t in self._tasks if t is not current and not t.done()]:
            await asyncio.wait(pending)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("kvsvc task %s failed", task.get_name(), exc_info=exc)


EngineMetadata = dict[Worker, WorkerMetadata]

COUNTERS = (
    "bytes",
    "descriptors",
    "transfers",
    "write_failures",
    "protocol_errors",
    "reconnects",
    "staged",
    "scattered",
    "early_served",
)
"""The service's monotonic counters (`ServiceContext.counts`), reported as deltas by `get_finished`."""


class PeerLog:
    """Warnings a peer's input triggers, at most `burst` of each kind in any `window_s`: anyone who can reach the
    control port can send a bad hello or frame per connection, and must not be able to flood the engine's log.
    What is held back is counted and named in the next line of its kind that goes out; the service's counters
    (`protocol_errors`) still count every one."""

    def __init__(self, clock: Callable[[], float], burst: int = 20, window_s: float = 60.0) -> None:
        self._clock = clock
        self._burst = burst
        self._window_s = window_s
        self._sent: dict[str, deque[float]] = {}
        self._held: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        self.log(logging.WARNING, kind, message, *args)

    def exception(self, kind: str, message: str, *args: object) -> None:
        """`log.exception` held to the same limit: a bug a peer's input reaches, once per connection, must not
        flood the log with a traceback each."""
        self.log(logging.ERROR, kind, message, *args, exc_info=True)

    def log(self, level: int, kind: str, message: str, *args: object, exc_info: bool = False) -> None:
        """Log `message % args` unless `kind` passed its limit; text arguments come from peers, so their control
        characters are escaped (a newline in an engine id would otherwise forge a line of its own)."""
        now = self._clock()
        sent = self._sent.setdefault(kind, deque())
        while sent and now - sent[0] >= self._window_s:
            sent.popleft()
        if len(sent) >= self._burst:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        sent.append(now)
        held = self._held.pop(kind, 0)
        if held:
            message = f"{message} (and {held} more of these in the last {self._window_s:g} s)"
        shown = [a if isinstance(a, int | float) else escape_controls(str(a)) for a in args]
        if exc_info:  # the frames are this code's; the exception's text may be a peer's
            error = sys.exc_info()[1]
            if error is not None:
                frames = "".join(traceback.format_tb(error.__traceback__))
                message, shown = (
                    f"{message}\n%s%s: %s",
                    [*shown, frames, type(error).__name__, escape_controls(str(error))],
                )
        log.log(level, message, *shown)


_CONTROLS: Final = {
    c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
    for c in [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
}


def escape_controls(text: str) -> str:
    """`text` with its control characters (newlines, escapes of a terminal) written as `\\xNN`: how text a peer
    chose goes into a log line."""
    return text.translate(_CONTROLS)


def _stage_histogram() -> LatencyHistogram:
    return LatencyHistogram(STAGE_BUCKETS)


@dataclass(slots=True, eq=False)
class ServiceContext:
    metadata: WorkerMetadata
    """This worker's metadata; replaced by `KVTransferService.start` with its transport and control addresses."""
    config: ServiceConfig
    transport: Transport
    clock: Callable[[], float]
    counts: dict[str, int]
    """The counters named in `COUNTERS`, bumped by either role."""
    tasks: TaskGroup
    """Every task either role starts (connections, fetches, writes, timers): `close` cancels what is left."""
    wake: asyncio.Event
    """Set by `changed`: the deadline timer re-reads the deadlines."""
    reports: asyncio.Event
    """Set by `changed`: `wait_for_reports` wakes, `get_finished` may have something new."""
    send_durations: LatencyHistogram
    """P: from a write's start (D's request met the held KV) to its last byte landed; layer-wise writes include
    the wait for their layers."""
    recv_durations: LatencyHistogram
    """D: from `start_recv` to the receive finished with its KV landed."""
    peer_log: PeerLog
    """Where warnings that a peer's input triggers go (`PeerLog`)."""
    staging: StagingArea | None = None
    """The staging region: P's writes gather into it when `StagingArea.rule` picks it, D lends windows of it; None
    writes every plan direct."""
    layer_compute: LatencyHistogram = field(default_factory=LatencyHistogram)
    """P, a layer-wise write that waited for its layers: from one layer's compute done to the next one's (the
    engine's compute of a layer, as the write sees it)."""
    layer_copy: LatencyHistogram = field(default_factory=LatencyHistogram)
    """P, a layer-wise write: from a layer's compute done to its bytes landed on D."""
    after_last_layer: LatencyHistogram = field(default_factory=LatencyHistogram)
    """P, a layer-wise write that waited for its last layer: from that layer's compute done to the write's last
    byte landed; what streaming the layers leaves after P's forward."""
    # The parts of staged writes, each timed when it completed (a chunk that failed keeps the parts it finished). They
    # overlap: chunks of a write start together, so one's wait for room is the gathers and writes before it; on a
    # GPU a gather, write or scatter ends when the event poller sees its CUDA event (`kvsvc.transport.streams`).
    staged_room: LatencyHistogram = field(default_factory=_stage_histogram)
    """P, a write through the staging region: each chunk's wait for room in it."""
    staged_gather: LatencyHistogram = field(default_factory=_stage_histogram)
    """P: each chunk's gather, from the call to its bytes in the room."""
    staged_write: LatencyHistogram = field(default_factory=_stage_histogram)
    """P: each chunk's write from its room, to its bytes landed on D."""
    round_wait: LatencyHistogram = field(default_factory=_stage_histogram)
    """P, a share written into D's window in rounds: each wait for D to empty half the window."""
    window_room: LatencyHistogram = field(default_factory=_stage_histogram)
    """D: each wait for room for a window that then got it (`window_wait_s` at most)."""
    window_scatter: LatencyHistogram = field(default_factory=_stage_histogram)
    """D: each round's scatter from a window into the blocks, from the call to the copy seen done."""

    def changed(self) -> None:
        """A protocol object took an event: a deadline may have moved and a transfer may have ended. Each role
        calls this where it carries out its protocol object's commands (the one place that signals)."""
        self.wake.set()
        self.reports.set()


def notice(ctx: ServiceContext, what: Notice) -> None:
    """Carry out a protocol object's `Notice`: log it, and count a protocol error if it is one."""
    level = logging.DEBUG if what.level == "debug" else logging.WARNING
    if what.protocol_error:
        ctx.counts["protocol_errors"] += 1
        ctx.peer_log.log(level, "protocol error", "%s", what.text)
    elif what.from_peer:
        ctx.peer_log.log(level, "peer report", "%s", what.text)
    else:
        log.log(level, "%s", what.text)


def unkeyed_peer_check(ctx: ServiceContext, ends: tuple[Endpoint, Endpoint] | None) -> str:
    """Why the control connection `ends` (this end, the far end) must close before a frame of it is read or a hello
    sent, or "" to go on: with a control token the hello's proofs decide; without one, the peer must be a process
    of this worker's own user by the kernel's word (`kvsvc.core.auth.unkeyed_peer_refusal`). Raises nothing."""
    if ctx.config.control_token is not None:
        return ""
    if ends is None:
        return "without a control token a worker needs the kernel's word on a connection's far end: none for this one"
    try:
        # One netlink request (about 0.1 ms) on the loop: a thread hop could delay D's first byte past P's deadline.
        uid = far_end_uid(ends)
    except (OSError, ValueError) as exc:
        return f"without a control token a worker needs the kernel's word on {ends[1][0]}:{ends[1][1]}: {exc}"
    return unkeyed_peer_refusal(os.getuid(), uid, trust_root=ctx.config.trust_root_peers)


_READ_CHUNK = 256 * 1024
# Frames sent or received in a row before the queue is written or the loop may turn: large enough that the socket
# write or loop turn is a small part of their handling, small enough that the peer or the loop's other work (a
# transport's completions) is not kept waiting long (about a millisecond of handling).
BATCH_FRAMES = 64


class ControlChannel:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_first_frame_bytes: int | None = None,
        first_frames: int = 1,
        frame_timeout_s: float = 10.0,
        first_byte_timeout_s: float | None = None,
    ) -> None:
        """`max_first_frame_bytes`: a smaller limit for the first `first_frames` frames (P's, for the hello
        exchange); `FrameReader`. `frame_timeout_s`: how long a frame may take from its first byte to its last.
        `first_byte_timeout_s`: how long the peer may stay silent after connecting (None: as long as it likes)."""
        self._frame_timeout = frame_timeout_s
        self._frame_began: float | None = None  # the loop's time when the frame read in part began
        # Until the first byte arrived: when silence ends the connection (the loop's time), else None.
        self._silent_until: float | None = None
        if first_byte_timeout_s is not None:
            self._silent_until = asyncio.get_running_loop().time() + first_byte_timeout_s
        self._first_byte_timeout = first_byte_timeout_s
        self._reader = reader
        self._writer = writer
        self._frames = FrameReader(
            max_frame_bytes, max_first_frame_bytes=max_first_frame_bytes, first_frames=first_frames
        )
        self._inbox: deque[Message] = deque()
        self._outbox: list[bytes] = []  # frames sent since the last flush
        self._handed = 0  # messages `receive` returned since it last let the loop turn
        self._closed = False
        peer, mine = writer.get_extra_info("peername"), writer.get_extra_info("sockname")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        # (this end, far end) of a TCP connection, for a transport that checks who holds the far end
        self.ends = (
            ((mine[0], mine[1]), (peer[0], peer[1])) if isinstance(peer, tuple) and isinstance(mine, tuple) else None
        )

    @classmethod
    async def connect(cls, address: str, *, timeout_s: float, frame_timeout_s: float = 10.0) -> ControlChannel:
        """Open a connection to `host:port`, whose frames must each arrive within `frame_timeout_s`.

        Raises:
            PeerLost: the address is malformed, refused, unreachable, or did not answer within `timeout_s`.
        """
        host, _, port = address.rpartition(":")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
        except (OSError, ValueError, TimeoutError) as exc:
            raise PeerLost(f"cannot connect to control address {address!r}: {type(exc).__name__}: {exc}") from None
        return cls(reader, writer, frame_timeout_s=frame_timeout_s)

    @property
    def closed(self) -> bool:
        return self._closed

    def send(self, message: Message) -> None:
        """Queue one frame.

        Raises:
            PeerLost: the channel is closed.
        """
        if self._closed or self._writer.is_closing():
            raise PeerLost(f"control connection to {self.peer} is closed")
        frame = encode(message)
        if self._outbox:
            self._outbox.append(frame)
            if len(self._outbox) >= BATCH_FRAMES:
                self._flush()  # the flush already scheduled finds the queue empty
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop running (a synchronous caller): write at once
            self._writer.write(frame)
            return
        self._outbox.append(frame)
        loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write the queued frames in one call (a no-op once the connection is closing)."""
        if self._outbox:
            frames, self._outbox = self._outbox, []
            if not self._writer.is_closing():
                self._writer.write(b"".join(frames))

    async def receive(self) -> Message:
        """The next message.

        Raises:
            MalformedFrame: the peer sent bytes that are not a frame of this protocol, or began a frame and did not
                end it within `frame_timeout_s`.
            PeerLost: EOF, a reset, or the channel was closed.
        """
        if self._inbox and self._handed >= BATCH_FRAMES:
            self._handed = 0
            await asyncio.sleep(0)
        while not self._inbox:
            self._handed = 0
            self._frames.raise_if_broken()
            if self._closed:
                raise PeerLost(f"control connection to {self.peer} is closed")
            # No read takes in more than the next frame may hold: a peer held to a small first frame cannot make
            # this side buffer more than that.
            size = min(_READ_CHUNK, self._frames.next_frame_limit + HEADER_BYTES)
            loop, began = asyncio.get_running_loop(), self._frame_began
            deadline = self._silent_until if began is None else began + self._frame_timeout
            try:
                async with asyncio.timeout_at(deadline):
                    data = await self._reader.read(size)
            except TimeoutError:
                if began is None:
                    raise MalformedFrame(
                        f"{self.peer} sent nothing within {self._first_byte_timeout:g} s of connecting"
                    ) from None
                raise MalformedFrame(
                    f"{self.peer} began a frame and sent {self._frames.buffered} bytes of it in "
                    f"{loop.time() - (began or 0.0):.1f} s, limit {self._frame_timeout:g} s"
                ) from None
            except (ConnectionError, OSError) as exc:
                raise PeerLost(f"control connection to {self.peer} broke: {exc}") from None
            if not data:
                raise PeerLost(f"control connection to {self.peer} closed by the peer")
            self._silent_until = None
            self._inbox.extend(self._frames.feed(data))
            if not self._frames.buffered:
                self._frame_began = None
            elif self._frame_began is None or self._inbox:  # a new frame began in this read
                self._frame_began = loop.time()
        self._handed += 1
        return self._inbox.popleft()

    def close(self) -> None:
        if not self._closed:
            self._flush()
            self._closed = True
            self._writer.close()

    async def wait_closed(self) -> None:
        self.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self._writer.wait_closed()
