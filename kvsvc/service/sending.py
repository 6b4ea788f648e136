"""The P role of a worker's service, `SendingRole`: serving D workers, driving the sans-IO `Sender`.

Rules: protocol decisions live in `Sender`; this module carries out its commands as the P side of the core's
drivers (`kvsvc.core.sender.PSide`: replies and round announcements on the connections D workers opened, writes
through its `BlockWriter`) and feeds it events (hellos, requests, layers ready, each write's `WriteEnd`).
Shares only a `ServiceContext`; never imports the D role. A request's blocks stay held until every write that may
touch them drained. Network input never raises out of a connection handler: it gets an error frame or a close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import Counter
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

from kvsvc.core.auth import HELLO_KEY, NONCE_BYTES, derive_key
from kvsvc.core.bounds import MAX_HELLO_FRAME_BYTES, ControlConnections
from kvsvc.core.data_planes import PLANE_NAMES, Route, choose_transport, needs_mooncake, probed, samehost_check_budget
from kvsvc.core.errors import (
    MalformedFrame,
    PeerLost,
    TransportError,
)
from kvsvc.core.hello import HelloRefusal, accept_hello, challenge_hello
from kvsvc.core.jobs import Notice
from kvsvc.core.layout import pool_regions
from kvsvc.core.messages import (
    PROTOCOL_VERSION,
    ErrorMessage,
    HelloRefused,
    IpcHandle,
    Message,
    WindowEmptied,
    Worker,
    WorkerMetadata,
    WorkerRef,
)
from kvsvc.core.sender import (
    Reply,
    SendCommand,
    Sender,
    SenderStatistics,
    SendRequest,
    Submit,
    WriteEnd,
    carry_out_p,
    check_send,
)
from kvsvc.core.windows import Announce
from kvsvc.service.context import ControlChannel, ServiceContext, escape_controls, notice, unkeyed_peer_check
from kvsvc.service.writing import BlockWriter, WriteTarget
from kvsvc.transport.routed import plane_of, start_mooncake

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Inbound:
    """P's control connection from one D worker, after its hello was accepted."""

    ref: WorkerRef
    meta: WorkerMetadata
    channel: ControlChannel
    expected: frozenset[Worker]
    target: WriteTarget  # the same D worker as the writes see it, with its cached plans


