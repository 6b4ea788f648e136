"""The D role of a worker's service, `ReceivingRole`: fetching from P workers, driving the sans-IO `Receiver`.

Rules: protocol decisions live in `Receiver`; this module carries out its commands on the control connections it
opens to P workers, and feeds it events (routes found, connections opened or lost, answers). What D knows of remote
engines (metadata, topology) lives in its `RemoteEngines`; the routes computed from a fetch are kept here for the
receives that follow; both are dropped when a connection breaks. Commands for a peer without a connection wait in its
outbox. Shares only a `ServiceContext`; never imports the P role; never waits in start_recv.
When a connection breaks after asking, the receive's blocks stay held for the abort grace, unless the transport can
prove the P worker's process gone (`Transport.peer_gone`, which `MooncakeTransport` can tell): then only for
`gone_settle_s`; or unless D reaches the same start of that P worker again (it reconnects with a backoff while such
receives wait) and P answers their aborts, which it does once their writes ended. What to probe and when to try again
is the core's `LostSources`; this module sleeps and probes.
Windows of D's staging region are its `WindowLender`'s (`kvsvc.service.lending`), which exists only where D can lend
them (`kvsvc.core.windows.lends_windows`): a request may carry one, and every frame from a P worker passes through the
lender before it reaches the `Receiver`. Without one, requests go out as they are and P's frames go straight to the
`Receiver`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from msgspec.structs import replace

from kvsvc.core.auth import HELLO_KEY, NONCE_BYTES, derive_key
from kvsvc.core.data_planes import choose_transport
from kvsvc.core.errors import (
    HandshakeError,
    KVSvcError,
    LocalProtocolError,
    MalformedFrame,
    NeedsMooncake,
    PeerLost,
    TransportError,
)
from kvsvc.core.hello import answer_challenge, check_hello_reply, open_hello
from kvsvc.core.jobs import Notice
from kvsvc.core.messages import (
    Message,
    TransferRequest,
    WindowEmptied,
    Worker,
    WorkerMetadata,
    WorkerRef,
    clip,
)
from kvsvc.core.receiver import (
    LoadTimes,
    LostSources,
    Receiver,
    ReceiverStatistics,
    RecvCommand,
    RecvReport,
    RecvRequest,
    ToSource,
    carry_out_d,
    check_recv,
    planned_bytes,
)
from kvsvc.core.windows import Deliver, Scatter, WindowKey, lends_windows
from kvsvc.service.context import ControlChannel, EngineMetadata, ServiceContext, notice, unkeyed_peer_check
from kvsvc.service.lending import WindowLender
from kvsvc.service.remotes import RemoteEngines, Routes
from kvsvc.transport.routed import exported_handles, start_mooncake

log = logging.getLogger(__name__)

# Landed receives' phases kept for the engine's next report (`take_loads`); a report every step takes them long before.
MAX_LOADS = 4096
# Byte counts of planned receives kept (`RecvRole._planned`); past it, the cache starts over.
MAX_PLANNED = 4096


@dataclass(slots=True)
class _Outbound:
    """D's control connection to one P worker."""

    ref: WorkerRef
    meta: WorkerMetadata
    channel: ControlChannel | None = None
    outbox: list[Message] | None = None
    task: asyncio.Task[None] | None = None
    last_error: str = ""
    plane: str = ""  # the data plane P's hello reply named for the pair's writes


@dataclass(frozen=True, slots=True)
class _KnownRoutes:
    """The routes to one start of a P engine, as published at `url`, for the own engine `own` (`set_own_engine`)."""

    url: str
    own: EngineMetadata | None
    routes: Routes


