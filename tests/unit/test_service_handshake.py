"""The D side's handshake: one metadata fetch per engine start, and no receive waits on another engine's."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from kvsvc.core.auth import harness_secret
from kvsvc.engine.bootstrap import BootstrapServer
from kvsvc.testing.engines import LoopbackEngine
from kvsvc.testing.plugin import LoopbackFactory
from kvsvc.testing.sim import EngineSpec

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def counting_bootstrap(
    p: LoopbackEngine, delay_s: float = 0.0, gate: asyncio.Event | None = None
) -> tuple[BootstrapServer, list[str]]:
    """Serve `p`'s metadata again, counting every request, delaying it, and holding it until `gate` is set."""
    hits: list[str] = []

    @web.middleware
    async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
        hits.append(request.path)
        await asyncio.sleep(delay_s)
        if gate is not None:
            await gate.wait()
        return await handler(request)

    server = BootstrapServer(dict(p.sim.metas))
    server.app.middlewares.append(count)
    await server.start()
    return server, hits


async def test_concurrent_receives_from_a_new_engine_share_one_metadata_fetch(
    loopback_engines: LoopbackFactory,
) -> None:
    p, d = await loopback_engines(EngineSpec(tp_size=2), EngineSpec(tp_size=1), transport="fake")
    server, hits = await counting_bootstrap(p, delay_s=0.2)
    try:
        for i in range(8):
            p.start_send(f"p{i}", f"t{i}", [i], 4)
            d.services[(0, 0)].start_recv(
                f"d{i}", f"t{i}", "prefill", server.url, [i], 4, secret=harness_secret(f"t{i}")
            )
        for i in range(8):
            assert await d.wait(f"d{i}") == "finished"
            d.check_received(f"t{i}", [i], 4)
        assert len(hits) == 1
    finally:
        await server.close()


async def test_a_slow_engine_never_delays_receives_from_another(loopback_engines: LoopbackFactory) -> None:
    fast, d = await loopback_engines(transport="fake")
    slow = await LoopbackEngine("slow", EngineSpec(), transport="fake").start()
    gate = asyncio.Event()
    server, hits = await counting_bootstrap(slow, gate=gate)  # answers only once the test is over
    try:
        d.services[(0, 0)].start_recv("d-slow", "t-slow", "slow", server.url, [1], 4, secret=harness_secret("t-slow"))
        while not hits:  # the slow fetch is under way
            await asyncio.sleep(0.01)
        fast.start_send("p-fast", "t-fast", [2], 4, secret=harness_secret("t-fast"))
        d.start_recv("d-fast", "t-fast", fast, [2], 4)
        assert await d.wait("d-fast", timeout_s=10) == "finished"
        assert d.services[(0, 0)].statistics().receiver.waiting_for_handshake == 1
    finally:
        d.abort("d-slow")
        gate.set()
        await server.close()
        await slow.close()
