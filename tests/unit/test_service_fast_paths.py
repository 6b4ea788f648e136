"""The service's many-small-requests paths: P submits through `start_write` without a task per write, and D reuses
the routes of a P engine start instead of recomputing them per receive. Same bytes, same exactly-once reports,
failures isolated per transfer."""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import AsyncIterator
from typing import Any

import pytest

import kvsvc.service.remotes as remotes_module
from kvsvc.core import planner
from kvsvc.core.auth import harness_secret
from kvsvc.core.planner import Descriptors, as_rows
from kvsvc.engine.bootstrap import BootstrapServer
from kvsvc.service import KVTransferService, ServiceConfig
from kvsvc.testing.fakes import LoopbackTransport
from kvsvc.transport.base import WriteFailed, Written
from tests.unit.test_service_wiring import BLOCK, LAYERS, Side, block_bytes_of, make_side, until, wait_output


class StartingTransport(LoopbackTransport):
    """A loopback transport with `start_write`: copies at once, resolves on the next loop iteration; writes whose
    first destination is in `fail_dst` fail (nothing copied), with `drained` resolved only by `release_drain`."""

    def __init__(self) -> None:
        super().__init__()
        self.started = 0
        self.fail_dst: set[int] = set()
        self.hold_drain: asyncio.Future[None] | None = None

    def start_write(self, peer: str, descriptors: Descriptors) -> asyncio.Future[Written] | None:
        descriptors = as_rows(descriptors)  # the service hands a table
        loop = asyncio.get_running_loop()
        result: asyncio.Future[Written] = loop.create_future()
        self.started += 1
        if descriptors[0][1] in self.fail_dst:
            drained = self.hold_drain or loop.create_future()
            if self.hold_drain is None:
                drained.set_result(None)
            failed = WriteFailed(f"injected failure to {peer}", -1, peer=peer, undrained=1, drained=drained)
            loop.call_soon(result.set_result, failed)
            return result
        for src, dst, length in descriptors:
            ctypes.memmove(dst, src, length)
        loop.call_soon(result.set_result, sum(d[2] for d in descriptors))
        return result


@pytest.fixture
async def fast_pair() -> AsyncIterator[tuple[Side, Side, str, StartingTransport]]:
    config = ServiceConfig(hold_timeout_s=5, recv_timeout_s=5, early_request_timeout_s=0.3, handshake_timeout_s=2)
    p, d = make_side("prefill", config, 1), make_side("decode", config, 2)
    transport = StartingTransport()
    transport.register(p.transport._local.regions())
    p = make_side_with(p, transport)
    url_meta = await p.service.start()
    await d.service.start()
    bootstrap = BootstrapServer({(0, 0): url_meta})
    url = await bootstrap.start()
    yield p, d, url, transport
    await p.service.close()
    await d.service.close()
    await bootstrap.close()


def make_side_with(side: Side, transport: StartingTransport) -> Side:
    service = KVTransferService(side.service.metadata, transport, side.service.config)
    return Side(service, side.pool, transport)


async def collect(service: Any, what: str, reqs: set[str], timeout: float = 10.0) -> dict[str, set[Any]]:
    got: dict[str, set[Any]] = {"finished_sending": set(), "finished_recving": set(), "failed_recving": set()}
    seen: list[str] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not reqs <= got[what] | got["failed_recving"] and loop.time() < deadline:
        out = service.get_finished()
        for name in got:
            for req in getattr(out, name) or ():
                got[name].add(req)
                seen.append(req)
        await asyncio.sleep(0.005)
    assert len(seen) == len(set(seen)), "a request was reported twice"
    return got


async def test_small_requests_go_through_start_write_and_every_byte_lands(
    fast_pair: tuple[Side, Side, str, StartingTransport],
) -> None:
    p, d, url, transport = fast_pair
    n = 12
    for i in range(n):
        p.service.start_send(f"p{i}", f"t{i}", [i], BLOCK, secret=harness_secret(f"t{i}"))
    for i in range(n):
        d.service.start_recv(f"d{i}", f"t{i}", "prefill", url, [n - 1 - i], BLOCK, secret=harness_secret(f"t{i}"))
    got = await collect(d.service, "finished_recving", {f"d{i}" for i in range(n)})
    assert got["finished_recving"] == {f"d{i}" for i in range(n)} and not got["failed_recving"]
    sent = await collect(p.service, "finished_sending", {f"p{i}" for i in range(n)})
    assert sent["finished_sending"] == {f"p{i}" for i in range(n)}
    assert transport.started == n and transport.writes == []  # no write took the task path
    for i in range(n):
        for layer in range(LAYERS):
            assert block_bytes_of(d, layer, n - 1 - i) == block_bytes_of(p, layer, i)
    stats = p.service.statistics()
    assert (stats.transfers_sent, stats.writes_in_flight, stats.holds) == (n, 0, 0)


