"""The handshake endpoint an engine serves (D workers fetch it with `kvsvc.service.remotes.fetch_engine_metadata`).

Rules: the body is `kvsvc.core.messages.encode_engine_metadata` (msgpack), served read-only at `METADATA_PATH`, and 503
until the engine published it. `GET /query` answers as MooncakeConnector's bootstrap server does, so that llm-d's
`mooncake` mode finds the engine id to name to D: `{"<dp rank>": {"engine_id": ...}}`, the rank this endpoint serves
(a D worker still reads everything else from the metadata). Binds loopback by default; `port=0` picks a free port,
readable from `BootstrapServer.url` after start. The admin endpoints add their routes to the same `web.Application`.
"""

from __future__ import annotations

import json
from typing import Final

from aiohttp import web

from kvsvc.core.messages import METADATA_CONTENT_TYPE as CONTENT_TYPE
from kvsvc.core.messages import METADATA_PATH, WorkerMetadata, encode_engine_metadata
from kvsvc.engine.http_bounds import HttpBounds, bounded_server

METADATA_KEY: Final = web.AppKey("kvsvc_metadata", list[bytes])
QUERY_PATH: Final = "/query"  # MooncakeConnector's bootstrap route, which llm-d's `mooncake` mode asks
_QUERY_KEY: Final = web.AppKey("kvsvc_query", list[str])


async def serve_app(app: web.Application, host: str, port: int, bounds: HttpBounds | None = None) -> web.AppRunner:
    """Bind `app` on `host:port` (0: a free port) and serve it behind `bounds` (`HttpBounds()` by default: a
    connection cap, header and body deadlines, request sizes); returns its runner (`cleanup()` stops it;
    `addresses[0]` is the bound address). Nothing is left behind when the bind fails.

    Raises:
        OSError: the address cannot be bound.
    """
    return await bounded_server(app, host, port, bounds or HttpBounds())


async def _handle_metadata(request: web.Request) -> web.Response:
    # A one-slot list, filled on publish: aiohttp forbids changing a started application's own state.
    body = published_metadata(request.app)
    if body is None:
        return web.Response(status=503, text="engine metadata is not published yet")
    return web.Response(body=body, content_type=CONTENT_TYPE)


async def _handle_query(request: web.Request) -> web.Response:
    slot = request.app.get(_QUERY_KEY)
    if not slot or published_metadata(request.app) is None:
        return web.Response(status=503, text="engine metadata is not published yet")
    return web.Response(text=slot[0], content_type="application/json")


def add_metadata_route(app: web.Application) -> None:
    """Serve the handshake endpoint (and `QUERY_PATH`) on `app`; publish with `publish_metadata`."""
    app[METADATA_KEY] = []
    app[_QUERY_KEY] = []
    app.router.add_get(METADATA_PATH, _handle_metadata)
    app.router.add_get(QUERY_PATH, _handle_query)


def publish_metadata(app: web.Application, metas: dict[tuple[int, int], WorkerMetadata], dp_rank: int = 0) -> None:
    """Make `metas` (the engine's merged worker metadata) the body of the handshake endpoint, and `QUERY_PATH`'s
    answer name its engine under `dp_rank`; may be called while the application serves.

    Raises:
        ValueError: `app` was not set up with `add_metadata_route`.
    """
    slot = app.get(METADATA_KEY)
    if slot is None:
        if app.frozen:
            raise ValueError("publish_metadata needs an application set up with add_metadata_route before it started")
        slot = app[METADATA_KEY] = []
    slot[:] = [encode_engine_metadata(metas)]
    engine_ids = sorted({meta.engine_id for meta in metas.values()})
    query = app.get(_QUERY_KEY)
    if query is not None:
        query[:] = [json.dumps({str(dp_rank): {"engine_id": engine_ids[0]}})] if len(engine_ids) == 1 else []


def published_metadata(app: web.Application) -> bytes | None:
    """The body the handshake endpoint serves now, or None before `publish_metadata`."""
    slot = app.get(METADATA_KEY)
    return slot[0] if slot else None


class BootstrapServer:
    """A stand-alone aiohttp server with only the handshake endpoint (tests and minimal embeddings)."""

    def __init__(
        self,
        metas: dict[tuple[int, int], WorkerMetadata] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        dp_rank: int = 0,
    ) -> None:
        self.app = web.Application(client_max_size=64 * 1024)
        add_metadata_route(self.app)
        if metas is not None:
            publish_metadata(self.app, metas, dp_rank)
        self._host, self._port = host, port
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        """Bind and serve; returns the base URL (`http://host:port`).

        Raises:
            OSError: the address cannot be bound.
        """
        self._runner = await serve_app(self.app, self._host, self._port)
        self.url = f"http://{self._host}:{self._runner.addresses[0][1]}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
