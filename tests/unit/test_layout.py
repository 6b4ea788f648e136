"""Contract tests of `kvsvc.core.layout`: head ownership, layer splits, byte geometry and pool regions
(docs/design.md, "Geometry")."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsvc.core.errors import TopologyError
from kvsvc.core.layout import (
    CROSS_LAYER,
    DTYPE_SIZES,
    LAYOUTS,
    block_bytes,
    block_geometry,
    check_base_addrs,
    check_kv_heads,
    check_layer_split,
    dtype_size,
    even_layer_split,
    head_order,
    heads_of_rank,
    holders_of_head,
    is_cross_layer,
    kv_cache_shape,
    kv_heads_per_rank,
    layer_addrs,
    layer_bytes,
    pool_bytes,
    pool_regions,
)
from kvsvc.core.messages import WorkerMetadata


def meta(**kw: object) -> WorkerMetadata:
    base: dict[str, object] = dict(
        engine_id="E", incarnation="i", pp_rank=0, pp_size=1, tp_rank=0, tp_size=2, start_layer=0, end_layer=1,
        num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16, num_blocks=10, layout="HND",
        is_mla=False, base_addrs=[0],
    )  # fmt: skip
    base.update(kw)
    return msgspec.convert(base, WorkerMetadata)


def test_kv_heads_per_rank_is_at_least_one() -> None:
    assert kv_heads_per_rank(8, 2) == 4
    assert kv_heads_per_rank(4, 8) == 1


def test_ranks_split_heads_evenly_when_tp_at_most_k() -> None:
    assert [list(heads_of_rank(r, 4, 8)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_ranks_replicate_heads_when_tp_exceeds_k() -> None:
    assert [list(heads_of_rank(r, 8, 2)) for r in range(8)] == [[0]] * 4 + [[1]] * 4
    assert list(holders_of_head(1, 8, 2)) == [4, 5, 6, 7]
    assert list(holders_of_head(5, 4, 8)) == [2]


@given(st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([1, 2, 4, 8, 16, 32]))
def test_every_head_is_held_and_holders_agree_with_heads_of_rank(k: int, tp: int) -> None:
    held = [h for r in range(tp) for h in heads_of_rank(r, tp, k)]
    assert set(held) == set(range(k))
    for head in range(k):
        assert [r for r in range(tp) if head in heads_of_rank(r, tp, k)] == list(holders_of_head(head, tp, k))


@pytest.mark.parametrize(("k", "tp"), [(8, 3), (4, 6), (6, 4), (0, 1), (4, 0)])
def test_uneven_head_counts_raise_topology_error_naming_both(k: int, tp: int) -> None:
    with pytest.raises(TopologyError, match=rf"(?s)(?=.*\b{k}\b)(?=.*\b{tp}\b)"):
        check_kv_heads(k, tp)


def test_rank_outside_tp_size_is_value_error() -> None:
    with pytest.raises(ValueError):
        heads_of_rank(2, 2, 8)


def test_even_layer_split_gives_remainder_to_stages_before_the_last() -> None:
    assert even_layer_split(32, 2) == [(0, 16), (16, 32)]
    assert even_layer_split(7, 3) == [(0, 2), (2, 5), (5, 7)]
    assert even_layer_split(5, 1) == [(0, 5)]
    with pytest.raises(ValueError):
        even_layer_split(2, 3)


@given(st.integers(1, 100), st.integers(1, 8))
def test_even_layer_split_tiles_all_layers_within_one(layers: int, pp: int) -> None:
    if layers < pp:
        return
    split = even_layer_split(layers, pp)
    check_layer_split(split, layers)
    sizes = [e - s for s, e in split]
    assert max(sizes) - min(sizes) <= 1


def test_any_explicit_split_is_accepted_and_bad_ones_refused() -> None:
    check_layer_split([(0, 1), (1, 7)], 7)
    for bad in ([(0, 3), (4, 7)], [(0, 4), (3, 7)], [(0, 3)], [(0, 0), (0, 7)]):
        with pytest.raises(ValueError):
            check_layer_split(bad, 7)


def test_dtype_sizes() -> None:
    assert {n: dtype_size(n) for n in DTYPE_SIZES} == {
        "bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
    }  # fmt: skip
    assert dtype_size("torch.float32") == 4
    with pytest.raises(TopologyError, match="complex64"):
        dtype_size("complex64")


def test_shapes_and_bytes_of_each_layout() -> None:
    hnd = meta()
    assert kv_cache_shape(hnd) == (10, 2, 4, 16, 128)
    assert block_bytes(hnd) == 2 * 4 * 16 * 128 * 2
    assert layer_bytes(hnd) == 10 * block_bytes(hnd)
    nhd = meta(layout="NHD", dtype="float32")
    assert kv_cache_shape(nhd) == (10, 2, 16, 4, 128)
    assert block_bytes(nhd) == 2 * 16 * 4 * 128 * 4
    mla = meta(is_mla=True, head_size=576, layout="whatever")
    assert kv_cache_shape(mla) == (10, 16, 576)
    assert layer_bytes(mla) == 10 * 16 * 576 * 2
    with pytest.raises(TopologyError, match="XYZ"):
        kv_cache_shape(meta(layout="XYZ"))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_strides_match_c_contiguous_tensor(layout: str) -> None:
    m = meta(layout=layout)
    g = block_geometry(m)
    shape = kv_cache_shape(m)
    elem = m.head_size * 2
    strides = [elem * math.prod(shape[i + 1 : -1]) for i in range(len(shape) - 1)]
    head_axis, token_axis = (2, 3) if layout == "HND" else (3, 2)
    assert (g.block_bytes, g.half_stride) == (strides[0], strides[1])
    assert (g.head_stride, g.token_stride) == (strides[head_axis], strides[token_axis])


# Axes of (block, half, head, token) in each per-layer layout's tensor (None: that axis does not exist).
AXES = {
    "HND": (0, 1, 2, 3),
    "NHD": (0, 1, 3, 2),
    "KV_HND": (1, 0, 2, 3),
    "KV_NHD": (1, 0, 3, 2),
    "HND_FUSED": (0, None, 1, 2),
    "HNC": (0, None, 1, 2),
    "NHC": (0, None, 2, 1),
}


@pytest.mark.parametrize("layout", sorted(AXES))
def test_every_per_layer_layout_geometry_matches_its_c_contiguous_tensor(layout: str) -> None:
    m = meta(layout=layout)
    g = block_geometry(m)
    shape = kv_cache_shape(m)
    # Byte strides of a C-contiguous tensor of that shape, its last axis (head_size elements) kept whole.
    strides = [2 * math.prod(shape[i + 1 :]) for i in range(len(shape))]
    block, half, head, token = AXES[layout]
    assert g.block_stride == strides[block]
    assert g.head_stride == strides[head] and g.token_stride == strides[token]
    if layout not in ("HNC", "NHC"):
        assert g.element_bytes == strides[-2]  # one token of one head (of one half)
    if layout in ("HNC", "NHC"):  # a cell of K then V: the last axis holds both halves
        assert g.halves == 2 and g.half_stride == g.element_bytes == m.head_size * 2
        assert g.head_stride == strides[head] and g.token_stride == strides[token]
    elif half is None:  # fused: K and V share one opaque element of 2 x head_size
        assert g.halves == 1 and g.element_bytes == 2 * m.head_size * 2
    else:
        assert g.halves == 2 and g.half_stride == strides[half]
    assert layer_bytes(m) == math.prod(shape) * 2 == m.num_blocks * g.block_bytes
    assert head_order(m) == ("NHD" if layout in ("NHD", "KV_NHD", "NHC") else "HND")


def test_cross_layer_pool_shape_and_sizes() -> None:
    pool = meta(layout=CROSS_LAYER, start_layer=2, end_layer=5)
    assert CROSS_LAYER == "HND_CROSS_LAYER" and CROSS_LAYER in LAYOUTS
    assert is_cross_layer(pool) and not is_cross_layer(meta())
    assert kv_cache_shape(pool) == (10, 3, 2, 4, 16, 128)
    # block_bytes and layer_bytes mean the same as in a per-layer HND tensor; the pool is all layers.
    assert block_bytes(pool) == block_bytes(meta()) == 2 * 4 * 16 * 128 * 2
    assert layer_bytes(pool) == 10 * block_bytes(pool)
    assert pool_bytes(pool) == 3 * layer_bytes(pool) == math.prod(kv_cache_shape(pool)) * 2
    assert block_geometry(pool).block_stride == 3 * block_bytes(pool)
    assert block_geometry(meta()).block_stride == block_bytes(meta())


def test_mla_cross_layer_pool() -> None:
    pool = meta(is_mla=True, head_size=576, layout=CROSS_LAYER, end_layer=4)
    assert kv_cache_shape(pool) == (10, 4, 16, 576)
    assert block_bytes(pool) == 16 * 576 * 2
    assert block_geometry(pool).block_stride == 4 * block_bytes(pool)
    assert head_order(pool) == "HND" == head_order(meta(is_mla=True, layout="NHD"))


@pytest.mark.parametrize("mla", [False, True])
def test_cross_layer_strides_match_c_contiguous_pool(mla: bool) -> None:
    m = meta(layout=CROSS_LAYER, end_layer=3, is_mla=mla)
    g = block_geometry(m)
    shape = kv_cache_shape(m)
    elem = m.head_size * 2
    strides = [elem * math.prod(shape[i + 1 : -1]) for i in range(len(shape) - 1)]
    assert (g.block_stride, g.block_bytes) == (strides[0], strides[1])  # block axis, then layer axis
    if mla:
        assert g.token_stride == strides[2]
    else:
        assert (g.half_stride, g.head_stride, g.token_stride) == tuple(strides[2:5])


def test_pool_regions_and_layer_addrs_of_each_layout() -> None:
    per_layer = meta(end_layer=3, base_addrs=[1000, 9000, 5000])
    size = layer_bytes(per_layer)
    assert pool_regions(per_layer) == [(1000, size), (9000, size), (5000, size)]
    assert layer_addrs(per_layer) == [1000, 9000, 5000]
    pool = meta(layout=CROSS_LAYER, end_layer=3, base_addrs=[4096])
    assert pool_regions(pool) == [(4096, pool_bytes(pool))]
    assert layer_addrs(pool) == [4096 + i * block_bytes(pool) for i in range(3)]


def test_base_addrs_count_is_checked_per_layout() -> None:
    check_base_addrs(meta(layout=CROSS_LAYER, end_layer=3, base_addrs=[0]))
    with pytest.raises(TopologyError, match=r"P worker: 3 base_addrs for layout HND_CROSS_LAYER; it needs 1"):
        check_base_addrs(meta(layout=CROSS_LAYER, end_layer=3, base_addrs=[0, 1, 2]), "P worker")
    with pytest.raises(TopologyError, match="0 base_addrs for layout HND_CROSS_LAYER"):
        pool_regions(meta(layout=CROSS_LAYER, base_addrs=[]))
    with pytest.raises(TopologyError, match="1 base_addrs for 2 layers"):
        layer_addrs(meta(end_layer=2, base_addrs=[0]))


def test_cross_layer_pool_of_no_layers_is_refused() -> None:
    with pytest.raises(TopologyError, match=r"HND_CROSS_LAYER.*\[3, 3\)"):
        kv_cache_shape(meta(layout=CROSS_LAYER, start_layer=3, end_layer=3))
