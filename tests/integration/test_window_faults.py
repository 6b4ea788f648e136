"""Windows through the service on real Mooncake, in one process (`LoopbackEngine` with staging regions whose copies
the test can hold): D reports a windowed share only after its scatter ended, also when the receive is aborted while
the scatter runs, and every window goes back; a share larger than its window moves in rounds, P at most two rounds
ahead of D's scatter, also when aborted mid-way; without room a share goes without a window; a D engine without a
region is the negative control of the scatter count; requests at other blocks reuse P's cached window stream, which
lands nothing right unshifted."""

from __future__ import annotations

import asyncio

import pytest

from kvsvc.service import ServiceConfig
from kvsvc.testing.engines import LoopbackEngine
from kvsvc.testing.plugin import LoopbackFactory
from kvsvc.testing.sim import EngineSpec

pytestmark = pytest.mark.integration

# Each P worker fills every other head range of D's blocks: a share of 128 KiB in 32 pieces, or 4 runs in P.
GEOMETRY = dict(num_layers=4, num_kv_heads=4, head_size=64, block_size=16, num_blocks=16)
P_SPEC = EngineSpec(tp_size=2, **GEOMETRY)  # type: ignore[arg-type]
D_SPEC = EngineSpec(tp_size=1, **GEOMETRY)  # type: ignore[arg-type]
BLOCKS, TOKENS = [3, 4, 5, 6], 64


def _scattered(d: LoopbackEngine) -> int:
    return sum(s.statistics().scattered_receives for s in d.services.values())


def _lent(*engines: LoopbackEngine) -> int:
    return sum(s.statistics().staging_in_use for e in engines for s in e.services.values())


