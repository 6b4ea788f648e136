"""Staged writes: gather many small source pieces into a staging region and write each contiguous destination run
with one descriptor; or write into a window of D's staging region that D scatters from; and the allocator that
lends a region out.

Pure module: numpy and the planner only (no torch, asyncio, mooncake, no I/O). Rules: a staged
plan moves exactly the bytes of the direct plan it comes from, to the same destination addresses (only the sources
change); pieces keep their order inside each destination run, so a run's staging bytes are its destination bytes in
order; no chunk exceeds the chunk size the caller gives, so every chunk fits the region; a run never crosses from one
destination region into another; whether to stage is `StagingRule`'s decision alone, from descriptor and byte counts.
`RangeAllocator` lends contiguous ranges of one region, never two overlapping ones, and takes them back in any order.

A window (D-side staging) holds one P worker's share of a request as a stream: the destination bytes that P worker
writes, in destination address order, packed. Both sides derive it from the set of destination bytes alone, which
does not depend on P's block ids, so P (`window_plan`) and D (`scatter_plan`) agree on every byte's place without
sending any layout. A share larger than its window moves in rounds (`window_round_bytes`): round k is stream bytes
`[k R, (k + 1) R)` in half `k % 2` of the window; P writes round k once D emptied round k - 2 (`stream_round` cuts
either side's columns to a round).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from kvsvc.core.errors import TopologyError
from kvsvc.core.formats import converts
from kvsvc.core.layout import Int64Array, pool_regions
from kvsvc.core.messages import WorkerMetadata
from kvsvc.core.planner import MAX_ROUNDS, MIN_ROUND_BYTES, plan_transfer

_EMPTY: Int64Array = np.zeros(0, dtype=np.int64)


class Way(Enum):
    """How one P worker's share for one D worker moves (`StagingRule.way`)."""

    DIRECT = "direct"  # one descriptor per piece contiguous on both sides
    GATHER = "gather"  # P gathers into its region; one descriptor per contiguous D run
    SCATTER = "scatter"  # P writes its source runs into D's window; D scatters into its blocks
    BOTH = "gather+scatter"  # P gathers into its region and writes D's window in one descriptor per chunk

    @property
    def scatters(self) -> bool:
        return self in (Way.SCATTER, Way.BOTH)


@dataclass(frozen=True, slots=True)
class StagingRule:
    """When a plan is staged, and how: the way whose estimated cost is lowest.

    A way costs `descriptor_cost_s` per descriptor, `gather_cost_s_per_byte` per byte P gathers and
    `scatter_cost_s_per_byte` per byte D scatters. The defaults are measured on 2-core CPU engines over TCP: a
    descriptor about 30 us; a gathered byte 0.5 ns (the copy alone costs 0.1-0.2 ns of P's loop, but the chunk's
    first byte waits for its last to be gathered); a scattered byte 1 ns, since D's scatter stands between the last
    byte and D's report, with a window lent and given back around it (docs/decisions.md, "The staging rule is a
    cost model"). With those, a head split whose D blocks are contiguous is gathered on P, and one whose D blocks
    interleave two P workers' heads goes through a window that D scatters: written straight from P's blocks where
    they hold the share in one run per layer, gathered into the window where its pieces lie apart in P too. On RDMA
    a descriptor costs a few microseconds, so fewer plans are worth staging.

    Raises (constructor):
        ValueError: a negative cost.
    """

    descriptor_cost_s: float = 30e-6
    gather_cost_s_per_byte: float = 0.5e-9
    scatter_cost_s_per_byte: float = 1e-9

    def __post_init__(self) -> None:
        costs = (self.descriptor_cost_s, self.gather_cost_s_per_byte, self.scatter_cost_s_per_byte)
        if min(costs) < 0:
            raise ValueError(f"costs must be >= 0, got {costs}")

    def stage(self, descriptors: int, runs: int, nbytes: int) -> bool:
        """Whether P gathers a plan of `descriptors` writing `nbytes` into `runs` contiguous destination runs."""
        if runs >= descriptors:
            return False  # nothing to gather
        direct = descriptors * self.descriptor_cost_s
        return runs * self.descriptor_cost_s + nbytes * self.gather_cost_s_per_byte < direct

    def way(self, descriptors: int, dst_runs: int, src_runs: int, nbytes: int, *, gather: bool, scatter: bool) -> Way:
        """The cheapest way for a share of `nbytes` that goes in `descriptors` direct, in `dst_runs` after a gather
        on P, and in `src_runs` into a window of D's region. `gather` / `scatter`: whether P / D have a region.

        A gather into a window costs one descriptor. A tie keeps the way with fewer copies, direct first.
        """
        gathered, scattered = nbytes * self.gather_cost_s_per_byte, nbytes * self.scatter_cost_s_per_byte
        costs = [(descriptors * self.descriptor_cost_s, Way.DIRECT)]
        if gather:
            costs.append((dst_runs * self.descriptor_cost_s + gathered, Way.GATHER))
        if scatter:
            costs.append((src_runs * self.descriptor_cost_s + scattered, Way.SCATTER))
        if gather and scatter:
            costs.append((self.descriptor_cost_s + gathered + scattered, Way.BOTH))
        best = min(cost for cost, _ in costs)
        return next(way for cost, way in costs if cost == best)


