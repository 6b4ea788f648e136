"""The embedders' harness on real Mooncake: `loopback_engines` gives started P and D engines in this process."""

from __future__ import annotations

import pytest

from kvsvc.service import ServiceConfig
from kvsvc.testing.engines import LoopbackEngine
from kvsvc.testing.plugin import LoopbackFactory
from kvsvc.testing.sim import EngineSpec

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("p_spec", "d_spec", "d_blocks"),
    [
        (EngineSpec(tp_size=1), EngineSpec(tp_size=2), [7, 1, 9, 12]),
        (EngineSpec(pp_size=2), EngineSpec(tp_size=2, block_size=8), [7, 1]),
    ],
    ids=["tp1-to-tp2", "pp2-to-tp2-block8"],
)
async def test_loopback_engines_move_every_byte_over_mooncake(
    loopback_engines: LoopbackFactory, p_spec: EngineSpec, d_spec: EngineSpec, d_blocks: list[int]
) -> None:
    p: LoopbackEngine
    d: LoopbackEngine
    p, d = await loopback_engines(p_spec, d_spec)
    p.start_send("p1", "t1", [2, 3, 4, 5], 13)
    d.start_recv("d1", "t1", p, d_blocks, 13)
    assert await d.wait("d1") == "finished"
    assert await p.wait("p1") == "finished_sending"
    d.check_received("t1", d_blocks, 13)
    assert p.holds() == 0 and d.holds() == 0


async def test_a_prefix_d_holds_already_is_left_as_it_is(loopback_engines: LoopbackFactory) -> None:
    p, d = await loopback_engines(EngineSpec(block_size=4), EngineSpec(tp_size=2, block_size=4))
    d_blocks = [7, 1, 9, 12]
    for worker in d.workers:  # D's own prefix (its prefix cache) in the first two blocks
        d.sim.arenas[worker][:] = 0x3C
    p.start_send("p1", "t1", [2, 3, 4, 5], 14)
    d.start_recv("d1", "t1", p, d_blocks, 14, first_token=8)
    assert await d.wait("d1") == "finished"
    assert await p.wait("p1") == "finished_sending"
    d.check_received("t1", d_blocks, 14, first_token=8)
    for worker in d.workers:
        prefix = d.sim.tokens(worker, 0, d_blocks, 8)
        assert (prefix == 0x3C).all(), "a block D held already was written"
    assert p.holds() == 0 and d.holds() == 0


async def test_a_decode_abort_reaches_the_prefill_engine(loopback_engines: LoopbackFactory) -> None:
    p, d = await loopback_engines(config=ServiceConfig(hold_timeout_s=30, early_request_timeout_s=30))
    d.start_recv("d1", "never-sent", p, [1], 4)
    d.abort("d1")
    assert await d.wait("d1") == "failed"
    p.start_send("p1", "never-sent", [1], 4)
    # P learnt of the abort before it held the transfer: the hold ends at once, not after 30 s.
    assert await p.wait("p1", timeout_s=10) == "finished_sending"
    assert p.holds() == 0 and d.holds() == 0


def test_the_harness_detects_a_wrong_byte(fake_clock: object) -> None:
    engine = LoopbackEngine("decode", EngineSpec())
    engine.sim.arenas[(0, 0)][:] = 7
    with pytest.raises(AssertionError, match=r"decode\(0, 0\) layer 0: token 0 of 't1' is wrong"):
        engine.check_received("t1", [0], 4)


async def test_a_load_slower_than_its_bound_is_logged_once_with_its_peers_plane_bytes_and_phases(
    loopback_engines: LoopbackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # A bound of 1 ns makes every load slow; the default (1 s) leaves the second pair's quiet (the negative control).
    caplog.set_level("WARNING", logger="kvsvc")
    pairs = [(await loopback_engines(config=ServiceConfig(slow_transfer_s=1e-9)), "slow")]
    pairs.append((await loopback_engines(), "quiet"))
    for (p, d), tag in pairs:
        p.start_send(f"p-{tag}", tag, [0, 1, 2, 3], 13)
        d.start_recv(f"d-{tag}", tag, p, [4, 5, 6, 7], 13)
        assert await d.wait(f"d-{tag}") == "finished"
        assert await p.wait(f"p-{tag}") == "finished_sending"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow transfer")]
    assert len(lines) == 1, lines
    [line] = lines
    (p, _), _ = pairs[0]
    assert "request d-slow (transfer slow)" in line and f"from engine {p.engine_id!r}, P workers [(0, 0)]" in line
    assert "plane mooncake" in line and "handshake" in line and "waiting at P" in line and "P's write" in line
    sent = sum(service.statistics().bytes_sent for service in p.services.values())
    assert f": {sent} bytes in " in line and sent > 0
