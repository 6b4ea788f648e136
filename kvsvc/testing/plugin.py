"""pytest plugin of `kvsvc.testing`, loaded automatically (the `pytest11` entry point) wherever kvsvc is installed.

Fixtures:
- `fake_clock`: a `FakeClock` at 0, for `KVTransferService(clock=...)` or `Sender`/`Receiver` `now` values.
- `peer_pair`: a factory `peer_pair(p_spec, d_spec, **kwargs) -> PeerPair`: protocol objects back to back.
- `loopback_engines`: an async factory `await loopback_engines(prefill_spec, decode_spec, config=...,
  transport="mooncake", staging_bytes=0, decode_staging_bytes=None)` returning started `(P, D)` `LoopbackEngine`s on
  real Mooncake (with a staging region per worker when `staging_bytes` > 0, D's of `decode_staging_bytes` where
  given: 0 for none); all are closed at teardown.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import pytest
import pytest_asyncio

from kvsvc.service import ServiceConfig
from kvsvc.testing.clock import FakeClock
from kvsvc.testing.pair import PeerPair
from kvsvc.testing.sim import EngineSpec

LoopbackFactory = Callable[..., Awaitable[tuple[Any, Any]]]


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def peer_pair() -> Callable[..., PeerPair]:
    def make(p: EngineSpec | None = None, d: EngineSpec | None = None, **kwargs: Any) -> PeerPair:
        return PeerPair(p or EngineSpec(), d or EngineSpec(), **kwargs)

    return make


@pytest_asyncio.fixture
async def loopback_engines() -> AsyncIterator[LoopbackFactory]:
    from kvsvc.testing.engines import LoopbackEngine

    started: list[LoopbackEngine] = []

    async def make(
        prefill: EngineSpec | None = None,
        decode: EngineSpec | None = None,
        *,
        config: ServiceConfig | None = None,
        transport: Literal["mooncake", "samehost", "fake"] = "mooncake",
        clock: Callable[[], float] = time.monotonic,
        staging_bytes: int = 0,
        decode_staging_bytes: int | None = None,
    ) -> tuple[LoopbackEngine, LoopbackEngine]:
        options = dict(config=config, transport=transport, clock=clock, staging_bytes=staging_bytes)
        p = LoopbackEngine("prefill", prefill or EngineSpec(), **options)  # type: ignore[arg-type]
        started.append(p)
        await p.start()
        if decode_staging_bytes is not None:
            options["staging_bytes"] = decode_staging_bytes
        d = LoopbackEngine("decode", decode or EngineSpec(), **options)  # type: ignore[arg-type]
        started.append(d)
        await d.start()
        return p, d

    yield make
    for engine in reversed(started):
        await engine.close()
