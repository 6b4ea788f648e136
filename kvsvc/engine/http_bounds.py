"""What one HTTP client may hold of an engine's handshake and admin server: `HttpBounds`, kept by `bounded_server`.

aiohttp bounds a request's line, headers and body sizes, but not how long a client may take to send its headers,
nor how many connections it may hold: a client that opens hundreds of connections and sends a byte a minute on
each would hold the server's sockets for good. Rules: the server holds at most `max_connections` at once; past it the
oldest connection not serving a request makes way for the new one (only when every one is busy does the new one
get a 503), so holding connections open keeps nobody out; a connection must deliver each request's headers within
`header_timeout_s` of its first byte (of connecting, for the first request), else it is closed; a request body
must arrive within `body_timeout_s` (the admin guard reads it); an idle kept-alive connection closes after
`keepalive_timeout_s`.
Imports asyncio and aiohttp only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, cast

from aiohttp import web

_REFUSED: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\nContent-Length: 44\r\n\r\n"
    b"too many connections to this engine's server"
)


@dataclass(frozen=True, slots=True)
class HttpBounds:
    """The bounds of one engine's HTTP server (docs/operations.md, "Bounds").

    Raises (constructor):
        ValueError: a bound below 1 (connections, sizes) or not positive (times).
    """

    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    keepalive_timeout_s: float = 15.0
    max_line_size: int = 8190
    max_field_size: int = 8190
    max_headers: int = 64

    def __post_init__(self) -> None:
        sizes = (self.max_connections, self.max_line_size, self.max_field_size, self.max_headers)
        times = (self.header_timeout_s, self.body_timeout_s, self.keepalive_timeout_s)
        if min(sizes) < 1 or min(times) <= 0:
            raise ValueError(f"HTTP bounds must be positive, got {self}")

    def handler_args(self) -> dict[str, Any]:
        """What aiohttp's request handler takes of these bounds."""
        return {
            "keepalive_timeout": self.keepalive_timeout_s,
            "max_line_size": self.max_line_size,
            "max_field_size": self.max_field_size,
            "max_headers": self.max_headers,
            # How long aiohttp keeps reading a body the handler left unread before it closes: no longer than a body
            # may take at all.
            "lingering_time": self.body_timeout_s,
        }


BOUNDS_KEY: Final = web.AppKey("kvsvc_http_bounds", HttpBounds)


class _Connections:
    """The connections one server holds, each with its header deadline."""

    def __init__(self, bounds: HttpBounds) -> None:
        self.bounds = bounds
        self.open: dict[asyncio.BaseTransport, _Bounded] = {}


class _Bounded(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the connection cap and the header deadline."""

    def __init__(self, inner: asyncio.Protocol, book: _Connections) -> None:
        self._inner = inner
        self._book = book
        self._transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._idle = False  # between requests: the next byte starts the next header deadline
        self.busy = False  # a handler is serving a request of it

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # a stream's (uvloop's is no subclass of asyncio's)
        if len(self._book.open) >= self._book.bounds.max_connections:
            idle = next((c for c in self._book.open.values() if not c.busy), None)  # oldest first
            if idle is None:
                transport.write(_REFUSED)
                transport.close()
                return
            idle.drop()
        self._transport = transport
        self._book.open[transport] = self
        self._arm()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._transport is None:
            return
        if self._idle:
            self._idle = False
            self._arm()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._transport is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is None:
            return
        self._disarm()
        self._book.open.pop(self._transport, None)
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def headers_done(self) -> None:
        """A request's headers arrived whole: its handler runs, free of the header deadline."""
        self._disarm()
        self.busy = True

    def request_done(self) -> None:
        """The handler answered: the connection is idle until its next byte (kept alive by aiohttp's own bound)."""
        self._idle = True
        self.busy = False

    def drop(self) -> None:
        """Close it now, to make way for a newer connection: it serves no request."""
        if self._transport is not None:
            self._book.open.pop(self._transport, None)
        self._expire()

    def _arm(self) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self._book.bounds.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self._transport is not None:
            self._transport.abort()  # a client that sends no request in time gets no answer either


def _tracker(book: _Connections) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def track(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        connection = book.open.get(request.transport) if request.transport is not None else None
        if connection is not None:
            connection.headers_done()
        try:
            return await handler(request)
        finally:
            if connection is not None:
                connection.request_done()

    return track


class _BoundedSite(web.TCPSite):
    """A `web.TCPSite` whose connections go through `_Bounded`: aiohttp's own site, with the protocol factory
    wrapped (aiohttp has no hook for it)."""

    __slots__ = ("_book",)

    def __init__(self, runner: web.AppRunner, host: str, port: int, book: _Connections) -> None:
        super().__init__(runner, host, port)
        self._book = book

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner, which stops it on cleanup
        handler = self._runner.server
        assert handler is not None
        book = self._book
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Bounded(handler(), book), self._host, self._port, backlog=self._backlog
        )
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port


async def bounded_server(app: web.Application, host: str, port: int, bounds: HttpBounds) -> web.AppRunner:
    """Serve `app` behind `bounds` on `host:port` (0: a free port); returns its runner (`cleanup()` stops it;
    `addresses[0]` is the bound address). Call before `app` is frozen; nothing is left behind when the bind fails.

    Raises:
        OSError: the address cannot be bound.
    """
    book = _Connections(bounds)
    app.middlewares.insert(0, _tracker(book))
    app[BOUNDS_KEY] = bounds
    runner = web.AppRunner(app, access_log=None, **bounds.handler_args())
    await runner.setup()
    try:
        await _BoundedSite(runner, host, port, book).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


__all__ = ["BOUNDS_KEY", "HttpBounds", "bounded_server"]
