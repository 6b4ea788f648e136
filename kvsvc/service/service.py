"""`KVTransferService`: the asyncio driver of one worker's transfers, embedded in each GPU worker.

Rules: all protocol decisions live in the sans-IO `Sender` (P role) and `Receiver` (D role); a worker plays both
roles at once, each driven by its own module (`sending.SendingRole`, `receiving.ReceivingRole`) that shares only
the `ServiceContext` built here. This module is the public facade and the lifecycle: it wires the roles, runs the
deadline timer and merges their reports. Every public method runs on the service's event loop and never blocks it.

`ServiceThread` drives it from synchronous worker code: the service lives on its own uvloop event loop in a daemon
thread; every method there hands the call to that loop, in order, and waits for its answer with a deadline
(`call_timeout_s`), so a wedged loop surfaces as `KVSvcTimeout`, never as a hang. Exceptions raised by the service are
re-raised in the caller's thread unchanged. Two calls let an engine's step go on past a busy loop: `post` does not
wait, and `get_finished` waits `report_wait_s` at most, then hands its report to a later call; only a loop silent for
`call_timeout_s` fails it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from msgspec.structs import replace

from kvsvc.core.errors import KVSvcError, KVSvcTimeout, ServiceClosed
from kvsvc.core.histogram import STAGE_BUCKETS, HistogramStatistics, LatencyHistogram
from kvsvc.core.messages import WorkerMetadata, check_own_metadata
from kvsvc.core.outputs import LOAD_FAILED, LOADS, KVConnectorOutput
from kvsvc.core.receiver import ReceiverStatistics, RecvRequest
from kvsvc.core.sender import SenderStatistics, SendRequest
from kvsvc.core.topology import TransferTopology
from kvsvc.service.config import ServiceConfig
from kvsvc.service.context import COUNTERS, EngineMetadata, PeerLog, ServiceContext, TaskGroup
from kvsvc.service.receiving import ReceivingRole
from kvsvc.service.sending import SendingRole
from kvsvc.service.staging_area import StagingArea
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
        only a D worker whose receive presents the request's secret is served. The request is checked once, as the role
        takes it (`kvsvc.core.sender.check_send`); below that it travels as it is. A repeat for a held transfer is a
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
        does not hold). The request is checked once, as the role takes it (`kvsvc.core.receiver.check_recv`). The
        outcome appears once in `get_finished` (finished, or failed with its blocks invalid). A repeat of a transfer
        being received is a no-op. Never waits on the handshake.

        Raises:
            ServiceClosed: `close` was called.
            ValueError: as `check_recv` (a block id outside this worker's pool, blocks that cannot hold the tokens,
                `first_token` outside `[0, num_tokens]`, a missing secret, a transfer id longer than
                `kvsvc.core.messages.MAX_NAME_CHARS`), or the transfer is received already for another request.
            LocalProtocolError: this engine has several PP stages and `set_engine_metadata` was not called.
        """
        self._check_open()
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
        land, so that they start in one step (`kvsvc.core.receiver.ReportGather`). Its `kv_connector_stats` holds
        the counters' changes, each failed receive's cause and each landed receive's phases (`LOAD_FAILED`,
        `LOADS`)."""
        self._ctx.reports.clear()
        sent = self._sending.take_finished()
        report = self._receiving.take_report(step_s)
        counts = self._ctx.counts
        deltas: dict[str, int | list[list[float]]] = {
            k: v - self._reported[k] for k, v in counts.items() if v != self._reported[k]
        }
        self._reported = dict(counts)
        for req_id, reason in report.reasons.items():
            log.warning("receive %s failed: %s", req_id, reason)
            self._reasons[req_id] = reason
        for cause in report.causes.values():
            key = f"{LOAD_FAILED}{cause}"
            failed = deltas.get(key, 0)
            deltas[key] = (failed if isinstance(failed, int) else 0) + 1
        loads = self._receiving.take_loads()
        if loads:
            deltas[LOADS] = [[t.total_s, t.handshake_s, t.queue_s, t.write_s, float(t.nbytes)] for t in loads]
        while len(self._reasons) > REMEMBERED_REASONS:
            del self._reasons[next(iter(self._reasons))]
        return KVConnectorOutput(
            finished_sending=sent or None,
            finished_recving=report.finished or None,
            failed_recving=report.failed or None,
            invalid_block_ids=report.invalid_block_ids,
            kv_connector_stats=deltas or None,
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
    "ServiceThread",
    "new_incarnation",
    "new_transfer_secret",
]


_T = TypeVar("_T")
# What a close may take past the writes' drain: the transport's own close (Mooncake waits up to 60 s for descriptors
# in flight), a peer probe it lets finish (up to about 5 s) and the engine's destruction (about 1 s), and slack.
CLOSE_SLACK_S = 90.0
# How long `get_finished` waits for the loop before the step goes on without its report: a drain takes microseconds,
# so only a loop busy with something else (a long copy, a stalled transport call) makes it wait this long.
REPORT_WAIT_S = 1.0


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (it is a dependency), asyncio's default loop otherwise."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class ServiceThread:
    """Runs one `KVTransferService` on a private event loop thread.

    `transport_factory` is called on the loop thread (Mooncake's engine is created there); the transport must have
    its KV pool registered before `start` returns, since the published metadata points into it.
    """

    def __init__(
        self,
        metadata: WorkerMetadata,
        transport_factory: Callable[[], Transport],
        config: ServiceConfig | None = None,
        *,
        call_timeout_s: float = 30.0,
        close_timeout_s: float | None = None,
        staging: StagingArea | None = None,
        report_wait_s: float = REPORT_WAIT_S,
    ) -> None:
        """`staging`: a staging region the transport factory registers, for the writes its rule picks (P side)."""
        self._metadata = metadata
        self._staging = staging
        self._factory = transport_factory
        self._config = config
        self._timeout = call_timeout_s
        drain = (config or ServiceConfig()).close_drain_timeout_s
        self._close_timeout = close_timeout_s if close_timeout_s is not None else drain + CLOSE_SLACK_S
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvsvc-loop", daemon=True)
        self._service: KVTransferService | None = None
        self._report_wait = min(report_wait_s, call_timeout_s)
        # A report the loop has not handed back yet, and when it was asked for: the next calls deliver it.
        self._late_report: concurrent.futures.Future[KVConnectorOutput] | None = None
        self._late_since = 0.0
        self.metadata: WorkerMetadata = metadata

    def start(self) -> WorkerMetadata:
        """Start the loop thread and the service; returns the metadata to publish.

        Raises:
            KVSvcTimeout: the service did not start within the call timeout.
            ServiceClosed: on any call after `close` (every method).
            OSError, TransportError: from the transport or the control server.
        """
        self._thread.start()

        async def boot() -> WorkerMetadata:
            self._service = KVTransferService(self._metadata, self._factory(), self._config, staging=self._staging)
            return await self._service.start()

        self.metadata = self._run(boot())
        return self.metadata

    @property
    def service(self) -> KVTransferService:
        """The service itself, to be touched only from its loop (`call` hands work there)."""
        if self._service is None:
            raise ServiceClosed("service thread not started")
        return self._service

    def call(self, fn: Callable[[KVTransferService], _T]) -> _T:
        """Run `fn(service)` on the loop and return its result (or raise its exception)."""

        async def run() -> _T:
            return fn(self.service)

        return self._run(run())

    def post(self, fn: Callable[[KVTransferService], object]) -> concurrent.futures.Future[object]:
        """Hand `fn(service)` to the loop and return at once; it runs in order with every other call. What it
        raises lands in the returned future only, so `fn` must deliver its outcomes itself.

        Raises:
            ServiceClosed: the loop is not running.
        """

        async def run() -> object:
            return fn(self.service)

        return self._submit(run())

    def set_engine_metadata(self, metas: dict[tuple[int, int], WorkerMetadata]) -> None:
        self.call(lambda s: s.set_engine_metadata(metas))

    def start_send(
        self,
        req_id: str,
        transfer_id: str,
        block_ids: list[int],
        num_tokens: int,
        ready: concurrent.futures.Future[None] | Sequence[concurrent.futures.Future[None]] | None = None,
        *,
        secret: str | None = None,
    ) -> str:
        """As `KVTransferService.start_send` (returns the transfer's secret); `ready` may be thread futures
        (wrapped for the loop)."""

        def go(s: KVTransferService) -> str:
            wrapped: Any = ready
            if isinstance(ready, concurrent.futures.Future):
                wrapped = asyncio.wrap_future(ready)
            elif ready is not None:
                wrapped = [asyncio.wrap_future(r) for r in ready]
            return s.start_send(req_id, transfer_id, block_ids, num_tokens, wrapped, secret=secret)

        return self.call(go)

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
        self.call(
            lambda s: s.start_recv(
                req_id, transfer_id, remote_engine_id, remote_url, block_ids, num_tokens, first_token, secret=secret
            )
        )

    def abort(self, req_id: str) -> None:
        self.call(lambda s: s.abort(req_id))

    def get_finished(self, wait_s: float = 0.0, step_s: float = 0.0) -> KVConnectorOutput:
        """As `KVTransferService.get_finished(step_s)`, waiting `report_wait_s` at most (plus `wait_s`, which the
        loop first spends waiting for news, `KVTransferService.wait_for_reports`, so an idle caller need not poll).
        A report the loop has not handed back by then is kept, never cancelled (the loop may have drained already),
        and delivered by a later call, merged with that call's own: nothing reported is ever lost or repeated. While
        it is pending, calls return an empty report at once and ask the loop nothing more.

        Raises:
            KVSvcTimeout: the loop has not answered a report for `call_timeout_s` (it is wedged, not busy).
            ServiceClosed: after `close`.
        """
        now = time.monotonic()
        late, self._late_report = self._late_report, None
        if late is not None and not late.done():
            self._late_report = late
            if now - self._late_since >= self._timeout:
                raise KVSvcTimeout(
                    f"kvsvc loop of worker {self.metadata.worker} has not answered get_finished for "
                    f"{now - self._late_since:.1f} s (call_timeout_s {self._timeout:g})"
                )
            return KVConnectorOutput()
        future = self._submit(self._drain(wait_s, step_s))
        try:
            report = future.result(self._report_wait + wait_s)
        except concurrent.futures.TimeoutError:
            self._late_report, self._late_since = future, now
            report = KVConnectorOutput()
        return report if late is None else _merge(late.result(), report)

    async def _drain(self, wait_s: float, step_s: float) -> KVConnectorOutput:
        if wait_s > 0:
            await self.service.wait_for_reports(wait_s)
        return self.service.get_finished(step_s)

    def statistics(self) -> ServiceStatistics:
        return self.call(lambda s: s.statistics())

    def close(self) -> None:
        """Close the service (`KVTransferService.close`: writes drain, then the transport closes) and stop the loop
        thread. Idempotent.

        Waits at most `close_timeout_s`: the service's own bounds (`close_drain_timeout_s` for the writes, then
        the transport's close timeout, Mooncake's 60 s by default, plus a probe and the engine's destruction) and
        some slack; a close that takes longer means a wedged loop, which is then stopped where it stands.

        Raises:
            KVSvcTimeout: the close did not end within `close_timeout_s` (the loop thread is stopped anyway).
        """
        if not self._thread.is_alive():
            return
        try:
            if self._service is not None:
                self._run(self._service.close(), timeout=self._close_timeout)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=self._timeout)
        if not self._thread.is_alive():
            self._loop.close()

    def _submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        if self._loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise ServiceClosed(f"service thread of worker {self.metadata.worker} is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        future = self._submit(coro)
        try:
            return future.result(timeout if timeout is not None else self._timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise KVSvcTimeout(f"kvsvc loop did not answer within {timeout or self._timeout:g} s") from None


def _merge(a: KVConnectorOutput, b: KVConnectorOutput) -> KVConnectorOutput:
    """Two reports of one worker as one (their id sets are disjoint: each id is reported once)."""

    def union(x: set[str] | None, y: set[str] | None) -> set[str] | None:
        return (x or set()) | (y or set()) or None

    return KVConnectorOutput(
        finished_sending=union(a.finished_sending, b.finished_sending),
        finished_recving=union(a.finished_recving, b.finished_recving),
        failed_recving=union(a.failed_recving, b.failed_recving),
        invalid_block_ids=a.invalid_block_ids | b.invalid_block_ids,
        kv_connector_stats=_sum_stats(a.kv_connector_stats, b.kv_connector_stats),
    )


def _sum_stats(a: object, b: object) -> object:
    """The service's stats are counter deltas, which add up, and lists of samples (`LOADS`), which concatenate."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _add(a.get(k), b.get(k)) for k in a.keys() | b.keys()}
    return b if a is None else a


def _add(a: object, b: object) -> object:
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a + b
    return a
