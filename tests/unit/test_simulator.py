"""Byte-exact simulator (docs/design.md, "Testing"): apply every (P worker, D worker) plan with memmove and check
every D byte.

Each side may use per-layer tensors (HND, NHD, MLA) or the cross-layer pool, chosen per side. P pools hold a known
code per (layer, half, head, token) in each element (two int64 words); D pools start as a sentinel. After all plans
ran: each slot D needs holds P's code and was written once; the slots of the last D block past `num_tokens`
(whole-block copies) hold P's code or the sentinel; every other byte is untouched.

A hybrid model (`window` > 0) makes the odd layers one or more sliding-window groups with block lists of their own,
which hold vLLM's null block where the window has passed on each side, as often as it has passed a block (vLLM's
rule on D; on P that rule or fewer null blocks, as a P that has not yet dropped them): D then needs only the tokens
its next step reads, may get the rest of its kept blocks, and its null block is never written. With `chunked` those
groups are chunked local attention instead (Llama 4), of chunks of `window` tokens: D needs its chunk from the
chunk's start.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsvc.cli.plan import synthetic_engine
from kvsvc.core.groups import CHUNKED_LOCAL, FULL, SLIDING_WINDOW, KVGroup, blocks_to_move
from kvsvc.core.layout import (
    CROSS_LAYER,
    FUSED,
    block_geometry,
    heads_of_rank,
    is_fused,
    layer_addrs,
    pool_regions,
)
from kvsvc.core.messages import WorkerMetadata
from kvsvc.core.planner import expected_destinations, is_source, plan_transfer, release_notifier, sources_of

SENTINEL = 0xAB
MAGIC = 0x5A5A_5A5A_5A5A
JUNK = -7  # P slots outside the request: a plan that reads them shows up as a wrong value
Engine = dict[tuple[int, int], WorkerMetadata]
U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]


def code(layer: int | I64, half: int | I64, head: int | I64, token: int | I64, heads: int) -> I64:
    return np.asarray(((layer * 2 + half) * heads + head) * (1 << 24) + token, dtype=np.int64)


@dataclass
class Layouts:
    """One scenario: both engines and the request's block ids on each."""

    p_pp: int = 1
    p_tp: int = 1
    d_pp: int = 1
    d_tp: int = 1
    layers: int = 4
    heads: int = 8
    p_block: int = 16
    d_block: int = 16
    tokens: int = 64
    first: int = 0  # D holds tokens [0, first) already (its prefix cache): they must stay untouched
    mla: bool = False
    layout: str = "HND"  # both sides, unless p_layout or d_layout says otherwise
    p_layout: str | None = None
    d_layout: str | None = None
    p_split: list[tuple[int, int]] | None = None
    d_split: list[tuple[int, int]] | None = None
    p_ids: list[int] | None = None
    d_ids: list[int] | None = None
    layer_gap: int = 64
    extra_blocks: int = 3
    whole_blocks: bool = True
    window: int = 0  # > 0: the odd layers are sliding-window groups of this many tokens
    window_groups: int = 1  # how many sliding-window groups the odd layers make (vLLM groups layers by count)
    p_drops: bool = True  # P's lists hold the null block as vLLM's rule says, or only before the blocks kvsvc moves
    chunked: bool = False  # the window groups are chunked local attention of chunks of `window` tokens


def _first_read(s: Layouts) -> int:
    """The first token D's next step reads in a window group, written out apart from `kvsvc.core.groups`: the query of
    token `tokens` attends to the `window - 1` tokens before it, or to its chunk from the chunk's start."""
    return s.tokens // s.window * s.window if s.chunked else max(0, s.tokens - s.window + 1)


def _window_kind(s: Layouts, layers: list[int]) -> KVGroup:
    """A window group of the case over `layers`: a sliding window, or chunked local attention."""
    if s.chunked:
        return KVGroup(kind=CHUNKED_LOCAL, layers=layers, attention_chunk=s.window)
    return KVGroup(kind=SLIDING_WINDOW, layers=layers, sliding_window=s.window)


