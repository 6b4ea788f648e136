"""The data planes behind a small `Transport` protocol: Mooncake, the same-host plane (`kvsvc.transport.samehost`),
the GPU plane (`kvsvc.transport.cuda_ipc`) and the transport that routes each peer to one of them
(`kvsvc.transport.routed`); a loopback fake for unit tests is in `kvsvc.testing.fakes`.

Imports: `kvsvc.transport.base` eagerly; `MooncakeTransport` is importable from here without the `mooncake` package
(it imports the engine only when constructed). Invariant: nothing here imports torch or starts an engine on import.
"""

from __future__ import annotations

from kvsvc.core.errors import InvalidDescriptor
from kvsvc.core.planner import AddressRanges, Region, check_descriptors
from kvsvc.transport.base import Transport, TransportClosed, TransportStatistics, WriteFailed
from kvsvc.transport.mooncake import MooncakeConfig, MooncakeTransport

__all__ = [
    "AddressRanges",
    "InvalidDescriptor",
    "MooncakeConfig",
    "MooncakeTransport",
    "Region",
    "Transport",
    "TransportClosed",
    "TransportStatistics",
    "WriteFailed",
    "check_descriptors",
]
