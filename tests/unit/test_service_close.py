"""`KVTransferService.close`: one close, awaited by every caller, that a cancelled caller does not cut short, and
that leaves no task of the service running."""

from __future__ import annotations

import asyncio

import pytest

from kvsvc.core.auth import harness_secret
from kvsvc.core.errors import ServiceClosed
from kvsvc.service import KVTransferService, ServiceConfig
from kvsvc.testing.fakes import LoopbackTransport
from tests.unit.test_service_wiring import make_side


class GatedTransport(LoopbackTransport):
    """A transport whose close waits for the test to open its gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.closed = False

    async def close(self) -> None:
        await self.gate.wait()
        await super().close()
        self.closed = True


async def gated_service() -> tuple[KVTransferService, GatedTransport]:
    side = make_side("engine", ServiceConfig(), 1)
    transport = GatedTransport()
    transport.register(side.transport._local.regions())
    service = KVTransferService(side.service.metadata, transport, side.service.config)
    await service.start()
    return service, transport


async def test_every_close_waits_for_the_one_close_to_end() -> None:
    service, transport = await gated_service()
    first, second = asyncio.ensure_future(service.close()), asyncio.ensure_future(service.close())
    await asyncio.sleep(0.05)
    assert not first.done() and not second.done(), "a close returned before the transport closed"
    with pytest.raises(ServiceClosed):
        service.start_send("r", "t", [0], 1, secret=harness_secret("t"))  # refused from the first call on
    transport.gate.set()
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert transport.closed
    await asyncio.wait_for(service.close(), 10)  # a later call returns at once


async def test_a_cancelled_caller_leaves_the_close_running_to_its_end() -> None:
    service, transport = await gated_service()
    caller = asyncio.ensure_future(service.close())
    await asyncio.sleep(0.05)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    transport.gate.set()
    await asyncio.wait_for(service.close(), 10)
    assert transport.closed
    assert service.statistics().tasks == 0, "a task of the service outlived its close"