async def _until(condition: object, timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("d_region", [True, False], ids=["windows", "negative control: no D region"])
async def test_each_p_worker_writes_its_share_into_a_window_that_d_scatters(
    loopback_engines: LoopbackFactory, d_region: bool
) -> None:
    p, d = await loopback_engines(P_SPEC, D_SPEC, staging_bytes=1 << 20, decode_staging_bytes=None if d_region else 0)
    p.start_send("p1", "t1", [0, 1, 2, 3], TOKENS)
    d.start_recv("d1", "t1", p, BLOCKS, TOKENS)
    assert await d.wait("d1") == "finished"
    assert await p.wait("p1") == "finished_sending"
    d.check_received("t1", BLOCKS, TOKENS)
    assert _scattered(d) == (2 if d_region else 0)
    assert _lent(p, d) == 0 and p.holds() == 0 and d.holds() == 0


async def test_an_abort_while_d_scatters_is_reported_only_after_the_scatter(loopback_engines: LoopbackFactory) -> None:
    p, d = await loopback_engines(P_SPEC, D_SPEC, staging_bytes=1 << 20)
    d.copies.gate.clear()  # D's scatters start and wait
    p.start_send("p1", "t1", [0, 1, 2, 3], TOKENS)
    d.start_recv("d1", "t1", p, BLOCKS, TOKENS)
    await _until(lambda: d.copies.scatters == 2)  # both shares landed in their windows; P answered done
    d.abort("d1")
    await asyncio.sleep(0.3)  # P answers the abort meanwhile
    kv = d.collect()
    assert "d1" not in (kv.finished_recving or set()) | (kv.failed_recving or set())  # blocks still being written
    assert _lent(d) > 0
    d.copies.gate.set()
    assert await d.wait("d1") == "failed"  # aborted by D, its blocks invalid
    assert await p.wait("p1") == "finished_sending"
    await _until(lambda: _lent(p, d) == 0)
    assert p.holds() == 0 and d.holds() == 0


async def test_a_share_larger_than_its_window_moves_in_rounds(loopback_engines: LoopbackFactory) -> None:
    p, d = await loopback_engines(P_SPEC, D_SPEC, staging_bytes=64 << 10)  # windows of 32 KiB: 8 rounds of 16
    p.start_send("p1", "t1", [0, 1, 2, 3], TOKENS)
    d.start_recv("d1", "t1", p, BLOCKS, TOKENS)
    assert await d.wait("d1") == "finished"
    assert await p.wait("p1") == "finished_sending"
    d.check_received("t1", BLOCKS, TOKENS)
    assert _scattered(d) == 2 and d.copies.scatters == 2 * 8
    assert _lent(p, d) == 0


async def test_p_fills_at_most_two_rounds_ahead_of_ds_scatter(loopback_engines: LoopbackFactory) -> None:
    p, d = await loopback_engines(P_SPEC, D_SPEC, staging_bytes=64 << 10)
    d.copies.gate.clear()  # D's scatters start and wait: P may fill both halves, then must wait
    p.start_send("p1", "t1", [0, 1, 2, 3], TOKENS)
    d.start_recv("d1", "t1", p, BLOCKS, TOKENS)
    await _until(lambda: d.copies.scatters == 2)  # round 0 of each P worker's share
    windows = d.services[(0, 0)]._receiving._windows.lent_windows()
    await _until(lambda: all(len(w.queue) == 1 for w in windows))  # round 1 filled, waiting behind round 0
    await asyncio.sleep(0.3)  # room for a wrong round 2 to arrive
    assert len(windows) == 2 and all([m.round for m in w.queue] == [1] for w in windows)  # type: ignore[attr-defined]
    assert d.copies.scatters == 2
    d.abort("d1")  # while rounds are in flight
    await asyncio.sleep(0.2)
    assert "d1" not in (d.collect().failed_recving or set())
    d.copies.gate.set()  # D ends round 0's scatter and only acknowledges the rest: P stops at its next round
    assert await d.wait("d1") == "failed"
    assert await p.wait("p1") == "finished_sending"
    await _until(lambda: _lent(p, d) == 0)
    assert p.holds() == 0 and d.holds() == 0
    assert d.copies.scatters == 2  # nothing scattered after the abort
    assert sum(s.statistics().write_failures for s in p.services.values()) == 2  # both writes stopped early


async def test_without_room_for_a_window_the_share_goes_without_one(loopback_engines: LoopbackFactory) -> None:
    p, d = await loopback_engines(P_SPEC, D_SPEC, staging_bytes=2)  # no window of 2 bytes or more can be lent
    p.start_send("p1", "t1", [0, 1, 2, 3], TOKENS)
    d.start_recv("d1", "t1", p, BLOCKS, TOKENS)
    assert await d.wait("d1") == "finished"
    assert await p.wait("p1") == "finished_sending"
    d.check_received("t1", BLOCKS, TOKENS)
    assert _scattered(d) == 0 and _lent(p, d) == 0


async def test_a_receive_that_expires_with_its_windows_lent_gives_them_back() -> None:
    config = ServiceConfig(recv_timeout_s=0.5, abort_grace_s=1.0, hold_timeout_s=5.0)
    p = await LoopbackEngine("prefill", P_SPEC, config=config, staging_bytes=1 << 20).start()
    d = await LoopbackEngine("decode", D_SPEC, config=config, staging_bytes=1 << 20).start()
    try:
        d.start_recv("d1", "t1", p, BLOCKS, TOKENS)  # P never holds t1: the request waits early on P
        await _until(lambda: _lent(d) > 0)  # the windows are lent with the requests
        assert await d.wait("d1") == "failed"
        await _until(lambda: _lent(d) == 0)
    finally:
        await d.close()
        await p.close()


@pytest.mark.parametrize("staging_bytes", [1 << 20, 0], ids=["gathered per layer", "negative control: no region"])
async def test_a_layer_wise_send_is_gathered_layer_by_layer(
    loopback_engines: LoopbackFactory, staging_bytes: int
) -> None:
    # P tp1 -> D tp2: each D worker's heads are every other half of P's blocks, contiguous in D: a gather on P.
    p, d = await loopback_engines(D_SPEC, P_SPEC, staging_bytes=staging_bytes)
    loop = asyncio.get_running_loop()
    layers = {w: [loop.create_future() for _ in range(GEOMETRY["num_layers"])] for w in p.workers}
    p.start_send("p1", "t1", [0, 1, 2, 3], TOKENS, ready=layers)
    d.start_recv("d1", "t1", p, BLOCKS, TOKENS)
    for futures in layers.values():
        for future in futures[:-1]:
            future.set_result(None)
    await asyncio.sleep(0.3)
    assert "d1" not in (d.collect().finished_recving or set())  # the last layer is still computing
    for futures in layers.values():
        futures[-1].set_result(None)
    assert await d.wait("d1") == "finished"
    assert await p.wait("p1") == "finished_sending"
    d.check_received("t1", BLOCKS, TOKENS)
    (stats,) = (s.statistics() for s in p.services.values())
    if staging_bytes:  # per D worker, one gather and one write per layer
        assert stats.staged_writes == 2 * 4 and stats.descriptors_sent == 2 * 4
    else:  # per D worker, per layer: a piece per block and K/V
        assert stats.staged_writes == 0 and stats.descriptors_sent == 2 * 4 * 4 * 2
    # The layer-wise figures, per D worker's write: each layer's copy; the last layer, waited for, and what followed
    # it; no layer's compute, as the first three were done before the write began.
    assert (stats.layer_copy.count, stats.after_last_layer.count, stats.layer_compute.count) == (2 * 4, 2, 0)
    assert _lent(p, d) == 0 and p.holds() == 0 and d.holds() == 0


async def test_a_layer_wise_send_whose_layers_are_all_computed_goes_as_one_write(
    loopback_engines: LoopbackFactory,
) -> None:
    """D asks after P's forward ended (pull, or a push whose D came late): nothing is left to stream, so each D
    worker's share goes as one submission, not one per layer."""
    p, d = await loopback_engines(D_SPEC, P_SPEC, staging_bytes=1 << 20)
    loop = asyncio.get_running_loop()
    layers = {w: [loop.create_future() for _ in range(GEOMETRY["num_layers"])] for w in p.workers}
    for futures in layers.values():
        for future in futures:
            future.set_result(None)
    p.start_send("p1", "t1", [0, 1, 2, 3], TOKENS, ready=layers)
    d.start_recv("d1", "t1", p, BLOCKS, TOKENS)
    assert await d.wait("d1") == "finished"
    assert await p.wait("p1") == "finished_sending"
    d.check_received("t1", BLOCKS, TOKENS)
    (stats,) = (s.statistics() for s in p.services.values())
    assert stats.layer_copy.count == 0  # no write went layer by layer
    # Per D worker, one gather and one write (layer by layer it would be four), a descriptor per layer of D's pool.
    assert (stats.staged_writes, stats.descriptors_sent) == (2, 2 * 4)


async def test_a_layer_wise_send_measures_each_layer_it_waited_for(loopback_engines: LoopbackFactory) -> None:
    """P's layers are computed one by one while its writes wait (push): the figures hold the compute of each layer
    after the first, each layer's copy and what followed the last layer, per write to a D worker."""
    p, d = await loopback_engines(D_SPEC, P_SPEC)
    loop = asyncio.get_running_loop()
    (futures,) = ([loop.create_future() for _ in range(GEOMETRY["num_layers"])] for _ in p.workers)
    (service,) = p.services.values()
    p.start_send("p1", "t1", [0, 1, 2, 3], TOKENS, ready={w: futures for w in p.workers})
    d.start_recv("d1", "t1", p, BLOCKS, TOKENS)
    await _until(lambda: service.statistics().writes_in_flight == 2)  # both D workers' writes are started...
    await asyncio.sleep(0.05)  # ...and have run to their wait for layer 0 (a yield, not a timed assertion)
    for future in futures:
        future.set_result(None)
        await asyncio.sleep(0.02)  # the next layer computes
    assert await d.wait("d1") == "finished"
    d.check_received("t1", BLOCKS, TOKENS)
    stats = service.statistics()
    assert (stats.layer_compute.count, stats.layer_copy.count, stats.after_last_layer.count) == (2 * 3, 2 * 4, 2)
    assert stats.layer_compute.total >= 0.8 * 2 * 3 * 0.02  # about the nap between two layers each, at the least


async def test_a_receive_that_ends_while_its_window_scatters_is_reported_after_the_scatter() -> None:
    # The receive expires and its abort grace passes while D's first scatter is held: the Receiver ends it, but the
    # report, which frees its blocks for the engine, waits until the copy into them ended.
    config = ServiceConfig(recv_timeout_s=1.0, abort_grace_s=0.5, hold_timeout_s=30.0)
    p = await LoopbackEngine("prefill", P_SPEC, config=config, staging_bytes=64 << 10).start()
    d = await LoopbackEngine("decode", D_SPEC, config=config, staging_bytes=64 << 10).start()
    try:
        d.copies.gate.clear()
        p.start_send("p1", "t1", [0, 1, 2, 3], TOKENS)
        d.start_recv("d1", "t1", p, BLOCKS, TOKENS)
        await _until(lambda: d.copies.scatters == 2)
        receiving = d.services[(0, 0)]._receiving
        await _until(lambda: receiving._receiver.req_of("t1") is None)  # ended: expiry, then the grace
        for _ in range(5):
            assert "d1" not in (d.collect().failed_recving or set())
            await asyncio.sleep(0.05)
        d.copies.gate.set()
        assert await d.wait("d1") == "failed"
        assert await p.wait("p1") == "finished_sending"
        await _until(lambda: _lent(p, d) == 0)
    finally:
        d.copies.gate.set()
        await d.close()
        await p.close()


@pytest.mark.parametrize("wait_s", [5.0, 0.0], ids=["waits for room", "negative control: never waits"])
async def test_a_request_waits_for_room_for_its_window(loopback_engines: LoopbackFactory, wait_s: float) -> None:
    # Room for one request's two windows of 128 KiB at a time; two requests at once.
    config = ServiceConfig(window_wait_s=wait_s)
    p, d = await loopback_engines(P_SPEC, D_SPEC, config=config, staging_bytes=256 << 10)
    blocks = {"1": [0, 1, 2, 3], "2": [8, 9, 10, 11]}
    for name, ids in blocks.items():
        p.start_send(f"p{name}", f"t{name}", ids, TOKENS)
    for name, ids in blocks.items():
        d.start_recv(f"d{name}", f"t{name}", p, ids, TOKENS)
    for name, ids in blocks.items():
        assert await d.wait(f"d{name}") == "finished"
        assert await p.wait(f"p{name}") == "finished_sending"
        d.check_received(f"t{name}", ids, TOKENS)
    assert _scattered(d) == (4 if wait_s else 2)  # without waiting, the second request's shares go direct
    assert _lent(p, d) == 0 and p.holds() == 0 and d.holds() == 0


@pytest.mark.parametrize("staging_bytes", [1 << 20, 0], ids=["gathered", "negative control: refused without"])
async def test_the_same_heads_in_two_orders_move_when_p_can_gather(
    loopback_engines: LoopbackFactory, staging_bytes: int
) -> None:
    # HND on P, NHD on D, 4 heads on each: a transposition of every token, gathered into D's order on P.
    p_spec = EngineSpec(layout="HND", **GEOMETRY)  # type: ignore[arg-type]
    d_spec = EngineSpec(layout="NHD", **GEOMETRY)  # type: ignore[arg-type]
    p, d = await loopback_engines(p_spec, d_spec, staging_bytes=staging_bytes)
    p.start_send("p1", "t1", [0, 1, 2, 3], TOKENS)
    d.start_recv("d1", "t1", p, BLOCKS, TOKENS)
    if not staging_bytes:
        assert await d.wait("d1") == "failed"  # refused when D met P's engine, with the reason
        p.abort("p1")
        return
    assert await d.wait("d1") == "finished"
    assert await p.wait("p1") == "finished_sending"
    d.check_received("t1", BLOCKS, TOKENS)
    (stats,) = (s.statistics() for s in p.services.values())
    assert stats.staged_writes == 1 and stats.descriptors_sent <= 4  # one run per layer, not one per (token, head)
    assert _lent(p, d) == 0 and p.holds() == 0 and d.holds() == 0


async def test_an_aborted_request_stops_waiting_for_room(loopback_engines: LoopbackFactory) -> None:
    config = ServiceConfig(window_wait_s=30.0)  # longer than the test: only the abort can end the wait
    p, d = await loopback_engines(P_SPEC, D_SPEC, config=config, staging_bytes=256 << 10)
    d.copies.gate.clear()  # the first request's windows stay lent while their scatters wait
    p.start_send("p1", "t1", [0, 1, 2, 3], TOKENS)
    p.start_send("p2", "t2", [8, 9, 10, 11], TOKENS)
    d.start_recv("d1", "t1", p, [0, 1, 2, 3], TOKENS)
    await _until(lambda: d.copies.scatters == 2)
    d.start_recv("d2", "t2", p, [8, 9, 10, 11], TOKENS)
    receiving = d.services[(0, 0)]._receiving
    await _until(lambda: receiving._windows.waiting_for_room == 2)  # both of t2's shares wait for room
    d.abort("d2")
    assert await d.wait("d2") == "failed"
    assert receiving._windows.waiting_for_room == 0
    d.copies.gate.set()
    assert await d.wait("d1") == "finished"
    d.check_received("t1", [0, 1, 2, 3], TOKENS)
    await _until(lambda: _lent(p, d) == 0)
    p.abort("p2")
    assert await p.wait("p1") == "finished_sending"


@pytest.mark.parametrize("shift", [True, False], ids=["cached stream shifted", "negative control: sources not shifted"])
async def test_requests_at_other_blocks_reuse_ps_cached_window_stream_byte_exact(
    loopback_engines: LoopbackFactory, monkeypatch: pytest.MonkeyPatch, shift: bool
) -> None:
    # The first request caches each P worker's window stream and its gathered chunks; the later ones, at other block
    # offsets on both sides, shift them (the sources by P's blocks, the chunks to their windows).
    if not shift:
        from kvsvc.service import writing

        real = writing.shift_chunks
        monkeypatch.setattr(writing, "shift_chunks", lambda chunks, src, dst: real(chunks, 0, dst))
    p, d = await loopback_engines(P_SPEC, D_SPEC, staging_bytes=1 << 20)
    requests = [([0, 1, 2, 3], [3, 4, 5, 6]), ([8, 9, 10, 11], [0, 1, 2, 3]), ([4, 5, 6, 7], [9, 10, 11, 12])]
    landed = []
    for i, (p_blocks, d_blocks) in enumerate(requests):
        p.start_send(f"p{i}", f"t{i}", p_blocks, TOKENS)
        d.start_recv(f"d{i}", f"t{i}", p, d_blocks, TOKENS)
        assert await d.wait(f"d{i}") == "finished"
        assert await p.wait(f"p{i}") == "finished_sending"
        try:
            d.check_received(f"t{i}", d_blocks, TOKENS)
            landed.append(True)
        except AssertionError:
            landed.append(False)
    assert _scattered(d) == 2 * len(requests)
    assert landed == ([True, True, True] if shift else [True, False, False])
    assert _lent(p, d) == 0 and p.holds() == 0 and d.holds() == 0
