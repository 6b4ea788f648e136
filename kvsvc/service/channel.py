"""One control connection between a D worker and a P worker: length-prefixed msgspec frames over asyncio streams.

Rules: `receive` returns whole messages or raises `MalformedFrame` (the peer sent garbage; close) or `PeerLost`
(EOF, reset, or closed by us). `send` never blocks: frames queue and go out together at the end of the current
loop iteration (one socket write for every frame sent meanwhile, in order), once `BATCH_FRAMES` are queued, or at
`close`. Closing flushes what was queued and is idempotent. Both ways keep a burst moving through the pair: a long
run of sends (D starting thousands of receives in one engine call) reaches P while it is still running, and `receive`
lets the loop turn after every `BATCH_FRAMES` messages it hands out from one read, so completions and answers flow
while a burst is handled. A connection may idle, but a frame once begun must end within `frame_timeout_s`: a peer
cannot hold the buffer of a partial frame for good, and P's end of a new connection may be held to a first byte
within about a second, so a connection that never speaks frees its slot soon.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from kvsvc.core.errors import MalformedFrame, PeerLost
from kvsvc.core.messages import HEADER_BYTES, MAX_FRAME_BYTES, FrameReader, Message, encode

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
