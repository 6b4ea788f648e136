"""`OnDemand` and `worker_transport`: Mooncake starts only where a pair needs it, registers what was recorded before,
starts once however many pairs ask at once, and never where the setting forbids it."""

from __future__ import annotations

import asyncio

import pytest

from kvsvc.core.errors import InvalidDescriptor, TransportError
from kvsvc.testing.fakes import LoopbackTransport
from kvsvc.transport.base import Transport
from kvsvc.transport.mooncake import MooncakeConfig
from kvsvc.transport.ondemand import NOT_ALLOWED, OnDemand
from kvsvc.transport.routed import RoutedTransport, start_mooncake, worker_transport


class Engines:
    """A factory of fake engines that counts its calls and what each registered."""

    def __init__(self) -> None:
        self.built: list[LoopbackTransport] = []

    def __call__(self) -> Transport:
        engine = LoopbackTransport()
        self.built.append(engine)
        return engine


async def test_nothing_starts_nor_registers_until_a_pair_needs_it_and_then_once() -> None:
    engines = Engines()
    lazy = OnDemand(engines)
    lazy.register([(4096, 8192)])
    assert lazy.session_id == "" and not engines.built
    with pytest.raises(InvalidDescriptor, match="not started"):
        await lazy.write("peer", [(4096, 0, 16)])
    sessions = await asyncio.gather(*(lazy.start() for _ in range(5)))  # five pairs at once: one engine
    assert len(engines.built) == 1 and set(sessions) == {engines.built[0].session_id} != {""}
    assert engines.built[0].statistics().registered_bytes == 8192  # what was recorded before the start
    lazy.register([(65536, 4096)])  # and after it, straight to the engine
    assert engines.built[0].statistics().registered_bytes == 8192 + 4096
    await lazy.close()


async def test_samehost_never_starts_mooncake_and_says_why() -> None:
    engines = Engines()
    lazy = OnDemand(engines, allowed=False)
    with pytest.raises(TransportError, match=NOT_ALLOWED):
        await lazy.start()
    assert not engines.built


def test_a_loopback_worker_starts_mooncake_on_demand_and_a_forced_or_eager_one_at_once() -> None:
    pytest.importorskip("mooncake.engine")
    lazy = worker_transport(MooncakeConfig(), "cpu", "auto")
    assert isinstance(lazy, RoutedTransport) and isinstance(lazy.primary, OnDemand)
    assert not lazy.primary.started and lazy.session_id == ""
    never = worker_transport(MooncakeConfig(on_demand=False), "cpu", "samehost")
    assert isinstance(never, RoutedTransport) and isinstance(never.primary, OnDemand) and not never.primary.started
    with pytest.raises(TransportError, match=NOT_ALLOWED):
        asyncio.run(start_mooncake(never))
    eager = worker_transport(MooncakeConfig(on_demand=False), "cpu", "auto")
    forced = worker_transport(MooncakeConfig(), "cpu", "mooncake")
    try:
        assert isinstance(eager, RoutedTransport) and eager.session_id.startswith("127.0.0.1:")
        assert not isinstance(forced, RoutedTransport) and forced.session_id.startswith("127.0.0.1:")
    finally:
        for each in (lazy, never, eager, forced):
            asyncio.run(each.close())
