"""The D role of a worker's service, `ReceivingRole`: fetching from P workers, driving the sans-IO `Receiver`.

Rules: protocol decisions live in `Receiver`; this module carries out its commands on the control connections it
opens to P workers, and feeds it events (routes found, connections opened or lost, answers). What D knows of remote
engines (metadata, routes, topology) lives in its `RemoteEngines`, dropped when a connection breaks. Commands for a
peer without a connection wait in its outbox. Shares only a `ServiceContext`; never imports the P role; never waits
in start_recv.
When a connection breaks after asking, the receive's blocks stay held for the abort grace, unless the transport can
prove the P worker's process gone (`Transport.peer_gone`, which `MooncakeTransport` can tell): then only for
`gone_settle_s`; or unless D reaches the same start of that P worker again (it reconnects with a backoff while such
receives wait) and P answers their aborts, which it does once their writes ended.
With a staging region that can scatter, a request whose share the staging rule sends through D (`Way.scatters`)
carries a window (without room it waits up to `window_wait_s`, then goes without one); P's done answer reaches the
`Receiver` only after the scatter copied the window into the blocks, and the window goes back once the receive
from that P worker ended and no scatter reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from dataclasses import replace as replace_plan

from msgspec.structs import replace

from kvsvc.coalesce import Int64Array
from kvsvc.errors import HandshakeError, KVSvcError, LocalProtocolError, MalformedFrame, PeerLost
from kvsvc.hello import check_hello_reply, make_hello
from kvsvc.jobs import Notice
from kvsvc.layout import block_geometry
from kvsvc.messages import (
    ErrorMessage,
    Message,
    TransferDone,
    TransferFailed,
    TransferRequest,
    WindowEmptied,
    WindowFilled,
    Worker,
    WorkerMetadata,
    WorkerRef,
)
from kvsvc.planner import check_block_ids, is_block_run
from kvsvc.receiver import Receiver, ReceiverStatistics, RecvCommand, RecvReport
from kvsvc.service.channel import ControlChannel
from kvsvc.service.context import EngineMetadata, ServiceContext, notice
from kvsvc.service.remotes import RemoteEngines, Routes
from kvsvc.service.staging import StagingArea, StagingFull
from kvsvc.staging import WindowPlan, plan_window, stream_round, window_round_bytes, window_rounds

log = logging.getLogger(__name__)

# Reconnects to a lost P worker that receives still wait on: first try, and the cap of the doubling delay.
RECONNECT_FIRST_S = 0.05
RECONNECT_MAX_S = 2.0
_WINDOW_PLAN_CACHE_ENTRIES = 1024


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
class _Window:
    """A window of D's staging region lent for one (transfer, P worker): where P writes the share (`share` bytes,
    in `rounds` rounds of `round_bytes` when it is larger than the window's `nbytes`), and the scatter that copies it
    into the blocks, as (stream offset, block address, length) columns."""

    req_id: str
    block_ids: list[int]
    addr: int
    nbytes: int
    share: int
    scatter: tuple[Int64Array, Int64Array, Int64Array]
    round_bytes: int
    rounds: int
    next_round: int = 0  # the round P fills next
    scattering: bool = False
    failed: str = ""  # why the rest is not scattered (a scatter failed, the receive is ending): rounds are only
    # acknowledged, and P's done answer becomes a failure
    queue: deque[Message] = field(default_factory=deque)  # P's frames about it, handled one scatter at a time

    @classmethod
    def lent(cls, req_id: str, block_ids: list[int], addr: int, plan: WindowPlan) -> _Window:
        """The window lent at `addr` for `plan`."""
        size = window_round_bytes(plan.nbytes, plan.window_bytes)
        rounds = window_rounds(plan.nbytes, plan.window_bytes)
        return cls(
            req_id, block_ids, addr, plan.window_bytes, plan.nbytes, (plan.offset, plan.dst, plan.length), size, rounds
        )


_WindowKey = tuple[str, str, Worker]  # (transfer_id, P engine, P worker)


class ReceivingRole:
    """D's side of one worker's service (see module docstring): remote engines, connections to P, receives."""

    def __init__(self, ctx: ServiceContext) -> None:
        self._ctx = ctx
        self._receiver = Receiver(recv_timeout_s=ctx.config.recv_timeout_s, abort_grace_s=ctx.config.abort_grace_s)
        self._remotes = RemoteEngines(ctx)
        self.topology = self._remotes.topology
        self._engine: EngineMetadata | None = None
        self._outbound: dict[tuple[str, Worker], _Outbound] = {}
        self._reconnect_delay: dict[tuple[str, Worker], float] = {}  # per lost P worker, doubled per failed try
        self._probing: set[str] = set()  # transfer engines a `peer_gone` probe runs against (one at a time each)
        self._windows: dict[_WindowKey, _Window] = {}
        # Requests that wait for room for a window: the receive's req_id and the task that sends them.
        self._waiting_room: dict[_WindowKey, tuple[str, asyncio.Task[None]]] = {}
        self._deferred: dict[str, tuple[str, list[int]]] = {}  # failed receives held back: req_id -> (why, blocks)
        # (P engine, incarnation, P worker, D blocks, tokens) -> the window plan of D blocks 0.. (None: no window)
        self._window_plans: dict[tuple[str, str, Worker, int, int], WindowPlan | None] = {}
        self._closing = False

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

    def start_recv(
        self,
        req_id: str,
        transfer_id: str,
        engine_id: str,
        url: str,
        block_ids: list[int],
        num_tokens: int,
        first_token: int = 0,
    ) -> None:
        """As `KVTransferService.start_recv`, once the service is known open."""
        check_block_ids(self._ctx.metadata, block_ids, num_tokens, "D", first_token)
        self._own_engine()
        now = self._ctx.clock()
        if not self._receiver.start(req_id, transfer_id, engine_id, block_ids, num_tokens, now, first_token):
            return
        self._ctx.changed()  # a new receive deadline
        if not self._route_known(transfer_id, engine_id, url):
            self._ctx.tasks.spawn(self._resolve_sources(transfer_id, engine_id, url), name=f"kvsvc-route-{req_id}")

    def abort(self, req_id: str) -> None:
        self._run_recv(self._receiver.abort(req_id, self._ctx.clock()))

    def expire(self, now: float) -> None:
        self._run_recv(self._receiver.expire(now))

    def next_deadline(self) -> float | None:
        return self._receiver.next_deadline()

    def take_report(self) -> RecvReport:
        """Receives that ended since the last call (see `Receiver.take_report`), except failed ones whose window a
        scatter still copies into their blocks: those wait for a later call, once it ended."""
        report = self._receiver.take_report()
        if not self._windows and not self._deferred:
            return report
        busy = {w.req_id: w.block_ids for w in self._windows.values() if w.scattering}
        for req_id in report.failed & busy.keys():
            self._deferred[req_id] = (report.reasons.pop(req_id, ""), busy[req_id])
            report.failed.discard(req_id)
            report.invalid_block_ids.difference_update(busy[req_id])
        for req_id in [r for r in self._deferred if r not in busy]:
            reason, block_ids = self._deferred.pop(req_id)
            report.failed.add(req_id)
            report.reasons[req_id] = reason
            report.invalid_block_ids.update(block_ids)
        return report

    def forget_engine(self, engine_id: str) -> None:
        """As `KVTransferService.forget_engine`."""
        for key, peer in list(self._outbound.items()):
            if key[0] == engine_id:
                self._drop_outbound(peer, f"engine {engine_id!r} forgotten by the operator")
        self._remotes.forget(engine_id)

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
        try:
            routes = await self._remotes.routes(engine_id, url, self._own_engine, self._engine)
        except (KVSvcError, ValueError, KeyError) as exc:  # unreachable, malformed or incompatible: all fail now
            self._run_recv(self._receiver.engine_failed(engine_id, f"{type(exc).__name__}: {exc}"))
            return
        self._route(transfer_id, engine_id, routes)

    def _route_known(self, transfer_id: str, engine_id: str, url: str) -> bool:
        """`_resolve_sources` at once, when an earlier receive from the same start of `engine_id` computed its
        routes (`RemoteEngines.known_routes`); False, having done nothing, otherwise."""
        routes = self._remotes.known_routes(engine_id, url, self._engine)
        if routes is None:
            return False
        self._route(transfer_id, engine_id, routes)
        return True

    def _route(self, transfer_id: str, engine_id: str, routes: Routes) -> None:
        # Peers first: commands for a peer without a connection wait in its outbox (Releases, early Aborts).
        for worker in routes.peers:
            self._ensure_outbound(routes.p_engine[worker])
        outbound = self._outbound
        connected = {src for src in routes.sources if (peer := outbound.get((engine_id, src))) and peer.channel}
        self._run_recv(self._receiver.sources_known(transfer_id, routes.sources, routes.releases, connected))

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
        channel: ControlChannel | None = None
        try:
            channel = await self._connect(peer)
            peer.channel = channel
            for message in peer.outbox or []:
                channel.send(message)
            peer.outbox = None
            self._reconnect_delay.pop((engine_id, src), None)
            self._run_recv(self._receiver.connected(engine_id, src))
            self._run_recv(self._receiver.reconnected(engine_id, src, peer.ref.incarnation))
            while True:
                self._on_p_message(peer, await channel.receive())
        except (PeerLost, MalformedFrame, HandshakeError) as exc:
            peer.last_error = str(exc)
            if isinstance(exc, MalformedFrame):
                self._ctx.counts["protocol_errors"] += 1
        finally:
            current = self._outbound.get((engine_id, src)) is peer
            if current:
                del self._outbound[(engine_id, src)]
                # A lost connection may mean a restart: fetch the engine's metadata again next time.
                self._remotes.invalidate(engine_id)
            if current:  # else `_drop_outbound` already reported it, and a newer connection may own the jobs
                reason = peer.last_error or f"connection to {peer.ref} closed"
                self._lost(peer, reason)
            if channel is not None:
                await channel.wait_closed()

    async def _connect(self, peer: _Outbound) -> ControlChannel:
        """Open and hello one P worker.

        Raises:
            PeerLost: unreachable, or closed during the hello.
            HandshakeError: the hello was refused, timed out, or P is not what its engine published.
        """
        p = peer.meta
        timeout_s = self._ctx.config.handshake_timeout_s
        channel = await ControlChannel.connect(p.control_addr, timeout_s=timeout_s)
        channel.send(make_hello(self._ctx.metadata, self._own_engine(), p, self._ctx.config.control_token))
        try:
            reply = await asyncio.wait_for(channel.receive(), timeout_s)
        except TimeoutError:
            channel.close()
            raise HandshakeError(f"{peer.ref} did not answer the hello within {timeout_s:g} s") from None
        try:
            check_hello_reply(p, reply)
        except HandshakeError:
            channel.close()
            raise
        return channel

    def _on_p_message(self, peer: _Outbound, message: Message) -> None:
        if self._windows and self._through_window(peer.ref.engine_id, peer.ref.worker, message):
            return
        self._run_recv(self._receiver.receive(peer.ref.engine_id, peer.ref.worker, message))
        now = self._ctx.clock()
        for started in self._receiver.take_landed():
            self._ctx.recv_durations.observe(now - started)

    def _run_recv(self, commands: Sequence[RecvCommand]) -> None:
        """Carry out what the `Receiver` decided on its last event (the one place the D role signals a change)."""
        self._ctx.changed()
        for command in commands:
            if isinstance(command, Notice):
                notice(self._ctx, command)
                continue
            peer = self._outbound.get((command.engine_id, command.src))
            if peer is None:
                continue
            message: Message | None = command.message
            if isinstance(message, TransferRequest) and self._ctx.staging is not None:
                message = self._windowed(peer, message)
            if message is not None:
                self._send(peer, message)
        if self._windows or self._waiting_room:
            self._tidy_windows()

    # -- windows (D-side staging) ------------------------------------------------------------------------------

    def _send(self, peer: _Outbound, message: Message) -> None:
        if peer.channel is not None:
            with contextlib.suppress(PeerLost):
                peer.channel.send(message)
        elif peer.outbox is not None:
            peer.outbox.append(message)

    def _windowed(self, peer: _Outbound, request: TransferRequest) -> TransferRequest | None:
        """`request` with a window of the staging region, when the staging rule sends P's share through one and
        there is room now; `request` as it is when the rule does not (P writes the blocks, directly or gathered);
        None when the request waits for room (`_ask_when_room` sends it)."""
        key = (request.transfer_id, peer.ref.engine_id, peer.ref.worker)
        req_id = self._receiver.req_of(request.transfer_id)
        waiting = self._waiting_room.get(key)
        if waiting is not None:
            if waiting[0] == req_id:
                return None  # a repeat while the first waits for room: that one goes out
            waiting[1].cancel()  # an ended receive's request, the transfer id started again: this one goes
            del self._waiting_room[key]
        window = self._windows.get(key)
        if window is None and req_id is not None:
            area = self._ctx.staging
            plan = None if area is None or area.scatter is None else self._window_plan(peer.meta, request, area)
            if plan is None:
                return request
            addr = area.try_lend(plan.window_bytes) if area is not None else None
            if addr is None and self._ctx.config.window_wait_s > 0:
                task = self._ctx.tasks.spawn(
                    self._ask_when_room(key, request, req_id, plan), name=f"kvsvc-window-{req_id}"
                )
                self._waiting_room[key] = (req_id, task)
                return None
            if addr is None:
                return request
            window = self._windows[key] = _Window.lent(req_id, request.block_ids, addr, plan)
        if window is None or window.req_id != req_id:
            return request  # the transfer id again while an earlier receive's window is still being scattered
        return replace(request, window_addr=window.addr, window_bytes=window.nbytes, share_bytes=window.share)

    async def _ask_when_room(self, key: _WindowKey, request: TransferRequest, req_id: str, plan: WindowPlan) -> None:
        """Wait up to `window_wait_s` for room for `request`'s window, then ask P, with the window or without it.
        Nothing is asked if the receive ended or is being aborted meanwhile (P answers its abort alone); the wait
        is cancelled then (`_tidy_windows`), which leaves nothing lent."""
        area = self._ctx.staging
        assert area is not None
        addr: int | None = None
        try:
            addr = await area.lend(plan.window_bytes, self._ctx.config.window_wait_s)
        except StagingFull:
            pass
        finally:
            if self._waiting_room.get(key, ("", None))[1] is asyncio.current_task():
                del self._waiting_room[key]
        transfer_id = request.transfer_id
        if (
            self._receiver.req_of(transfer_id) != req_id
            or self._receiver.ending(transfer_id)
            or not self._receiver.waits_on(*key)
        ):
            if addr is not None:
                area.give_back(addr)
            return
        if addr is not None:
            window = self._windows[key] = _Window.lent(req_id, request.block_ids, addr, plan)
            request = replace(request, window_addr=window.addr, window_bytes=window.nbytes, share_bytes=window.share)
        current = self._outbound.get(key[1:])
        if current is not None:
            self._send(current, request)

    def _window_plan(self, p: WorkerMetadata, request: TransferRequest, area: StagingArea) -> WindowPlan | None:
        """`plan_window`, from a cache when D's blocks for the tokens are one run of consecutive ids and D holds no
        prefix: the plan of the run starting at block 0, its destinations shifted (as P's plan cache does)."""
        d, ids, tokens = self._ctx.metadata, request.block_ids, request.num_tokens
        rule, max_bytes = area.rule, area.chunk_bytes
        count = -(-tokens // d.block_size)
        if request.first_token or not 0 < count <= len(ids) or not is_block_run(ids, count):
            return plan_window(p, d, ids, tokens, request.first_token, rule, max_bytes)
        key = (p.engine_id, p.incarnation, p.worker, count, tokens)
        if key in self._window_plans:
            unit = self._window_plans[key]
        else:
            unit = plan_window(p, d, list(range(count)), tokens, 0, rule, max_bytes)
            if len(self._window_plans) < _WINDOW_PLAN_CACHE_ENTRIES:
                self._window_plans[key] = unit
        if unit is None or ids[0] == 0:
            return unit
        return replace_plan(unit, dst=unit.dst + ids[0] * block_geometry(d).block_stride)

    def _through_window(self, engine_id: str, src: Worker, message: Message) -> bool:
        """Take P's frames about a windowed share (its rounds, its answer) in order, one scatter at a time; True when
        `message` was taken, False when it goes to the `Receiver` now."""
        if not isinstance(message, WindowFilled | TransferDone | TransferFailed | ErrorMessage):
            return False
        window = self._windows.get((message.transfer_id, engine_id, src))
        if window is None and isinstance(message, WindowFilled):  # late: its receive ended and gave it back
            notice(self._ctx, Notice(f"late round {message.round} of {message.transfer_id!r} from P{src}", "debug"))
            return True
        if window is None:
            return False
        window.queue.append(message)
        self._next_in_window(engine_id, src, window)
        return True

    def _next_in_window(self, engine_id: str, src: Worker, window: _Window) -> None:
        while window.queue and not window.scattering:
            message = window.queue.popleft()
            if isinstance(message, WindowFilled):
                self._round_filled(engine_id, src, window, message)
            elif isinstance(message, TransferDone) and window.next_round != window.rounds - 1:
                reason = f"P answered done after {window.next_round} of {window.rounds} rounds of its window"
                failed = TransferFailed(transfer_id=message.transfer_id, reason=reason)
                self._run_recv(self._receiver.receive(engine_id, src, failed))
            elif isinstance(message, TransferDone) and not window.failed:
                self._scatter_round(engine_id, src, window, message, window.rounds - 1)
            else:
                if isinstance(message, TransferDone):  # a scatter failed: the blocks are not whole
                    message = TransferFailed(transfer_id=message.transfer_id, reason=window.failed)
                self._run_recv(self._receiver.receive(engine_id, src, message))

    def _round_filled(self, engine_id: str, src: Worker, window: _Window, message: WindowFilled) -> None:
        index = message.round
        if index < window.next_round:  # a repeat: it was emptied already
            self._tell_p(engine_id, src, WindowEmptied(transfer_id=message.transfer_id, round=index))
        elif index != window.next_round or index >= window.rounds - 1:
            what = f"P{src} of {engine_id!r} filled round {index} of {message.transfer_id!r}'s window, "
            notice(self._ctx, Notice(what + f"expected {window.next_round} of {window.rounds}", protocol_error=True))
        elif window.failed or self._receiver.ending(message.transfer_id):
            # Nothing to scatter into any more (a scatter failed, or the receive is being aborted): let P's write
            # reach its end, or its next round check, quickly.
            window.failed = window.failed or "the receive ended before its window was scattered"
            window.next_round += 1
            self._tell_p(engine_id, src, WindowEmptied(transfer_id=message.transfer_id, round=index))
        else:
            self._scatter_round(engine_id, src, window, message, index)

    def _scatter_round(
        self, engine_id: str, src: Worker, window: _Window, message: WindowFilled | TransferDone, index: int
    ) -> None:
        area = self._ctx.staging
        assert area is not None and area.scatter is not None
        offset, dst, length = window.scatter
        r_dst, r_offset, r_length = stream_round(offset, dst, length, index, window.round_bytes)
        base = window.addr + (index % 2) * window.round_bytes
        window.scattering = True
        copy: asyncio.Future[None]
        try:
            copy = asyncio.ensure_future(area.scatter(base + r_offset, r_dst, r_length))
        except Exception as exc:  # an embedder's scatter that raises at the call: as if the copy failed
            copy = asyncio.get_running_loop().create_future()
            copy.set_exception(exc)
        copy.add_done_callback(lambda done: self._scattered(engine_id, src, window, message, done))

    def _scattered(
        self,
        engine_id: str,
        src: Worker,
        window: _Window,
        message: WindowFilled | TransferDone,
        copy: asyncio.Future[None],
    ) -> None:
        """A round's scatter ended: P may fill its half again, or P's done answer goes on (a failure in its place
        when a scatter failed)."""
        window.scattering = False
        if copy.cancelled():
            return  # the service closed
        exc = copy.exception()
        if exc is not None and not window.failed:
            window.failed = f"scatter of D's window into its blocks failed: {type(exc).__name__}: {exc}"
        window.next_round += 1
        if isinstance(message, WindowFilled):
            self._tell_p(engine_id, src, WindowEmptied(transfer_id=message.transfer_id, round=message.round))
        elif window.failed:
            failed = TransferFailed(transfer_id=message.transfer_id, reason=window.failed)
            self._run_recv(self._receiver.receive(engine_id, src, failed))
        else:
            self._ctx.counts["scattered"] += 1
            self._run_recv(self._receiver.receive(engine_id, src, message))
        self._next_in_window(engine_id, src, window)
        self._free_windows()
        self._ctx.changed()  # a failed receive held back for this scatter may be reported now

    def _tell_p(self, engine_id: str, src: Worker, message: Message) -> None:
        peer = self._outbound.get((engine_id, src))
        if peer is not None and peer.channel is not None:
            with contextlib.suppress(PeerLost):
                peer.channel.send(message)

    def _tidy_windows(self) -> None:
        """Stop the waits for room of receives that ended or are being aborted (they would hold the region's line
        for nothing), and give back the windows nothing needs any more."""
        for key, (req_id, task) in list(self._waiting_room.items()):
            if self._receiver.req_of(key[0]) != req_id or self._receiver.ending(key[0]):
                task.cancel()
                del self._waiting_room[key]
        if self._windows:
            self._free_windows()

    def _free_windows(self) -> None:
        """Give back every window whose receive from its P worker ended and that no scatter reads."""
        area = self._ctx.staging
        assert area is not None
        for key, window in list(self._windows.items()):
            if not window.scattering and not self._receiver.waits_on(*key):
                del self._windows[key]
                area.give_back(window.addr)

    def _drop_outbound(self, peer: _Outbound, reason: str) -> None:
        peer.last_error = reason
        if peer.channel is not None:
            peer.channel.close()
        if peer.task is not None:
            peer.task.cancel()
        self._outbound.pop((peer.ref.engine_id, peer.ref.worker), None)
        self._lost(peer, reason)

    def _lost(self, peer: _Outbound, reason: str) -> None:
        engine_id, src = peer.ref.engine_id, peer.ref.worker
        now = self._ctx.clock()
        self._run_recv(self._receiver.peer_lost(engine_id, src, reason, now, peer.ref.incarnation))
        if self._closing or not self._receiver.waits_on_lost(engine_id, src):
            return
        if peer.meta.transport_addr not in self._probing:
            self._ctx.tasks.spawn(self._confirm_gone(peer, reason), name=f"kvsvc-probe-{peer.ref}")
        self._ctx.tasks.spawn(self._reconnect(peer), name=f"kvsvc-reconnect-{peer.ref}")

    async def _reconnect(self, peer: _Outbound) -> None:
        """Reach the lost P worker again while receives hold blocks only because of it: its answers to their
        aborts (`Receiver.reconnected`) end the wait. A failed try loses the connection again, which schedules the
        next try after twice the delay; the receives' abort grace bounds it all."""
        key = (peer.ref.engine_id, peer.ref.worker)
        delay = self._reconnect_delay.get(key, RECONNECT_FIRST_S)
        self._reconnect_delay[key] = min(2 * delay, RECONNECT_MAX_S)
        await asyncio.sleep(delay)
        if not self._receiver.waits_on_lost(*key):
            self._reconnect_delay.pop(key, None)  # nothing waits any more
            return
        if self._closing or key in self._outbound:
            return  # closed, or already connecting (maybe to a newer start, which `reconnected` tells apart)
        self._ctx.counts["reconnects"] += 1
        self._ensure_outbound(peer.meta)

    async def _confirm_gone(self, peer: _Outbound, reason: str) -> None:
        """Shorten the abort grace of the receives that lost `peer` if its transfer engine is gone: a dead
        process writes nothing more once what it had sent has landed (`gone_settle_s`)."""
        session = peer.meta.transport_addr
        self._probing.add(session)
        try:
            gone = await self._ctx.transport.peer_gone(session)
        finally:
            self._probing.discard(session)
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