NULL = 0  # vLLM's null block: a hybrid case's block lists never use it for a token


def _list_of(layer: int, s: Layouts) -> int:
    """The block list (and KV cache group) of `layer`: 0 for the full-attention layers, then one per window group."""
    return 1 + (layer // 2) % s.window_groups if s.window and layer % 2 else 0


def _groups(s: Layouts, start: int, end: int) -> list[KVGroup]:
    """The hybrid case's KV cache groups, as a worker holding layers `[start, end)` publishes them."""
    layers = range(start, end)
    return [KVGroup(kind=FULL, layers=[i for i in layers if _list_of(i, s) == 0])] + [
        _window_kind(s, [i for i in layers if _list_of(i, s) == g]) for g in range(1, s.window_groups + 1)
    ]


def _window_ids(full: list[int], block: int, s: Layouts, group: int, vllm_rule: bool) -> list[int]:
    """Sliding-window group `group`'s list beside `full`: fresh ids for the blocks it keeps, the null block before
    (vLLM's rule: every block whose tokens all lie before the first token D's next step reads; else fewer)."""
    kind = _window_kind(s, [1])
    if vllm_rule:
        kept = range(_first_read(s) // block, len(full))
    else:
        kept = blocks_to_move(kind, len(full), block, s.tokens) if s.tokens else range(0)
    top = max(full, default=0) + 1 + group * len(full)
    fresh = iter(range(top, top + len(full)))
    return [next(fresh) if i in kept else NULL for i in range(len(full))]


def _engine(
    name: str, s: Layouts, pp: int, tp: int, block: int, ids: list[int], split: object, layout: str | None
) -> Engine:
    head_size = 8  # element = 16 bytes of float16: two int64 words
    engine = synthetic_engine(
        name,
        pp_size=pp,
        tp_size=tp,
        num_layers=s.layers,
        num_kv_heads=1 if s.mla else s.heads,
        head_size=head_size,
        dtype="float16",
        block_size=block,
        num_blocks=max(ids, default=0) + 1 + s.extra_blocks,
        layout=layout or s.layout,
        is_mla=s.mla,
        layer_split=split,  # type: ignore[arg-type]
        base_addr=128,
        layer_gap=s.layer_gap,
    )
    if not s.window:
        return engine
    return {
        key: msgspec.structs.replace(meta, kv_groups=_groups(s, meta.start_layer, meta.end_layer), null_block=NULL)
        for key, meta in engine.items()
    }


def _bytes(arena: U8, meta: WorkerMetadata, local_layer: int) -> U8:
    """One layer's KV as a strided view of `arena` with axes (block, half, head, slot, byte), whatever the layout:
    the strides are the planner's own geometry, so every layout is read the way the tensors hold it."""
    g = block_geometry(meta)
    base = layer_addrs(meta)[local_layer]
    shape = (meta.num_blocks, g.halves, g.local_heads, g.block_size, g.element_bytes)
    strides = (g.block_stride, g.half_stride, g.head_stride, g.token_stride, 1)
    view: U8 = np.lib.stride_tricks.as_strided(arena[base:], shape=shape, strides=strides, writeable=True)
    return view


def _view(arena: U8, meta: WorkerMetadata, local_layer: int) -> I64:
    return _bytes(arena, meta, local_layer).view(np.int64)


def _arena_size(engine: Engine) -> int:
    return max(start + size for m in engine.values() for start, size in pool_regions(m)) + 256


def _slot_index(meta: WorkerMetadata, ids: list[int]) -> I64:
    """Token held by each (block, slot) of the pool for this request; -1 outside it (and in the null block of a
    hybrid case's sliding-window list)."""
    pos = np.full(meta.num_blocks, -1, dtype=np.int64)
    pos[np.asarray(ids, dtype=np.int64)] = np.arange(len(ids))
    if meta.kv_groups:
        pos[NULL] = -1
    token = pos[:, None] * meta.block_size + np.arange(meta.block_size)[None, :]
    return np.where(pos[:, None] >= 0, token, -1)


def _codes(meta: WorkerMetadata, ids: list[int], layer: int, heads: int) -> I64:
    """Code of every element of one layer, axes (block, half, head, slot) as `_bytes` has them."""
    token = _slot_index(meta, ids)[:, None, None, :]  # (nb, 1, 1, bs)
    if meta.is_mla:
        return np.asarray(code(layer, 0, 0, token, 1), dtype=np.int64)
    local = np.asarray(heads_of_rank(meta.tp_rank, meta.tp_size, heads), dtype=np.int64)[None, None, :, None]
    half = np.arange(block_geometry(meta).halves)[None, :, None, None]
    shape = (token.shape[0], half.size, local.size, token.shape[-1])
    return np.broadcast_to(code(layer, half, local, token, heads), shape)


def simulate(s: Layouts) -> int:
    """Run every pair's plan; assert the simulator's properties; return the number of descriptors."""
    p_need = -(-s.tokens // s.p_block)
    d_need = -(-s.tokens // s.d_block)
    p_ids = s.p_ids if s.p_ids is not None else list(range(p_need))
    d_ids = s.d_ids if s.d_ids is not None else list(range(d_need))
    p_lists, d_lists = [p_ids], [d_ids]
    if s.window:  # the null block is no token's: the full group's ids start at 1
        p_ids, d_ids = [i + 1 for i in p_ids], [i + 1 for i in d_ids]
        groups = range(s.window_groups)
        p_lists = [p_ids] + [_window_ids(p_ids, s.p_block, s, g, s.p_drops) for g in groups]
        d_lists = [d_ids] + [_window_ids(d_ids, s.d_block, s, g, True) for g in groups]
    p_flat, d_flat = [b for ids in p_lists for b in ids], [b for ids in d_lists for b in ids]
    p_engine = _engine("P", s, s.p_pp, s.p_tp, s.p_block, p_flat, s.p_split, s.p_layout)
    d_engine = _engine("D", s, s.d_pp, s.d_tp, s.d_block, d_flat, s.d_split, s.d_layout)
    heads = 1 if s.mla else s.heads
    p_arena = np.zeros(_arena_size(p_engine), dtype=np.uint8)
    for meta in p_engine.values():
        for i, layer in enumerate(range(meta.start_layer, meta.end_layer)):
            codes = _codes(meta, p_lists[_list_of(layer, s)], layer, heads)
            view = _view(p_arena, meta, i)
            view[..., 0] = np.where(codes >= 0, codes, JUNK)
            view[..., 1:] = (view[..., 0] ^ MAGIC)[..., None]
    d_arena = np.full(_arena_size(d_engine), SENTINEL, dtype=np.uint8)
    writes = np.zeros(d_arena.size, dtype=np.uint8)

    descriptors = 0
    for p_key, p_meta in sorted(p_engine.items()):
        regions = [(b, b + size) for b, size in pool_regions(p_meta)]
        for d_key, d_meta in sorted(d_engine.items()):
            plan = plan_transfer(
                p_meta, d_meta, p_flat, d_flat, s.tokens, whole_blocks=s.whole_blocks, first_token=s.first
            )
            assert not plan or is_source(p_meta, d_meta), (p_key, d_key)
            # A window that has passed every block of D's list needs nothing (D's next step reads its own token).
            assert plan or s.window or not (is_source(p_meta, d_meta) and s.tokens > s.first), (p_key, d_key)
            assert plan == sorted(plan), "plans are sorted by source address"
            d_regions = [(b, b + size) for b, size in pool_regions(d_meta)]
            for a, b in itertools.pairwise(plan):
                mergeable = (
                    a.src_addr + a.length == b.src_addr
                    and a.dst_addr + a.length == b.dst_addr
                    and _region(a.src_addr, regions) == _region(b.src_addr, regions)
                    and _region(a.dst_addr, d_regions) == _region(b.dst_addr, d_regions)
                )
                assert not mergeable, (a, b)
            for src, dst, length in plan:
                assert length > 0
                assert _inside(src, length, regions), "P reads outside its own KV tensors"
                assert _inside(dst, length, d_regions), "P writes outside the D worker's KV tensors"
                d_arena[dst : dst + length] = p_arena[src : src + length]
                writes[dst : dst + length] += 1
            descriptors += len(plan)

    checked = np.zeros(d_arena.size, dtype=bool)
    last_end = d_need * s.d_block  # tokens up to here sit in listed D blocks
    for d_meta in d_engine.values():
        for start, size in pool_regions(d_meta):
            checked[start : start + size] = True
        for i, layer in enumerate(range(d_meta.start_layer, d_meta.end_layer)):
            expected = _codes(d_meta, d_lists[_list_of(layer, s)], layer, heads)
            token = expected & ((1 << 24) - 1)
            got = _view(d_arena, d_meta, i)
            count = _bytes(writes, d_meta, i)
            listed = expected >= 0
            # A window layer needs the tokens D's next step reads; the rest of its kept blocks may come too.
            needed = max(s.first, _first_read(s)) if _list_of(layer, s) else s.first
            required = listed & (token >= needed) & (token < s.tokens)
            optional = listed & (((token >= s.first) & (token < needed)) | ((token >= s.tokens) & (token < last_end)))
            untouched = ~(required | optional)
            assert (got[..., 0][required] == expected[required]).all(), f"D layer {layer}: wrong or missing KV"
            assert (got[..., 1:][required] == (expected[required] ^ MAGIC)[:, None]).all()
            assert (count[required] == 1).all(), f"D layer {layer}: required byte written != once"
            tail_written = (count[optional] == 1).all(axis=-1)
            tail_clean = (count[optional] == 0).all(axis=-1)
            assert (tail_written | tail_clean).all()
            assert (got[..., 0][optional][tail_written] == expected[optional][tail_written]).all()
            assert (count[untouched] == 0).all(), f"D layer {layer}: wrote a slot it must not"
            assert (_bytes(d_arena, d_meta, i)[untouched] == SENTINEL).all()
            if is_fused(d_meta):  # an opaque chunk is written whole: every slot of a listed block, or none
                slots = (count > 0).all(axis=-1)
                assert (slots.all(axis=-1) == slots.any(axis=-1))[listed.any(axis=-1)].all(), "a fused chunk was cut"
    assert (writes[~checked] == 0).all() and (d_arena[~checked] == SENTINEL).all(), "wrote between tensors"
    _check_routing(p_engine, d_engine)
    return descriptors


def _inside(addr: int, length: int, regions: list[tuple[int, int]]) -> bool:
    # One region per tensor as a transfer engine may register them: a run never crosses into the next tensor.
    return _region(addr, regions) == _region(addr + length - 1, regions) != -1


def _region(addr: int, regions: list[tuple[int, int]]) -> int:
    return next((i for i, (lo, hi) in enumerate(sorted(regions)) if lo <= addr < hi), -1)


def _check_routing(p_engine: Engine, d_engine: Engine) -> None:
    for d_key, d_meta in d_engine.items():
        srcs = sources_of(d_meta, p_engine)
        assert srcs, f"D worker {d_key} has no source"
        for p_key in srcs:
            assert d_key in expected_destinations(p_engine[p_key], d_engine)
    for p_meta in p_engine.values():
        notifier = release_notifier(p_meta, d_engine)
        if expected_destinations(p_meta, d_engine):
            assert notifier is None
        else:
            assert notifier is not None
            d_meta = d_engine[notifier]
            assert max(d_meta.start_layer, p_meta.start_layer) < min(d_meta.end_layer, p_meta.end_layer)


CASES = {
    "same layout": Layouts(),
    "P tp2 -> D tp4": Layouts(p_tp=2, d_tp=4),
    "P tp4 -> D tp2": Layouts(p_tp=4, d_tp=2),
    "K=4 P tp8 -> D tp1": Layouts(heads=4, p_tp=8, d_tp=1),
    "K=4 P tp1 -> D tp8": Layouts(heads=4, p_tp=1, d_tp=8),
    "K=4 P tp8 -> D tp2": Layouts(heads=4, p_tp=8, d_tp=2),
    "P pp2 -> D pp1": Layouts(p_pp=2, layers=6),
    "P pp1 -> D pp2": Layouts(d_pp=2, layers=6),
    "P pp3 tp2 -> D pp2 tp4, 7 layers": Layouts(p_pp=3, p_tp=2, d_pp=2, d_tp=4, layers=7),
    "explicit uneven splits": Layouts(
        p_pp=2, d_pp=3, layers=7, p_split=[(0, 1), (1, 7)], d_split=[(0, 3), (3, 4), (4, 7)]
    ),
    "block 16 -> 32": Layouts(p_block=16, d_block=32, p_tp=2, d_tp=4),
    "block 32 -> 16": Layouts(p_block=32, d_block=16, p_tp=4, d_tp=2),
    "block 16 -> 24, partial": Layouts(p_block=16, d_block=24, tokens=61, p_tp=2, d_tp=1),
    "MLA P tp4 -> D tp2 with PP": Layouts(mla=True, p_tp=4, d_tp=2, d_pp=2, layers=5),
    "MLA P tp1 pp2 -> D tp4": Layouts(mla=True, p_tp=1, p_pp=2, d_tp=4, layers=4),
    "MLA block 32 -> 16": Layouts(mla=True, p_block=32, d_block=16, tokens=50),
    "partial last block": Layouts(tokens=37),
    "partial last block, head split": Layouts(tokens=37, p_tp=1, d_tp=2),
    "partial last block, no whole-block copy": Layouts(tokens=37, whole_blocks=False),
    "scattered block ids": Layouts(tokens=80, p_ids=[9, 3, 4, 5, 0], d_ids=[2, 7, 8, 1, 0], p_tp=2, d_tp=4),
    "NHD, no head split": Layouts(layout="NHD", p_tp=2, d_tp=2, d_block=32, tokens=45),
    "NHD, replicated heads": Layouts(layout="NHD", heads=2, p_tp=2, d_tp=4),
    "touching layer tensors": Layouts(layer_gap=0, extra_blocks=0, tokens=64),  # runs stop at each tensor's end
    "zero tokens": Layouts(tokens=0, p_ids=[], d_ids=[]),
    "cross-layer both sides": Layouts(layout=CROSS_LAYER, tokens=61),
    "cross-layer both, scattered ids": Layouts(
        layout=CROSS_LAYER, tokens=80, p_ids=[9, 3, 4, 5, 0], d_ids=[2, 7, 8, 1, 0], p_tp=2, d_tp=4
    ),
    "cross-layer P -> HND D": Layouts(p_layout=CROSS_LAYER, tokens=45, p_ids=[3, 1, 2], d_ids=[0, 4, 5]),
    "HND P -> cross-layer D": Layouts(d_layout=CROSS_LAYER, tokens=45),
    "cross-layer P -> NHD D, one head per rank": Layouts(p_layout=CROSS_LAYER, d_layout="NHD", heads=2, p_tp=2, d_tp=2),
    "NHD P -> cross-layer D, replicated": Layouts(p_layout="NHD", d_layout=CROSS_LAYER, heads=2, p_tp=4, d_tp=8),
    "cross-layer head split P tp2 -> D tp4": Layouts(layout=CROSS_LAYER, p_tp=2, d_tp=4, tokens=37),
    "cross-layer head gather P tp4 -> D tp1": Layouts(p_layout=CROSS_LAYER, p_tp=4, d_tp=1),
    "cross-layer PP change P pp3 -> D pp2": Layouts(layout=CROSS_LAYER, p_pp=3, d_pp=2, p_tp=2, d_tp=4, layers=7),
    "cross-layer D pp2 <- HND P pp1": Layouts(d_layout=CROSS_LAYER, d_pp=2, layers=5),
    "cross-layer uneven splits": Layouts(
        layout=CROSS_LAYER, p_pp=2, d_pp=3, layers=7, p_split=[(0, 1), (1, 7)], d_split=[(0, 3), (3, 4), (4, 7)]
    ),
    "cross-layer block 16 -> 24, partial": Layouts(layout=CROSS_LAYER, p_block=16, d_block=24, tokens=61, p_tp=2),
    "cross-layer block 32 -> 16 vs HND": Layouts(p_layout=CROSS_LAYER, p_block=32, d_block=16, tokens=50, d_tp=2),
    "cross-layer no whole-block copy": Layouts(layout=CROSS_LAYER, tokens=37, whole_blocks=False),
    "MLA cross-layer both, PP": Layouts(mla=True, layout=CROSS_LAYER, p_tp=4, d_tp=2, d_pp=2, layers=5),
    "MLA cross-layer P -> per-layer D": Layouts(mla=True, p_layout=CROSS_LAYER, p_block=32, d_block=16, tokens=50),
    "cross-layer pools touching": Layouts(layout=CROSS_LAYER, layer_gap=0, extra_blocks=0, p_tp=2, d_tp=2),
    "KV_NHD (FlashAttention), no head split": Layouts(layout="KV_NHD", p_tp=2, d_tp=2, tokens=45),
    "KV_NHD P -> NHD D, replicated": Layouts(p_layout="KV_NHD", d_layout="NHD", heads=2, p_tp=2, d_tp=4),
    "KV_HND head split P tp1 -> D tp2": Layouts(layout="KV_HND", p_tp=1, d_tp=2, tokens=37),
    "KV_HND P -> HND D, block 16 -> 32": Layouts(p_layout="KV_HND", d_layout="HND", d_block=32, tokens=50),
    "HND P -> KV_HND D, head gather": Layouts(p_layout="HND", d_layout="KV_HND", p_tp=4, d_tp=1, tokens=61),
    "cross-layer P -> KV_HND D": Layouts(p_layout=CROSS_LAYER, d_layout="KV_HND", p_tp=2, d_tp=4, tokens=33),
    "HNC (vLLM 0.32 GPU) head split": Layouts(layout="HNC", p_tp=1, d_tp=2, tokens=37),
    "HNC P -> HND D, block 16 -> 32": Layouts(p_layout="HNC", d_layout="HND", d_block=32, tokens=50, p_tp=2),
    "NHC, no head split, partial": Layouts(layout="NHC", p_tp=2, d_tp=2, tokens=45),
    "NHC P -> KV_NHD D, replicated": Layouts(p_layout="NHC", d_layout="KV_NHD", heads=2, p_tp=2, d_tp=4),
    "D holds a prefix already": Layouts(tokens=61, first=32, p_tp=2, d_tp=4),
    "D holds a prefix, blocks 16 -> 24": Layouts(tokens=61, first=24, p_block=16, d_block=24),
    "D holds a prefix, cross-layer, scattered": Layouts(
        layout=CROSS_LAYER, tokens=80, first=48, p_ids=[9, 3, 4, 5, 0], d_ids=[2, 7, 8, 1, 0]
    ),
    "D holds every token": Layouts(tokens=48, first=48),
    "fused, D holds a prefix": Layouts(layout=FUSED, tokens=50, first=32, p_tp=1, d_tp=2),
    "fused (vLLM CPU)": Layouts(layout=FUSED, tokens=64),
    "fused, partial last block": Layouts(layout=FUSED, tokens=37, whole_blocks=False),
    "fused head split P tp1 -> D tp2, partial": Layouts(layout=FUSED, p_tp=1, d_tp=2, tokens=37),
    "fused head gather P tp4 -> D tp1, scattered": Layouts(
        layout=FUSED, p_tp=4, d_tp=1, tokens=70, p_ids=[9, 3, 4, 5, 0], d_ids=[2, 7, 8, 1, 0]
    ),
    "fused, replicated heads, PP change": Layouts(layout=FUSED, heads=2, p_tp=1, d_tp=4, d_pp=2, layers=5, tokens=20),
    "sliding window (vLLM CPU)": Layouts(layout=FUSED, window=40, tokens=150),
    "sliding window, head split": Layouts(window=20, tokens=100, p_tp=1, d_tp=2),
    "sliding window, blocks 16 -> 24, PP change": Layouts(window=30, tokens=97, d_block=24, d_pp=2, layers=6),
    "sliding window wider than the prompt": Layouts(window=500, tokens=61),
    "sliding window, D holds a prefix": Layouts(window=16, tokens=90, first=80, p_tp=2, d_tp=1),
    "two sliding-window groups, several null blocks": Layouts(
        layout=FUSED, window=96, window_groups=2, tokens=250, p_block=64, d_block=64, layers=6
    ),
    "two window groups, blocks 32 -> 48, window ends on a block": Layouts(
        window=96, window_groups=2, tokens=223, p_block=32, d_block=48, layers=6, p_tp=2, d_tp=1
    ),
    "chunked local (vLLM CPU)": Layouts(layout=FUSED, window=64, chunked=True, tokens=150),
    "chunked local, a chunk starts at the last token": Layouts(window=64, chunked=True, tokens=128, p_tp=2, d_tp=1),
    "chunked local, blocks 16 -> 24, head split, PP change": Layouts(
        window=48, chunked=True, tokens=97, d_block=24, p_tp=1, d_tp=2, d_pp=2, layers=6
    ),
    "chunked local, D holds a prefix": Layouts(window=32, chunked=True, tokens=90, first=80),
    "two chunked groups, chunks shorter than a block": Layouts(
        window=24, chunked=True, window_groups=2, tokens=223, p_block=32, d_block=16, layers=6
    ),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_every_d_byte_is_written_once_with_the_right_kv(case: Layouts) -> None:
    simulate(case)


def test_a_sliding_window_layer_moves_its_window_only() -> None:
    # 4 layers of 10 blocks of 16 tokens: the full layers move 10 blocks each, the window of 40 tokens 3 (its reads
    # start at token 120, in block 7).
    case = Layouts(layout=FUSED, window=40, tokens=160)
    simulate(case)
    p, d = (_engine(side, case, 1, 1, 16, list(range(21)), None, None)[(0, 0)] for side in "PD")
    full, window = list(range(1, 11)), [0] * 6 + list(range(11, 15))
    plan = plan_transfer(p, d, full + window, full + window, 160)
    assert sum(r.length for r in plan) == (2 * 10 + 2 * 3) * block_geometry(p).block_bytes


def test_whole_blocks_merge_k_and_v_of_a_partial_last_block() -> None:
    fewer = simulate(Layouts(tokens=37))
    more = simulate(Layouts(tokens=37, whole_blocks=False))
    assert fewer < more


def test_runs_never_cross_from_one_layer_tensor_into_the_next_even_where_they_touch() -> None:
    # Each tensor may be its own registered memory region (and RDMA cannot span two): one run per layer.
    assert simulate(Layouts(layer_gap=0, extra_blocks=0, tokens=64, layers=4)) == 4


def test_cross_layer_pools_move_contiguous_blocks_of_all_layers_in_one_descriptor() -> None:
    assert simulate(Layouts(layout=CROSS_LAYER, tokens=61, layers=6)) == 1
    assert simulate(Layouts(layout=CROSS_LAYER, mla=True, tokens=64, layers=6)) == 1
    # Two runs of blocks contiguous on both sides: ids 3,4 -> 6,7 and 0 -> 1.
    assert simulate(Layouts(layout=CROSS_LAYER, tokens=48, p_ids=[3, 4, 0], d_ids=[6, 7, 1])) == 2


def test_cross_layer_pp_change_is_one_descriptor_per_block_and_stage_slice() -> None:
    # D's blocks interleave the layers of P's two stages, so each P stage writes one slice per D block.
    assert simulate(Layouts(layout=CROSS_LAYER, p_pp=2, layers=6, tokens=64)) == 2 * 4
    # Mixed layouts cannot merge across layers: one run per (layer, block).
    assert simulate(Layouts(p_layout=CROSS_LAYER, layers=3, tokens=64)) == 3 * 4


@st.composite
def layouts(draw: st.DrawFn) -> Layouts:
    mla = draw(st.booleans())
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    tps = [1, 2, 4, 8]
    p_tp, d_tp = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
    layers = draw(st.integers(1, 6))
    p_pp = draw(st.integers(1, min(3, layers)))
    d_pp = draw(st.integers(1, min(3, layers)))
    p_block = draw(st.sampled_from([4, 8, 16, 12]))
    d_block = draw(st.sampled_from([4, 8, 16, 12]))
    tokens = draw(st.integers(0, 70))
    hnd_order = ["HND", "KV_HND", "HNC", CROSS_LAYER]
    choices = ["HND", CROSS_LAYER] if mla else [*hnd_order, "NHD", "KV_NHD", "NHC"]
    p_layout, d_layout = draw(st.sampled_from(choices)), draw(st.sampled_from(choices))
    if not mla:
        per_p, per_d = max(1, heads // p_tp), max(1, heads // d_tp)
        nhd_order = ("NHD", "KV_NHD", "NHC")
        nhd_p, nhd_d = p_layout in nhd_order, d_layout in nhd_order
        # Two head orders only where check_compatible allows them: not the same several heads on both sides.
        if per_p == per_d > 1 and nhd_p != nhd_d:
            replace = draw(st.sampled_from(hnd_order))
            p_layout, d_layout = [replace if x in nhd_order else x for x in (p_layout, d_layout)]
        if draw(st.integers(0, 5)) == 0:  # the fused layout pairs only with itself, at one block size
            p_layout = d_layout = FUSED
            d_block = p_block
    p_need, d_need = -(-tokens // p_block), -(-tokens // d_block)
    p_pool = p_need + draw(st.integers(0, 4))
    d_pool = d_need + draw(st.integers(0, 4))
    p_ids = draw(st.permutations(range(p_pool)))[:p_need]
    d_ids = draw(st.permutations(range(d_pool)))[:d_need]
    return Layouts(
        p_pp=p_pp,
        p_tp=p_tp,
        d_pp=d_pp,
        d_tp=d_tp,
        layers=layers,
        heads=heads,
        p_block=p_block,
        d_block=d_block,
        tokens=tokens,
        mla=mla,
        p_layout=p_layout,
        d_layout=d_layout,
        p_ids=list(p_ids),
        d_ids=list(d_ids),
        layer_gap=draw(st.sampled_from([0, 32])),
        extra_blocks=draw(st.integers(0, 2)),
        whole_blocks=draw(st.booleans()),
        window=draw(st.one_of(st.just(0), st.integers(1, 80))),
        window_groups=draw(st.integers(1, 3)),
        p_drops=draw(st.booleans()),
        chunked=draw(st.booleans()),
        # A prefix D holds already: whole D blocks (as a prefix cache hit is), or any token off the fused layout.
        first=draw(
            st.sampled_from(range(0, tokens + 1, d_block))
            if p_layout == FUSED
            else st.one_of(st.just(0), st.integers(0, tokens), st.sampled_from(range(0, tokens + 1, d_block)))
        ),
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_random_layouts_are_byte_exact(case: Layouts) -> None:
    simulate(case)
