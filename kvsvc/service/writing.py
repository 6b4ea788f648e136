"""P's writes into D workers' KV blocks, `BlockWriter`: carries out the `Sender`'s `Submit`s, each through the plane its
D worker's pair chose at the hello (`WriteTarget.transport`).

Rules: each `Submit` is planned (its D worker's `PlanCache`, below), written, and ends in one value,
`kvsvc.core.sender.WriteEnd`, set once on the future `BlockWriter.write` returned, only when none of its descriptors can
move any more. A plane's write ends in a value too (`kvsvc.transport.base.Written`: the bytes, or its `WriteFailed`),
and so does each part of a write here (`Part`); only what is not the plane's fault (a plan, a window, room, a gather, a
plane breaking its contract) raises. What a failed write waits for first (its plane's `drained` future; for one that
raised outside the plane's contract, the plane to drain, bounded; or nothing) is the core's write-failure table's
decision (`kvsvc.core.sender.FAULT_WAITS`), so the request's blocks stay held until then. Either failure becomes a
`WriteFault` at one place, `_failed`; the role hands the `WriteEnd` to the `Sender`. Small writes skip the task when the
plane's `start_write` takes them. With a staging region, a plan its rule picks is gathered there chunk by chunk and
written one descriptor per destination run (`kvsvc.service.staging_area`). A request with a window of D's staging region
is written there as one stream (`kvsvc.core.staging_plans.window_plan`), gathered too when the rule picks it; D scatters
it. A share larger than its window moves in rounds, as its `kvsvc.core.windows.FillingWindow` says: round k waits until
D emptied round k - 2 (within the hold timeout), and each round but the last is announced. A layer-wise write stages
each layer on its own when the rule picks it. A converting pair's writes (`kvsvc.core.formats`) are always staged: the
gather converts P's floats into D's fp8. Part of the P role (`kvsvc.service.sending` owns it); imports kvsvc's core,
never the D role.

A `PlanCache` holds what one P worker writes to one D worker, as descriptor tables planned once per request shape and
shifted per request: the plan, its window stream when D lent a window, and the staged form of either. A request
whose P and D blocks are each one run of consecutive ids (one KV cache group, no prefix held by D) takes the form
cached for the runs starting at block 0, shifted by each side's first block times its block stride (a window
stream's destinations by the window's address instead); everything else is planned, and checked, in full. Cached
arrays are read-only, and the cache is bounded by descriptors, not by entries alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvsvc.core.data_planes import rule_on
from kvsvc.core.errors import KVSvcError, KVSvcTimeout, PeerLost, TopologyError, TransferAborted
from kvsvc.core.formats import Conversion, as_written, conversion
from kvsvc.core.layout import Int64Array, block_geometry, is_cross_layer, layer_addrs, pool_regions
from kvsvc.core.messages import WindowEmptied, WorkerMetadata, WorkerRef
from kvsvc.core.planner import is_block_run, plan_transfer_arrays
from kvsvc.core.sender import (
    FaultKind,
    FaultWait,
    Landed,
    PSide,
    Sender,
    Submit,
    WriteEnd,
    WriteFault,
    carry_out_p,
    fault_wait,
    streams_by_layer,
)
from kvsvc.core.staging_plans import (
    StagedChunk,
    StagingRule,
    count_runs,
    plan_staged,
    region_ids,
    shift_chunks,
    window_plan,
)
from kvsvc.core.windows import (
    AwaitHalf,
    Fail,
    FillCommand,
    FillEvent,
    FillingWindow,
    RoundsFilled,
    round_emptied,
    round_step,
    share_refusal,
)
from kvsvc.service.context import ServiceContext
from kvsvc.transport.base import Transport, WriteFailed, Written

_PLAN_CACHE_ENTRIES = 1024  # per D worker connection
# Descriptors cached per D worker connection, all plans together: 24 MiB, and their staged forms and window streams
# about as much again each.
_PLAN_CACHE_ROWS = 1 << 20

Key = tuple[int, int, int]  # (P blocks, D blocks, tokens) of a request whose blocks are runs from 0 on both sides


@dataclass(frozen=True, slots=True)
class Shifted:
    """A request's table as a cached one (`PlanCache.plans[key]`) shifted by `src_shift` / `dst_shift` bytes; for a
    windowed write, the cached plan's window stream (`PlanCache.streams[key]`), `dst_shift` being the window's
    address."""

    key: Key
    src_shift: int
    dst_shift: int


@dataclass(slots=True)
class PlanCache:
    """The tables of one (P worker, D worker) pair (see module docstring). `src` and `dst` given to its methods are
    always the same two workers' metadata."""

    plans: dict[Key, Int64Array] = field(default_factory=dict)
    rows: int = 0  # descriptors in `plans`
    # The staged form (`plan_staged`) of each plan in `plans` written into D's blocks, or None where the rule
    # writes it direct: shifted like the plan (`shift_chunks`), since staging it costs more than planning it.
    staged_plans: dict[Key, list[StagedChunk] | None] = field(default_factory=dict)
    # The window stream (`window_plan`: source, stream offset, length) of each plan in `plans`, and its staged form
    # for a window at address 0, or None where the rule writes the stream as it is: both shift like the plan (the
    # stream's order and merges depend only on which ranges touch; the window's address only moves the chunks).
    streams: dict[Key, tuple[Int64Array, Int64Array, Int64Array]] = field(default_factory=dict)
    staged_streams: dict[Key, list[StagedChunk] | None] = field(default_factory=dict)
    strides: tuple[int, int] = (0, 0)  # block strides of P and of D, once a shifted plan needs them
    src_regions: list[int] = field(default_factory=list)  # start addresses of P's registered tensors
    # P as planned for this D (`kvsvc.core.formats.as_written`) and the conversion its gather makes, if any: found at
    # the first plan. A converting pair is always staged (the gather converts) and takes no window.
    view: WorkerMetadata | None = None
    conversion: Conversion | None = None

    def written(self, src: WorkerMetadata, dst: WorkerMetadata) -> WorkerMetadata:
        """P worker `src` as planned for `dst` (itself unless the pair converts), found once.

        Raises:
            TopologyError: as `kvsvc.core.formats.conversion`.
        """
        if self.view is None:
            self.conversion = conversion(src, dst)
            self.view = as_written(src, dst)
        return self.view

    def descriptors(
        self, src: WorkerMetadata, dst: WorkerMetadata, command: Submit
    ) -> tuple[Int64Array, Shifted | None]:
        """The descriptors of `command` as a `(source, destination, length)` table: its plan, or, with a window that
        holds the whole share, the plan's stream into that window; and the cached table it shifts, if any.

        Raises:
            TopologyError / ValueError: as `plan` and `stream`.
        """
        if not command.window_bytes:
            return self.plan(src, dst, command)
        sources, offset, length, shifted = self.stream(src, dst, command)
        return np.column_stack((sources, command.window_addr + offset, length)), shifted

    def plan(self, src: WorkerMetadata, dst: WorkerMetadata, command: Submit) -> tuple[Int64Array, Shifted | None]:
        """`plan_transfer` as a table (read-only when cached), and the cached plan it shifts, if it is one.

        A request whose blocks are runs is the plan of the runs starting at block 0, shifted: merging depends only on
        which ranges touch, and a shift keeps that (a run touches the next layer's tensor only when it spans the
        whole pool, and then it starts at block 0). Planning is otherwise the P worker's main cost, for thousands of
        one-block requests a second as for a head split in NHD (thousands of descriptors per request); a cached
        table shifts in one numpy add whatever its size.

        Raises:
            TopologyError / ValueError: as `plan_transfer` (the uncached path runs every check).
        """
        src = self.written(src, dst)
        src_ids, dst_ids, num_tokens = command.src_block_ids, command.dst_block_ids, command.num_tokens
        if command.first_token or src.kv_groups:  # a hybrid model's ids are one list per group: never one run
            columns = plan_transfer_arrays(src, dst, src_ids, dst_ids, num_tokens, first_token=command.first_token)
            return _table(columns), None
        n_src, n_dst = -(-num_tokens // src.block_size), -(-num_tokens // dst.block_size)
        # Both id lists passed `check_block_ids` on their way in (the engine's call, D's request), so a run of
        # consecutive ids lies inside its pool; anything the cache cannot take is planned, and checked, in full.
        if not (
            0 < n_src <= len(src_ids)
            and 0 < n_dst <= len(dst_ids)
            and is_block_run(src_ids, n_src)
            and is_block_run(dst_ids, n_dst)
        ):
            return _table(plan_transfer_arrays(src, dst, src_ids, dst_ids, num_tokens)), None
        key = (n_src, n_dst, num_tokens)
        unit = self.plans.get(key)
        if unit is None:
            unit = _table(plan_transfer_arrays(src, dst, range(n_src), range(n_dst), num_tokens))
            unit.flags.writeable = False
            if len(self.plans) < _PLAN_CACHE_ENTRIES and self.rows + len(unit) <= _PLAN_CACHE_ROWS:
                self.plans[key] = unit
                self.rows += len(unit)
        cached = key in self.plans
        if src_ids[0] == dst_ids[0] == 0:
            return unit, Shifted(key, 0, 0) if cached else None
        if not self.strides[0]:
            self.strides = (block_geometry(src).block_stride, block_geometry(dst).block_stride)
        shift_src, shift_dst = src_ids[0] * self.strides[0], dst_ids[0] * self.strides[1]
        table = unit + np.array([shift_src, shift_dst, 0], dtype=np.int64)
        return table, Shifted(key, shift_src, shift_dst) if cached else None

    def stream(
        self, src: WorkerMetadata, dst: WorkerMetadata, command: Submit
    ) -> tuple[Int64Array, Int64Array, Int64Array, Shifted | None]:
        """`command`'s share as a window stream: (source, stream offset, length) columns (`window_plan`), and the
        cached stream it shifts, if any: its `dst_shift` is the window's address, where the stream's offset 0 lies.

        Raises:
            TopologyError / ValueError: as `plan`, or D planned a share of another size; ValueError: D lent a window
                to a converting pair (whose P writes D's blocks itself: decision 102).
        """
        self.written(src, dst)
        if self.conversion is not None:
            raise ValueError(
                f"D lent a window for {command.transfer_id!r}, but P converts its KV and writes D's blocks"
            )
        table, shifted = self.plan(src, dst, command)
        if shifted is None:
            sources, offset, length = self._window_stream(src, table)
        else:
            cached = self.streams.get(shifted.key)
            if cached is None:
                cached = self.streams[shifted.key] = _frozen_columns(self._window_stream(src, self.plans[shifted.key]))
            sources, offset, length = cached
            sources = sources + shifted.src_shift if shifted.src_shift else sources
            shifted = Shifted(shifted.key, shifted.src_shift, command.window_addr)
        refused = share_refusal(command, int(length.sum()))
        if refused is not None:
            raise ValueError(refused)
        return sources, offset, length, shifted

    def staged(
        self,
        dst: WorkerMetadata,
        table: Int64Array,
        rule: StagingRule,
        chunk_bytes: int,
        windowed: bool = False,
        shifted: Shifted | None = None,
    ) -> list[StagedChunk] | None:
        """The chunks (of at most `chunk_bytes`) of the descriptor table `table` staged, when `rule` picks staging or
        the pair converts (P's gather converts). `windowed`: they write one window of D's region (one destination
        region), not D's blocks. `shifted`: `table` is that cached table shifted, whose staged form is cached too.

        Raises:
            ValueError: two descriptors overlap in the destination (a planner bug).
        """
        converts = self.conversion is not None
        if len(table) < 2 and not converts:
            return None
        if shifted is not None:
            cache = self.staged_streams if windowed else self.staged_plans
            if shifted.key not in cache:
                unit = np.column_stack(self.streams[shifted.key]) if windowed else self.plans[shifted.key]
                cache[shifted.key] = _frozen(self.staged(dst, unit, rule, chunk_bytes, windowed))
            chunks = cache[shifted.key]
            return None if chunks is None else shift_chunks(chunks, shifted.src_shift, shifted.dst_shift)
        sources, dsts, length = table.T
        # A run must stay inside one of D's registered tensors, even where two of them touch.
        region = None if windowed else region_ids(dsts, [start for start, _ in pool_regions(dst)])
        if not converts and not rule.stage(len(table), count_runs(dsts, length, region), int(length.sum())):
            return None
        return plan_staged(sources, dsts, length, chunk_bytes, region)

    def _window_stream(self, src: WorkerMetadata, table: Int64Array) -> tuple[Int64Array, Int64Array, Int64Array]:
        """The descriptor table `table` as a window stream at address 0 (`window_plan`)."""
        sources, dsts, length = table.T
        if not self.src_regions:
            self.src_regions = [start for start, _ in pool_regions(src)]
        return window_plan(sources, dsts, length, 0, region_ids(sources, self.src_regions))


def _table(columns: tuple[Int64Array, Int64Array, Int64Array]) -> Int64Array:
    """Three descriptor columns (`plan_transfer_arrays`) as one `(n, 3)` table."""
    return np.column_stack(columns).astype(np.int64, copy=False).reshape(-1, 3)


def _frozen(chunks: list[StagedChunk] | None) -> list[StagedChunk] | None:
    """`chunks` with their arrays read-only: a cached staged plan is handed to every request that shifts it."""
    for c in chunks or ():
        for column in (c.gather_src, c.gather_offset, c.gather_length, c.write_offset, c.write_dst, c.write_length):
            column.flags.writeable = False
    return chunks


def _frozen_columns(
    columns: tuple[Int64Array, Int64Array, Int64Array],
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """`columns` read-only: a cached stream is shifted for every request, never changed. (Empty ones may be a module's
    shared empty array: left as they are.)"""
    for column in columns:
        if column.size:
            column.flags.writeable = False
    return columns


__all__ = ["PlanCache", "Shifted"]


log = logging.getLogger(__name__)

Part = tuple[int, int] | WriteFailed
"""How a write, or a part of one (a chunk, a layer, a round), ended: (bytes, descriptors) landed, or its plane's
failure, once no descriptor of it can move any more."""

CLOSED_MID_WRITE = "P service closed before the write finished"


@dataclass(slots=True)
class WriteTarget:
    """A D worker this P worker writes to, as its accepted hello described it, and the writes in rounds into its
    windows (`fills`, `kvsvc.core.windows.FillingWindow`), which wait for D's `WindowEmptied` frames."""

    ref: WorkerRef
    meta: WorkerMetadata
    transport: Transport
    """The plane this pair's writes take (`kvsvc.transport.routed.plane_of`), chosen at the hello."""
    plans: PlanCache = field(default_factory=PlanCache)  # what this P worker writes to this D worker, cached
    fills: dict[str, FillingWindow] = field(default_factory=dict)  # per transfer writing in rounds
    wakeups: dict[str, asyncio.Future[None]] = field(default_factory=dict)  # a write in rounds that waits
    gone: str = ""  # why the control connection closed; "" while it is open
    session: str = ""  # the transport session writes go to (`kvsvc.core.data_planes.Route`); "" means Mooncake's
    plane: str = "mooncake"  # `Route.kind`: what a descriptor costs, so whether staging pays (`rule_on`)

    def __post_init__(self) -> None:
        self.session = self.session or self.meta.transport_addr

    def emptied(self, message: WindowEmptied) -> list[FillCommand]:
        """D emptied a round of a window (`kvsvc.core.windows.round_emptied`): the write waiting for it goes on."""
        commands = round_emptied(message, self.fills, str(self.ref))
        self._wake(message.transfer_id)
        return commands

    async def wait(self, fill: FillingWindow, clock: Callable[[], float]) -> None:
        """Wait while `fill` waits for D to empty a half: until a frame or a lost connection changed its state, or
        its deadline passed (then it fails, `FillingWindow.expire`). Cancellation leaves nothing behind."""
        assert fill.deadline is not None
        waiter = self.wakeups[fill.transfer_id] = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(max(0.0, fill.deadline - clock())):
                await waiter
        except TimeoutError:
            fill.expire(fill.deadline)
        finally:
            if self.wakeups.get(fill.transfer_id) is waiter:
                del self.wakeups[fill.transfer_id]

    def lose(self, reason: str) -> None:
        """The control connection closed: every write in rounds fails, once no round of it is on the wire."""
        self.gone = reason or "control connection closed"
        for transfer_id, fill in self.fills.items():
            fill.peer_lost(f"{self.ref}: {self.gone}")
            self._wake(transfer_id)

    def _wake(self, transfer_id: str) -> None:
        waiter = self.wakeups.pop(transfer_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class BlockWriter:
    """The writes of one P worker (see module docstring).

    `side` carries out what its writes in rounds announce (`kvsvc.core.sender.PSide`: the role); `sender` says
    whether a job still wants its write (`Sender.writing`): a write in rounds stops at the next round once it does
    not.
    """

    def __init__(self, ctx: ServiceContext, side: PSide, sender: Sender) -> None:
        self._ctx = ctx
        self._side = side
        self._sender = sender
        self._layer_ready: dict[str, list[asyncio.Future[None]]] = {}
        self._writes: set[asyncio.Task[None]] = set()
        # Writes submitted without a task (`_submit_now`): their result futures, and `drained` futures of failed
        # ones whose descriptors may still move (their blocks stay held until these resolve).
        self._started: set[asyncio.Future[Any]] = set()
        self._began: dict[int, float] = {}  # id(Submit) -> when its write started, for the latency histogram

    def write(self, command: Submit, target: WriteTarget | None) -> asyncio.Future[WriteEnd]:
        """Start the write `command` asks for into `target` (None: its connection is gone or was replaced); the
        future resolves with how it ended, once nothing of it can move any more, never from this call. The future
        is never cancelled: a write that `close` cancels ends as a `WriteFault`."""
        ended: asyncio.Future[WriteEnd] = asyncio.get_running_loop().create_future()
        self._began[id(command)] = self._ctx.clock()
        if target is not None and self._submit_now(command, target, ended):
            return ended
        write = self._ctx.tasks.spawn(self._write(command, target, ended), name=f"kvsvc-write-{command.transfer_id}")
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)
        return ended

    def layer_wise(self, transfer_id: str, ready: Sequence[Awaitable[None]]) -> None:
        """Write `transfer_id` layer by layer: each local layer once its own future in `ready` resolved."""
        # An engine's futures are awaited as they are; anything else is awaited by a task of the service's group.
        self._layer_ready[transfer_id] = [
            r if asyncio.isfuture(r) else self._ctx.tasks.spawn(_awaited(r), name=f"kvsvc-layer-{transfer_id}")
            for r in ready
        ]

    def _streamed_layers(self, transfer_id: str) -> list[asyncio.Future[None]] | None:
        """The layer futures of `transfer_id` when its write goes layer by layer (`streams_by_layer`), else None."""
        layers = self._layer_ready.get(transfer_id)
        if layers is None or streams_by_layer([_computed_well(ready) for ready in layers]):
            return layers
        return None

    def forget_layers(self) -> None:
        """Drop the layer futures of the transfers the `Sender` no longer holds."""
        for transfer_id in [t for t in self._layer_ready if not self._sender.holds(t)]:
            del self._layer_ready[transfer_id]

    @property
    def in_flight(self) -> int:
        return len(self._writes) + len(self._started)

    async def wait_writes(self) -> None:
        """Wait up to `close_drain_timeout_s` for the writes in flight, then cancel the write tasks left."""
        if self._writes or self._started:
            waits: set[asyncio.Future[Any]] = {*self._writes, *self._started}
            _, pending = await asyncio.wait(waits, timeout=self._ctx.config.close_drain_timeout_s)
            for task in pending & self._writes:
                task.cancel()

    async def _write(self, command: Submit, target: WriteTarget | None, ended: asyncio.Future[WriteEnd]) -> None:
        ndesc = 0
        try:
            if target is None:
                raise PeerLost(f"control connection to {command.dst} lost before the write")
            layers = self._streamed_layers(command.transfer_id)
            if _in_rounds(command):
                if layers is not None:  # rounds follow D's address order, not the layers: all of them first
                    await _computed(layers)
                part = await self._write_rounds(target, command)
            elif layers is None:
                table, unit = self._descriptors(target, command)
                part = await self._write_once(target, table, command, unit)
            else:
                table, _ = self._descriptors(target, command)
                ndesc = len(table)
                part = await self._write_layerwise(target, table, layers, command)
        except asyncio.CancelledError:
            # Only `close` cancels, after `close_drain_timeout_s`: the engine is going away with its blocks.
            self._end(command, ended, WriteFault(CLOSED_MID_WRITE))
            raise
        except Exception as exc:  # a plan, a window, room, D's rounds, a gather, a plane outside its contract
            self._failed(command, exc, ndesc, target, ended)
            return
        if isinstance(part, WriteFailed):
            self._failed(command, part, ndesc, target, ended)
        else:
            self._end(command, ended, Landed(*part))

    def _end(self, command: Submit, ended: asyncio.Future[WriteEnd], end: WriteEnd) -> None:
        began = self._began.pop(id(command), None)
        if isinstance(end, Landed):
            if began is not None:
                took = self._ctx.clock() - began
                self._ctx.send_durations.observe(took)
                end = Landed(end.nbytes, end.descriptors, took)
            counts = self._ctx.counts
            counts["bytes"] += end.nbytes
            counts["descriptors"] += end.descriptors
            counts["transfers"] += 1
        if not ended.done():
            ended.set_result(end)

    def _submit_now(self, command: Submit, target: WriteTarget, ended: asyncio.Future[WriteEnd]) -> bool:
        """The many-small-requests path of `_write`: plan and submit at once, no task, when the transport can
        (`start_write`); the outcome arrives in `_started_write_done`. False, having done nothing, in any other
        case (layer-wise, a plan that raises, a transport that would wait): `_write` runs then. A `start_write`
        that raises, against its contract, fails the write as a `write` raising outside its contract does (once
        the plane drained, `_settled`): it may have submitted part, so it is never resubmitted."""
        if self._streamed_layers(command.transfer_id) is not None or _in_rounds(command):
            return False
        try:
            table, unit = self._descriptors(target, command)
            if self._staged(target, table, command.window_bytes > 0, unit) is not None:
                return False  # a staged write waits for room and for its gather: it needs the task
        except Exception:  # whatever a plan raises, `_write` meets again and reports
            return False
        try:
            result = target.transport.start_write(target.session, table)
        except Exception as exc:  # the plane broke its contract: it may have submitted part, so never resubmit
            self._failed(command, exc, len(table), target, ended, "start_write")
            return True
        if result is None:
            return False
        self._started.add(result)
        ndesc = len(table)
        result.add_done_callback(lambda fut: self._started_write_done(command, ndesc, fut, target, ended))
        return True

    def _started_write_done(
        self,
        command: Submit,
        ndesc: int,
        result: asyncio.Future[Written],
        target: WriteTarget,
        ended: asyncio.Future[WriteEnd],
    ) -> None:
        self._started.discard(result)
        if result.cancelled():
            self._end(command, ended, WriteFault(CLOSED_MID_WRITE, ndesc))
            return
        exc = result.exception()
        written = exc if exc is not None else result.result()
        if isinstance(written, int):
            self._end(command, ended, Landed(written, ndesc))
        else:
            self._failed(command, written, ndesc, target, ended)

    def _failed(
        self,
        command: Submit,
        failure: BaseException | WriteFailed,
        ndesc: int,
        target: WriteTarget | None,
        ended: asyncio.Future[WriteEnd],
        call: str = "write",
    ) -> None:
        """A write failed (any path: its plane's `WriteFailed`, or what raised; `call`: the plane's method it
        reached): it ends once the peer can no longer make progress on it, so the request's blocks stay held until
        then (`_fault` says what it waits for)."""
        self._ctx.counts["write_failures"] += 1
        fault = WriteFault(f"{type(failure).__name__}: {failure}", ndesc)
        drained = self._fault(command, failure, target, call)
        if drained is None or drained.done():
            self._end(command, ended, fault)
            return
        self._started.add(drained)  # `wait_writes` and `in_flight` see it until it drained

        def after_drain(_: asyncio.Future[Any]) -> None:
            self._started.discard(drained)
            self._end(command, ended, fault)

        drained.add_done_callback(after_drain)

    def _fault(
        self, command: Submit, failure: BaseException | WriteFailed, target: WriteTarget | None, call: str
    ) -> asyncio.Future[Any] | None:
        """What a failed write must wait for before its blocks may be released, as the core's write-failure table
        decides (`kvsvc.core.sender.fault_wait`) from how it failed (`_fault_kind`) and whether a plane was asked;
        None for nothing."""
        kind = _fault_kind(failure)
        if kind is FaultKind.OUTSIDE_CONTRACT:
            log.error(
                "%s of transfer %r to %s raised outside the plane's contract",
                call,
                command.transfer_id,
                command.dst,
                exc_info=failure if isinstance(failure, BaseException) else None,
            )
        match fault_wait(kind, target is not None):
            case FaultWait.DRAINED:
                return failure.drained if isinstance(failure, WriteFailed) else None
            case FaultWait.SETTLED:
                return self._settled(command, target) if target is not None else None
            case FaultWait.NOTHING:
                return None

    def _settled(self, command: Submit, target: WriteTarget) -> asyncio.Task[None]:
        """For a write that raised outside its plane's contract: a task that ends once `target`'s plane has nothing
        in flight to its D worker, or after `close_drain_timeout_s` for a peer that stopped making progress. The
        plane is asked even when the control connection is gone: a removed peer's writes are still counted there."""
        bound = self._ctx.config.close_drain_timeout_s
        waited = _drained_within(target.transport, target.session, bound, command)
        return self._ctx.tasks.spawn(waited, name=f"kvsvc-settle-{command.transfer_id}")

    def _descriptors(self, target: WriteTarget, command: Submit) -> tuple[Int64Array, Shifted | None]:
        """`command`'s descriptor table and the cached one it shifts (`PlanCache.descriptors`).

        Raises:
            TopologyError / ValueError: as `PlanCache.descriptors`.
        """
        return target.plans.descriptors(self._ctx.metadata, target.meta, command)

    def _staged(
        self, target: WriteTarget, table: Int64Array, windowed: bool = False, unit: Shifted | None = None
    ) -> list[StagedChunk] | None:
        """`table` staged in this worker's region's chunks, when it has a region whose rule picks staging
        (`PlanCache.staged`); None to write it as it is.

        Raises:
            ValueError: two descriptors overlap in the destination (a planner bug).
            TopologyError: the pair converts (`kvsvc.core.formats`) and this worker has no staging region.
        """
        area = self._ctx.staging
        if area is None:
            if target.plans.conversion is not None:
                raise TopologyError(f"P converts its KV into {target.ref}'s format in a staging region, and has none")
            return None
        rule = rule_on(target.plane, area.rule)
        return target.plans.staged(target.meta, table, rule, area.chunk_bytes, windowed, unit)

    async def _write_once(
        self, target: WriteTarget, table: Int64Array, command: Submit, unit: Shifted | None = None
    ) -> Part:
        """Write the descriptor table `table` (the cached plan or window stream `unit` shifted, if given), gathered
        through the staging region when its rule picks it.

        Raises:
            StagingFull / what the gather raises: as `_write_staged`; InvalidDescriptor / TransportClosed: as
                `Transport.write`.
        """
        chunks = self._staged(target, table, command.window_bytes > 0, unit)
        if chunks is not None:
            return await self._write_staged(target, chunks)
        return _part(await target.transport.write(target.session, table), len(table))

    async def _write_rounds(self, target: WriteTarget, command: Submit) -> Part:
        """Write a share larger than its window in rounds, as its `FillingWindow` says (module docstring); a round's
        plane failure ends it.

        Raises:
            as `_stream` and `_write_once`; PeerLost / KVSvcTimeout: D did not empty a round in time;
            TransferAborted: the job was aborted (it stops at a round's start, once earlier rounds landed).
        """
        src, offset, length, _ = target.plans.stream(self._ctx.metadata, target.meta, command)
        transfer_id, clock = command.transfer_id, self._ctx.clock
        timeout_s = self._ctx.config.hold_timeout_s
        stream = (src, offset, length)
        fill = FillingWindow(transfer_id, stream, command.window_addr, command.window_bytes, timeout_s, dst=command.dst)
        if target.gone:
            fill.peer_lost(target.gone)
        target.fills[transfer_id] = fill
        nbytes = ndesc = 0
        try:
            while True:
                step = round_step(fill, lambda: self._sender.writing(transfer_id, command.dst.worker))
                if isinstance(step, RoundsFilled):
                    return nbytes, ndesc
                if isinstance(step, Fail):
                    raise _fill_error(step.cause, step.reason)
                if isinstance(step, AwaitHalf):
                    began = clock()
                    await target.wait(fill, clock)
                    self._ctx.round_wait.observe(clock() - began)
                    continue
                table = np.column_stack((step.src, step.dst, step.length))
                part = await self._write_once(target, table, command)
                if isinstance(part, WriteFailed):
                    return part
                nbytes, ndesc = nbytes + part[0], ndesc + part[1]
                carry_out_p(fill.landed(clock()), self._side)
        finally:
            target.fills.pop(transfer_id, None)

    async def _write_staged(self, target: WriteTarget, chunks: list[StagedChunk]) -> Part:
        """Write `chunks` through the staging region, each as soon as it has room; ends as `_all_written`.

        Raises:
            StagingFull / what the gather raises: as `_all_written`.
        """
        written = await _all_written(self._write_chunk(target, chunk) for chunk in chunks)
        if not isinstance(written, WriteFailed):
            self._ctx.counts["staged"] += 1
        return written

    async def _write_chunk(self, target: WriteTarget, chunk: StagedChunk) -> Part:
        """Lend room for `chunk`, gather its pieces there, write its runs; the room goes back once nothing can read
        it any more (after a failed write's drain). A converting pair's gather converts (`TorchGather.convert`); a
        region whose copies cannot raises `TopologyError`. A cancelled chunk keeps its room: only `close` cancels."""
        ctx = self._ctx
        area = ctx.staging
        assert area is not None
        began = ctx.clock()
        addr = await area.lend(chunk.nbytes, ctx.config.hold_timeout_s)
        lent = ctx.clock()
        ctx.staged_room.observe(lent - began)
        try:
            conversion = target.plans.conversion
            if conversion is None:
                await area.gather(chunk.gather_src, addr + chunk.gather_offset, chunk.gather_length)
            elif area.convert is None:
                raise TopologyError(f"this worker's staging copies cannot convert its KV into {target.ref}'s format")
            else:
                await area.convert(conversion, chunk.gather_src, addr + chunk.gather_offset, chunk.gather_length)
        except asyncio.CancelledError:
            raise  # the copy may still be running into the room
        except BaseException:
            area.give_back(addr)
            raise
        gathered = ctx.clock()
        ctx.staged_gather.observe(gathered - lent)
        descriptors = np.column_stack((addr + chunk.write_offset, chunk.write_dst, chunk.write_length))
        try:
            written = await target.transport.write(target.session, descriptors)
        except asyncio.CancelledError:
            raise
        except BaseException:
            # A plane that raised outside its contract may still read the room; a later chunk's gather into it
            # changes only what that stray copy carries into blocks whose write failed (`_settled` holds them).
            area.give_back(addr)
            raise
        if isinstance(written, WriteFailed) and written.drained is not None and not written.drained.done():
            written.drained.add_done_callback(lambda _: area.give_back(addr))
            return written
        area.give_back(addr)
        if not isinstance(written, WriteFailed):
            ctx.staged_write.observe(ctx.clock() - gathered)
        return _part(written, len(descriptors))

    async def _write_layerwise(
        self,
        target: WriteTarget,
        table: Int64Array,
        layers: list[asyncio.Future[None]],
        command: Submit,
    ) -> Part:
        """Write each layer's descriptors (rows of `table`) as soon as its compute finished, later layers still
        computing, each layer gathered through the staging region when the rule picks it for that layer; ends as
        `_all_written`.

        A cross-layer pool puts every layer inside each block, so one descriptor spans layers: it goes once the
        last layer finished (the layer-wise gain needs per-layer tensors).
        """
        meta = self._ctx.metadata
        per_layer = [table[:0]] * len(layers)
        if is_cross_layer(meta):
            per_layer[-1] = table
        else:
            addrs = np.asarray(layer_addrs(meta), dtype=np.int64)
            by_start = np.argsort(addrs)
            layer = by_start[np.searchsorted(addrs[by_start], table[:, 0], side="right") - 1]
            per_layer = [table[layer == i] for i in range(len(layers))]

        clock, ctx = self._ctx.clock, self._ctx
        waited = [not ready.done() for ready in layers]  # computed while the write waits, not before it began
        computed_at = [0.0] * len(layers)

        async def one(layer: int) -> Part:
            await _computed(layers if is_cross_layer(meta) else [layers[layer]])
            computed_at[layer] = clock()
            if not len(per_layer[layer]):
                return 0, 0
            written = await self._write_once(target, per_layer[layer], command)
            if not isinstance(written, WriteFailed):
                ctx.layer_copy.observe(clock() - computed_at[layer])
            return written

        written = await _all_written(one(i) for i in range(len(layers)))
        if isinstance(written, WriteFailed):
            return written
        for i in range(1, len(layers) if not is_cross_layer(meta) else 0):  # there, every layer waits for all
            if waited[i - 1] and waited[i]:
                ctx.layer_compute.observe(max(0.0, computed_at[i] - computed_at[i - 1]))
        if waited[-1]:
            ctx.after_last_layer.observe(clock() - computed_at[-1])
        return written


async def _drained_within(transport: Transport, session: str, bound: float, command: Submit) -> None:
    """Wait until `transport` has nothing in flight to `session`, at most `bound` seconds; raises nothing."""
    try:
        await asyncio.wait_for(transport.drained(session), bound)
    except TimeoutError:
        log.warning(
            "write of %r to %s raised outside its plane's contract and the plane still had writes to it in flight "
            "after %g s: ending it anyway",
            command.transfer_id,
            command.dst,
            bound,
        )
    except Exception:  # `drained` raises nothing by contract; a plane that does cannot hold the write forever
        log.exception("waiting for the plane to drain after the write of %r failed", command.transfer_id)


async def _awaited(ready: Awaitable[None]) -> None:
    await ready


def _computed_well(ready: asyncio.Future[None]) -> bool:
    return ready.done() and not ready.cancelled() and ready.exception() is None


async def _computed(layers: Sequence[asyncio.Future[None]]) -> None:
    """Wait for the compute of `layers`.

    Raises:
        TransferAborted: a layer's compute failed (the engine's error, named): the write cannot go on.
    """
    try:
        await asyncio.gather(*layers)
    except Exception as exc:
        raise TransferAborted(f"the compute of a layer failed: {type(exc).__name__}: {exc}") from exc


async def _all_written(parts: Iterable[Awaitable[Part]]) -> Part:
    """Run the writes `parts` together; their summed counts, or the first plane failure among them, once every
    failed part's descriptors stopped moving (its `drained`): the job may end only then, not after the first
    failure's alone.

    Raises:
        what a part raised, once the parts' drains are over: a failure outside the plane's contract first, so that
        the write waits for the plane too (`BlockWriter._settled`), then the plane's failure is returned, then any
        other error is raised.
    """
    results = await asyncio.gather(*parts, return_exceptions=True)
    faults = [r for r in results if isinstance(r, WriteFailed)]
    errors = [r for r in results if isinstance(r, BaseException)]
    drains = [f.drained for f in faults if f.drained is not None]
    if drains:
        await asyncio.shield(asyncio.gather(*drains, return_exceptions=True))
    outside = next((e for e in errors if _fault_kind(e) is FaultKind.OUTSIDE_CONTRACT), None)
    if outside is not None:
        raise outside
    if faults:
        return faults[0]
    if errors:
        raise errors[0]
    done = [r for r in results if isinstance(r, tuple)]
    return sum(n for n, _ in done), sum(d for _, d in done)


def _part(written: Written, descriptors: int) -> Part:
    """A plane's write of `descriptors` descriptors as a `Part`."""
    return written if isinstance(written, WriteFailed) else (written, descriptors)


def _fault_kind(failure: BaseException | WriteFailed) -> FaultKind:
    """How a write failed, by the transport contract (`kvsvc.transport.base`): the plane's `WriteFailed`; a failure
    the contract allows (`KVSvcError`, `ValueError`: raised before anything was submitted, or once all it submitted
    ended); or anything else, which may leave part of the write moving."""
    if isinstance(failure, WriteFailed):
        return FaultKind.PLANE
    return FaultKind.WITHIN_CONTRACT if isinstance(failure, KVSvcError | ValueError) else FaultKind.OUTSIDE_CONTRACT


def _fill_error(cause: FillEvent | None, reason: str) -> Exception:
    """The error a failed write in rounds raises, by whose doing it failed (`kvsvc.core.windows.Fail`)."""
    if cause is FillEvent.EXPIRE:
        return KVSvcTimeout(reason)
    if cause is FillEvent.STOP:
        return TransferAborted(reason)
    return PeerLost(reason)


def _in_rounds(command: Submit) -> bool:
    """Whether `command`'s share moves through its window in rounds (D planned it larger than the window)."""
    return command.window_bytes > 0 and command.share_bytes > command.window_bytes
