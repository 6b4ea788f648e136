"""Vectorised core of the planner: turn (layers x token segments x elements) into maximal byte runs.

Pure module: imports numpy and `kvsvc.core.layout` only (no torch, asyncio, mooncake). Invariants: an element is one
token of one head of one K/V half, `element_bytes` long on both sides; the planner only ever emits runs made of
whole elements it was asked to copy; the output is sorted by source address and no two runs could merge
(source ranges are disjoint, so after sorting a mergeable pair is always adjacent).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvsvc.core.layout import BlockGeometry

Int64Array = npt.NDArray[np.int64]


def merge_runs(
    src: Int64Array, dst: Int64Array, length: Int64Array, region: Int64Array | None = None
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """Sort runs by source address and merge every pair contiguous on both sides; src ranges must be disjoint.

    `region`, when given, is a per-run id of the (source tensor, destination tensor) pair: runs of different
    regions never merge, since a transfer engine may register each tensor as its own memory region and a
    descriptor must lie inside one region on each side.
    """
    if src.size == 0:
        return src, dst, length
    order = np.argsort(src, kind="stable")
    src, dst, length = src[order], dst[order], length[order]
    end_src = src[:-1] + length[:-1]
    end_dst = dst[:-1] + length[:-1]
    starts_run = np.ones(src.size, dtype=bool)
    starts_run[1:] = (end_src != src[1:]) | (end_dst != dst[1:])
    if region is not None:
        region = region[order]
        starts_run[1:] |= region[:-1] != region[1:]
    heads = np.flatnonzero(starts_run)
    return src[heads], dst[heads], np.add.reduceat(length, heads)


MAX_PITCH = (1 << 31) - 1  # the largest pitch a CUDA 2D copy takes on current GPUs (CU_DEVICE_ATTRIBUTE_MAX_PITCH)


def pitched_runs(table: Int64Array, min_rows: int) -> tuple[Int64Array, Int64Array]:
    """Split a descriptor table (rows `(src, dst, length)`, sorted by source) into pitched runs and the rest.

    A pitched run is at least `min_rows` consecutive rows of one length whose sources step by one constant pitch
    and whose destinations by another, each pitch at least the length (rows never overlap) and at most
    `MAX_PITCH`: what one 2D copy moves. A split layout's plan is mostly such runs (a head share of every block,
    layer after layer), which a copy engine moves as one call each instead of one per row. Returns
    `(pitched, rest)`: `pitched` has rows `(src, dst, width, height, src_pitch, dst_pitch)`, `rest` the rows of
    `table` no run took, in their order; together they cover exactly the bytes of `table`. Runs are found in the
    table's order (a plan sorted by source has them), taken greedily from the start, so a row where two runs meet
    goes to the first. `min_rows` below 2 counts as 2; rows of length 0 join no run.
    """
    empty = np.zeros((0, 6), dtype=np.int64)
    min_rows = max(2, min_rows)
    n = len(table)
    if n < min_rows:
        return empty, table
    src, dst, length = table[:, 0], table[:, 1], table[:, 2]
    step_src, step_dst = np.diff(src), np.diff(dst)
    width = length[:-1]
    # Pair j joins rows j and j + 1; a run is a stretch of joinable pairs with one pair of steps.
    joins = (width > 0) & (length[1:] == width) & (step_src >= width) & (step_dst >= width)
    joins &= (step_src <= MAX_PITCH) & (step_dst <= MAX_PITCH)
    same = np.zeros(n - 1, dtype=bool)
    same[1:] = joins[1:] & joins[:-1] & (step_src[1:] == step_src[:-1]) & (step_dst[1:] == step_dst[:-1])
    firsts = np.flatnonzero(joins & ~same)  # the first pair of each stretch
    lasts = np.flatnonzero(joins & ~np.append(same[1:], False))
    # A stretch of k pairs spans k + 1 rows, one of which an earlier stretch may have taken.
    keep = lasts - firsts + 2 >= min_rows
    runs, taken = [], np.zeros(n, dtype=bool)
    free = 0
    for first, last in zip(firsts[keep].tolist(), lasts[keep].tolist(), strict=True):
        start = max(first, free)
        height = last + 2 - start
        if height < min_rows:
            continue
        runs.append((src[start], dst[start], length[start], height, step_src[first], step_dst[first]))
        taken[start : start + height] = True
        free = start + height
    if not runs:
        return empty, table
    return np.array(runs, dtype=np.int64), table[~taken]


def _segment_runs(
    gs: BlockGeometry,
    gd: BlockGeometry,
    src_heads: Int64Array,
    dst_heads: Int64Array,
    slot_src: int,
    slot_dst: int,
    count: int,
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """Runs, relative to the two block starts, that copy `count` tokens from slot `slot_src` to `slot_dst`."""
    halves = np.arange(gs.halves, dtype=np.int64)[:, None, None]
    tokens = np.arange(count, dtype=np.int64)[None, None, :]
    src = halves * gs.half_stride + src_heads[None, :, None] * gs.head_stride + (slot_src + tokens) * gs.token_stride
    dst = halves * gd.half_stride + dst_heads[None, :, None] * gd.head_stride + (slot_dst + tokens) * gd.token_stride
    src, dst = np.broadcast_arrays(src, dst)
    length = np.full(src.size, gs.element_bytes, dtype=np.int64)
    return merge_runs(src.ravel(), dst.ravel(), length)


def _segments(bs_s: int, bs_d: int, num_tokens: int, first_token: int = 0) -> tuple[Int64Array, Int64Array]:
    """Start token and token count of each segment of `[first_token, num_tokens)`: a token range inside one P
    block and one D block."""
    if first_token >= num_tokens:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if bs_s == bs_d and first_token % bs_s == 0:
        starts = np.arange(first_token, num_tokens, bs_s, dtype=np.int64)
    else:
        # Every block boundary of either side after `first_token`, and `first_token` itself.
        inner = np.union1d(
            np.arange(-(-first_token // bs_s) * bs_s, num_tokens, bs_s),
            np.arange(-(-first_token // bs_d) * bs_d, num_tokens, bs_d),
        )
        starts = np.union1d([first_token], inner).astype(np.int64)
    return starts, np.diff(np.append(starts, num_tokens))


def unmerged_run_count(
    gs: BlockGeometry,
    gd: BlockGeometry,
    src_heads: Sequence[int],
    dst_heads: Sequence[int],
    num_layers: int,
    num_tokens: int,
) -> int:
    """Descriptors of a plan that merges inside each (layer, P block, D block) but never across them."""
    starts, counts = _segments(gs.block_size, gd.block_size, num_tokens)
    heads_src = np.asarray(src_heads, dtype=np.int64)
    heads_dst = np.asarray(dst_heads, dtype=np.int64)
    per_pattern: dict[tuple[int, int, int], int] = {}
    total = 0
    for start, count in zip(starts.tolist(), counts.tolist(), strict=True):
        pattern = (start % gs.block_size, start % gd.block_size, count)
        if pattern not in per_pattern:
            per_pattern[pattern] = _segment_runs(gs, gd, heads_src, heads_dst, *pattern)[0].size
        total += per_pattern[pattern]
    return total * num_layers


def plan_runs(
    gs: BlockGeometry,
    gd: BlockGeometry,
    src_heads: Sequence[int],
    dst_heads: Sequence[int],
    src_layer_bases: Sequence[int],
    dst_layer_bases: Sequence[int],
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    num_tokens: int,
    *,
    first_token: int = 0,
    src_one_region: bool = False,
    dst_one_region: bool = False,
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """Maximal runs copying tokens `[first_token, num_tokens)` of the given local heads (paired by position) of
    every layer; token t lies in block `ids[t // block_size]` of each side's list.

    `src_layer_bases[i]` and `dst_layer_bases[i]` are the two sides' addresses of block 0 of the same global layer;
    block b of a layer lies `b * block_stride` after it (a cross-layer pool interleaves layers that way). A token
    segment is a token range inside one source block and one destination block; segments with the same slots
    and length share one intra-block run pattern, so Python work grows with distinct patterns, not tokens.
    Runs never cross from one layer tensor into the next, even where tensors touch, unless that side is one region
    (`*_one_region`: a cross-layer pool).
    """
    bs_s, bs_d = gs.block_size, gd.block_size
    starts, counts = _segments(bs_s, bs_d, num_tokens, first_token)
    if starts.size == 0:
        return starts, starts.copy(), starts.copy()
    block_src, slot_src = np.divmod(starts, bs_s)
    block_dst, slot_dst = np.divmod(starts, bs_d)
    block_off_src = np.asarray(src_block_ids, dtype=np.int64)[block_src] * gs.block_stride
    block_off_dst = np.asarray(dst_block_ids, dtype=np.int64)[block_dst] * gd.block_stride
    bases_src = np.asarray(src_layer_bases, dtype=np.int64)[:, None, None]
    bases_dst = np.asarray(dst_layer_bases, dtype=np.int64)[:, None, None]
    heads_src = np.asarray(src_heads, dtype=np.int64)
    heads_dst = np.asarray(dst_heads, dtype=np.int64)

    key = (slot_src * (bs_d + 1) + slot_dst) * (max(bs_s, bs_d) + 1) + counts
    patterns, which = np.unique(key, return_inverse=True)
    layer_index = np.arange(len(src_layer_bases), dtype=np.int64)[:, None, None]
    # One id per (source tensor, destination tensor): the layer, unless that side is a single region.
    layer_region = (0 if src_one_region else layer_index) * (len(src_layer_bases) + 1) + (
        0 if dst_one_region else layer_index
    )
    parts_src: list[Int64Array] = []
    parts_dst: list[Int64Array] = []
    parts_len: list[Int64Array] = []
    parts_region: list[Int64Array] = []
    for index in range(patterns.size):
        segs = np.flatnonzero(which == index)
        first = int(segs[0])
        rel_src, rel_dst, rel_len = _segment_runs(
            gs, gd, heads_src, heads_dst, int(slot_src[first]), int(slot_dst[first]), int(counts[first])
        )
        src = bases_src + block_off_src[segs][None, :, None] + rel_src[None, None, :]
        dst = bases_dst + block_off_dst[segs][None, :, None] + rel_dst[None, None, :]
        parts_src.append(src.ravel())
        parts_dst.append(dst.ravel())
        parts_len.append(np.broadcast_to(rel_len, src.shape).ravel())
        parts_region.append(np.broadcast_to(layer_region, src.shape).ravel())
    return merge_runs(
        np.concatenate(parts_src), np.concatenate(parts_dst), np.concatenate(parts_len), np.concatenate(parts_region)
    )
