"""The asyncio transfer service each worker embeds, and its thread-safe facade."""

from __future__ import annotations

from kvsvc.service.config import ServiceConfig
from kvsvc.service.service import (
    KVTransferService,
    ServiceStatistics,
    ServiceThread,
    new_incarnation,
    new_transfer_secret,
)

__all__ = [
    "KVTransferService",
    "ServiceConfig",
    "ServiceStatistics",
    "ServiceThread",
    "new_incarnation",
    "new_transfer_secret",
]
