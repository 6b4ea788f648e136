"""P's writes into D workers' KV blocks, `BlockWriter`: carries out the `Sender`'s `Submit`s through the transport.

Rules: each `Submit` is planned (from a per-D-worker cache when it can be), written, and its result handed back once
through the injected `write_result`, only when none of its descriptors can move any more: a failed write waits for
its `drained` future, so the request's blocks stay held until then. Small writes skip the task when the transport's
`start_write` takes them. With a staging region, a plan its rule picks is gathered there chunk by chunk and written
one descriptor per destination run (`kvsvc.service.staging`). A request with a window of D's staging region is
written there as one stream (`kvsvc.staging.window_plan`), gathered too when the rule picks it; D scatters it. A share
larger than its window moves in rounds: round k waits until D emptied round k - 2 (`WindowEmptied`, within the hold
timeout), and each round but the last is announced with `WindowFilled`. A layer-wise write stages each layer on its
own when the rule picks it.
Part of the P role (`kvsvc.service.sending` owns it); imports kvsvc's core, never the D role.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvsvc.coalesce import Int64Array
from kvsvc.errors import KVSvcTimeout, PeerLost, TopologyError, TransferAborted
from kvsvc.layout import block_geometry, is_cross_layer, layer_addrs, pool_regions
from kvsvc.messages import Message, WindowFilled, Worker, WorkerMetadata, WorkerRef
from kvsvc.planner import is_block_run, plan_transfer_arrays
from kvsvc.sender import Submit
from kvsvc.service.context import ServiceContext
from kvsvc.staging import (
    StagedChunk,
    count_runs,
    plan_staged,
    region_ids,
    shift_chunks,
    stream_round,
    window_plan,
    window_round_bytes,
    window_rounds,
)
from kvsvc.transport.base import WriteFailed

_PLAN_CACHE_ENTRIES = 1024  # per D worker connection
# Descriptors cached per D worker connection, all plans together: 24 MiB, and their staged forms and window streams
# about as much again each.
_PLAN_CACHE_ROWS = 1 << 20

WriteResult = Callable[[str, Worker, str | None, int, int], None]
"""`(transfer_id, D worker, error or None, bytes, descriptors)`: how a write's end reaches the `Sender`."""


def _nowhere(message: Message) -> None:
    raise PeerLost(f"no control connection to send {type(message).__name__} on")


