"""`KVTransferService`: the asyncio driver of one worker's transfers, embedded in each GPU worker.

Rules: all protocol decisions live in the sans-IO `Sender` (P role) and `Receiver` (D role); a worker plays both
roles at once, each driven by its own module (`sending.SendingRole`, `receiving.ReceivingRole`) that shares only
the `ServiceContext` built here. This module is the public facade and the lifecycle: it wires the roles, runs the
deadline timer and merges their reports. Every public method runs on the service's event loop and never blocks it;
`kvsvc.service.threaded` drives it from other threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from msgspec.structs import replace

from kvsvc.core.errors import KVSvcError, ServiceClosed
from kvsvc.core.histogram import STAGE_BUCKETS, HistogramStatistics, LatencyHistogram
from kvsvc.core.messages import WorkerMetadata, check_own_metadata
from kvsvc.core.outputs import KVConnectorOutput
from kvsvc.core.receiver import ReceiverStatistics
from kvsvc.core.requests import RecvRequest, SendRequest, check_recv, check_send
from kvsvc.core.sender import SenderStatistics
from kvsvc.core.topology import TransferTopology
from kvsvc.service.config import ServiceConfig
from kvsvc.service.context import COUNTERS, EngineMetadata, PeerLog, ServiceContext
from kvsvc.service.receiving import ReceivingRole
from kvsvc.service.sending import SendingRole
from kvsvc.service.staging_area import StagingArea
from kvsvc.service.tasks import TaskGroup
from kvsvc.transport.base import Transport, TransportStatistics

log = logging.getLogger(__name__)
REMEMBERED_REASONS = 1024


_NONE_YET = LatencyHistogram().statistics()  # frozen: one snapshot may stand for every empty histogram
_NO_STAGE_YET = LatencyHistogram(STAGE_BUCKETS).statistics()


@dataclass(frozen=True, slots=True)
class ServiceStatistics:
    """How full everything is; read by the admin endpoints and metrics."""

    sender: SenderStatistics
    receiver: ReceiverStatistics
    inbound_peers: int
    outbound_peers: int
    remote_engines: int
    writes_in_flight: int
    bytes_sent: int
    descriptors_sent: int
    transfers_sent: int
    write_failures: int
    protocol_errors: int
    # D: tries to reach a lost P worker again while receives waited on it (docs/decisions.md, "After a lost
    # connection, D's blocks wait for proof")
    reconnects: int
    tasks: int  # tasks the service runs now (connections, fetches, writes, timers): 0 once closed
    transport: TransportStatistics
    send_durations: HistogramStatistics  # P: write start to last byte landed, per write to one D worker
    recv_durations: HistogramStatistics  # D: start_recv to KV landed, per receive
    staged_writes: int = 0  # P: writes to one D worker that went through the staging region
    scattered_receives: int = 0  # D: shares from one P worker that came through a window and were scattered
    staging_in_use: int = 0  # bytes of the staging region lent now, gathers and windows (0 when idle, else a leak)
    staging_waits: int = 0  # P: gathers that had to wait for room
    control_connections: int = 0  # P: control connections open now, accepted or before their hello
    # P's layer-wise writes (`ServiceContext.layer_compute`, `layer_copy`, `after_last_layer`)
    layer_compute: HistogramStatistics = _NONE_YET
    layer_copy: HistogramStatistics = _NONE_YET
    after_last_layer: HistogramStatistics = _NONE_YET
    # The parts of staged writes (`ServiceContext.staged_room`...)
    staged_room: HistogramStatistics = _NO_STAGE_YET
    staged_gather: HistogramStatistics = _NO_STAGE_YET
    staged_write: HistogramStatistics = _NO_STAGE_YET
    round_wait: HistogramStatistics = _NO_STAGE_YET
    window_room: HistogramStatistics = _NO_STAGE_YET
    window_scatter: HistogramStatistics = _NO_STAGE_YET

    @property
    def holds(self) -> int:
        """Requests P still holds plus receives D still waits for: 0 when nothing leaked."""
        return self.sender.holds + self.receiver.receives


class KVTransferService:
    """One worker's transfer service (see module docstring).

    Lifecycle: construct with the worker's metadata (addresses of its registered KV pool) and a transport whose
    pool is registered, `await start()` (returns the metadata to publish), optionally `set_engine_metadata`, then
    `start_send` / `start_recv` / `abort` / `get_finished` from the loop, and `await close()` last.
    """

    def __init__(
        self,
        metadata: WorkerMetadata,
        transport: Transport,
        config: ServiceConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        staging: StagingArea | None = None,
    ) -> None:
        """`staging`: a staging region registered with `transport`, for writes the staging rule picks (P side).

        Raises:
            ValueError: a field of `metadata` is past what peers decode (`kvsvc.core.messages.check_own_metadata`).
        """
        check_own_metadata(metadata)
        self.config = config or ServiceConfig()
        self._ctx = ServiceContext(
            metadata=metadata,
            config=self.config,
            transport=transport,
            clock=clock,
            counts=dict.fromkeys(COUNTERS, 0),
            tasks=TaskGroup(),
            wake=asyncio.Event(),
            reports=asyncio.Event(),
            send_durations=LatencyHistogram(),
            recv_durations=LatencyHistogram(),
            peer_log=PeerLog(clock),
            staging=staging,
        )
        self._sending = SendingRole(self._ctx)
        self._receiving = ReceivingRole(self._ctx)
        self._closed: asyncio.Future[None] | None = None  # the one close, which every `close()` call awaits
        self._reasons: dict[str, str] = {}  # why recent receives failed, oldest first
        self._reported = dict(self._ctx.counts)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    @property
    def metadata(self) -> WorkerMetadata:
        """This worker's metadata, with its transport and control addresses once started."""
        return self._ctx.metadata

    @property
    def topology(self) -> TransferTopology:
        """The remote engines this worker receives from, as vLLM's `TransferTopology` sees them."""
        return self._receiving.topology

    async def start(self) -> WorkerMetadata:
        """Bind the control server and start the deadline timer; returns the metadata to publish.

        Raises:
            OSError: the control address cannot be bound.
        """
        port = await self._sending.listen()
        staging = self._ctx.staging
        self._ctx.metadata = replace(
            self._ctx.metadata,
            transport_addr=self._ctx.transport.session_id,
            # Forced to Mooncake, a worker offers no same-host plane to anyone.
            samehost_addr="" if self.config.transport == "mooncake" else self._ctx.transport.local_session_id,
            control_addr=f"{self.config.control_host}:{port}",
            # P writes windows only into the region D published (D lends them only where it can scatter).
            staging_addr=staging.addr if staging is not None else 0,
            staging_size=staging.size if staging is not None else 0,
            accepts_windows=True,
        )
        self._receiving.start()
        self._ctx.tasks.spawn(self._deadline_loop(), name="kvsvc-deadlines")
        return self._ctx.metadata

    def set_engine_metadata(self, metas: EngineMetadata) -> None:
        """This worker's own engine (all its workers), as the engine core merged it; needed by D workers of
        engines with pp_size > 1 to tell P how the engine splits layers.

        Raises:
            ValueError: `metas` lacks this worker or disagrees with its layout.
        """
        self._receiving.set_own_engine(metas)

    async def close(self) -> None:
        """Stop accepting work, let in-flight writes drain (up to `close_drain_timeout_s`), answer failed every D
        request still waiting (so D need not wait for its deadlines), then cancel every task the service started
        and close its connections and the transport. What was not reported (every hold ends, as aborted) stays in
        `get_finished`.

        Idempotent: every call, concurrent or later, waits for the one close to end. Cancelling a caller does not
        cancel the close: it runs on to its end (its waits are bounded: the writes' drain, then the transport's
        close), and only that caller gets `CancelledError`; call `close` again to wait for the end. New calls
        raise `ServiceClosed` from the moment the first `close` is called.
        """
        if self._closed is None:
            self._sending.stop_accepting()  # no new work from here on (`_check_open`)
            self._closed = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closed)

    async def _close(self) -> None:
        await self._sending.wait_writes()
        self._sending.shut_down()  # D's waiting receives fail now, not at their deadlines
        self._ctx.tasks.cancel()
        self._receiving.close_connections()
        self._sending.close_connections()
        await self._ctx.tasks.wait()
        await self._sending.wait_closed()
        await self._receiving.close()
        await self._ctx.transport.close()

    # -- the engine's calls ------------------------------------------------------------------------------------

    def send(self, request: SendRequest, ready: Awaitable[None] | Sequence[Awaitable[None]] | None = None) -> None:
        """Hold `request.req_id`'s KV in its blocks until the D workers that need it fetched it, or the hold expires;
        only a D worker whose receive presents the request's secret is served. The request is checked here, once
        (`kvsvc.core.requests.check_send`); below this call it travels as it is. A repeat for a held transfer is a
        no-op.

        `ready` is the completion of the compute that wrote the KV: None when it is done already, one awaitable
        for the whole request, or one per local layer (in layer order) for layer-wise sends, where a layer goes
        as soon as its own compute finished.

        Raises:
            ServiceClosed: `close` was called.
            ValueError: as `check_send` (a block id outside this worker's pool, blocks that cannot hold the tokens,
                a secret too short or too long, a transfer id longer than `kvsvc.core.messages.MAX_NAME_CHARS`),
                `ready` has not one future per local layer, or the transfer is held already for another request or
                with another secret.
        """
        self._check_open()
        check_send(self._ctx.metadata, request)
        self._sending.send(request, ready)

    def start_send(
        self,
        req_id: str,
        transfer_id: str,
        block_ids: list[int],
        num_tokens: int,
        ready: Awaitable[None] | Sequence[Awaitable[None]] | None = None,
        *,
        secret: str | None = None,
    ) -> str:
        """`send` from its fields, for an embedder: returns the transfer's secret, for D's `start_recv`. `secret`:
        the one the engine drew for this transfer (every P worker of the engine holds it with the same one); None
        draws a fresh one (`new_transfer_secret`), which suits an engine of one worker.

        Raises:
            as `send`.
        """
        secret = new_transfer_secret() if secret is None else secret
        self.send(SendRequest(req_id, transfer_id, tuple(block_ids), num_tokens, secret), ready)
        return secret

    def recv(self, request: RecvRequest) -> None:
        """Receive tokens `[first_token, num_tokens)` of `request.transfer_id` from engine `request.engine_id`
        (bootstrap endpoint `request.bootstrap_addr`) into its blocks, where token t goes to block `block_ids[t //
        block_size]`: a `first_token` > 0 leaves the prefix this engine holds already (its prefix cache) untouched.
        The secret is the transfer's as P's `send` held it (P treats a request without it as one for a transfer it
        does not hold). The request is checked here, once (`kvsvc.core.requests.check_recv`). The outcome appears
        once in `get_finished` (finished, or failed with its blocks invalid). A repeat of a transfer being received
        is a no-op. Never waits on the handshake.

        Raises:
            ServiceClosed: `close` was called.
            ValueError: as `check_recv` (a block id outside this worker's pool, blocks that cannot hold the tokens,
                `first_token` outside `[0, num_tokens]`, a missing secret, a transfer id longer than
                `kvsvc.core.messages.MAX_NAME_CHARS`), or the transfer is received already for another request.
            LocalProtocolError: this engine has several PP stages and `set_engine_metadata` was not called.
        """
        self._check_open()
        check_recv(self._ctx.metadata, request)
        self._receiving.recv(request)

    def start_recv(
        self,
        req_id: str,
        transfer_id: str,
        remote_engine_id: str,
        remote_url: str,
        block_ids: list[int],
        num_tokens: int,
        first_token: int = 0,
        *,
        secret: str,
    ) -> None:
        """`recv` from its fields, for an embedder.

        Raises:
            as `recv`.
        """
        args = (req_id, transfer_id, remote_engine_id, remote_url, tuple(block_ids), num_tokens, first_token, secret)
        self.recv(RecvRequest(*args))

    def abort(self, req_id: str) -> None:
        """Abort `req_id` on whichever side holds it. Its blocks are reported (finished_sending on P, failed on D)
        only once no write can touch them any more. Unknown ids are ignored."""
        self._sending.abort(req_id)
        self._receiving.abort(req_id)

    def withdraw(self, transfer_id: str, secret: str, reason: str) -> None:
        """P: this engine will never hold `transfer_id` (its request ended mid-prefill); D workers that asked
        for it early, with `secret`, are answered failed now (`Sender.withdraw`).

        Raises:
            ValueError: `secret` is too short to be a transfer's.
        """
        self._sending.withdraw(transfer_id, secret, reason)

    def get_finished(self, step_s: float = 0.0) -> KVConnectorOutput:
        """Drain what ended since the last call: each req_id appears exactly once over the service's life.
        `step_s`: the engine's forward time, when the engine calls from a step that computes nothing until this
        report (0 otherwise): then receives that landed may wait, `report_gather_s` at most, for others about to
        land, so that they start in one step (`kvsvc.core.receiver.ReportGather`)."""
        self._ctx.reports.clear()
        sent = self._sending.take_finished()
        report = self._receiving.take_report(step_s)
        counts = self._ctx.counts
        deltas = {k: v - self._reported[k] for k, v in counts.items()}
        self._reported = dict(counts)
        for req_id, reason in report.reasons.items():
            log.warning("receive %s failed: %s", req_id, reason)
            self._reasons[req_id] = reason
        while len(self._reasons) > REMEMBERED_REASONS:
            del self._reasons[next(iter(self._reasons))]
        return KVConnectorOutput(
            finished_sending=sent or None,
            finished_recving=report.finished or None,
            failed_recving=report.failed or None,
            invalid_block_ids=report.invalid_block_ids,
            kv_connector_stats={k: v for k, v in deltas.items() if v} or None,
        )

    async def wait_for_reports(self, timeout_s: float | None = None) -> None:
        """Return once `get_finished` may have something new since its last call (an answer from P, a write that
        ended, a deadline, the end of a report's hold), or after `timeout_s`; wake-ups may be spurious. Lets an
        embedder wake on completions instead of polling."""
        held = self._receiving.report_held_until
        if held is not None:  # a millisecond late: a timer may fire early by its clock's resolution
            left = max(0.0, held - self._ctx.clock()) + 0.001
            timeout_s = left if timeout_s is None else min(timeout_s, left)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._ctx.reports.wait()

    def check_deadlines(self) -> None:
        """Apply every deadline that passed by the clock now (the timer does this by itself; tests with a fake
        clock call it)."""
        now = self._ctx.clock()
        self._sending.expire(now)
        self._receiving.expire(now)

    def failure_reason(self, req_id: str) -> str | None:
        """Why receive `req_id` failed, once `get_finished` reported it failed (the latest `REMEMBERED_REASONS`
        failures are remembered); None for a receive that did not fail, or is forgotten."""
        return self._reasons.get(req_id)

    def statistics(self) -> ServiceStatistics:
        counts = self._ctx.counts
        return ServiceStatistics(
            sender=self._sending.sender_statistics(),
            receiver=self._receiving.receiver_statistics(),
            inbound_peers=self._sending.inbound_peers,
            outbound_peers=self._receiving.outbound_peers,
            remote_engines=self._receiving.remote_engines,
            writes_in_flight=self._sending.writes_in_flight,
            bytes_sent=counts["bytes"],
            descriptors_sent=counts["descriptors"],
            transfers_sent=counts["transfers"],
            write_failures=counts["write_failures"],
            protocol_errors=counts["protocol_errors"],
            reconnects=counts["reconnects"],
            tasks=len(self._ctx.tasks),
            transport=self._ctx.transport.statistics(),
            send_durations=self._ctx.send_durations.statistics(),
            recv_durations=self._ctx.recv_durations.statistics(),
            staged_writes=counts["staged"],
            scattered_receives=counts["scattered"],
            staging_in_use=self._ctx.staging.in_use if self._ctx.staging is not None else 0,
            staging_waits=self._ctx.staging.waits if self._ctx.staging is not None else 0,
            control_connections=self._sending.control_connections,
            layer_compute=self._ctx.layer_compute.statistics(),
            layer_copy=self._ctx.layer_copy.statistics(),
            after_last_layer=self._ctx.after_last_layer.statistics(),
            staged_room=self._ctx.staged_room.statistics(),
            staged_gather=self._ctx.staged_gather.statistics(),
            staged_write=self._ctx.staged_write.statistics(),
            round_wait=self._ctx.round_wait.statistics(),
            window_room=self._ctx.window_room.statistics(),
            window_scatter=self._ctx.window_scatter.statistics(),
        )

    def peers(self) -> list[dict[str, object]]:
        """One row per control connection, for the admin endpoint."""
        return [*self._receiving.peer_rows(), *self._sending.peer_rows()]

    def forget_engine(self, engine_id: str) -> None:
        """Drop everything cached about `engine_id`: its metadata and connections (its receives fail)."""
        self._receiving.forget_engine(engine_id)

    # -- internals ---------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed is not None:
            raise ServiceClosed(f"transfer service of worker {self._ctx.metadata.worker} is closed")

    async def _deadline_loop(self) -> None:
        roles = (("P", self._sending), ("D", self._receiving))
        failing = {"P": False, "D": False}  # a role whose last check raised: logged once per run of failures
        while True:
            now = self._ctx.clock()
            for name, role in roles:
                try:
                    role.expire(now)
                    failing[name] = False
                except Exception:  # a bug of ours: the next round still runs, or no hold would ever expire again
                    if not failing[name]:
                        log.exception("checking the %s deadlines of worker %s failed", name, self._ctx.metadata.worker)
                    failing[name] = True
            # Re-check at least every second so a fake or jumping clock is never missed for long. A role whose check
            # raised still has that deadline due: it waits the second rather than spin, the other role does not.
            now = self._ctx.clock()
            waits = [1.0]
            for name, role in roles:
                deadline = role.next_deadline()
                if deadline is not None:
                    waits.append(max(deadline - now, 1.0) if failing[name] else deadline - now)
            timeout = min(waits)
            self._ctx.wake.clear()
            # `asyncio.timeout`, not `wait_for`: on Python 3.11 `wait_for` swallows a cancellation that arrives as
            # the event is set, and the wake event is set all the time (`ServiceContext.changed`).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(timeout, 0.001)):
                    await self._ctx.wake.wait()


def new_incarnation() -> str:
    """A random id for one start of an engine: a restarted engine is a new peer."""
    return uuid.uuid4().hex[:12]


def new_transfer_secret() -> str:
    """A fresh secret for one transfer (128 random bits, 22 URL-safe characters)."""
    return secrets.token_urlsafe(16)


__all__ = [
    "KVSvcError",
    "KVTransferService",
    "ServiceConfig",
    "ServiceStatistics",
    "new_incarnation",
    "new_transfer_secret",
]
