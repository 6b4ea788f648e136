"""One control connection between a D worker and a P worker: length-prefixed msgspec frames over asyncio streams.

Rules: `receive` returns whole messages or raises `MalformedFrame` (the peer sent garbage; close) or `PeerLost`
(EOF, reset, or closed by us). `send` never blocks: frames queue and go out together at the end of the current
loop iteration (one socket write for every frame sent meanwhile, in order), or at `drain`/`close`; `drain`
applies backpressure where the caller wants it. Closing flushes what was queued and is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from kvsvc.errors import PeerLost
from kvsvc.messages import MAX_FRAME_BYTES, FrameReader, Message, encode

_READ_CHUNK = 256 * 1024


class ControlChannel:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, max_frame_bytes: int = MAX_FRAME_BYTES
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._frames = FrameReader(max_frame_bytes)
        self._inbox: deque[Message] = deque()
        self._outbox: list[bytes] = []  # frames sent since the last flush
        self._closed = False
        peer, mine = writer.get_extra_info("peername"), writer.get_extra_info("sockname")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        # (this end, far end) of a TCP connection, for a transport that checks who holds the far end
        self.ends = (
            ((mine[0], mine[1]), (peer[0], peer[1])) if isinstance(peer, tuple) and isinstance(mine, tuple) else None
        )
        self.frames_sent = 0
        self.frames_received = 0

    @classmethod
    async def connect(cls, address: str, *, timeout_s: float) -> ControlChannel:
        """Open a connection to `host:port`.

        Raises:
            PeerLost: the address is malformed, refused, unreachable, or did not answer within `timeout_s`.
        """
        host, _, port = address.rpartition(":")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
        except (OSError, ValueError, TimeoutError) as exc:
            raise PeerLost(f"cannot connect to control address {address!r}: {type(exc).__name__}: {exc}") from None
        return cls(reader, writer)

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
        self.frames_sent += 1
        if self._outbox:
            self._outbox.append(frame)
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

    async def drain(self) -> None:
        """Wait until the write buffer is below its high-water mark.

        Raises:
            PeerLost: the connection broke.
        """
        self._flush()
        try:
            await self._writer.drain()
        except (ConnectionError, RuntimeError) as exc:
            raise PeerLost(f"control connection to {self.peer} broke: {exc}") from None

    async def receive(self) -> Message:
        """The next message.

        Raises:
            MalformedFrame: the peer sent bytes that are not a frame of this protocol.
            PeerLost: EOF, a reset, or the channel was closed.
        """
        while not self._inbox:
            self._frames.raise_if_broken()
            if self._closed:
                raise PeerLost(f"control connection to {self.peer} is closed")
            try:
                data = await self._reader.read(_READ_CHUNK)
            except (ConnectionError, OSError) as exc:
                raise PeerLost(f"control connection to {self.peer} broke: {exc}") from None
            if not data:
                raise PeerLost(f"control connection to {self.peer} closed by the peer")
            self._inbox.extend(self._frames.feed(data))
        self.frames_received += 1
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