@dataclass(frozen=True, slots=True)
class StagedChunk:
    """One piece of a staged write: copy `gathers` into the staging range lent for it, then write `writes`.

    `gathers` are (source address, offset in the chunk, length); `writes` (offset in the chunk, destination address,
    length). `nbytes` is the chunk's size: what the staging region must lend.
    """

    gather_src: Int64Array
    gather_offset: Int64Array
    gather_length: Int64Array
    write_offset: Int64Array
    write_dst: Int64Array
    write_length: Int64Array
    nbytes: int


def region_ids(addrs: Int64Array, region_starts: Sequence[int]) -> Int64Array:
    """For each address, the index of the region (given by its start address) it lies in, in start order."""
    return np.searchsorted(np.sort(np.asarray(region_starts, dtype=np.int64)), addrs, side="right").astype(np.int64)


def destination_runs(
    dst: Int64Array, length: Int64Array, region: Int64Array | None = None
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """The maximal contiguous destination runs of a plan's writes. `region`, when given, is each write's destination
    region (`region_ids`): a run never crosses from one region into the next, even where they touch, since a
    descriptor must lie inside one registered region.

    Returns (order, run_start, run_length): `order` sorts the writes by destination address; `run_start[i]` is the
    index, in that order, of run i's first write.

    Raises:
        ValueError: two writes overlap in the destination (a planner bug).
    """
    if dst.size == 0:
        return _EMPTY, _EMPTY, _EMPTY
    order = np.argsort(dst, kind="stable")
    d, n = dst[order], length[order]
    ends = d[:-1] + n[:-1]
    if np.any(ends > d[1:]):
        raise ValueError("destination ranges overlap")
    starts = np.ones(d.size, dtype=bool)
    starts[1:] = ends != d[1:]
    if region is not None:
        r = region[order]
        starts[1:] |= r[:-1] != r[1:]
    run_start = np.flatnonzero(starts)
    return order, run_start, np.add.reduceat(n, run_start)


def count_runs(dst: Int64Array, length: Int64Array, region: Int64Array | None = None) -> int:
    """How many contiguous destination runs a plan's writes form: the fewest descriptors a staged write needs.

    Raises:
        ValueError: two writes overlap in the destination.
    """
    return int(destination_runs(dst, length, region)[1].size)


def plan_staged(
    src: Int64Array, dst: Int64Array, length: Int64Array, chunk_bytes: int, region: Int64Array | None = None
) -> list[StagedChunk]:
    """The staged form of a direct plan `(src, dst, length)`: chunks of at most `chunk_bytes`, in destination order.

    Each destination run (`destination_runs`, with `region`) is laid out in a byte stream one after the other; the
    stream is cut every `chunk_bytes` bytes, cutting a run (and a gather piece) where a cut falls. A chunk writes one
    descriptor per run part it holds.

    Raises:
        ValueError: `chunk_bytes` < 1, or two writes overlap in the destination.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    order, run_start, run_length = destination_runs(dst, length, region)
    if order.size == 0:
        return []
    p_src, p_dst, p_len = src[order], dst[order], length[order]
    # Offsets in the stream: pieces follow one another; runs are the same bytes grouped.
    p_off = np.concatenate(([0], np.cumsum(p_len)[:-1])).astype(np.int64)
    r_off, r_dst = p_off[run_start], p_dst[run_start]
    total = int(p_len.sum())
    chunks: list[StagedChunk] = []
    for begin in range(0, total, chunk_bytes):
        end = min(begin + chunk_bytes, total)
        g = _clip(p_off, p_len, begin, end)
        w = _clip(r_off, run_length, begin, end)
        chunks.append(
            StagedChunk(
                gather_src=p_src[g[0]] + g[1],
                gather_offset=p_off[g[0]] + g[1] - begin,
                gather_length=g[2],
                write_offset=r_off[w[0]] + w[1] - begin,
                write_dst=r_dst[w[0]] + w[1],
                write_length=w[2],
                nbytes=end - begin,
            )
        )
    return chunks


def shift_chunks(chunks: Sequence[StagedChunk], src_shift: int, dst_shift: int) -> list[StagedChunk]:
    """The staged form of a plan whose every source address moved by `src_shift` and destination by `dst_shift`,
    from the staged form `chunks` of the unmoved plan: equal to `plan_staged` of the moved plan as long as no run
    changes region (a shift keeps the destination order, which ranges touch, and every byte's stream offset)."""
    if not (src_shift or dst_shift):
        return list(chunks)
    return [replace(c, gather_src=c.gather_src + src_shift, write_dst=c.write_dst + dst_shift) for c in chunks]


def stream_offsets(dst: Int64Array, length: Int64Array) -> tuple[Int64Array, Int64Array]:
    """The window stream of a share: (order, offset), `order` sorting the pieces by destination address and
    `offset[i]` the stream offset of piece `order[i]`."""
    order = np.argsort(dst, kind="stable")
    n = length[order]
    return order, np.concatenate(([0], np.cumsum(n)[:-1])).astype(np.int64) if n.size else _EMPTY


def window_plan(
    src: Int64Array, dst: Int64Array, length: Int64Array, window: int, src_region: Int64Array | None = None
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """P's side of a window: the plan `(src, dst, length)` rewritten to write each piece at its stream offset in
    the window at address `window`, pieces that follow each other in both P's memory and the stream merged into one
    descriptor (never across P's registered tensors, given as `src_region`, see `region_ids`).

    Returns the merged (src, window address, length) columns, in stream order.
    """
    if src.size == 0:
        return _EMPTY, _EMPTY, _EMPTY
    order, offset = stream_offsets(dst, length)
    s, n = src[order], length[order]
    starts = np.ones(s.size, dtype=bool)
    starts[1:] = s[:-1] + n[:-1] != s[1:]
    if src_region is not None:
        r = src_region[order]
        starts[1:] |= r[:-1] != r[1:]
    first = np.flatnonzero(starts)
    return s[first], window + offset[first], np.add.reduceat(n, first)


def scatter_plan(
    dst: Int64Array, length: Int64Array, region: Int64Array | None = None
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """D's side of a window: (stream offset, destination address, length) of each contiguous destination run the
    share's pieces form (inside one of D's registered tensors, `region`), in stream order; the scatter copies
    each from the window to its place.

    Raises:
        ValueError: two pieces overlap in the destination.
    """
    order, run_start, run_length = destination_runs(dst, length, region)
    if order.size == 0:
        return _EMPTY, _EMPTY, _EMPTY
    offset = np.concatenate(([0], np.cumsum(length[order])[:-1])).astype(np.int64)
    return offset[run_start], dst[order][run_start], run_length


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """What D needs to lend a window for one P worker's share: the share's size, the window's (smaller when the share
    moves in rounds), and the scatter that empties it, as (stream offset, destination address, length) columns
    (`scatter_plan`)."""

    nbytes: int
    window_bytes: int
    offset: Int64Array
    dst: Int64Array
    length: Int64Array
    way: Way


def plan_window(
    p: WorkerMetadata,
    d: WorkerMetadata,
    block_ids: Sequence[int],
    num_tokens: int,
    first_token: int,
    rule: StagingRule,
    max_bytes: int,
) -> WindowPlan | None:
    """D's decision for one request to P worker `p`: the window to lend when `rule` sends the share through D
    (`Way.scatters`), of the share's size or `max_bytes` when the share is larger (it then moves in rounds); None
    when P should write the blocks (or will refuse the request, which it does with the reason). P's gather is
    counted on when `p` published a staging region.

    P's block ids do not change which of D's bytes it writes, so D plans with any `num_tokens` of them. A P that
    does not accept windows (`WorkerMetadata.accepts_windows`: one that predates them) gets none.
    """
    if not p.accepts_windows or converts(p, d):
        return None  # D's scatter would copy P's bytes as they are: a converting P writes D's blocks itself
    n_src = -(-num_tokens // p.block_size)
    try:
        plan = plan_transfer(p, d, range(n_src), block_ids, num_tokens, first_token=first_token)
    except (TopologyError, ValueError):
        return None
    if len(plan) < 2:
        return None
    table = np.asarray(plan, dtype=np.int64).reshape(-1, 3)
    src, dst, length = table[:, 0], table[:, 1], table[:, 2]
    nbytes = int(length.sum())
    if nbytes > max_bytes and (max_bytes // 2 < MIN_ROUND_BYTES or -(-nbytes // (max_bytes // 2)) > MAX_ROUNDS):
        return None  # too many rounds: P would refuse the window
    dst_region = region_ids(dst, [start for start, _ in pool_regions(d)])
    src_runs = window_plan(src, dst, length, 0, region_ids(src, [start for start, _ in pool_regions(p)]))[0].size
    dst_runs = count_runs(dst, length, dst_region)
    way = rule.way(len(plan), dst_runs, src_runs, nbytes, gather=p.staging_size > 0, scatter=True)
    if not way.scatters:
        return None
    return WindowPlan(nbytes, min(nbytes, max_bytes), *scatter_plan(dst, length, dst_region), way)


def window_round_bytes(share: int, window: int) -> int:
    """The bytes of one round of a `share`-byte stream through a `window`-byte window: the whole share when it fits,
    else half the window (so P fills one half while D empties the other).

    Raises:
        ValueError: an empty share, or a window of under 2 bytes that does not hold the share.
    """
    if share < 1 or (share > window and window < 2):
        raise ValueError(f"a share of {share} bytes cannot move through a window of {window}")
    return share if share <= window else window // 2


def window_rounds(share: int, window: int) -> int:
    """How many rounds a `share`-byte stream takes through a `window`-byte window (`window_round_bytes`)."""
    return -(-share // window_round_bytes(share, window))


def stream_round(
    offset: Int64Array, other: Int64Array, length: Int64Array, index: int, round_bytes: int
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """The part of a stream's pieces in round `index`: pieces at stream `offset` with `length` bytes, paired with
    `other` addresses (P's sources, or D's destinations), cut to `[index R, (index + 1) R)`.

    Returns (other address, offset in the round, length) of each part, in stream order.
    """
    begin = index * round_bytes
    kept, skip, part = _clip(offset, length, begin, begin + round_bytes)
    return other[kept] + skip, offset[kept] + skip - begin, part


def _clip(offset: Int64Array, length: Int64Array, begin: int, end: int) -> tuple[Int64Array, Int64Array, Int64Array]:
    """(index, skip, kept length) of the intervals `[offset, offset + length)` that meet `[begin, end)`."""
    lo = np.maximum(offset, begin)
    hi = np.minimum(offset + length, end)
    index = np.flatnonzero(hi > lo)
    return index, (lo - offset)[index], (hi - lo)[index]


class RangeAllocator:
    """Lends contiguous ranges of a region of `capacity` bytes, first fit: the lowest free gap that holds the size.
    A range comes back whenever it is freed, in any order, so one range held long (a write to a frozen peer,
    waiting for its drain) keeps only its own bytes. Pure bookkeeping: the service waits for room, this only says
    where there is some.

    Raises (constructor):
        ValueError: `capacity` < 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"staging capacity must be >= 1 byte, got {capacity}")
        self.capacity = capacity
        self._lent: dict[int, int] = {}  # offset -> size
        self.in_use = 0

    def allocate(self, size: int) -> int | None:
        """The offset of a free range of `size` bytes, now lent; None when no gap holds it yet.

        Raises:
            ValueError: `size` < 1 or larger than the region (it would never fit).
        """
        if not 0 < size <= self.capacity:
            raise ValueError(f"cannot lend {size} bytes from a staging region of {self.capacity}")
        at = 0
        for offset in sorted(self._lent):
            if offset - at >= size:
                break
            at = offset + self._lent[offset]
        else:
            if self.capacity - at < size:
                return None
        self._lent[at] = size
        self.in_use += size
        return at

    def free(self, offset: int) -> None:
        """Give back the range lent at `offset`.

        Raises:
            KeyError: nothing is lent at `offset` (or it was freed already).
        """
        size = self._lent.pop(offset, None)
        if size is None:
            raise KeyError(f"no staging range lent at offset {offset}")
        self.in_use -= size


__all__ = [
    "RangeAllocator",
    "StagedChunk",
    "StagingRule",
    "Way",
    "WindowPlan",
    "count_runs",
    "destination_runs",
    "plan_staged",
    "plan_window",
    "region_ids",
    "scatter_plan",
    "shift_chunks",
    "stream_offsets",
    "stream_round",
    "window_plan",
    "window_round_bytes",
    "window_rounds",
]
