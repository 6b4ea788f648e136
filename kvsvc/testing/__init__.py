"""Test harness for people who embed kvsvc, and for kvsvc's own tests.

- `FakeClock`: deadlines without waiting (`KVTransferService(clock=...)`, `Sender`/`Receiver` `now`).
- `PeerPair`, `EngineSpec`: P and D protocol objects back to back, no event loop, byte-exact simulated pools.
- `LoopbackTransport` (`kvsvc.testing.fakes`): an in-process transport for unit tests of service logic.
- `kvsvc.testing.engines`: loopback P and D engines on the real Mooncake engine.
- The pytest plugin (`kvsvc.testing.plugin`, loaded automatically once kvsvc is installed) turns them into fixtures.
"""

from __future__ import annotations

from kvsvc.testing.clock import FakeClock
from kvsvc.testing.pair import PeerPair
from kvsvc.testing.sim import EngineSpec, SimEngine, kv_pattern

__all__ = ["EngineSpec", "FakeClock", "PeerPair", "SimEngine", "kv_pattern"]
