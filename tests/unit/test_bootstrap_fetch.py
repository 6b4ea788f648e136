"""D's metadata fetch (`kvsvc.service.remotes.fetch_engine_metadata`) against hostile bootstrap servers: real aiohttp
servers on loopback that redirect, send endless bodies, or publish control addresses on another host. Bounds are
counted on the server side (bytes it got to write, requests it saw), never timed."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import msgspec
import pytest
from aiohttp import web

from kvsvc.cli.plan import synthetic_engine
from kvsvc.core.errors import HandshakeError
from kvsvc.core.messages import METADATA_PATH, encode_engine_metadata
from kvsvc.service.remotes import MAX_ERROR_BYTES, fetch_engine_metadata

pytestmark = pytest.mark.timeout(60)

CHUNK = 64 * 1024
ENDLESS = 128 * 1024 * 1024  # what a hostile server offers
READ_BOUND = 32 * 1024 * 1024  # what it may get to write before D stops reading: socket buffers, not the body


class Server:
    """A bootstrap server whose every route is `handler`; counts requests per path and bytes written."""

    def __init__(self, handler: Callable[[Server, web.Request], Awaitable[web.StreamResponse]]) -> None:
        self.handler = handler
        self.hits: Counter[str] = Counter()
        self.written = 0
        self.url = ""

    async def __aenter__(self) -> Server:
        async def route(request: web.Request) -> web.StreamResponse:
            self.hits[request.path_qs] += 1
            return await self.handler(self, request)

        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", route)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._runner.cleanup()

    async def endless(self, request: web.Request, status: int) -> web.StreamResponse:
        response = web.StreamResponse(status=status)
        await response.prepare(request)
        try:
            while self.written < ENDLESS:
                await response.write(b"x" * CHUNK)
                self.written += CHUNK
        except (ConnectionError, RuntimeError):
            pass  # D closed the connection: what it read is bounded
        return response


def _metas(control_host: str = "127.0.0.1") -> dict[tuple[int, int], object]:
    engine = synthetic_engine(
        "P", pp_size=1, tp_size=1, num_layers=2, num_kv_heads=2, head_size=8, block_size=16, num_blocks=8
    )
    return {key: msgspec.structs.replace(m, control_addr=f"{control_host}:5000") for key, m in engine.items()}


def _document(control_host: str = "127.0.0.1") -> bytes:
    return encode_engine_metadata(_metas(control_host))  # type: ignore[arg-type]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(auto_decompress=False) as client:
        yield client


async def test_a_redirect_is_not_followed(session: aiohttp.ClientSession) -> None:
    async def handler(server: Server, request: web.Request) -> web.StreamResponse:
        if request.path == METADATA_PATH:
            raise web.HTTPFound(f"{server.url}/elsewhere")
        return web.Response(body=_document())

    async with Server(handler) as server:
        with pytest.raises(HandshakeError, match="HTTP 302"):
            await fetch_engine_metadata(session, server.url, timeout_s=10)
    assert server.hits == Counter({METADATA_PATH: 1})  # never /elsewhere


async def test_an_endless_error_body_is_read_only_for_a_short_excerpt(session: aiohttp.ClientSession) -> None:
    async with Server(lambda server, request: server.endless(request, 503)) as server:
        with pytest.raises(HandshakeError, match="HTTP 503") as raised:
            await fetch_engine_metadata(session, server.url, timeout_s=10)
    assert len(str(raised.value)) < 2 * MAX_ERROR_BYTES + 200
    assert server.written < READ_BOUND, f"the server got to write {server.written} bytes"


async def test_an_endless_document_is_refused_past_the_cap(session: aiohttp.ClientSession) -> None:
    async with Server(lambda server, request: server.endless(request, 200)) as server:
        with pytest.raises(HandshakeError, match="larger than"):
            await fetch_engine_metadata(session, server.url, timeout_s=10)
    assert server.written < READ_BOUND, f"the server got to write {server.written} bytes"


@pytest.mark.parametrize("suffix", ["/admin", "/v1/peers/x/forget?y=1", "?q=1", "#f"])
async def test_d_fetches_only_the_metadata_path_of_a_host_and_port(session: aiohttp.ClientSession, suffix: str) -> None:
    async def handler(server: Server, request: web.Request) -> web.StreamResponse:
        return web.Response(body=_document())

    async with Server(handler) as server:
        with pytest.raises(HandshakeError, match="path, query or fragment"):
            await fetch_engine_metadata(session, server.url + suffix, timeout_s=10)
    assert not server.hits  # not one request


async def test_without_a_key_only_loopback_is_fetched_from(session: aiohttp.ClientSession) -> None:
    with pytest.raises(HandshakeError, match="beyond loopback and this engine has no control token"):
        await fetch_engine_metadata(session, "http://192.0.2.1:8998", timeout_s=10, keyed=False)


async def test_control_addresses_on_another_host_are_refused_naming_both(session: aiohttp.ClientSession) -> None:
    async def handler(server: Server, request: web.Request) -> web.StreamResponse:
        return web.Response(body=_document("192.0.2.7"))

    async with Server(handler) as server:
        with pytest.raises(HandshakeError, match=r"'192\.0\.2\.7:5000' is not on the host of bootstrap address"):
            await fetch_engine_metadata(session, server.url, timeout_s=10)


async def test_loopback_control_addresses_go_with_a_loopback_bootstrap_address(
    session: aiohttp.ClientSession,
) -> None:
    async def handler(server: Server, request: web.Request) -> web.StreamResponse:
        return web.Response(body=_document("127.0.0.1"))

    async with Server(handler) as server:
        url = server.url.replace("127.0.0.1", "localhost")
        assert await fetch_engine_metadata(session, url, timeout_s=10) == _metas("127.0.0.1")