async def test_a_failed_start_write_fails_only_its_own_transfer_and_waits_for_its_drain(
    fast_pair: tuple[Side, Side, str, StartingTransport],
) -> None:
    p, d, url, transport = fast_pair
    loop = asyncio.get_running_loop()
    transport.hold_drain = loop.create_future()
    transport.fail_dst = {d.service.metadata.base_addrs[0] + 5 * (d.pool.size // LAYERS // 16)}  # D block 5
    for i, dst in enumerate([4, 5, 6]):
        p.service.start_send(f"p{i}", f"t{i}", [i], BLOCK, secret=harness_secret(f"t{i}"))
        d.service.start_recv(f"d{i}", f"t{i}", "prefill", url, [dst], BLOCK, secret=harness_secret(f"t{i}"))
    got = await collect(d.service, "finished_recving", {"d0", "d2"})
    assert got["finished_recving"] == {"d0", "d2"} and not got["failed_recving"]
    sent = await collect(p.service, "finished_sending", {"p0", "p2"})
    assert "p1" not in sent["finished_sending"]  # its descriptors may still move: still held
    await asyncio.sleep(0.05)
    assert "p1" not in (p.service.get_finished().finished_sending or set())
    assert p.service.statistics().writes_in_flight == 1
    transport.hold_drain.set_result(None)
    out = await wait_output(d.service, "failed_recving", "d1")
    assert out.invalid_block_ids == {5}
    await wait_output(p.service, "finished_sending", "p1")
    assert p.service.statistics().write_failures == 1


async def test_d_computes_a_p_engines_routes_once_per_start(
    fast_pair: tuple[Side, Side, str, StartingTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    p, d, url, _ = fast_pair
    calls: list[int] = []
    real = planner.sources_of

    def counting(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(remotes_module, "sources_of", counting)
    p.service.start_send("p0", "t0", [0], BLOCK, secret=harness_secret("t0"))
    d.service.start_recv("d0", "t0", "prefill", url, [0], BLOCK, secret=harness_secret("t0"))
    await wait_output(d.service, "finished_recving", "d0")
    first = len(calls)
    for i in range(1, 8):
        p.service.start_send(f"p{i}", f"t{i}", [i], BLOCK, secret=harness_secret(f"t{i}"))
        d.service.start_recv(f"d{i}", f"t{i}", "prefill", url, [i], BLOCK, secret=harness_secret(f"t{i}"))
    got = await collect(d.service, "finished_recving", {f"d{i}" for i in range(1, 8)})
    assert got["finished_recving"] == {f"d{i}" for i in range(1, 8)}
    assert len(calls) == first  # the later receives reused the routes
    # A lost connection means a possible restart: the routes go with the cached metadata.
    await p.service.close()
    await asyncio.sleep(0.05)
    d.service.start_recv("d9", "t9", "prefill", url, [9], BLOCK, secret=harness_secret("t9"))
    await wait_output(d.service, "failed_recving", "d9")
    assert len(calls) > first


async def test_routes_from_a_fetch_marked_out_of_date_while_it_ran_are_not_reused(
    fast_pair: tuple[Side, Side, str, StartingTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection to the engine lost during the fetch may mean a restart: the receive that fetched still goes on,
    but the next one fetches again instead of reusing routes to a start that may be gone."""
    p, d, url, _ = fast_pair
    fetches: list[int] = []
    real_fetch = remotes_module.fetch_engine_metadata

    async def counting_fetch(*args: Any, **kwargs: Any) -> Any:
        fetches.append(1)
        return await real_fetch(*args, **kwargs)

    remotes = d.service._receiving._remotes
    real_routes = remotes.routes

    async def routes_then_lost(engine_id: str, url: str, own: Any) -> Any:
        routes = await real_routes(engine_id, url, own)
        remotes.invalidate(engine_id)  # as when a connection to that engine broke meanwhile
        return routes

    monkeypatch.setattr(remotes_module, "fetch_engine_metadata", counting_fetch)
    monkeypatch.setattr(remotes, "routes", routes_then_lost)
    p.service.start_send("p0", "t0", [0], BLOCK, secret=harness_secret("t0"))
    d.service.start_recv("d0", "t0", "prefill", url, [0], BLOCK, secret=harness_secret("t0"))
    await wait_output(d.service, "finished_recving", "d0")
    monkeypatch.setattr(remotes, "routes", real_routes)
    p.service.start_send("p1", "t1", [1], BLOCK, secret=harness_secret("t1"))
    d.service.start_recv("d1", "t1", "prefill", url, [1], BLOCK, secret=harness_secret("t1"))
    await wait_output(d.service, "finished_recving", "d1")
    assert len(fetches) == 2


async def test_a_small_write_failing_outside_the_contract_after_d_left_still_waits_for_the_plane(
    fast_pair: tuple[Side, Side, str, StartingTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plane is asked to drain even once D's control connection is gone: the likely moment for a plane to
    misbehave is a dying D, and the write's blocks must stay held until nothing of it can move."""
    p, d, url, transport = fast_pair
    loop = asyncio.get_running_loop()
    pending: list[asyncio.Future[int]] = []
    asked: list[str | None] = []
    plane_idle = loop.create_future()

    def start_write(peer: str, descriptors: Descriptors) -> asyncio.Future[int]:
        pending.append(loop.create_future())
        return pending[-1]

    async def drained(peer: str | None = None) -> None:
        asked.append(peer)
        await plane_idle

    monkeypatch.setattr(transport, "start_write", start_write)
    monkeypatch.setattr(transport, "drained", drained)
    p.service.start_send("p0", "t0", [0], BLOCK, secret=harness_secret("t0"))
    d.service.start_recv("d0", "t0", "prefill", url, [3], BLOCK, secret=harness_secret("t0"))
    await until(lambda: pending)
    session = d.service.metadata.transport_addr
    await d.service.close()
    await until(lambda: p.service.statistics().inbound_peers == 0)
    assert p.service.statistics().inbound_peers == 0
    pending[0].set_exception(RuntimeError("a plane's bug after D left"))
    await until(lambda: asked)
    assert asked == [session] and p.service.statistics().writes_in_flight == 1
    assert "p0" not in (p.service.get_finished().finished_sending or set())
    plane_idle.set_result(None)
    await wait_output(p.service, "finished_sending", "p0")


async def test_parts_of_a_write_raise_the_failure_outside_the_contract_first() -> None:
    from kvsvc.core.errors import KVSvcTimeout
    from kvsvc.service.writing import Part, _all_written

    loop = asyncio.get_running_loop()
    drained = loop.create_future()
    refused_by_the_plane = WriteFailed("peer failed it", drained=drained)

    async def refused() -> Part:
        return refused_by_the_plane

    async def broken() -> Part:
        raise RuntimeError("a plane's bug")

    async def timed_out() -> Part:
        raise KVSvcTimeout("no room in time")

    async def landed() -> Part:
        return 64, 1

    loop.call_later(0.05, drained.set_result, None)
    with pytest.raises(RuntimeError, match="a plane's bug"):
        await _all_written([refused(), landed(), broken()])
    assert drained.done()  # the parts' failure ends only once the plane's part drained
    assert await _all_written([landed(), refused(), timed_out()]) is refused_by_the_plane
    with pytest.raises(KVSvcTimeout):
        await _all_written([landed(), timed_out()])
    assert await _all_written([landed(), landed()]) == (128, 2)


def test_the_writer_sorts_each_failure_by_the_transport_contract() -> None:
    """`_fault_kind` is where a failure becomes a row of the core's write-failure table: the plane's
    `WriteFailed`, a failure the contract allows (kvsvc's own errors, `ValueError`), or anything else."""
    from kvsvc.core.errors import PeerLost, TopologyError
    from kvsvc.core.sender import FaultKind
    from kvsvc.service.writing import _fault_kind

    assert _fault_kind(WriteFailed("peer gone")) is FaultKind.PLANE
    assert _fault_kind(TopologyError("no such layer")) is FaultKind.WITHIN_CONTRACT
    assert _fault_kind(PeerLost("closed")) is FaultKind.WITHIN_CONTRACT
    assert _fault_kind(ValueError("overlap")) is FaultKind.WITHIN_CONTRACT
    assert _fault_kind(RuntimeError("a bug")) is FaultKind.OUTSIDE_CONTRACT
    assert _fault_kind(MemoryError()) is FaultKind.OUTSIDE_CONTRACT
