"""`kvsvc.engine.http_bounds`: the engine's HTTP server against slow and greedy clients, on a real socket. Each
test is the attack (headers a byte at a time, connections held open, a body that never ends), and a legitimate
request beside it is still answered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from kvsvc.engine.bootstrap import serve_app
from kvsvc.engine.http_bounds import HttpBounds

BOUNDS = HttpBounds(max_connections=4, header_timeout_s=0.3, body_timeout_s=0.3, keepalive_timeout_s=5.0)
WAIT_S = 10.0  # a bound on the test, not a claim on how fast


async def _hello(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _echo(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, int]]:
    app = web.Application()
    app.router.add_get("/", _hello)
    app.router.add_post("/", _echo)
    runner = await serve_app(app, "127.0.0.1", 0, BOUNDS)
    host, port = runner.addresses[0][:2]
    try:
        yield host, port
    finally:
        await runner.cleanup()


async def _closed(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed the connection."""
    async with asyncio.timeout(WAIT_S):
        return await reader.read()


async def _get(host: str, port: int) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"http://{host}:{port}/") as response:
        return await response.text()


async def test_a_client_that_never_finishes_its_headers_is_closed(server: tuple[str, int]) -> None:
    reader, writer = await asyncio.open_connection(*server)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
    assert await _closed(reader) == b""
    assert await _get(*server) == "ok"
    writer.close()


async def test_a_silent_connection_is_closed_and_a_kept_alive_one_is_held_to_each_request(
    server: tuple[str, int],
) -> None:
    reader, writer = await asyncio.open_connection(*server)
    assert await _closed(reader) == b""  # nothing sent at all
    writer.close()
    reader, writer = await asyncio.open_connection(*server)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    async with asyncio.timeout(WAIT_S):
        first = await reader.readuntil(b"ok")
    assert first.startswith(b"HTTP/1.1 200")
    writer.write(b"GET / HTTP/1.1\r\n")  # a second request, begun and left hanging
    assert await _closed(reader) == b""
    writer.close()


async def test_connections_held_open_past_the_cap_make_way_for_a_new_one(server: tuple[str, int]) -> None:
    """A client holding every slot keeps nobody out: the oldest idle connection gives way."""
    held = [await asyncio.open_connection(*server) for _ in range(BOUNDS.max_connections)]
    assert await _get(*server) == "ok"
    assert await _closed(held[0][0]) == b""  # the oldest made way
    for _, each in held:
        each.close()


async def test_past_the_cap_with_every_connection_busy_a_new_one_gets_503() -> None:
    release, started = asyncio.Event(), [0]

    async def slow(_: web.Request) -> web.Response:
        started[0] += 1
        await release.wait()
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/", slow)
    runner = await serve_app(app, "127.0.0.1", 0, BOUNDS)
    host, port = runner.addresses[0][:2]
    try:
        busy = []
        for _ in range(BOUNDS.max_connections):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            busy.append((reader, writer))
        async with asyncio.timeout(WAIT_S):
            while started[0] < BOUNDS.max_connections:  # every connection serves a request
                await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection(host, port)
        refused = await _closed(reader)
        assert refused.startswith(b"HTTP/1.1 503") and b"too many connections" in refused
        writer.close()
        release.set()
        for each_reader, each_writer in busy:
            async with asyncio.timeout(WAIT_S):
                assert (await each_reader.readuntil(b"late")).startswith(b"HTTP/1.1 200")
            each_writer.close()
    finally:
        release.set()
        await runner.cleanup()


async def test_a_body_that_never_arrives_is_refused_by_the_admin_guard() -> None:
    from kvsvc.engine.admin import build_admin_app
    from tests.unit.test_admin import TOKEN, FakeView, meta

    app = build_admin_app(FakeView(metas={(0, 0): meta(0, 0)}), token=TOKEN)
    runner = await serve_app(app, "127.0.0.1", 0, BOUNDS)
    host, port = runner.addresses[0][:2]
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            b"POST /v1/drain HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n"
            b"Content-Length: 100\r\n\r\n0123456789"
        )
        async with asyncio.timeout(WAIT_S):
            answer = await reader.readuntil(b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 408"), answer
        writer.close()
    finally:
        await runner.cleanup()


def test_bounds_below_one_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="max_connections=0"):
        HttpBounds(max_connections=0)


def test_the_bounds_hold_on_uvloop_too() -> None:
    """The engines serve on uvloop, whose transports are not asyncio's classes."""
    import uvloop

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/", _hello)
        runner = await serve_app(app, "127.0.0.1", 0, BOUNDS)
        host, port = runner.addresses[0][:2]
        try:
            assert await _get(host, port) == "ok"
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET / HTTP/1.1\r\n")
            assert await _closed(reader) == b""
            writer.close()
        finally:
            await runner.cleanup()

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