@dataclass(slots=True)
class WriteTarget:
    """A D worker this P worker writes to, as its accepted hello described it, and the rounds of its windows that
    it emptied (`window_emptied`), which writes in rounds wait for (`wait_emptied`)."""

    ref: WorkerRef
    meta: WorkerMetadata
    send: Callable[[Message], None] = _nowhere
    """Sends a frame to this D worker on its control connection; raises `PeerLost` when it is closed."""
    # Plans of requests whose P and D blocks are each one run of consecutive ids, for the run starting at block 0
    # on both sides, keyed (P blocks, D blocks, tokens): see `BlockWriter._plan`.
    plans: dict[tuple[int, int, int], Int64Array] = field(default_factory=dict)
    plan_rows: int = 0  # descriptors in `plans`
    # The staged form (`plan_staged`) of each plan in `plans` written into D's blocks, or None where the rule
    # writes it direct: shifted like the plan (`shift_chunks`), since staging it costs more than planning it.
    staged: dict[tuple[int, int, int], list[StagedChunk] | None] = field(default_factory=dict)
    # The window stream (`window_plan`: source, stream offset, length) of each plan in `plans`, and its staged form
    # for a window at address 0, or None where the rule writes the stream as it is: both shift like the plan (the
    # stream's order and merges depend only on which ranges touch; the window's address only moves the chunks).
    streams: dict[tuple[int, int, int], tuple[Int64Array, Int64Array, Int64Array]] = field(default_factory=dict)
    staged_streams: dict[tuple[int, int, int], list[StagedChunk] | None] = field(default_factory=dict)
    strides: tuple[int, int] = (0, 0)  # block strides of P (this worker) and of this D worker
    src_regions: list[int] = field(default_factory=list)  # start addresses of this P worker's registered tensors
    emptied: dict[str, set[int]] = field(default_factory=dict)  # per transfer writing in rounds
    waiters: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    gone: str = ""  # why the control connection closed; "" while it is open

    def window_emptied(self, transfer_id: str, index: int) -> None:
        """D emptied round `index` of `transfer_id`'s window. One for a transfer not writing in rounds (a repeat, a
        late one) is dropped."""
        rounds = self.emptied.get(transfer_id)
        if rounds is None:
            return
        rounds.add(index)
        waiter = self.waiters.pop(transfer_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_emptied(self, transfer_id: str, index: int, timeout_s: float) -> None:
        """Return once D emptied round `index` of `transfer_id`.

        Raises:
            PeerLost: the control connection closed first.
            KVSvcTimeout: not within `timeout_s`.

        Cancellation leaves nothing behind (the waiter is replaced by the next wait).
        """
        rounds = self.emptied.setdefault(transfer_id, set())
        try:
            async with asyncio.timeout(timeout_s):
                while index not in rounds:
                    if self.gone:
                        raise PeerLost(f"{self.ref}: {self.gone}")
                    waiter = asyncio.get_running_loop().create_future()
                    self.waiters[transfer_id] = waiter
                    await waiter
        except TimeoutError:
            raise KVSvcTimeout(
                f"{self.ref} emptied no round {index} of {transfer_id!r}'s window within {timeout_s:g} s"
            ) from None

    def lose(self, reason: str) -> None:
        """The control connection closed: every write waiting for a round fails with `PeerLost`."""
        self.gone = reason or "control connection closed"
        for waiter in self.waiters.values():
            if not waiter.done():
                waiter.set_result(None)  # the waiting loop sees `gone`
        self.waiters.clear()


class BlockWriter:
    """The writes of one P worker (see module docstring).

    `target` finds the D worker a `Submit` names (None once its connection is gone or was replaced); `write_result`
    feeds each write's end back to the `Sender`; `wanted` says whether a job still wants its write (`Sender.writing`):
    a write in rounds stops at the next round once it does not.
    """

    def __init__(
        self,
        ctx: ServiceContext,
        target: Callable[[WorkerRef], WriteTarget | None],
        write_result: WriteResult,
        wanted: Callable[[str, Worker], bool] = lambda transfer_id, dst: True,
    ) -> None:
        self._ctx = ctx
        self._target = target
        self._write_result = write_result
        self._wanted = wanted
        self._layer_ready: dict[str, list[asyncio.Future[None]]] = {}
        self._writes: set[asyncio.Task[None]] = set()
        # Writes submitted without a task (`_start_write`): their result futures, and `drained` futures of failed
        # ones whose descriptors may still move (their blocks stay held until these resolve).
        self._started: set[asyncio.Future[Any]] = set()
        self._began: dict[int, float] = {}  # id(Submit) -> when its write started, for the latency histogram
        self._start_write = ctx.transport.start_write

    def submit(self, command: Submit) -> None:
        """Start the write `command` asks for; its end reaches `write_result` later, never from this call."""
        self._began[id(command)] = self._ctx.clock()
        if self._submit_now(command):
            return
        write = self._ctx.tasks.spawn(self._write(command), name=f"kvsvc-write-{command.transfer_id}")
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)

    def layer_wise(self, transfer_id: str, ready: Sequence[Awaitable[None]]) -> None:
        """Write `transfer_id` layer by layer: each local layer once its own future in `ready` resolved."""
        self._layer_ready[transfer_id] = [asyncio.ensure_future(r) for r in ready]

    def forget_layers(self, ended: Callable[[str], bool]) -> None:
        """Drop the layer futures of the transfers for which `ended` is true."""
        for transfer_id in [t for t in self._layer_ready if ended(t)]:
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

    async def _write(self, command: Submit) -> None:
        nbytes = ndesc = 0
        target = self._target(command.dst)
        try:
            if target is None:
                raise PeerLost(f"control connection to {command.dst} lost before the write")
            layers = self._layer_ready.get(command.transfer_id)
            if _in_rounds(command):
                if layers is not None:  # rounds follow D's address order, not the layers: all of them first
                    await asyncio.gather(*layers)
                nbytes, ndesc = await self._write_rounds(target, command)
            elif layers is None:
                table, unit = self._descriptors(target, command)
                nbytes, ndesc = await self._write_once(target, table, command, unit)
            else:
                table, _ = self._descriptors(target, command)
                ndesc = len(table)
                nbytes, ndesc = await self._write_layerwise(target, table, layers, command)
        except asyncio.CancelledError:
            # Only `close` cancels, after `close_drain_timeout_s`: the engine is going away with its blocks.
            self._began.pop(id(command), None)
            self._write_result(
                command.transfer_id, command.dst.worker, "P service closed before the write finished", 0, 0
            )
            raise
        except Exception as exc:  # a transport failure, a plan refused, a layer's compute that failed: all end the job
            self._write_failed(command, exc, ndesc)
            return
        self._write_ended(command, None, nbytes, ndesc)

    def _write_ended(self, command: Submit, error: str | None, nbytes: int, ndesc: int) -> None:
        counts = self._ctx.counts
        began = self._began.pop(id(command), None)
        if error is None:
            if began is not None:
                self._ctx.send_durations.observe(self._ctx.clock() - began)
            counts["bytes"] += nbytes
            counts["descriptors"] += ndesc
            counts["transfers"] += 1
        self._write_result(command.transfer_id, command.dst.worker, error, nbytes, ndesc)

    def _submit_now(self, command: Submit) -> bool:
        """The many-small-requests path of `_write`: plan and submit at once, no task, when the transport can
        (`start_write`); the outcome arrives in `_started_write_done`. False, having done nothing, in any other
        case (layer-wise, no connection, a plan that raises, a transport that would wait): `_write` runs then."""
        if command.transfer_id in self._layer_ready or _in_rounds(command):
            return False
        target = self._target(command.dst)
        if target is None:
            return False
        try:
            table, unit = self._descriptors(target, command)
            if self._staged(target, table, command.window_bytes > 0, unit) is not None:
                return False  # a staged write waits for room and for its gather: it needs the task
        except (TopologyError, ValueError):
            return False  # `_write` plans again and reports why
        result = self._start_write(target.meta.transport_addr, _tuples(table))
        if result is None:
            return False
        self._started.add(result)
        ndesc = len(table)
        result.add_done_callback(lambda fut: self._started_write_done(command, ndesc, fut))
        return True

    def _started_write_done(self, command: Submit, ndesc: int, result: asyncio.Future[int]) -> None:
        self._started.discard(result)
        if result.cancelled():
            self._write_ended(command, "P service closed before the write finished", 0, ndesc)
            return
        exc = result.exception()
        if exc is None:
            self._write_ended(command, None, result.result(), ndesc)
        else:
            self._write_failed(command, exc, ndesc)

    def _write_failed(self, command: Submit, exc: BaseException, ndesc: int) -> None:
        """A write failed (either path): it ends once the peer can no longer make progress on it, so the request's
        blocks stay held until then (a failure whose `drained` is pending)."""
        self._ctx.counts["write_failures"] += 1
        error = f"{type(exc).__name__}: {exc}"
        drained = exc.drained if isinstance(exc, WriteFailed) else None
        if drained is None or drained.done():
            self._write_ended(command, error, 0, ndesc)
            return
        self._started.add(drained)  # `wait_writes` and `in_flight` see it until it drained

        def after_drain(_: asyncio.Future[None]) -> None:
            self._started.discard(drained)
            self._write_ended(command, error, 0, ndesc)

        drained.add_done_callback(after_drain)

    def _descriptors(self, target: WriteTarget, command: Submit) -> tuple[Int64Array, _Unit | None]:
        """The descriptors of `command` as a `(source, destination, length)` table: its plan, or, with a window that
        holds the whole share, the plan's stream into that window; and the cached plan or stream it shifts (`_plan`,
        `_stream`), if any.

        Raises:
            TopologyError / ValueError: as `_plan` and `_stream`.
        """
        if not command.window_bytes:
            return self._plan(target, command)
        src, offset, length, unit = self._stream(target, command)
        return np.column_stack((src, command.window_addr + offset, length)), unit

    def _stream(self, target: WriteTarget, command: Submit) -> tuple[Int64Array, Int64Array, Int64Array, _Unit | None]:
        """`command`'s share as a window stream: (source, stream offset, length) columns (`window_plan`), and the
        cached stream it shifts, if any: its `dst_shift` is the window's address, where the stream's offset 0 lies.

        Raises:
            TopologyError / ValueError: as `_plan`, or D planned a share of another size.
        """
        table, unit = self._plan(target, command)
        if unit is None:
            src, offset, length = self._window_stream(target, table)
        else:
            cached = target.streams.get(unit.key)
            if cached is None:
                cached = target.streams[unit.key] = _frozen_columns(self._window_stream(target, target.plans[unit.key]))
            src, offset, length = cached
            src = src + unit.src_shift if unit.src_shift else src
            unit = _Unit(unit.key, unit.src_shift, command.window_addr)
        nbytes = int(length.sum())
        share = command.share_bytes or command.window_bytes
        if nbytes != share:
            raise ValueError(
                f"D planned a share of {share} bytes for {command.transfer_id!r} (window of {command.window_bytes}); "
                f"this P worker writes it {nbytes}"
            )
        return src, offset, length, unit

    def _window_stream(self, target: WriteTarget, table: Int64Array) -> tuple[Int64Array, Int64Array, Int64Array]:
        """The descriptor table `table` as a window stream at address 0 (`window_plan`)."""
        src, dst, length = table.T
        if not target.src_regions:
            target.src_regions = [start for start, _ in pool_regions(self._ctx.metadata)]
        return window_plan(src, dst, length, 0, region_ids(src, target.src_regions))

    async def _write_once(
        self, target: WriteTarget, table: Int64Array, command: Submit, unit: _Unit | None = None
    ) -> tuple[int, int]:
        """Write the descriptor table `table` (the cached plan or window stream `unit` shifted, if given), gathered
        through the staging region when its rule picks it; (bytes, descriptors).

        Raises:
            WriteFailed / StagingFull / what the gather raises: as `_write_staged` or `Transport.write`.
        """
        chunks = self._staged(target, table, command.window_bytes > 0, unit)
        if chunks is not None:
            return await self._write_staged(target.meta.transport_addr, chunks)
        return await self._ctx.transport.write(target.meta.transport_addr, _tuples(table)), len(table)

    async def _write_rounds(self, target: WriteTarget, command: Submit) -> tuple[int, int]:
        """Write a share larger than its window in rounds (module docstring); (bytes, descriptors).

        Raises:
            as `_stream` and `_write_once`; PeerLost / KVSvcTimeout: D did not empty a round in time;
            TransferAborted: the job was aborted (it stops at a round's start, once earlier rounds landed).
        """
        src, offset, length, _ = self._stream(target, command)
        share = int(length.sum())
        size, count = window_round_bytes(share, command.window_bytes), window_rounds(share, command.window_bytes)
        transfer_id, nbytes, ndesc = command.transfer_id, 0, 0
        target.emptied.setdefault(transfer_id, set())
        try:
            for index in range(count):
                if index >= 2:
                    await target.wait_emptied(transfer_id, index - 2, self._ctx.config.hold_timeout_s)
                if index and not self._wanted(transfer_id, command.dst.worker):
                    raise TransferAborted(f"{transfer_id!r} aborted after {index} of {count} rounds of D's window")
                r_src, r_offset, r_length = stream_round(offset, src, length, index, size)
                base = command.window_addr + (index % 2) * size
                round_table = np.column_stack((r_src, base + r_offset, r_length))
                written, submitted = await self._write_once(target, round_table, command)
                nbytes, ndesc = nbytes + written, ndesc + submitted
                if index < count - 1:
                    target.send(WindowFilled(transfer_id=transfer_id, round=index))
        finally:
            target.emptied.pop(transfer_id, None)
            target.waiters.pop(transfer_id, None)
        return nbytes, ndesc

    def _plan(self, target: WriteTarget, command: Submit) -> tuple[Int64Array, _Unit | None]:
        """`plan_transfer` as a `(source, destination, length)` table (read-only when cached), and the cached plan
        it shifts, if it is one; from `target`'s cache when the used P and D blocks are each one run of consecutive
        ids and D holds no prefix already (`first_token` 0).

        Such a plan is the plan of the runs starting at block 0, shifted by each side's first block times its
        block stride: merging depends only on which ranges touch, and a shift keeps that (a run touches the next
        layer's tensor only when it spans the whole pool, and then it starts at block 0). Planning is otherwise the
        P worker's main cost, for thousands of one-block requests a second as for a head split in NHD (thousands of
        descriptors per request); a cached table shifts in one numpy add whatever its size.

        Raises:
            TopologyError / ValueError: as `plan_transfer` (the uncached path runs every check).
        """
        src, dst = self._ctx.metadata, target.meta
        src_ids, dst_ids, num_tokens = command.src_block_ids, command.dst_block_ids, command.num_tokens
        if command.first_token:
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
        unit = target.plans.get(key)
        if unit is None:
            unit = _table(plan_transfer_arrays(src, dst, range(n_src), range(n_dst), num_tokens))
            unit.flags.writeable = False
            if len(target.plans) < _PLAN_CACHE_ENTRIES and target.plan_rows + len(unit) <= _PLAN_CACHE_ROWS:
                target.plans[key] = unit
                target.plan_rows += len(unit)
        cached = key in target.plans
        if src_ids[0] == dst_ids[0] == 0:
            return unit, _Unit(key, 0, 0) if cached else None
        if not target.strides[0]:
            target.strides = (block_geometry(src).block_stride, block_geometry(dst).block_stride)
        shift_src, shift_dst = src_ids[0] * target.strides[0], dst_ids[0] * target.strides[1]
        table = unit + np.array([shift_src, shift_dst, 0], dtype=np.int64)
        return table, _Unit(key, shift_src, shift_dst) if cached else None

    def _staged(
        self, target: WriteTarget, table: Int64Array, windowed: bool = False, unit: _Unit | None = None
    ) -> list[StagedChunk] | None:
        """The chunks of the descriptor table `table` staged, when there is a staging region and its rule picks
        staging. `windowed`: they write one window of D's region (one destination region), not D's blocks. `unit`:
        `table` is that cached plan shifted (with `windowed`, that plan's cached window stream, its `dst_shift` the
        window's address), whose staged form is cached too.

        Raises:
            ValueError: two descriptors overlap in the destination (a planner bug).
        """
        area = self._ctx.staging
        if area is None or len(table) < 2:
            return None
        if unit is not None:
            cache = target.staged_streams if windowed else target.staged
            if unit.key not in cache:
                if windowed:
                    src, offset, length = target.streams[unit.key]
                    cache[unit.key] = _frozen(self._staged(target, np.column_stack((src, offset, length)), True))
                else:
                    cache[unit.key] = _frozen(self._staged(target, target.plans[unit.key]))
            chunks = cache[unit.key]
            return None if chunks is None else shift_chunks(chunks, unit.src_shift, unit.dst_shift)
        src, dst, length = table.T
        # A run must stay inside one of D's registered tensors, even where two of them touch.
        region = None if windowed else region_ids(dst, [start for start, _ in pool_regions(target.meta)])
        if not area.rule.stage(len(table), count_runs(dst, length, region), int(length.sum())):
            return None
        return plan_staged(src, dst, length, area.chunk_bytes, region)

    async def _write_staged(self, peer: str, chunks: list[StagedChunk]) -> tuple[int, int]:
        """Write `chunks` through the staging region, each as soon as it has room; returns (bytes, descriptors).

        Raises:
            WriteFailed / StagingFull / what the gather raises: the first failure, once no chunk of the write can
                move any more bytes.
        """
        written = await _all_written(self._write_chunk(peer, chunk) for chunk in chunks)
        self._ctx.counts["staged"] += 1
        return written

    async def _write_chunk(self, peer: str, chunk: StagedChunk) -> tuple[int, int]:
        """Lend room for `chunk`, gather its pieces there, write its runs; the room goes back once nothing can read
        it any more (after a failed write's drain). A cancelled chunk keeps its room: only `close` cancels."""
        area = self._ctx.staging
        assert area is not None
        addr = await area.lend(chunk.nbytes, self._ctx.config.hold_timeout_s)
        try:
            await area.gather(chunk.gather_src, addr + chunk.gather_offset, chunk.gather_length)
        except asyncio.CancelledError:
            raise  # the copy may still be running into the room
        except BaseException:
            area.give_back(addr)
            raise
        columns = ((addr + chunk.write_offset).tolist(), chunk.write_dst.tolist(), chunk.write_length.tolist())
        descriptors = list(zip(*columns, strict=True))
        try:
            nbytes = await self._ctx.transport.write(peer, descriptors)
        except asyncio.CancelledError:
            raise
        except WriteFailed as exc:
            if exc.drained is not None and not exc.drained.done():
                exc.drained.add_done_callback(lambda _: area.give_back(addr))
            else:
                area.give_back(addr)
            raise
        except BaseException:
            area.give_back(addr)
            raise
        area.give_back(addr)
        return nbytes, len(descriptors)

    async def _write_layerwise(
        self,
        target: WriteTarget,
        table: Int64Array,
        layers: list[asyncio.Future[None]],
        command: Submit,
    ) -> tuple[int, int]:
        """Write each layer's descriptors (rows of `table`) as soon as its compute finished, later layers still
        computing, each layer gathered through the staging region when the rule picks it for that layer; (bytes,
        descriptors).

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

        async def one(layer: int) -> tuple[int, int]:
            if is_cross_layer(meta):
                await asyncio.gather(*layers)
            else:
                await layers[layer]
            return await self._write_once(target, per_layer[layer], command) if len(per_layer[layer]) else (0, 0)

        return await _all_written(one(i) for i in range(len(layers)))


@dataclass(frozen=True, slots=True)
class _Unit:
    """A request's plan as a cached one (`WriteTarget.plans[key]`) shifted by `src_shift` / `dst_shift` bytes; for a
    windowed write, the cached plan's window stream (`WriteTarget.streams[key]`), `dst_shift` being the window's
    address."""

    key: tuple[int, int, int]
    src_shift: int
    dst_shift: int


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


def _tuples(table: Int64Array) -> list[tuple[int, int, int]]:
    """A descriptor table as the `(source, destination, length)` tuples the transport's writes take."""
    src, dst, length = table.T.tolist()
    return list(zip(src, dst, length, strict=True))


async def _all_written(parts: Iterable[Awaitable[tuple[int, int]]]) -> tuple[int, int]:
    """Run the writes `parts` (each returning bytes and descriptors) together; their summed counts.

    Raises:
        the first part's failure, once every failed part's descriptors stopped moving (its `drained`): the job may
        end only then, not after the first failure's alone.
    """
    results = await asyncio.gather(*parts, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    drains = [f.drained for f in failures if isinstance(f, WriteFailed) and f.drained is not None]
    if drains:
        await asyncio.shield(asyncio.gather(*drains, return_exceptions=True))
    if failures:
        raise failures[0]
    done = [r for r in results if isinstance(r, tuple)]
    return sum(n for n, _ in done), sum(d for _, d in done)


def _in_rounds(command: Submit) -> bool:
    """Whether `command`'s share moves through its window in rounds (D planned it larger than the window)."""
    return command.window_bytes > 0 and command.share_bytes > command.window_bytes
