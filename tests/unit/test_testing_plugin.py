"""The pytest plugin's fixtures, used as docs/testing.md shows them."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvsvc.core.auth import harness_secret
from kvsvc.service import ServiceConfig
from kvsvc.testing import EngineSpec, FakeClock, PeerPair
from kvsvc.testing.plugin import LoopbackFactory


def test_p_tp2_to_d_tp1_moves_every_byte(peer_pair: Callable[..., PeerPair]) -> None:
    pair = peer_pair(EngineSpec(tp_size=2), EngineSpec(tp_size=1))
    pair.start_send("p-1", "t1", [0, 1, 2], 10)
    pair.start_recv("d-1", "t1", [5, 6, 7], 10)
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_reported_once(["p-1"], ["d-1"])
    pair.assert_received("t1")


def test_fake_clock_starts_at_zero_and_only_moves_when_told(fake_clock: FakeClock) -> None:
    assert fake_clock() == 0
    fake_clock.advance(2)
    assert fake_clock() == 2
    with pytest.raises(ValueError):
        fake_clock.advance(-1)


async def test_loopback_engines_with_the_fake_transport_need_no_mooncake(loopback_engines: LoopbackFactory) -> None:
    p, d = await loopback_engines(EngineSpec(tp_size=2), EngineSpec(tp_size=1), transport="fake")
    p.start_send("p-1", "t1", [0, 1, 2], 10)
    d.start_recv("d-1", "t1", p, [3, 4, 5], 10)
    assert await d.wait("d-1") == "finished"
    assert await p.wait("p-1") == "finished_sending"
    d.check_received("t1", [3, 4, 5], 10)


async def test_a_service_with_a_fake_clock_expires_a_hold_when_the_clock_says_so(
    loopback_engines: LoopbackFactory, fake_clock: FakeClock
) -> None:
    p, _ = await loopback_engines(transport="fake", config=ServiceConfig(hold_timeout_s=5), clock=fake_clock)
    service = p.services[(0, 0)]
    service.start_send("p-1", "t1", [0], 4, secret=harness_secret("t1"))
    service.check_deadlines()
    assert not service.get_finished().finished_sending
    fake_clock.advance(5)
    service.check_deadlines()
    assert service.get_finished().finished_sending == {"p-1"}
    assert service.statistics().sender.expired_holds == 1
