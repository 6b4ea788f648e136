"""Staged writes: gather many small source pieces into a staging region and write each contiguous destination run
with one descriptor, and the allocator that lends the region out.

Pure module: numpy and `kvsvc.coalesce` only (no torch, asyncio, mooncake, no I/O). Rules: a staged plan moves
exactly the bytes of the direct plan it comes from, to the same destination addresses (only the sources change);
pieces keep their order inside each destination run, so a run's staging bytes are its destination bytes in order;
no chunk exceeds the chunk size the caller gives, so every chunk fits the region; a run never crosses from one
destination region into another; whether to stage is `StagingRule`'s decision alone, from descriptor and byte counts.
`RangeAllocator` lends contiguous ranges of one region, never two overlapping ones, and takes them back in any order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvsvc.coalesce import Int64Array

_EMPTY: Int64Array = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class StagingRule:
    """When a plan is staged: when its estimated cost is lower that way.

    Direct: `descriptors × descriptor_cost_s`. Staged: `runs × descriptor_cost_s + bytes × copy_cost_s_per_byte`
    (the gather copies every byte once). The defaults are TCP's measured cost of a descriptor (about 30 us) and a
    memcpy of about 5 GB/s; on RDMA a descriptor costs a few microseconds, so fewer plans are worth staging.

    Raises (constructor):
        ValueError: a negative cost.
    """

    descriptor_cost_s: float = 30e-6
    copy_cost_s_per_byte: float = 0.2e-9

    def __post_init__(self) -> None:
        if self.descriptor_cost_s < 0 or self.copy_cost_s_per_byte < 0:
            raise ValueError(f"costs must be >= 0, got {self.descriptor_cost_s}, {self.copy_cost_s_per_byte}")

    def stage(self, descriptors: int, runs: int, nbytes: int) -> bool:
        """Whether a plan of `descriptors` writing `nbytes` into `runs` contiguous destination runs is staged."""
        if runs >= descriptors:
            return False  # nothing to gather
        direct = descriptors * self.descriptor_cost_s
        return runs * self.descriptor_cost_s + nbytes * self.copy_cost_s_per_byte < direct


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
    "count_runs",
    "destination_runs",
    "plan_staged",
    "region_ids",
]
