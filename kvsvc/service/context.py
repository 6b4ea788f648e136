"""What the two roles of one worker's service share, handed to each explicitly: `ServiceContext`.

Rules: the P role (`kvsvc.service.sending`) and the D role (`kvsvc.service.receiving`) never import or call each
other; everything they both need is here, built by `KVTransferService` and injected, so a test can pass fakes.
Only `metadata` ever changes, once, when `start` fills in the bound addresses. Imports types and values only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvsvc.histogram import LatencyHistogram
from kvsvc.jobs import Notice
from kvsvc.messages import Worker, WorkerMetadata
from kvsvc.service.config import ServiceConfig
from kvsvc.service.staging_area import StagingArea
from kvsvc.service.tasks import TaskGroup
from kvsvc.transport.base import Transport

EngineMetadata = dict[Worker, WorkerMetadata]

log = logging.getLogger("kvsvc.service")

COUNTERS = (
    "bytes",
    "descriptors",
    "transfers",
    "write_failures",
    "protocol_errors",
    "reconnects",
    "staged",
    "scattered",
)
"""The service's monotonic counters (`ServiceContext.counts`), reported as deltas by `get_finished`."""


@dataclass(slots=True, eq=False)
class ServiceContext:
    metadata: WorkerMetadata
    """This worker's metadata; replaced by `KVTransferService.start` with its transport and control addresses."""
    config: ServiceConfig
    transport: Transport
    clock: Callable[[], float]
    counts: dict[str, int]
    """The counters named in `COUNTERS`, bumped by either role."""
    tasks: TaskGroup
    """Every task either role starts (connections, fetches, writes, timers): `close` cancels what is left."""
    wake: asyncio.Event
    """Set by `changed`: the deadline timer re-reads the deadlines."""
    reports: asyncio.Event
    """Set by `changed`: `wait_for_reports` wakes, `get_finished` may have something new."""
    send_durations: LatencyHistogram
    """P: from a write's start (D's request met the held KV) to its last byte landed; layer-wise writes include
    the wait for their layers."""
    recv_durations: LatencyHistogram
    """D: from `start_recv` to the receive finished with its KV landed."""
    staging: StagingArea | None = None
    """The staging region: P's writes gather into it when `StagingArea.rule` picks it, D lends windows of it; None
    writes every plan direct."""

    def changed(self) -> None:
        """A protocol object took an event: a deadline may have moved and a transfer may have ended. Each role
        calls this where it carries out its protocol object's commands (the one place that signals)."""
        self.wake.set()
        self.reports.set()


def notice(ctx: ServiceContext, what: Notice) -> None:
    """Carry out a protocol object's `Notice`: log it, and count a protocol error if it is one."""
    if what.protocol_error:
        ctx.counts["protocol_errors"] += 1
    log.log(logging.DEBUG if what.level == "debug" else logging.WARNING, "%s", what.text)