class SendingRole:
    """P's side of one worker's service (see module docstring): its control server, holds and writes."""

    def __init__(self, ctx: ServiceContext) -> None:
        self._ctx = ctx
        config = ctx.config
        self._sender = Sender(
            hold_timeout_s=config.hold_timeout_s,
            early_request_timeout_s=config.early_request_timeout_s,
            max_early_requests=config.max_early_requests,
            max_early_request_bytes=config.max_early_request_bytes,
            max_early_request_bytes_total=config.max_early_request_bytes_total,
            exact_tokens=any(group.mamba is not None for group in ctx.metadata.kv_groups),
        )
        # Which connections P holds, and which one stands for each D worker, is the core's (`ControlConnections`);
        # `_inbound` holds the routed ones, each with its write target.
        self._connections: ControlConnections[ControlChannel, tuple[str, Worker]] = ControlConnections(
            config.max_control_connections, config.max_control_connections_per_host, config.max_pending_hellos
        )
        self._inbound: dict[tuple[str, Worker], _Inbound] = {}
        # Sessions a hello is routing to (checked, probed, admitted on a same-host plane) and has not published yet:
        # no other connection's end may unpublish them meanwhile (`_forget_session`).
        self._routing: Counter[str] = Counter()
        self._writer = BlockWriter(ctx, self, self._sender)
        self._server: asyncio.Server | None = None
        self._accepting = True

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def listen(self) -> int:
        """Bind the control server D workers connect to; returns its port.

        Raises:
            OSError: the control address cannot be bound.
        """
        self._server = await asyncio.start_server(
            self._serve_connection, self._ctx.config.control_host, self._ctx.config.control_port
        )
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def stop_accepting(self) -> None:
        """Refuse new control connections from now on."""
        self._accepting = False
        if self._server is not None:
            self._server.close()

    async def wait_writes(self) -> None:
        """Wait up to `close_drain_timeout_s` for the writes in flight, then cancel the write tasks left."""
        await self._writer.wait_writes()

    def shut_down(self) -> None:
        """Answer failed what D workers still wait for (see `Sender.shut_down`), before the connections close."""
        self._run_send(self._sender.shut_down("P worker shutting down"))

    def close_connections(self) -> None:
        for inbound in list(self._inbound.values()):
            inbound.channel.close()

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_closed()

    # -- the engine's calls ------------------------------------------------------------------------------------

    def send(self, request: SendRequest, ready: Awaitable[None] | Sequence[Awaitable[None]] | None) -> None:
        """As `KVTransferService.send`, once the service is known open: the request's one check, the hold now, and
        the write once `ready` says the KV is written (layer by layer, for one future per local layer).

        Raises:
            ValueError: as `check_send`; layer-wise `ready` has not one future per local layer; as `Sender.hold`.
        """
        check_send(self._ctx.metadata, request)
        layers = self._ctx.metadata.num_layers
        if isinstance(ready, Sequence) and len(ready) != layers:
            raise ValueError(f"layer-wise ready has {len(ready)} futures for {layers} local layers")
        transfer_id = request.transfer_id
        self._run_send(self._sender.hold(request, self._ctx.clock()))
        self._ctx.counts["early_served"] = self._sender.early_served
        if ready is None:
            self._run_send(self._sender.ready(transfer_id))
        elif isinstance(ready, Sequence):
            self._writer.layer_wise(transfer_id, ready)
            self._run_send(self._sender.ready(transfer_id))
        else:
            name = f"kvsvc-ready-{request.req_id}"
            self._ctx.tasks.spawn(self._await_ready(request.req_id, transfer_id, ready), name=name)

    def abort(self, req_id: str) -> None:
        self._run_send(self._sender.abort(req_id))

    def withdraw(self, transfer_id: str, secret: str, reason: str) -> None:
        self._run_send(self._sender.withdraw(transfer_id, secret, reason))

    def expire(self, now: float) -> None:
        self._run_send(self._sender.expire(now))

    def next_deadline(self) -> float | None:
        return self._sender.next_deadline()

    def take_finished(self) -> set[str]:
        """The req_ids whose holds ended since the last call (see `Sender.take_finished`)."""
        sent = self._sender.take_finished()
        self._writer.forget_layers()
        return sent

    # -- how full it is ----------------------------------------------------------------------------------------

    def sender_statistics(self) -> SenderStatistics:
        return self._sender.statistics()

    @property
    def control_connections(self) -> int:
        """Control connections open to this P worker, accepted or still before their hello."""
        return self._connections.open

    @property
    def inbound_peers(self) -> int:
        return len(self._inbound)

    @property
    def writes_in_flight(self) -> int:
        return self._writer.in_flight

    def peer_rows(self) -> list[dict[str, object]]:
        """One row per control connection from a D worker, for the admin endpoint."""
        return [
            {
                "direction": "from_d",
                "peer": str(inbound.ref),
                "peer_engine_id": inbound.ref.engine_id,
                "peer_pp_rank": inbound.ref.pp_rank,
                "peer_tp_rank": inbound.ref.tp_rank,
                "incarnation": inbound.ref.incarnation,
                "state": "connected",
                "expected_destinations": sorted(inbound.expected),
                "transport": inbound.target.plane,
                "session": inbound.target.session,
            }
            for inbound in self._inbound.values()
        ]

    # -- control connections from D workers --------------------------------------------------------------------

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Both of D's frames before its hello is accepted (its start and its hello) are held to the hello's limit;
        # every frame, to the hello's time.
        channel = ControlChannel(
            reader,
            writer,
            max_first_frame_bytes=MAX_HELLO_FRAME_BYTES,
            first_frames=2,
            frame_timeout_s=self._ctx.config.handshake_timeout_s,
            first_byte_timeout_s=self._ctx.config.first_byte_timeout_s,
        )
        if not self._accepting:
            channel.close()
            return
        host = channel.ends[1][0] if channel.ends is not None else channel.peer
        admission = self._connections.admit(channel, host)
        if admission.refusal:
            self._refuse(channel, HelloRefused(version=PROTOCOL_VERSION, reason=admission.refusal))
            await channel.wait_closed()
            return
        if admission.displaced is not None:
            self._refuse(admission.displaced, HelloRefused(version=PROTOCOL_VERSION, reason=admission.why))
            admission.displaced.close()
        task = asyncio.current_task()
        if task is not None:  # asyncio made this handler's task: the service's group owns it too
            self._ctx.tasks.adopt(task)
        inbound: _Inbound | None = None
        try:
            inbound = await self._accept_hello(channel)
            if inbound is None:
                return
            while True:
                self._on_d_message(inbound, await channel.receive())
        except MalformedFrame as exc:
            self._ctx.counts["protocol_errors"] += 1
            self._ctx.peer_log.warning("malformed frame", "closing control connection from %s: %s", channel.peer, exc)
            with contextlib.suppress(PeerLost):
                channel.send(ErrorMessage(reason=str(exc)))
        except PeerLost:
            pass
        except asyncio.CancelledError:
            # Only `close` cancels a handler; returning (not re-raising) keeps asyncio's stream callback quiet.
            pass
        except Exception:  # a bug of ours: log it and drop this connection, never the service
            self._ctx.counts["protocol_errors"] += 1
            self._ctx.peer_log.exception("connection failed", "control connection from %s failed", channel.peer)
        finally:
            lost = self._connections.leave(channel)  # the D worker it still stood for, if any
            if inbound is not None:
                inbound.target.lose(f"control connection from {inbound.ref} closed")
            routed = self._inbound.pop(lost, None) if lost is not None else None
            if routed is not None:  # this very connection, routed: its jobs are lost
                self._run_send(self._sender.peer_lost(routed.ref))
                self._forget_session(routed.target.session)
            await channel.wait_closed()

    async def _accept_hello(self, channel: ControlChannel) -> _Inbound | None:
        timeout_s = self._ctx.config.handshake_timeout_s
        hello_key = derive_key(self._ctx.config.control_token, HELLO_KEY)
        try:
            async with asyncio.timeout(timeout_s):  # the whole exchange, both of D's frames
                refused = unkeyed_peer_check(self._ctx, channel.ends)
                if refused:
                    self._refuse(channel, HelloRefused(version=PROTOCOL_VERSION, reason=refused))
                    return None
                first = await channel.receive()
                challenged = challenge_hello(self._ctx.metadata, first, hello_key, secrets.token_bytes(NONCE_BYTES))
                if isinstance(challenged, HelloRefusal):
                    self._refuse(channel, challenged.reply)
                    return None
                channel.send(challenged.reply)
                second = await channel.receive()
        except TimeoutError:
            self._refuse(channel, HelloRefused(version=PROTOCOL_VERSION, reason=f"no hello within {timeout_s:g} s"))
            return None
        decision = accept_hello(self._ctx.metadata, challenged, second, hello_key)
        if isinstance(decision, HelloRefusal):
            self._refuse(channel, decision.reply)
            return None
        d, ref = decision.peer_meta, decision.peer
        key = _inbound_key(ref)
        acceptance = self._connections.accept(channel, key)  # proven: from now on no flood displaces it
        if not acceptance.accepted:  # refused before it replaces anything, or displaced meanwhile (closing)
            if acceptance.refusal:
                self._refuse(channel, HelloRefused(version=PROTOCOL_VERSION, reason=acceptance.refusal))
            return None
        if acceptance.replaces is not None:  # a reconnect, or a restarted D engine: the old connection's jobs are gone
            self._replace(key, ref, acceptance.replaces)
        # D's staging region too: P writes the windows D lends there.
        regions = pool_regions(d) + ([(d.staging_addr, d.staging_size)] if d.staging_size else [])
        try:
            route = await self._route(d, ref, regions, channel.ends, decision.ipc_handles)
        except _NoPlane as exc:
            self._refuse(channel, HelloRefused(version=PROTOCOL_VERSION, reason=str(exc)))
            return None
        except (TransportError, ValueError) as exc:  # a pool no memory can be (empty, overlapping itself)
            reason = f"D worker {ref} publishes an impossible KV pool: {exc}"
            self._refuse(channel, HelloRefused(version=PROTOCOL_VERSION, reason=reason))
            return None
        if not self._connections.holds(channel, key):  # a newer hello of this D worker replaced it while routed
            self._forget_session(route.session)
            return None
        try:  # no await since the check: the regions published are those of the hello that stands
            self._ctx.transport.add_peer(route.session, regions)
        except (TransportError, ValueError) as exc:  # a pool no memory can be (empty, overlapping itself)
            self._forget_session(route.session)
            reason = f"D worker {ref} publishes an impossible KV pool: {exc}"
            self._refuse(channel, HelloRefused(version=PROTOCOL_VERSION, reason=reason))
            return None
        writes_via = plane_of(self._ctx.transport, route.session)  # once per pair, not per write
        target = WriteTarget(ref, d, writes_via, session=route.session, plane=route.kind)
        inbound = _Inbound(ref, d, channel, decision.expected, target)
        self._inbound[key] = inbound
        with contextlib.suppress(PeerLost):  # D gone meanwhile: the handler's next receive cleans up
            channel.send(decision.seal(route.kind))  # D stages by the plane
        return inbound

    def _replace(self, key: tuple[str, Worker], ref: WorkerRef, old: ControlChannel) -> None:
        """Close `old`, the connection D worker `key` held until `ref`'s newer hello was accepted, and fail the jobs
        it carried once routed (one still being routed just ends: it is no longer the D worker's)."""
        old.close()
        routed = self._inbound.pop(key, None)
        if routed is not None:
            routed.target.lose(f"replaced by a new connection from {ref}")
            self._run_send(self._sender.peer_lost(routed.ref))
            self._forget_session(routed.target.session)  # a restarted D worker writes elsewhere now

    def _forget_session(self, session: str) -> None:
        """Unpublish `session` from the plane (its regions, a same-host plane's admission, a GPU plane's mapping)
        once no D worker that stands writes to it and no hello is routing to it: what a replaced, restarted or
        refused D worker left does not outlive it. Writes in flight to it still finish."""
        if self._routing[session] == 0 and all(other.target.session != session for other in self._inbound.values()):
            self._ctx.transport.remove_peer(session)

    async def _route(
        self,
        d: WorkerMetadata,
        ref: WorkerRef,
        regions: list[tuple[int, int]],
        via: tuple[tuple[str, int], tuple[str, int]] | None,
        handles: list[IpcHandle],
    ) -> Route:
        """Pick the plane for D worker `d` (`choose_transport`), and for a same-host plane check the claimed process
        against the control connection `via` and probe once (`Transport.reachable`, with the `regions` D publishes:
        the kernel's ptrace policy, or opening the GPU allocations `handles` D exported): refused, the pair runs on
        Mooncake. Logs the route once. The caller publishes the regions on the plane once the hello still stands.

        Raises:
            _NoPlane: the pair takes Mooncake, and D's hello names no Mooncake session (`needs_mooncake`) or this
                worker's Mooncake cannot start.
            TransportError / ValueError: a region no memory can be (the same-host probe's check).
        """
        setting = self._ctx.config.transport
        route, refused = choose_transport(self._ctx.metadata, d, setting), ""
        if route.kind != "mooncake":
            # Well inside the hello's own budget: D waits that long for the answer, and Mooncake must still make it.
            budget_s = samehost_check_budget(self._ctx.config.handshake_timeout_s)
            reach = self._ctx.transport.reachable(route.session, regions, via, handles)
            self._routing[route.session] += 1
            try:
                refused = await asyncio.wait_for(reach, budget_s)
            except TimeoutError:
                refused = f"no answer from the check of the process within {budget_s:g} s"
            finally:
                self._routing[route.session] -= 1
                if not self._routing[route.session]:
                    del self._routing[route.session]
            route = probed(route, d, refused)
        if route.kind == "mooncake":
            try:  # the first pair on Mooncake starts this worker's engine, before D is asked to start its own
                await start_mooncake(self._ctx.transport)
            except TransportError as exc:
                raise _NoPlane(f"writes to D worker {ref} take Mooncake ({route.reason}), and {exc}") from None
        if missing := needs_mooncake(route, d):
            raise _NoPlane(missing)
        if route.kind == "mooncake":
            # A plane asked for, or one the rule picked and the probe refused, and not had: a warning.
            level = logging.WARNING if setting == "samehost" or refused else logging.INFO
            log.log(
                level, "writes to %s go over Mooncake: %s", escape_controls(str(ref)), escape_controls(route.reason)
            )
        else:
            plane = PLANE_NAMES[route.kind]
            log.info("writes to %s go over the %s: %s", escape_controls(str(ref)), plane, escape_controls(route.reason))
        return route

    def _refuse(self, channel: ControlChannel, reply: HelloRefused | ErrorMessage) -> None:
        self._ctx.counts["protocol_errors"] += 1
        self._ctx.peer_log.warning("hello refused", "refusing hello from %s: %s", channel.peer, reply.reason)
        with contextlib.suppress(PeerLost):
            channel.send(reply)

    def _on_d_message(self, inbound: _Inbound, message: Message) -> None:
        if isinstance(message, WindowEmptied):  # a write in rounds' frame, beside the job tables (`p_frame`)
            carry_out_p(inbound.target.emptied(message), self)
            return
        now = self._ctx.clock()
        self._run_send(self._sender.receive(inbound.ref, inbound.meta, inbound.expected, message, now))

    # -- carrying out the core's commands (`kvsvc.core.sender.PSide`) -------------------------------------------

    def _run_send(self, commands: list[SendCommand]) -> None:
        """Carry out what the `Sender` decided on its last event (the one place the P role signals a change)."""
        self._ctx.changed()
        carry_out_p(commands, self)

    def submit(self, command: Submit) -> None:
        ended = self._writer.write(command, self._write_target(command.dst))
        ended.add_done_callback(lambda end: self._written(command, end.result()))

    def reply(self, command: Reply) -> None:
        self._send_to(command.dst, command.message)

    def announce(self, command: Announce) -> None:
        self._send_to(command.dst, command.message)

    def log(self, notice_: Notice) -> None:
        notice(self._ctx, notice_)

    def _written(self, command: Submit, end: WriteEnd) -> None:
        self._run_send(self._sender.write_ended(command.transfer_id, command.dst.worker, end))

    def _send_to(self, dst: WorkerRef, message: Message) -> None:
        inbound = self._inbound.get(_inbound_key(dst))
        if inbound is not None and inbound.ref == dst and not inbound.channel.closed:
            with contextlib.suppress(PeerLost):
                inbound.channel.send(message)

    def _write_target(self, dst: WorkerRef) -> WriteTarget | None:
        inbound = self._inbound.get(_inbound_key(dst))
        return inbound.target if inbound is not None and inbound.ref == dst else None

    async def _await_ready(self, req_id: str, transfer_id: str, ready: Awaitable[None]) -> None:
        try:
            await ready
        except Exception as exc:  # the engine's compute failed: nobody can have this KV
            log.warning("ready future of %s failed (%s); aborting its hold", req_id, exc)
            self._run_send(self._sender.abort(req_id))
            return
        self._run_send(self._sender.ready(transfer_id))


class _NoPlane(Exception):
    """No data plane can carry a pair's writes: the hello is refused with this reason."""


def _inbound_key(ref: WorkerRef) -> tuple[str, Worker]:
    return (ref.engine_id, ref.worker)