class ReceivingRole:
    """D's side of one worker's service (see module docstring): remote engines, connections to P, receives."""

    def __init__(self, ctx: ServiceContext) -> None:
        self._ctx = ctx
        config = ctx.config
        self._receiver = Receiver(
            recv_timeout_s=config.recv_timeout_s,
            abort_grace_s=config.abort_grace_s,
            report_gather_s=config.report_gather_s,
        )
        self._remotes = RemoteEngines(ctx)
        self.topology = self._remotes.topology
        self._engine: EngineMetadata | None = None
        self._outbound: dict[tuple[str, Worker], _Outbound] = {}
        self._known_routes: dict[str, _KnownRoutes] = {}  # per P engine id, once a receive computed them
        self._lost_sources = LostSources()  # what to do about a lost P worker: probe it, try it again
        self._planned_bytes: dict[tuple[str, str, Worker, int, int, int], int | None] = {}
        area = ctx.staging
        self._windows: WindowLender | None = None
        if area is not None and lends_windows(area.scatter is not None, len(ctx.metadata.kv_groups)):
            self._windows = WindowLender(ctx, area, self._receiver, self)
        self._closing = False
        self._loads: list[LoadTimes] = []

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Open the HTTP session that fetches remote engines' metadata (needs the running loop)."""
        self._remotes.start()

    def set_own_engine(self, metas: EngineMetadata) -> None:
        """As `KVTransferService.set_engine_metadata`."""
        meta = self._ctx.metadata
        own = metas.get(meta.worker)
        if own is None or (own.start_layer, own.end_layer) != (meta.start_layer, meta.end_layer):
            raise ValueError(f"engine metadata does not hold worker {meta.worker} with its layers")
        self._engine = dict(metas)

    def close_connections(self) -> None:
        self._closing = True
        for peer in list(self._outbound.values()):
            if peer.channel is not None:
                peer.channel.close()

    async def close(self) -> None:
        await self._remotes.close()

    # -- the engine's calls ------------------------------------------------------------------------------------

    def recv(self, request: RecvRequest) -> None:
        """As `KVTransferService.recv`, once the service is known open: the request's one check, the receive now,
        and its jobs at once when the routes to this start of P are known, else once a task found them.

        Raises:
            ValueError: as `check_recv`, or as `Receiver.start`. LocalProtocolError: as `KVTransferService.recv`.
        """
        check_recv(self._ctx.metadata, request)
        self._own_engine()
        receive = secrets.token_hex(8)  # this receive's own name: P never answers it with another's outcome
        if not self._receiver.start(request, self._ctx.clock(), receive):
            return
        self._ctx.changed()  # a new receive deadline
        transfer_id, engine_id, url = request.transfer_id, request.engine_id, request.bootstrap_addr
        known = self._known_routes.get(engine_id)
        if known is not None and known.url == url and known.own is self._engine:
            self._start_jobs(transfer_id, engine_id, known.routes)  # no task: the routes of an earlier receive
        else:
            name = f"kvsvc-route-{request.req_id}"
            self._ctx.tasks.spawn(self._resolve_sources(transfer_id, engine_id, url), name=name)

    def abort(self, req_id: str) -> None:
        self._run_recv(self._receiver.abort(req_id, self._ctx.clock()))

    def expire(self, now: float) -> None:
        self._run_recv(self._receiver.expire(now))

    def next_deadline(self) -> float | None:
        return self._receiver.next_deadline()

    def take_report(self, step_s: float = 0.0) -> RecvReport:
        """Receives that ended since the last call (see `Receiver.take_report`), except failed ones whose window a
        scatter still copies into their blocks, and finished ones while `ReportGather` holds them for others about
        to land (`step_s`: as `KVTransferService.get_finished`): those wait for a later call."""
        report = self._receiver.take_report(self._ctx.clock(), step_s)
        return self._windows.hold_back(report) if self._windows is not None and self._windows.busy else report

    @property
    def report_held_until(self) -> float | None:
        """When a report that `ReportGather` holds goes out at the latest (None while none is held)."""
        return self._receiver.report_held_until

    def forget_engine(self, engine_id: str) -> None:
        """As `KVTransferService.forget_engine`."""
        for key, peer in list(self._outbound.items()):
            if key[0] == engine_id:
                self._drop_outbound(peer, f"engine {engine_id!r} forgotten by the operator")
        self._remotes.forget(engine_id)
        self._known_routes.pop(engine_id, None)

    # -- how full it is ----------------------------------------------------------------------------------------

    def receiver_statistics(self) -> ReceiverStatistics:
        return self._receiver.statistics()

    @property
    def outbound_peers(self) -> int:
        return sum(p.channel is not None for p in self._outbound.values())

    @property
    def remote_engines(self) -> int:
        return len(self._remotes)

    def peer_rows(self) -> list[dict[str, object]]:
        """One row per control connection to a P worker, and one per P engine start refused when they met (its
        layout does not fit), for the admin endpoint."""
        rows: list[dict[str, object]] = [
            {
                "direction": "to_p",
                "peer": str(peer.ref),
                "peer_engine_id": peer.ref.engine_id,
                "peer_pp_rank": peer.ref.pp_rank,
                "peer_tp_rank": peer.ref.tp_rank,
                "incarnation": peer.ref.incarnation,
                "state": "connected" if peer.channel is not None else ("failed" if peer.last_error else "connecting"),
                "describe": self._remotes.describe(peer.ref),
                "last_error": peer.last_error,
            }
            for peer in self._outbound.values()
        ]
        return rows + [
            {
                "direction": "to_p",
                "peer": refusal.engine_id,
                "peer_engine_id": refusal.engine_id,
                "incarnation": refusal.incarnation,
                "state": "refused",
                "last_error": refusal.reason,
            }
            for refusal in self._remotes.refusals()
        ]

    # -- remote engines and routes -----------------------------------------------------------------------------

    async def _resolve_sources(self, transfer_id: str, engine_id: str, url: str) -> None:
        own = self._engine
        self._known_routes.pop(engine_id, None)  # this fetch may find another start of the engine
        try:
            routes = await self._remotes.routes(engine_id, url, self._own_engine)
        except (KVSvcError, ValueError, KeyError) as exc:  # unreachable, malformed or incompatible: all fail now
            self._run_recv(self._receiver.engine_failed(engine_id, f"{type(exc).__name__}: {exc}"))
            return
        except Exception as exc:  # a bug of ours on a document we did not foresee: its receives still fail now
            log.exception("resolving the workers of engine %r failed unexpectedly", clip(engine_id, 80))
            self._run_recv(self._receiver.engine_failed(engine_id, f"{type(exc).__name__}: {exc}"))
            return
        if self._remotes.current(engine_id, url, routes.p_engine):  # not marked out of date while it ran
            self._known_routes[engine_id] = _KnownRoutes(url, own, routes)
        self._start_jobs(transfer_id, engine_id, routes)

    def _start_jobs(self, transfer_id: str, engine_id: str, routes: Routes) -> None:
        # Peers first: commands for a peer without a connection wait in its outbox (Releases, early Aborts).
        for worker in routes.peers:
            self._ensure_outbound(routes.p_engine[worker])
        outbound = self._outbound
        connected = {src for src in routes.sources if (peer := outbound.get((engine_id, src))) and peer.channel}
        planned = self._planned(transfer_id, routes)
        self._run_recv(self._receiver.sources_known(transfer_id, routes.sources, routes.releases, connected, planned))

    def _planned(self, transfer_id: str, routes: Routes) -> dict[Worker, int]:
        """The bytes each source writes for `transfer_id` (`planned_bytes`), cached: they depend on the counts only."""
        request = self._receiver.request_of(transfer_id)
        if request is None:
            return {}
        block_ids, num_tokens, first_token = request
        planned: dict[Worker, int] = {}
        for src in routes.sources:
            p = routes.p_engine[src]
            key = (p.engine_id, p.incarnation, src, len(block_ids), num_tokens, first_token)
            if key not in self._planned_bytes:
                if len(self._planned_bytes) >= MAX_PLANNED:
                    self._planned_bytes.clear()
                self._planned_bytes[key] = planned_bytes(p, self._ctx.metadata, block_ids, num_tokens, first_token)
            nbytes = self._planned_bytes[key]
            if nbytes is not None:
                planned[src] = nbytes
        return planned

    # -- control connections to P workers ----------------------------------------------------------------------

    def _ensure_outbound(self, p: WorkerMetadata) -> None:
        key = (p.engine_id, p.worker)
        peer = self._outbound.get(key)
        if peer is not None and peer.ref.incarnation == p.incarnation and peer.task is not None:
            return
        if peer is not None:
            self._drop_outbound(peer, f"P engine {p.engine_id!r} restarted (incarnation {p.incarnation})")
        peer = _Outbound(WorkerRef.of(p), p, outbox=[])
        self._outbound[key] = peer
        peer.task = self._ctx.tasks.spawn(self._run_outbound(peer), name=f"kvsvc-to-{peer.ref}")

    async def _run_outbound(self, peer: _Outbound) -> None:
        engine_id, src = peer.ref.engine_id, peer.ref.worker
        on_frame = self._windows.on_p_message if self._windows is not None else self._on_answer
        channel: ControlChannel | None = None
        cause = "p_lost"  # what the receives this connection's end fails count as
        try:
            channel = await self._connect(peer)
            peer.channel = channel
            for message in peer.outbox or []:
                channel.send(message)
            peer.outbox = None
            self._lost_sources.reached((engine_id, src))
            self._run_recv(self._receiver.connected(engine_id, src))
            self._run_recv(self._receiver.reconnected(engine_id, src, peer.ref.incarnation))
            while True:
                on_frame(engine_id, src, await channel.receive())
        except (PeerLost, MalformedFrame, HandshakeError) as exc:
            peer.last_error = str(exc)
            if isinstance(exc, MalformedFrame):
                self._ctx.counts["protocol_errors"] += 1
            if isinstance(exc, HandshakeError):
                cause = "handshake"
        finally:
            current = self._outbound.get((engine_id, src)) is peer
            if current:
                del self._outbound[(engine_id, src)]
                # A lost connection may mean a restart: fetch the engine's metadata again next time.
                self._remotes.invalidate(engine_id)
                self._known_routes.pop(engine_id, None)
            if current:  # else `_drop_outbound` already reported it, and a newer connection may own the jobs
                reason = peer.last_error or f"connection to {peer.ref} closed"
                self._lost(peer, reason, cause)
            if channel is not None:
                await channel.wait_closed()

    async def _connect(self, peer: _Outbound) -> ControlChannel:
        """Open and hello one P worker. This worker's Mooncake engine starts first where the pair will take it
        (`choose_transport` from the two metadata), or when P refused a hello for want of it (a probe on P refused
        the same-host plane); the hello names the engine's session once it runs.

        Raises:
            PeerLost: unreachable, or closed during the hello.
            HandshakeError: the hello was refused, timed out, P is not what its engine published, or the pair needs
                Mooncake and this worker's cannot start.
        """
        try:
            return await self._hello(peer)
        except NeedsMooncake as exc:  # said by a P that passed the uid check or proved the key on this connection
            await self._start_mooncake(peer, str(exc))
            return await self._hello(peer)

    async def _start_mooncake(self, peer: _Outbound, why: str) -> None:
        """Raises:
        HandshakeError: this worker's Mooncake engine cannot start (its setting, or the engine failed).
        """
        try:
            await start_mooncake(self._ctx.transport)
        except TransportError as exc:
            raise HandshakeError(f"{peer.ref}: {why}, and {exc}") from None

    async def _hello(self, peer: _Outbound) -> ControlChannel:
        """One connection and hello to P worker `peer` (`_connect`). Raises as `_connect`."""
        p, me = peer.meta, self._ctx.metadata
        timeout_s = self._ctx.config.handshake_timeout_s
        key = derive_key(self._ctx.config.control_token, HELLO_KEY)
        channel = await ControlChannel.connect(p.control_addr, timeout_s=timeout_s, frame_timeout_s=timeout_s)
        try:
            async with asyncio.timeout(timeout_s):  # the whole exchange, both of P's frames
                refused = unkeyed_peer_check(self._ctx, channel.ends)
                if refused:  # nothing of this worker, not even its identity, goes to a peer of another user
                    raise HandshakeError(f"{peer.ref} at {p.control_addr}: {refused}")
                start = open_hello(me, p, key, secrets.token_bytes(NONCE_BYTES))
                channel.send(start)
                # Nothing of this worker's pool goes out before P's proof verified (`answer_challenge`).
                reply = await channel.receive()
                handles = exported_handles(self._ctx.transport)
                hello = answer_challenge(me, self._own_engine(), p, start, reply, key, handles)  # P verified
                # Only a verified P makes this worker start Mooncake (where the pair will take it), and the hello
                # names the engine's session once it runs (published "" while it waits for a first pair).
                if choose_transport(p, me).kind == "mooncake":
                    await self._start_mooncake(peer, "the pair takes Mooncake")
                if (session := self._ctx.transport.session_id) != me.transport_addr:
                    me = replace(me, transport_addr=session)
                    hello = answer_challenge(me, self._own_engine(), p, start, reply, key, handles)
                channel.send(hello)
                plane = check_hello_reply(p, await channel.receive(), key, start, reply, hello)
                peer.plane = plane
                if self._windows is not None:
                    self._windows.plane_chosen(p.engine_id, p.worker, plane)
        except TimeoutError:
            channel.close()
            raise HandshakeError(f"{peer.ref} did not answer the hello within {timeout_s:g} s") from None
        except BaseException:
            channel.close()
            raise
        return channel

    def _on_answer(self, engine_id: str, src: Worker, message: Message) -> None:
        """P's frame (once the window protocol passed it on, where D lends windows): the `Receiver`'s."""
        self._run_recv(self._receiver.receive(engine_id, src, message))

    def _run_recv(self, commands: Sequence[RecvCommand]) -> None:
        """Carry out what the `Receiver` decided on its last event, and signal the change (as `start_recv` does for a
        new receive, and the lender for a scatter that ended); time the receives that landed on it."""
        self._ctx.changed()
        now = self._ctx.clock()
        for times in self._receiver.take_landed(now):
            self._ctx.recv_durations.observe(times.total_s)
            self._loaded(times)
        carry_out_d(commands, self)
        if self._windows is not None and self._windows.busy:
            self._windows.tidy()

    def take_loads(self) -> list[LoadTimes]:
        """The receives that landed since the last call, in phases (at most `MAX_LOADS`: the oldest go first)."""
        loads, self._loads = self._loads, []
        return loads

    def _loaded(self, times: LoadTimes) -> None:
        """Keep a landed receive's phases for the engine's metrics; log it when it took `slow_transfer_s` or more."""
        self._loads.append(times)
        if len(self._loads) > MAX_LOADS:
            del self._loads[: len(self._loads) - MAX_LOADS]
        bound = self._ctx.config.slow_transfer_s
        if bound and times.total_s >= bound:
            planes = sorted({self._outbound[(times.engine_id, s)].plane or "?" for s in times.sources
                             if (times.engine_id, s) in self._outbound})  # fmt: skip
            # At a bounded rate, its ids escaped: they come from the params a client sent.
            self._ctx.peer_log.warning(
                "slow transfer",
                "slow transfer: request %s (transfer %s) from engine %r, P workers %s, plane %s: %d bytes in %.3f s "
                "(handshake %.3f s, waiting at P %.3f s, P's write %.3f s, %.2f GB/s)",
                times.req_id, times.transfer_id, times.engine_id, list(times.sources), "/".join(planes) or "?",
                times.nbytes, times.total_s, times.handshake_s, times.queue_s, times.write_s, times.gbps,
            )  # fmt: skip

    # -- carrying out the core's commands (`kvsvc.core.receiver.DSide`) -------------------------------------------

    def windowed(self, engine_id: str, src: Worker, request: TransferRequest) -> TransferRequest | None:
        peer = self._outbound.get((engine_id, src))
        if peer is None:
            return None
        return self._windows.windowed(peer.meta, request) if self._windows is not None else request

    def scatter(self, key: WindowKey, command: Scatter) -> None:
        assert self._windows is not None  # only lent windows scatter
        self._windows.scatter(key, command)

    def deliver(self, key: WindowKey, command: Deliver) -> None:
        if command.scattered:
            self._ctx.counts["scattered"] += 1
        self._on_answer(key[1], key[2], command.message)

    def log(self, notice_: Notice) -> None:
        notice(self._ctx, notice_)

    # -- frames to P workers ----------------------------------------------------------------------------------

    def _send(self, peer: _Outbound, message: Message) -> None:
        if peer.channel is not None:
            if isinstance(message, TransferRequest):
                self._receiver.asked(message.transfer_id, self._ctx.clock())
            with contextlib.suppress(PeerLost):
                peer.channel.send(message)
        elif peer.outbox is not None:
            peer.outbox.append(message)

    def tell_p(self, engine_id: str, src: Worker, message: ToSource | WindowEmptied) -> None:
        """Send `message` to P worker `src` of `engine_id` on its connection, or keep it for the connection being
        opened; dropped when there is neither."""
        peer = self._outbound.get((engine_id, src))
        if peer is not None:
            self._send(peer, message)

    def _drop_outbound(self, peer: _Outbound, reason: str) -> None:
        peer.last_error = reason
        if peer.channel is not None:
            peer.channel.close()
        if peer.task is not None:
            peer.task.cancel()
        self._outbound.pop((peer.ref.engine_id, peer.ref.worker), None)
        self._lost(peer, reason)

    def _lost(self, peer: _Outbound, reason: str, cause: str = "p_lost") -> None:
        engine_id, src = peer.ref.engine_id, peer.ref.worker
        now = self._ctx.clock()
        self._run_recv(self._receiver.peer_lost(engine_id, src, reason, now, peer.ref.incarnation, cause))
        waiting = self._receiver.waits_on_lost(engine_id, src)
        recovery = self._lost_sources.lost((engine_id, src), peer.meta, waiting=waiting, closing=self._closing)
        if recovery.probe:
            self._ctx.tasks.spawn(self._confirm_gone(peer, reason, recovery.probe), name=f"kvsvc-probe-{peer.ref}")
        if recovery.retry_after_s is not None:
            name = f"kvsvc-reconnect-{peer.ref}"
            self._ctx.tasks.spawn(self._reconnect(peer, recovery.retry_after_s), name=name)

    async def _reconnect(self, peer: _Outbound, after_s: float) -> None:
        """Reach the lost P worker again after `after_s`, as `LostSources.retry` decides then: its answers to the
        receives' aborts (`Receiver.reconnected`) end their wait. A failed try loses the connection again, which
        schedules the next try after twice the delay; the receives' abort grace bounds it all."""
        key = (peer.ref.engine_id, peer.ref.worker)
        await asyncio.sleep(after_s)
        waiting = self._receiver.waits_on_lost(*key)
        if self._lost_sources.retry(key, waiting=waiting, closing=self._closing, connecting=key in self._outbound):
            self._ctx.counts["reconnects"] += 1
            self._ensure_outbound(peer.meta)

    async def _confirm_gone(self, peer: _Outbound, reason: str, addresses: tuple[str, ...]) -> None:
        """Shorten the abort grace of the receives that lost `peer` if its transfer engine is gone (the first of
        `addresses` whose probe says so): a dead process writes nothing more once what it had sent has landed
        (`gone_settle_s`)."""
        try:
            gone = False
            for address in addresses:
                if not gone:
                    gone = await self._ctx.transport.peer_gone(address)
        finally:
            self._lost_sources.probe_ended(peer.meta)
        if not gone:
            return
        await asyncio.sleep(self._ctx.config.gone_settle_s)
        why = f"{reason}; its transfer engine is gone"
        self._run_recv(self._receiver.source_gone(peer.ref.engine_id, peer.ref.worker, why))

    # -- helpers -----------------------------------------------------------------------------------------------

    def _own_engine(self) -> EngineMetadata:
        """This worker's engine, as `set_engine_metadata` gave it, or built from this worker alone (pp_size 1).

        Raises:
            LocalProtocolError: the engine has several PP stages and `set_engine_metadata` was not called.
        """
        meta = self._ctx.metadata
        if self._engine is not None:
            return self._engine
        if meta.pp_size != 1:
            raise LocalProtocolError(
                f"worker {meta.worker} of a pp_size {meta.pp_size} engine needs set_engine_metadata before it can "
                "receive"
            )
        return {(0, tp): replace(meta, tp_rank=tp) for tp in range(meta.tp_size)}
