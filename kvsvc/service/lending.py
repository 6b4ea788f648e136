"""D's windows, `WindowLender`: lends windows of the staging region for the requests the staging rule sends through D,
and carries out the window-round protocol (`kvsvc.core.windows.LentWindows`) on them.

Rules: the protocol's decisions live in `kvsvc.core.windows`; this module decides only where a window's bytes come from
(the staging region, at once or after a wait of at most `window_wait_s`, else the request goes without one) and
carries out the commands: each scatter is a task of the service's `TaskGroup`, and its end goes back to
`LentWindows.scattered`. Every frame from a P worker passes through `on_p_message` before the `Receiver` sees it. A
window goes back once the receive from its P worker ended and no scatter reads it (`tidy`); a failed receive whose
window a scatter still copies into is reported only after that copy (`hold_back`). Part of the D role
(`kvsvc.service.receiving` owns one when D can lend windows at all, `kvsvc.core.windows.lends_windows`); never imports
the P role.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import replace as replace_plan

from kvsvc.core.data_planes import rule_on
from kvsvc.core.layout import block_geometry
from kvsvc.core.messages import Message, TransferRequest, Worker, WorkerMetadata
from kvsvc.core.planner import is_block_run
from kvsvc.core.receiver import DSide, Receiver, RecvReport, carry_out_d
from kvsvc.core.staging_plans import WindowPlan, plan_window
from kvsvc.core.windows import (
    GoWithout,
    LendAt,
    LentWindow,
    LentWindows,
    Scatter,
    WaitForRoom,
    WindowKey,
    d_frame,
    lent_window,
    window_choice,
    with_window,
)
from kvsvc.service.context import ServiceContext
from kvsvc.service.staging_area import StagingArea, StagingFull

_WINDOW_PLAN_CACHE_ENTRIES = 1024


class WindowLender:
    """The windows of one D worker in `area`, which can scatter (see module docstring). `side` (the receiving role,
    `kvsvc.core.receiver.DSide`) carries out the windows' commands: frames to P workers, P's answers to the
    `Receiver`, and the scatters, which it hands back to `scatter` here."""

    def __init__(self, ctx: ServiceContext, area: StagingArea, receiver: Receiver, side: DSide) -> None:
        self._ctx = ctx
        self._area = area
        self._receiver = receiver
        self._side = side
        self._windows = LentWindows()
        # Requests that wait for room for a window: the receive's req_id and the task that sends them.
        self._waiting_room: dict[WindowKey, tuple[str, asyncio.Task[None]]] = {}
        # (P engine, incarnation, P worker, plane, D blocks, tokens) -> the window plan of D blocks 0.. (None: none)
        self._plans: dict[tuple[str, str, Worker, str, int, int], WindowPlan | None] = {}
        # The plane each P worker said (`HelloOk.plane`) its writes into this worker take, at its last hello.
        self._planes: dict[tuple[str, Worker], str] = {}

    def plane_chosen(self, engine_id: str, worker: Worker, plane: str) -> None:
        """P worker `worker` of `engine_id` said at its hello that its writes take `plane`."""
        self._planes[(engine_id, worker)] = plane

    @property
    def busy(self) -> bool:
        """Whether any window is lent or waited for (else `tidy` and `hold_back` have nothing to do)."""
        return self._windows.busy or bool(self._waiting_room)

    @property
    def waiting_for_room(self) -> int:
        """Requests that wait for room for their window."""
        return len(self._waiting_room)

    def lent_windows(self) -> list[LentWindow]:
        """The windows lent now, for inspection (tests, admin)."""
        return list(self._windows)

    # -- lending -----------------------------------------------------------------------------------------------

    def windowed(self, p: WorkerMetadata, request: TransferRequest) -> TransferRequest | None:
        """`request` with a window of the staging region, when the staging rule sends P's share through one and
        there is room now; `request` as it is when the rule does not (P writes the blocks, directly or gathered);
        None when the request waits for room (a task sends it then)."""
        area = self._area
        key = (request.transfer_id, p.engine_id, p.worker)
        req_id = self._receiver.req_of(request.transfer_id)
        waiting = self._waiting_room.get(key)
        window = lent_window(self._windows, key, req_id, waiting[0] if waiting is not None else None)
        if window == "hold":
            return None
        if waiting is not None:  # an ended receive's request, the transfer id started again: this one goes
            waiting[1].cancel()
            del self._waiting_room[key]
        if window == "lend":
            assert req_id is not None
            plan = self._plan(p, request, area)
            addr = area.try_lend(plan.window_bytes) if plan is not None else None
            match window_choice(plan is not None, addr, self._ctx.config.window_wait_s):
                case GoWithout():
                    return request
                case WaitForRoom():
                    assert plan is not None
                    waited = self._ask_when_room(key, request, req_id, plan)
                    self._waiting_room[key] = (req_id, self._ctx.tasks.spawn(waited, name=f"kvsvc-window-{req_id}"))
                    return None
                case LendAt(addr=lent):
                    assert plan is not None
                    window = self._windows.lend(key, req_id, request.block_ids, lent, plan, request.receive)
        # None: the transfer id again while an earlier receive's window is still being scattered
        return request if window is None else with_window(request, window)

    async def _ask_when_room(self, key: WindowKey, request: TransferRequest, req_id: str, plan: WindowPlan) -> None:
        """Wait up to `window_wait_s` for room for `request`'s window, then ask P, with the window or without it.
        Nothing is asked if the receive ended or is being aborted meanwhile (P answers its abort alone); the wait
        is cancelled then (`tidy`), which leaves nothing lent."""
        area = self._area
        addr: int | None = None
        began = self._ctx.clock()
        try:
            addr = await area.lend(plan.window_bytes, self._ctx.config.window_wait_s)
            self._ctx.window_room.observe(self._ctx.clock() - began)
        except StagingFull:
            pass
        finally:
            if self._waiting_room.get(key, ("", None))[1] is asyncio.current_task():
                del self._waiting_room[key]
        transfer_id = request.transfer_id
        receiver = self._receiver
        if receiver.req_of(transfer_id) != req_id or receiver.ending(transfer_id) or not receiver.waits_on(*key):
            if addr is not None:
                area.give_back(addr)
            return
        if addr is not None:
            window = self._windows.lend(key, req_id, request.block_ids, addr, plan, request.receive)
            request = with_window(request, window)
        self._side.tell_p(key[1], key[2], request)

    def _plan(self, p: WorkerMetadata, request: TransferRequest, area: StagingArea) -> WindowPlan | None:
        """`plan_window`, from a cache when D's blocks for the tokens are one run of consecutive ids and D holds no
        prefix: the plan of the run starting at block 0, its destinations shifted (as P's plan cache does)."""
        d, ids, tokens = self._ctx.metadata, request.block_ids, request.num_tokens
        # P chose the plane and said so at its hello, which ended before the Receiver asks it for anything.
        plane = self._planes[(p.engine_id, p.worker)]
        rule, max_bytes = rule_on(plane, area.rule), area.chunk_bytes
        count = -(-tokens // d.block_size)
        if request.first_token or not 0 < count <= len(ids) or not is_block_run(ids, count):
            return plan_window(p, d, ids, tokens, request.first_token, rule, max_bytes)
        key = (p.engine_id, p.incarnation, p.worker, plane, count, tokens)
        if key in self._plans:
            unit = self._plans[key]
        else:
            unit = plan_window(p, d, list(range(count)), tokens, 0, rule, max_bytes)
            if len(self._plans) < _WINDOW_PLAN_CACHE_ENTRIES:
                self._plans[key] = unit
        if unit is None or ids[0] == 0:
            return unit
        return replace_plan(unit, dst=unit.dst + ids[0] * block_geometry(d).block_stride)

    # -- the rounds --------------------------------------------------------------------------------------------

    def on_p_message(self, engine_id: str, src: Worker, message: Message) -> None:
        """A frame from P worker `src`: the window protocol takes it first (`kvsvc.core.windows.d_frame`)."""
        key, commands = d_frame(self._windows, engine_id, src, message)
        carry_out_d(commands, self._side, key)

    def scatter(self, key: WindowKey, command: Scatter) -> None:
        """Start copying one round of window `key` into the blocks now; a task of the service's group awaits the
        copy, and its end goes back to `LentWindows.scattered`."""
        area = self._area
        assert area.scatter is not None
        began = self._ctx.clock()
        copy: Awaitable[None]
        try:
            copy = area.scatter(command.src, command.dst, command.length)
        except Exception as exc:  # an embedder's copy that raises at the call: as if the copy failed
            failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            copy = failed
        self._ctx.tasks.spawn(self._scattered(key, copy, began), name=f"kvsvc-scatter-{key[0]}")

    async def _scattered(self, key: WindowKey, copy: Awaitable[None], began: float) -> None:
        """Wait for a round's copy; its end goes back to the protocol. Cancelled (only by `close`), it leaves the
        window lent: the region is not used after close."""
        error: str | None = None
        try:
            await copy
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an embedder's copy: whatever it raises fails this receive, not the service
            error = f"{type(exc).__name__}: {exc}"
        else:
            self._ctx.window_scatter.observe(self._ctx.clock() - began)
        carry_out_d(self._windows.scattered(key, error), self._side, key)
        self.tidy()
        self._ctx.changed()  # a failed receive held back for this scatter may be reported now

    # -- ending ------------------------------------------------------------------------------------------------

    def tidy(self) -> None:
        """Stop the waits for room of receives that ended or are being aborted (they would hold the region's line
        for nothing), mark the windows of ending receives, and give back the windows nothing needs any more."""
        receiver = self._receiver
        for key, (req_id, task) in list(self._waiting_room.items()):
            if receiver.req_of(key[0]) != req_id or receiver.ending(key[0]):
                task.cancel()
                del self._waiting_room[key]
        for addr in self._windows.tidy(lambda key: receiver.waits_on(*key), receiver.ending):
            self._area.give_back(addr)

    def hold_back(self, report: RecvReport) -> RecvReport:
        """`report` less the failed receives that a scatter still copies into (`LentWindows.hold_back`)."""
        return self._windows.hold_back(report)
