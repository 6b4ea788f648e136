"""`PlanCache`: what one P worker writes to one D worker for a `Submit`, as descriptor tables, planned once per
request shape and shifted per request: the plan (`plan_transfer`), its window stream when D lent a window
(`window_plan`), and the staged form of either when the staging rule picks a gather (`plan_staged`) or the pair
converts (`kvsvc.core.formats`: P's gather converts its floats into D's fp8, and every planned byte is D's).

Part of the P role (`kvsvc.service.writing` keeps one per D worker connection); imports kvsvc's core only: no
asyncio, no transport, no I/O. Rules: a request whose P and D blocks are each one run of consecutive ids (one KV
cache group, no prefix held by D) takes the form cached for the runs starting at block 0, shifted by each side's
first block times its block stride (a window stream's destinations by the window's address instead); everything
else is planned, and checked, in full. Cached arrays are read-only, and the cache is bounded by descriptors, not
by entries alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvsvc.core.coalesce import Int64Array
from kvsvc.core.driver import share_refusal
from kvsvc.core.formats import Conversion, as_written, conversion
from kvsvc.core.layout import block_geometry, pool_regions
from kvsvc.core.messages import WorkerMetadata
from kvsvc.core.planner import is_block_run, plan_transfer_arrays
from kvsvc.core.sender import Submit
from kvsvc.core.staging_plans import (
    StagedChunk,
    StagingRule,
    count_runs,
    plan_staged,
    region_ids,
    shift_chunks,
    window_plan,
)

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
