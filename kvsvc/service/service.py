"""`KVTransferService`: the asyncio driver of one worker's transfers, embedded in each GPU worker.

Rules: all protocol decisions live in the sans-IO `Sender` (P role) and `Receiver` (D role); this module only
carries their commands out (control frames, transport writes, timers) and feeds them events. Every public method
runs on the service's event loop and never blocks it; `kvsvc.service.threaded` drives it from other threads. A
worker plays both roles at once. Network input never raises out of a connection handler: it is answered with an
error frame and, if the stream is broken, the connection closes and the peer's jobs fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from bisect import bisect_right
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from msgspec.structs import replace

from kvsvc.engine.bootstrap import fetch_engine_metadata
from kvsvc.errors import (
    HandshakeError,
    KVSvcError,
    LocalProtocolError,
    MalformedFrame,
    PeerLost,
    PeerMismatch,
    ServiceClosed,
    TopologyError,
    TransferError,
    TransportError,
    VersionMismatch,
)
from kvsvc.layout import block_bytes, block_geometry, is_cross_layer, layer_addrs, pool_regions
from kvsvc.messages import (
    PROTOCOL_VERSION,
    Abort,
    ErrorMessage,
    Hello,
    HelloOk,
    HelloRefused,
    Message,
    Ping,
    Pong,
    Release,
    TransferDone,
    TransferFailed,
    TransferRequest,
    WorkerMetadata,
    WorkerRef,
    check_version,
)
from kvsvc.outputs import KVConnectorOutput
from kvsvc.planner import check_compatible, expected_destinations, plan_transfer, release_notifier, sources_of
from kvsvc.receiver import Receiver, ReceiverStatistics, SendToSource
from kvsvc.sender import Reply, SendCommand, Sender, SenderStatistics, Submit
from kvsvc.service.channel import ControlChannel
from kvsvc.service.config import ServiceConfig
from kvsvc.topology import EngineTransferInfo, TransferTopology
from kvsvc.transport.base import Transport, TransportStatistics, WriteFailed

log = logging.getLogger(__name__)
Worker = tuple[int, int]
EngineMetadata = dict[Worker, WorkerMetadata]


@dataclass(slots=True)
class _RemoteEngine:
    """D's view of one P engine start: its published workers, fetched once and shared by concurrent receives."""

    engine_id: str
    url: str
    fetch: asyncio.Task[EngineMetadata]
    # Once fetched: which P workers this D worker needs and must release, so later receives skip the task and the
    # computation (`KVTransferService._route_known`); None until then. Valid for `routes_engine` only (own engine).
    routes: _Routes | None = None
    routes_engine: EngineMetadata | None = None


@dataclass(frozen=True, slots=True)
class _Routes:
    p_engine: EngineMetadata
    sources: list[Worker]
    releases: list[Worker]
    peers: list[Worker]  # sorted union of both


@dataclass(slots=True)
class _Outbound:
    """D's control connection to one P worker."""

    ref: WorkerRef
    meta: WorkerMetadata
    channel: ControlChannel | None = None
    outbox: list[Message] | None = None
    task: asyncio.Task[None] | None = None
    last_error: str = ""


@dataclass(slots=True)
class _Inbound:
    """P's control connection from one D worker, after its hello was accepted."""

    ref: WorkerRef
    meta: WorkerMetadata
    channel: ControlChannel
    expected: frozenset[Worker]
    # Plans of requests whose P and D blocks are each one run of consecutive ids, for the run starting at block 0
    # on both sides, keyed (P blocks, D blocks, tokens): see `KVTransferService._plan`.
    plans: dict[tuple[int, int, int], list[tuple[int, int, int]]] = field(default_factory=dict)
    strides: tuple[int, int] = (0, 0)  # block strides of P (this worker) and of this D worker


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
    transport: TransportStatistics

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
    ) -> None:
        self.config = config or ServiceConfig()
        self._meta = metadata
        self._transport = transport
        self._clock = clock
        self._sender = Sender(
            hold_timeout_s=self.config.hold_timeout_s,
            early_request_timeout_s=self.config.early_request_timeout_s,
            max_early_requests=self.config.max_early_requests,
        )
        self._receiver = Receiver(recv_timeout_s=self.config.recv_timeout_s, abort_grace_s=self.config.abort_grace_s)
        self.topology = TransferTopology(
            tp_rank=metadata.tp_rank,
            tp_size=metadata.tp_size,
            block_size=metadata.block_size,
            engine_id=metadata.engine_id,
            is_mla=metadata.is_mla,
            total_num_kv_heads=metadata.num_kv_heads,
            pp_rank=metadata.pp_rank,
            pp_size=metadata.pp_size,
            start_layer=metadata.start_layer,
            end_layer=metadata.end_layer,
        )
        self._engine: EngineMetadata | None = None
        self._remotes: dict[str, _RemoteEngine] = {}
        self._outbound: dict[tuple[str, Worker], _Outbound] = {}
        self._inbound: dict[tuple[str, Worker], _Inbound] = {}
        self._layer_ready: dict[str, list[asyncio.Future[None]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writes: set[asyncio.Task[None]] = set()
        # Writes submitted without a task (`_start_write`): their result futures, and `drained` futures of failed
        # ones whose descriptors may still move (their blocks stay held until these resolve).
        self._started: set[asyncio.Future[Any]] = set()
        self._start_write: Callable[..., asyncio.Future[int] | None] | None = getattr(transport, "start_write", None)
        self._server: asyncio.Server | None = None
        self._http: aiohttp.ClientSession | None = None
        self._wake = asyncio.Event()
        self._reports = asyncio.Event()  # set when `get_finished` may have something new
        self._deadline_task: asyncio.Task[None] | None = None
        self._closing = False
        self._counts = {"bytes": 0, "descriptors": 0, "transfers": 0, "write_failures": 0, "protocol_errors": 0}
        self._reported = dict(self._counts)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    @property
    def metadata(self) -> WorkerMetadata:
        """This worker's metadata, with its transport and control addresses once started."""
        return self._meta

    async def start(self) -> WorkerMetadata:
        """Bind the control server and start the deadline timer; returns the metadata to publish.

        Raises:
            OSError: the control address cannot be bound.
        """
        self._server = await asyncio.start_server(
            self._serve_connection, self.config.control_host, self.config.control_port
        )
        port = self._server.sockets[0].getsockname()[1]
        self._meta = replace(
            self._meta, transport_addr=self._transport.session_id, control_addr=f"{self.config.control_host}:{port}"
        )
        self._http = aiohttp.ClientSession()
        self._deadline_task = asyncio.create_task(self._deadline_loop(), name="kvsvc-deadlines")
        return self._meta

    def set_engine_metadata(self, metas: EngineMetadata) -> None:
        """This worker's own engine (all its workers), as the engine core merged it; needed by D workers of
        engines with pp_size > 1 to tell P how the engine splits layers.

        Raises:
            ValueError: `metas` lacks this worker or disagrees with its layout.
        """
        own = metas.get(self._meta.worker)
        if own is None or (own.start_layer, own.end_layer) != (self._meta.start_layer, self._meta.end_layer):
            raise ValueError(f"engine metadata does not hold worker {self._meta.worker} with its layers")
        self._engine = dict(metas)

    async def close(self) -> None:
        """Stop accepting work, let in-flight writes drain (up to `close_drain_timeout_s`), then close
        connections, timers and the transport. Idempotent. What was not reported stays in `get_finished`."""
        if self._closing:
            return
        self._closing = True
        if self._server is not None:
            self._server.close()
        if self._writes or self._started:
            waits: set[asyncio.Future[Any]] = {*self._writes, *self._started}
            _, pending = await asyncio.wait(waits, timeout=self.config.close_drain_timeout_s)
            for task in pending & self._writes:
                task.cancel()
        for task in [*self._tasks, *([self._deadline_task] if self._deadline_task else [])]:
            task.cancel()
        for peer in list(self._outbound.values()):
            if peer.channel is not None:
                peer.channel.close()
        for inbound in list(self._inbound.values()):
            inbound.channel.close()
        await asyncio.gather(*self._tasks, *self._writes, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        if self._http is not None:
            await self._http.close()
        await self._transport.close()

    # -- the engine's calls ------------------------------------------------------------------------------------

    def start_send(
        self,
        req_id: str,
        transfer_id: str,
        block_ids: list[int],
        num_tokens: int,
        ready: Awaitable[None] | Sequence[Awaitable[None]] | None = None,
    ) -> None:
        """Hold `req_id`'s KV in `block_ids` until the D workers that need it fetched it, or the hold expires.

        `ready` is the completion of the compute that wrote the KV: None when it is done already, one awaitable
        for the whole request, or one per local layer (in layer order) for layer-wise sends, where a layer goes
        as soon as its own compute finished. A repeat for a held transfer is a no-op.

        Raises:
            ServiceClosed: `close` was called.
            ValueError: a block id is outside this worker's pool, or the blocks cannot hold `num_tokens`.
        """
        self._check_open()
        self._check_blocks(self._meta, block_ids, num_tokens, "P")
        layered = isinstance(ready, Sequence)
        if layered and len(ready) != self._meta.num_layers:  # type: ignore[arg-type]
            raise ValueError(f"layer-wise ready has {len(ready)} futures for {self._meta.num_layers} local layers")  # type: ignore[arg-type]
        self._run_send(self._sender.hold(req_id, transfer_id, block_ids, num_tokens, self._clock()))
        self._wake.set()
        if ready is None:
            self._run_send(self._sender.ready(transfer_id))
        elif isinstance(ready, Sequence):
            self._layer_ready[transfer_id] = [asyncio.ensure_future(r) for r in ready]
            self._run_send(self._sender.ready(transfer_id))
        else:
            self._spawn(self._await_ready(req_id, transfer_id, ready))

    def start_recv(
        self,
        req_id: str,
        transfer_id: str,
        remote_engine_id: str,
        remote_url: str,
        block_ids: list[int],
        num_tokens: int,
    ) -> None:
        """Receive `transfer_id` from engine `remote_engine_id` (bootstrap endpoint `remote_url`) into
        `block_ids`. The outcome appears once in `get_finished` (finished, or failed with its blocks invalid).
        A repeat of a transfer being received is a no-op. Never waits on the handshake.

        Raises:
            ServiceClosed: `close` was called.
            ValueError: a block id is outside this worker's pool, or the blocks cannot hold `num_tokens`.
            LocalProtocolError: this engine has several PP stages and `set_engine_metadata` was not called.
        """
        self._check_open()
        self._check_blocks(self._meta, block_ids, num_tokens, "D")
        self._own_engine()
        if not self._receiver.start(req_id, transfer_id, remote_engine_id, block_ids, num_tokens, self._clock()):
            return
        self._wake.set()
        if not self._route_known(transfer_id, remote_engine_id, remote_url):
            self._spawn(self._resolve_sources(transfer_id, remote_engine_id, remote_url))

    def abort(self, req_id: str) -> None:
        """Abort `req_id` on whichever side holds it. Its blocks are reported (finished_sending on P, failed on D)
        only once no write can touch them any more. Unknown ids are ignored."""
        self._run_send(self._sender.abort(req_id))
        self._run_recv(self._receiver.abort(req_id, self._clock()))
        self._wake.set()

    def get_finished(self) -> KVConnectorOutput:
        """Drain what ended since the last call: each req_id appears exactly once over the service's life."""
        self._reports.clear()
        sent = self._sender.drain_finished()
        for transfer_id in [t for t in self._layer_ready if not self._sender.holds(t)]:
            del self._layer_ready[transfer_id]
        report = self._receiver.drain()
        deltas = {k: v - self._reported[k] for k, v in self._counts.items()}
        self._reported = dict(self._counts)
        for req_id, reason in report.reasons.items():
            log.warning("receive %s failed: %s", req_id, reason)
        return KVConnectorOutput(
            finished_sending=sent or None,
            finished_recving=report.finished or None,
            failed_recving=report.failed or None,
            invalid_block_ids=report.invalid_block_ids,
            kv_connector_stats={k: v for k, v in deltas.items() if v} or None,
        )

    async def wait_for_reports(self, timeout_s: float | None = None) -> None:
        """Return once `get_finished` may have something new since its last call (an answer from P, a write that
        ended, a deadline), or after `timeout_s`; wake-ups may be spurious. Lets an embedder wake on completions
        instead of polling."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._reports.wait(), timeout_s)

    def check_deadlines(self) -> None:
        """Apply every deadline that passed by the clock now (the timer does this by itself; tests with a fake
        clock call it)."""
        now = self._clock()
        self._run_send(self._sender.expire(now))
        self._run_recv(self._receiver.expire(now))
        self._reports.set()

    def statistics(self) -> ServiceStatistics:
        return ServiceStatistics(
            sender=self._sender.statistics(),
            receiver=self._receiver.statistics(),
            inbound_peers=len(self._inbound),
            outbound_peers=sum(p.channel is not None for p in self._outbound.values()),
            remote_engines=len(self._remotes),
            writes_in_flight=len(self._writes) + len(self._started),
            bytes_sent=self._counts["bytes"],
            descriptors_sent=self._counts["descriptors"],
            transfers_sent=self._counts["transfers"],
            write_failures=self._counts["write_failures"],
            protocol_errors=self._counts["protocol_errors"],
            transport=self._transport.statistics(),
        )

    def peers(self) -> list[dict[str, object]]:
        """One row per control connection, for the admin endpoint."""
        rows: list[dict[str, object]] = []
        for peer in self._outbound.values():
            rows.append(
                {
                    "direction": "to_p",
                    "peer": str(peer.ref),
                    "peer_engine_id": peer.ref.engine_id,
                    "peer_pp_rank": peer.ref.pp_rank,
                    "peer_tp_rank": peer.ref.tp_rank,
                    "incarnation": peer.ref.incarnation,
                    "state": "connected"
                    if peer.channel is not None
                    else ("failed" if peer.last_error else "connecting"),
                    "describe": self._describe(peer.ref),
                    "last_error": peer.last_error,
                }
            )
        for inbound in self._inbound.values():
            rows.append(
                {
                    "direction": "from_d",
                    "peer": str(inbound.ref),
                    "peer_engine_id": inbound.ref.engine_id,
                    "peer_pp_rank": inbound.ref.pp_rank,
                    "peer_tp_rank": inbound.ref.tp_rank,
                    "incarnation": inbound.ref.incarnation,
                    "state": "connected",
                    "expected_destinations": sorted(inbound.expected),
                }
            )
        return rows

    def forget_engine(self, engine_id: str) -> None:
        """Drop everything cached about `engine_id`: its metadata and connections (its receives fail)."""
        self._remotes.pop(engine_id, None)
        for key, peer in list(self._outbound.items()):
            if key[0] == engine_id:
                self._drop_outbound(peer, f"engine {engine_id!r} forgotten by the operator")
        self.topology.unregister_remote_engine(engine_id)

    # -- P role: serving D workers -----------------------------------------------------------------------------

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = ControlChannel(reader, writer)
        if self._closing:
            channel.close()
            return
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        inbound: _Inbound | None = None
        try:
            inbound = await self._accept_hello(channel)
            if inbound is None:
                return
            while True:
                self._on_d_message(inbound, await channel.receive())
        except MalformedFrame as exc:
            self._counts["protocol_errors"] += 1
            log.warning("closing control connection from %s: %s", channel.peer, exc)
            with contextlib.suppress(PeerLost):
                channel.send(ErrorMessage(reason=str(exc)))
        except PeerLost:
            pass
        except asyncio.CancelledError:
            # Only `close` cancels a handler; returning (not re-raising) keeps asyncio's stream callback quiet.
            pass
        except Exception:  # a bug of ours: log it and drop this connection, never the service
            self._counts["protocol_errors"] += 1
            log.exception("control connection from %s failed", channel.peer)
        finally:
            if inbound is not None and self._inbound.get(self._inbound_key(inbound.ref)) is inbound:
                del self._inbound[self._inbound_key(inbound.ref)]
                self._run_send(self._sender.peer_lost(inbound.ref))
            await channel.wait_closed()
            if task is not None:
                self._tasks.discard(task)

    async def _accept_hello(self, channel: ControlChannel) -> _Inbound | None:
        try:
            first = await asyncio.wait_for(channel.receive(), self.config.handshake_timeout_s)
        except TimeoutError:
            self._refuse(channel, f"no hello within {self.config.handshake_timeout_s:g} s")
            return None
        if not isinstance(first, Hello):
            self._counts["protocol_errors"] += 1
            channel.send(ErrorMessage(reason=f"expected hello as the first frame, got {type(first).__name__}"))
            return None
        try:
            check_version(first.version)
            d_engine = self._check_hello(first)
        except (VersionMismatch, PeerMismatch, TopologyError) as exc:
            self._refuse(channel, str(exc))
            return None
        d = first.sender
        ref = WorkerRef.of(d)
        key = self._inbound_key(ref)
        old = self._inbound.pop(key, None)
        if old is not None:  # a reconnect, or a restarted D engine: the old connection's jobs are gone
            old.channel.close()
            self._run_send(self._sender.peer_lost(old.ref))
        try:
            self._transport.add_peer(d.transport_addr, pool_regions(d))
        except (TransportError, ValueError) as exc:  # a pool no memory can be (empty, overlapping itself)
            self._refuse(channel, f"D worker {ref} publishes an impossible KV pool: {exc}")
            return None
        inbound = _Inbound(ref, d, channel, frozenset(expected_destinations(self._meta, d_engine)))
        inbound.strides = (block_geometry(self._meta).block_stride, block_geometry(d).block_stride)
        self._inbound[key] = inbound
        channel.send(HelloOk(version=PROTOCOL_VERSION, sender=self._meta))
        return inbound

    def _check_hello(self, hello: Hello) -> EngineMetadata:
        """The D engine's layout rebuilt from the hello, after checking it is meant for us and compatible.

        Raises:
            PeerMismatch: the hello expects another engine, start or worker, or its layer split is inconsistent.
            TopologyError: D's layout cannot be served from ours.
        """
        me, d = self._meta, hello.sender
        expected = (hello.expect_engine_id, hello.expect_incarnation, hello.expect_pp_rank, hello.expect_tp_rank)
        actual = (me.engine_id, me.incarnation, me.pp_rank, me.tp_rank)
        if expected != actual:
            raise PeerMismatch(f"hello expects engine/incarnation/pp/tp {expected}, this worker is {actual}")
        stages = [tuple(s) for s in hello.stage_layers]
        if (
            len(stages) != d.pp_size
            or not (0 <= d.pp_rank < d.pp_size)
            or stages[d.pp_rank] != (d.start_layer, d.end_layer)
        ):
            raise PeerMismatch(
                f"D worker {WorkerRef.of(d)} layers [{d.start_layer}, {d.end_layer}) disagree with its engine's "
                f"stage split {stages} (pp_size {d.pp_size})"
            )
        check_compatible(me, d)
        return {
            (pp, tp): replace(
                d, pp_rank=pp, tp_rank=tp, start_layer=start, end_layer=end, base_addrs=_placeholder(d, end - start)
            )
            for pp, (start, end) in enumerate(stages)
            for tp in range(d.tp_size)
        }

    def _on_d_message(self, inbound: _Inbound, message: Message) -> None:
        now = self._clock()
        if isinstance(message, TransferRequest):
            try:
                self._check_blocks(inbound.meta, message.block_ids, message.num_tokens, "D")
            except ValueError as exc:
                inbound.channel.send(TransferFailed(transfer_id=message.transfer_id, reason=str(exc)))
                self._run_send(
                    self._sender.remote_abort(inbound.ref, message.transfer_id, str(exc), now, inbound.expected)
                )
                return
            self._run_send(self._sender.request(inbound.ref, inbound.expected, message, now))
        elif isinstance(message, Release):
            self._run_send(self._sender.release(inbound.ref, inbound.expected, message, now))
        elif isinstance(message, Abort):
            self._run_send(
                self._sender.remote_abort(inbound.ref, message.transfer_id, message.reason, now, inbound.expected)
            )
        elif isinstance(message, Ping):
            inbound.channel.send(Pong(nonce=message.nonce))
        elif isinstance(message, ErrorMessage):
            log.warning("D worker %s reports a protocol error: %s", inbound.ref, message.reason)
        else:
            self._counts["protocol_errors"] += 1
            inbound.channel.send(ErrorMessage(reason=f"unexpected {type(message).__name__} from a D worker"))
        self._wake.set()

    def _run_send(self, commands: list[SendCommand]) -> None:
        for command in commands:
            if isinstance(command, Submit):
                if self._submit_now(command):
                    continue
                write = asyncio.create_task(self._write(command), name=f"kvsvc-write-{command.transfer_id}")
                self._writes.add(write)
                write.add_done_callback(self._writes.discard)
            elif isinstance(command, Reply):
                inbound = self._inbound.get(self._inbound_key(command.dst))
                if inbound is not None and inbound.ref == command.dst and not inbound.channel.closed:
                    with contextlib.suppress(PeerLost):
                        inbound.channel.send(command.message)

    async def _write(self, command: Submit) -> None:
        error: str | None = None
        nbytes = ndesc = 0
        inbound = self._inbound.get(self._inbound_key(command.dst))
        try:
            if inbound is None or inbound.ref != command.dst:
                raise PeerLost(f"control connection to {command.dst} lost before the write")
            descriptors = self._plan(inbound, command.src_block_ids, command.dst_block_ids, command.num_tokens)
            ndesc = len(descriptors)
            layers = self._layer_ready.get(command.transfer_id)
            if layers is None:
                nbytes = await self._transport.write(inbound.meta.transport_addr, descriptors)
            else:
                nbytes = await self._write_layerwise(inbound.meta.transport_addr, descriptors, layers)
        except WriteFailed as exc:
            error = f"{type(exc).__name__}: {exc}"
            self._counts["write_failures"] += 1
            if exc.drained is not None:
                # The peer stopped making progress: the blocks stay held until Mooncake gave up on every descriptor.
                await asyncio.shield(exc.drained)
        except (TransferError, TopologyError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            self._counts["write_failures"] += 1
        except asyncio.CancelledError:
            error = "P service closed before the write finished"
            self._run_send(self._sender.write_result(command.transfer_id, command.dst.worker, error))
            raise
        self._write_ended(command, error, nbytes, ndesc)

    def _write_ended(self, command: Submit, error: str | None, nbytes: int, ndesc: int) -> None:
        if error is None:
            self._counts["bytes"] += nbytes
            self._counts["descriptors"] += ndesc
            self._counts["transfers"] += 1
        self._run_send(self._sender.write_result(command.transfer_id, command.dst.worker, error, nbytes, ndesc))
        self._reports.set()

    def _submit_now(self, command: Submit) -> bool:
        """The many-small-requests path of `_write`: plan and submit at once, no task, when the transport can
        (`start_write`); the outcome arrives in `_started_write_done`. False, having done nothing, in any other
        case (layer-wise, no connection, a plan that raises, a transport that would wait): `_write` runs then."""
        if self._start_write is None or command.transfer_id in self._layer_ready:
            return False
        inbound = self._inbound.get(self._inbound_key(command.dst))
        if inbound is None or inbound.ref != command.dst:
            return False
        try:
            descriptors = self._plan(inbound, command.src_block_ids, command.dst_block_ids, command.num_tokens)
        except (TopologyError, ValueError):
            return False  # `_write` plans again and reports why
        result = self._start_write(inbound.meta.transport_addr, descriptors)
        if result is None:
            return False
        self._started.add(result)
        result.add_done_callback(lambda fut: self._started_write_done(command, len(descriptors), fut))
        return True

    def _started_write_done(self, command: Submit, ndesc: int, result: asyncio.Future[int]) -> None:
        self._started.discard(result)
        if result.cancelled():
            self._write_ended(command, "P service closed before the write finished", 0, ndesc)
            return
        exc = result.exception()
        if exc is None:
            self._write_ended(command, None, result.result(), ndesc)
            return
        self._counts["write_failures"] += 1
        error = f"{type(exc).__name__}: {exc}"
        drained = exc.drained if isinstance(exc, WriteFailed) else None
        if drained is None or drained.done():
            self._write_ended(command, error, 0, ndesc)
            return
        # The peer stopped making progress: the blocks stay held until Mooncake gave up on every descriptor.
        self._started.add(drained)

        def after_drain(_: asyncio.Future[None]) -> None:
            self._started.discard(drained)
            self._write_ended(command, error, 0, ndesc)

        drained.add_done_callback(after_drain)

    def _plan(
        self, inbound: _Inbound, src_ids: list[int], dst_ids: list[int], num_tokens: int
    ) -> Sequence[tuple[int, int, int]]:
        """`plan_transfer`, from `inbound`'s cache when the used P and D blocks are each one run of consecutive ids.

        Such a plan is the plan of the runs starting at block 0, shifted by each side's first block times its
        block stride: merging depends only on which ranges touch, and a shift keeps that (a run touches the next
        layer's tensor only when it spans the whole pool, and then it starts at block 0). Planning thousands of
        one-block requests a second is otherwise the P worker's main cost.

        Raises:
            TopologyError / ValueError: as `plan_transfer` (the uncached path runs every check).
        """
        src, dst = self._meta, inbound.meta
        n_src, n_dst = -(-num_tokens // src.block_size), -(-num_tokens // dst.block_size)
        if not (
            0 < n_src <= len(src_ids)
            and 0 < n_dst <= len(dst_ids)
            and 0 <= src_ids[0] <= src.num_blocks - n_src
            and 0 <= dst_ids[0] <= dst.num_blocks - n_dst
            and _is_run(src_ids, n_src)
            and _is_run(dst_ids, n_dst)
        ):
            return plan_transfer(src, dst, src_ids, dst_ids, num_tokens)
        key = (n_src, n_dst, num_tokens)
        unit = inbound.plans.get(key)
        if unit is None:
            unit = [tuple(d) for d in plan_transfer(src, dst, range(n_src), range(n_dst), num_tokens)]  # type: ignore[misc]
            if len(inbound.plans) < _PLAN_CACHE_ENTRIES and len(unit) <= _PLAN_CACHE_DESCRIPTORS:
                inbound.plans[key] = unit
        if src_ids[0] == dst_ids[0] == 0:
            return unit
        if not inbound.strides[0]:
            inbound.strides = (block_geometry(src).block_stride, block_geometry(dst).block_stride)
        shift_src, shift_dst = src_ids[0] * inbound.strides[0], dst_ids[0] * inbound.strides[1]
        return [(s + shift_src, d + shift_dst, n) for s, d, n in unit]

    async def _write_layerwise(
        self, peer: str, descriptors: Sequence[tuple[int, int, int]], layers: list[asyncio.Future[None]]
    ) -> int:
        """Write each layer's descriptors as soon as its compute finished, later layers still computing.

        A cross-layer pool puts every layer inside each block, so one descriptor spans layers: it goes once the
        last layer finished (the layer-wise gain needs per-layer tensors).
        """
        per_layer: list[list[tuple[int, int, int]]] = [[] for _ in layers]
        if is_cross_layer(self._meta):
            per_layer[-1] = list(descriptors)
        else:
            addrs = layer_addrs(self._meta)
            starts = sorted(addrs)
            order = {addr: i for i, addr in enumerate(addrs)}
            for desc in descriptors:
                per_layer[order[starts[bisect_right(starts, desc[0]) - 1]]].append(desc)

        async def one(layer: int) -> int:
            if is_cross_layer(self._meta):
                await asyncio.gather(*layers)
            else:
                await layers[layer]
            return await self._transport.write(peer, per_layer[layer]) if per_layer[layer] else 0

        results = await asyncio.gather(*(one(i) for i in range(len(layers))), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
        return sum(r for r in results if isinstance(r, int))

    async def _await_ready(self, req_id: str, transfer_id: str, ready: Awaitable[None]) -> None:
        try:
            await ready
        except Exception as exc:  # the engine's compute failed: nobody can have this KV
            log.warning("ready future of %s failed (%s); aborting its hold", req_id, exc)
            self._run_send(self._sender.abort(req_id))
            return
        self._run_send(self._sender.ready(transfer_id))

    # -- D role: fetching from P workers -----------------------------------------------------------------------

    async def _resolve_sources(self, transfer_id: str, engine_id: str, url: str) -> None:
        try:
            p_engine = await self._remote_engine(engine_id, url)
            sources = sources_of(self._meta, p_engine)
            own = self._own_engine()
            releases = [w for w, p in sorted(p_engine.items()) if release_notifier(p, own) == self._meta.worker]
        except (KVSvcError, ValueError, KeyError) as exc:  # unreachable, malformed or incompatible: all fail now
            self._remotes.pop(engine_id, None)
            self._receiver.engine_failed(engine_id, f"{type(exc).__name__}: {exc}")
            self._reports.set()
            return
        routes = _Routes(p_engine, sources, releases, sorted({*sources, *releases}))
        remote = self._remotes.get(engine_id)
        if remote is not None and remote.url == url and _fetched(remote) is p_engine:
            remote.routes, remote.routes_engine = routes, self._engine  # this very fetch: later receives reuse it
        self._route(transfer_id, engine_id, routes)

    def _route_known(self, transfer_id: str, engine_id: str, url: str) -> bool:
        """`_resolve_sources` at once, when an earlier receive from the same start of `engine_id` (same URL, same
        metadata fetch, same own engine) computed its routes; False, having done nothing, otherwise."""
        remote = self._remotes.get(engine_id)
        if remote is None or remote.routes is None or remote.url != url or remote.routes_engine is not self._engine:
            return False
        self._route(transfer_id, engine_id, remote.routes)
        return True

    def _route(self, transfer_id: str, engine_id: str, routes: _Routes) -> None:
        # Peers first: commands for a peer without a connection wait in its outbox (Releases, early Aborts).
        for worker in routes.peers:
            self._ensure_outbound(routes.p_engine[worker])
        outbound = self._outbound
        connected = {src for src in routes.sources if (peer := outbound.get((engine_id, src))) and peer.channel}
        self._run_recv(self._receiver.sources_known(transfer_id, routes.sources, routes.releases, connected))

    async def _remote_engine(self, engine_id: str, url: str) -> EngineMetadata:
        remote = self._remotes.get(engine_id)
        if remote is None or remote.url != url or (remote.fetch.done() and remote.fetch.exception() is not None):
            assert self._http is not None
            fetch = asyncio.create_task(self._fetch_engine(engine_id, url))
            remote = self._remotes[engine_id] = _RemoteEngine(engine_id, url, fetch)
        return await asyncio.shield(remote.fetch)

    async def _fetch_engine(self, engine_id: str, url: str) -> EngineMetadata:
        assert self._http is not None
        metas = await fetch_engine_metadata(self._http, url, timeout_s=self.config.handshake_timeout_s)
        found = next(iter(metas.values())).engine_id
        if found != engine_id:
            raise HandshakeError(f"{url} serves engine {found!r}, not {engine_id!r}")
        for src in sources_of(self._meta, metas):
            check_compatible(metas[src], self._meta)
        # A refetch means a new start of the engine: what was registered for the old one must go.
        self.topology.unregister_remote_engine(engine_id)
        for p in metas.values():
            if p.tp_rank == 0 and p.start_layer < self._meta.end_layer and self._meta.start_layer < p.end_layer:
                info = EngineTransferInfo(
                    p.tp_size, block_bytes(p), p.block_size, 1, p.pp_rank, p.start_layer, p.end_layer
                )
                self.topology.register_remote_engine(engine_id, info)
        return metas

    def _ensure_outbound(self, p: WorkerMetadata) -> None:
        key = (p.engine_id, p.worker)
        peer = self._outbound.get(key)
        if peer is not None and peer.ref.incarnation == p.incarnation and peer.task is not None:
            return
        if peer is not None:
            self._drop_outbound(peer, f"P engine {p.engine_id!r} restarted (incarnation {p.incarnation})")
        peer = _Outbound(WorkerRef.of(p), p, outbox=[])
        self._outbound[key] = peer
        peer.task = self._spawn(self._run_outbound(peer))

    async def _run_outbound(self, peer: _Outbound) -> None:
        engine_id, src = peer.ref.engine_id, peer.ref.worker
        channel: ControlChannel | None = None
        try:
            channel = await self._connect(peer)
            peer.channel = channel
            for message in peer.outbox or []:
                channel.send(message)
            peer.outbox = None
            self._run_recv(self._receiver.connected(engine_id, src))
            while True:
                self._on_p_message(peer, await channel.receive())
        except (PeerLost, MalformedFrame, HandshakeError) as exc:
            peer.last_error = str(exc)
            if isinstance(exc, MalformedFrame):
                self._counts["protocol_errors"] += 1
        finally:
            if self._outbound.get((engine_id, src)) is peer:
                del self._outbound[(engine_id, src)]
                # A lost connection may mean a restart: fetch the engine's metadata again next time.
                self._remotes.pop(engine_id, None)
            self._receiver.peer_lost(engine_id, src, peer.last_error or f"connection to {peer.ref} closed")
            self._reports.set()
            if channel is not None:
                await channel.wait_closed()

    async def _connect(self, peer: _Outbound) -> ControlChannel:
        """Open and hello one P worker.

        Raises:
            PeerLost: unreachable, or closed during the hello.
            HandshakeError: the hello was refused, timed out, or P is not what its engine published.
        """
        p = peer.meta
        channel = await ControlChannel.connect(p.control_addr, timeout_s=self.config.handshake_timeout_s)
        own = self._own_engine()
        stage_layers = sorted({(m.pp_rank, m.start_layer, m.end_layer) for m in own.values()})
        channel.send(
            Hello(
                version=PROTOCOL_VERSION,
                sender=self._meta,
                stage_layers=[(start, end) for _, start, end in stage_layers],
                expect_engine_id=p.engine_id,
                expect_incarnation=p.incarnation,
                expect_pp_rank=p.pp_rank,
                expect_tp_rank=p.tp_rank,
            )
        )
        try:
            reply = await asyncio.wait_for(channel.receive(), self.config.handshake_timeout_s)
        except TimeoutError:
            channel.close()
            raise HandshakeError(
                f"{peer.ref} did not answer the hello within {self.config.handshake_timeout_s:g} s"
            ) from None
        if isinstance(reply, HelloRefused):
            channel.close()
            raise HandshakeError(f"{peer.ref} refused the hello: {reply.reason}")
        if not isinstance(reply, HelloOk):
            channel.close()
            raise HandshakeError(f"{peer.ref} answered the hello with {type(reply).__name__}")
        if reply.sender != p:
            channel.close()
            raise PeerMismatch(
                f"{peer.ref} says it is {WorkerRef.of(reply.sender)} with other metadata than its engine published"
            )
        return channel

    def _on_p_message(self, peer: _Outbound, message: Message) -> None:
        engine_id, src = peer.ref.engine_id, peer.ref.worker
        self._reports.set()
        if isinstance(message, TransferDone | TransferFailed):
            error = message.reason if isinstance(message, TransferFailed) else None
            if not self._receiver.answer(engine_id, src, message.transfer_id, error):
                log.debug("late or unknown answer for %r from %s", message.transfer_id, peer.ref)
        elif isinstance(message, ErrorMessage):
            log.warning("P worker %s reports a protocol error: %s", peer.ref, message.reason)
            if message.transfer_id:
                self._receiver.answer(engine_id, src, message.transfer_id, f"P error: {message.reason}")
        elif not isinstance(message, Pong):
            self._counts["protocol_errors"] += 1
            if peer.channel is not None:
                peer.channel.send(ErrorMessage(reason=f"unexpected {type(message).__name__} from a P worker"))

    def _run_recv(self, commands: list[SendToSource]) -> None:
        for command in commands:
            peer = self._outbound.get((command.engine_id, command.src))
            if peer is None:
                continue
            if peer.channel is not None:
                with contextlib.suppress(PeerLost):
                    peer.channel.send(command.message)
            elif peer.outbox is not None:
                peer.outbox.append(command.message)

    def _drop_outbound(self, peer: _Outbound, reason: str) -> None:
        peer.last_error = reason
        if peer.channel is not None:
            peer.channel.close()
        if peer.task is not None:
            peer.task.cancel()
        self._outbound.pop((peer.ref.engine_id, peer.ref.worker), None)
        self._receiver.peer_lost(peer.ref.engine_id, peer.ref.worker, reason)
        self._reports.set()

    # -- helpers -----------------------------------------------------------------------------------------------

    def _own_engine(self) -> EngineMetadata:
        if self._engine is not None:
            return self._engine
        if self._meta.pp_size != 1:
            raise LocalProtocolError(
                f"worker {self._meta.worker} of a pp_size {self._meta.pp_size} engine needs set_engine_metadata "
                "before it can receive"
            )
        return {(0, tp): replace(self._meta, tp_rank=tp) for tp in range(self._meta.tp_size)}

    def _describe(self, ref: WorkerRef) -> str:
        try:
            return self.topology.describe(ref.engine_id, ref.pp_rank)
        except KeyError:
            return ""

    @staticmethod
    def _inbound_key(ref: WorkerRef) -> tuple[str, Worker]:
        return (ref.engine_id, ref.worker)

    @staticmethod
    def _check_blocks(meta: WorkerMetadata, block_ids: list[int], num_tokens: int, side: str) -> None:
        bad = [b for b in block_ids if not 0 <= b < meta.num_blocks]
        if bad:
            raise ValueError(f"{side} block ids {bad[:8]} outside the pool of {meta.num_blocks} blocks")
        if not 0 <= num_tokens <= len(block_ids) * meta.block_size:
            raise ValueError(
                f"{num_tokens} tokens do not fit {side}'s {len(block_ids)} blocks of {meta.block_size} tokens"
            )

    def _refuse(self, channel: ControlChannel, reason: str) -> None:
        self._counts["protocol_errors"] += 1
        log.warning("refusing hello from %s: %s", channel.peer, reason)
        with contextlib.suppress(PeerLost):
            channel.send(HelloRefused(version=PROTOCOL_VERSION, reason=reason))

    def _check_open(self) -> None:
        if self._closing:
            raise ServiceClosed(f"transfer service of worker {self._meta.worker} is closed")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("kvsvc task %s failed", task.get_name(), exc_info=exc)

    async def _deadline_loop(self) -> None:
        while True:
            self.check_deadlines()
            deadlines = [d for d in (self._sender.next_deadline(), self._receiver.next_deadline()) if d is not None]
            # Re-check at least every second so a fake or jumping clock is never missed for long.
            timeout = min([1.0, *(d - self._clock() for d in deadlines)])
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(timeout, 0.001))


_PLAN_CACHE_ENTRIES = 1024  # per D worker connection
_PLAN_CACHE_DESCRIPTORS = 4096  # larger plans cost more to shift than to plan


def _fetched(remote: _RemoteEngine) -> EngineMetadata | None:
    """The metadata `remote`'s fetch returned, or None while it runs or when it failed."""
    fetch = remote.fetch
    if not fetch.done() or fetch.cancelled() or fetch.exception() is not None:
        return None
    return fetch.result()


def _is_run(ids: list[int], count: int) -> bool:
    """Whether the first `count` ids are consecutive."""
    first = ids[0]
    return ids[count - 1] == first + count - 1 and (count <= 2 or ids[:count] == list(range(first, first + count)))


def _placeholder(meta: WorkerMetadata, layers: int) -> list[int]:
    """Base addresses for a D worker known only by layout (P never writes to it, it only plans who it sources)."""
    return [0] * (1 if meta.layout == "HND_CROSS_LAYER" else layers)


def new_incarnation() -> str:
    """A random id for one start of an engine: a restarted engine is a new peer."""
    return uuid.uuid4().hex[:12]


__all__ = ["KVSvcError", "KVTransferService", "ServiceConfig", "ServiceStatistics", "new_incarnation"]
