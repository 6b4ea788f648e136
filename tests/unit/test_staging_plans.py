"""The staged form of a plan moves the same bytes to the same places in fewer writes, never a run across two
destination regions; the allocator never lends one byte twice. Hypothesis drives random plans, chunk sizes and
lend/free sequences; the bytes are checked by copying through numpy arenas, as the transport would."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.core.staging_plans import (
    RangeAllocator,
    StagingRule,
    count_runs,
    destination_runs,
    plan_staged,
    region_ids,
    shift_chunks,
)

SRC_SIZE = DST_SIZE = 4096


@st.composite
def plans(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint destination pieces (some touching, so runs form) fed from arbitrary disjoint source pieces."""
    count = draw(st.integers(1, 40))
    lengths = draw(st.lists(st.integers(1, 64), min_size=count, max_size=count))
    gaps = draw(st.lists(st.sampled_from([0, 0, 0, 1, 7, 100]), min_size=count, max_size=count))
    dst, at = [], 0
    for length, gap in zip(lengths, gaps, strict=True):
        at += gap
        dst.append(at)
        at += length
    order = draw(st.permutations(range(count)))
    src, at = [0] * count, 0
    for i in order:  # sources in another order, with gaps: the gather must follow the destination
        at += draw(st.integers(0, 5))
        src[i] = at
        at += lengths[i]
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), np.array(lengths, dtype=np.int64)


def _direct(src: np.ndarray, dst: np.ndarray, length: np.ndarray, memory: np.ndarray) -> np.ndarray:
    out = np.zeros(DST_SIZE, dtype=np.uint8)
    for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
        out[d : d + n] = memory[s : s + n]
    return out


@given(plans(), st.integers(1, 3000))
@settings(max_examples=200, deadline=None)
def test_a_staged_plan_writes_the_direct_plans_bytes_in_one_write_per_run_part(
    plan: tuple[np.ndarray, np.ndarray, np.ndarray], chunk_bytes: int
) -> None:
    src, dst, length = plan
    memory = np.random.default_rng(0).integers(1, 256, SRC_SIZE, dtype=np.uint8)
    staged_out = np.zeros(DST_SIZE, dtype=np.uint8)
    chunks = plan_staged(src, dst, length, chunk_bytes)
    for chunk in chunks:
        assert 0 < chunk.nbytes <= chunk_bytes
        staging = np.zeros(chunk.nbytes, dtype=np.uint8)
        gathered = zip(
            chunk.gather_src.tolist(), chunk.gather_offset.tolist(), chunk.gather_length.tolist(), strict=True
        )
        for s, o, n in gathered:
            staging[o : o + n] = memory[s : s + n]
        written = zip(chunk.write_offset.tolist(), chunk.write_dst.tolist(), chunk.write_length.tolist(), strict=True)
        for o, d, n in written:
            staged_out[d : d + n] = staging[o : o + n]
        assert int(chunk.gather_length.sum()) == int(chunk.write_length.sum()) == chunk.nbytes
    assert np.array_equal(staged_out, _direct(src, dst, length, memory))
    writes = sum(c.write_dst.size for c in chunks)
    runs = count_runs(dst, length)
    assert runs <= writes <= runs + len(chunks) - 1  # each cut adds at most one write
    if chunk_bytes >= int(length.sum()):
        assert writes == runs and len(chunks) == 1


@given(plans(), st.integers(1, 3000), st.integers(0, 1 << 40), st.integers(0, 1 << 40))
@settings(max_examples=200, deadline=None)
def test_a_shifted_staged_plan_is_the_staged_plan_of_the_shifted_plan(
    plan: tuple[np.ndarray, np.ndarray, np.ndarray], chunk_bytes: int, src_shift: int, dst_shift: int
) -> None:
    """What lets P cache one staged plan per shape and shift it to each request's blocks."""
    src, dst, length = plan
    shifted = shift_chunks(plan_staged(src, dst, length, chunk_bytes), src_shift, dst_shift)
    direct = plan_staged(src + src_shift, dst + dst_shift, length, chunk_bytes)
    assert len(shifted) == len(direct)
    for a, b in zip(shifted, direct, strict=True):
        assert a.nbytes == b.nbytes
        for name in ("gather_src", "gather_offset", "gather_length", "write_offset", "write_dst", "write_length"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_a_run_never_crosses_from_one_destination_region_into_the_next() -> None:
    dst = np.array([0, 100, 200], dtype=np.int64)
    length = np.array([100, 100, 100], dtype=np.int64)
    assert count_runs(dst, length) == 1
    region = region_ids(dst, [0, 200])  # two layer tensors that touch at 200
    assert region.tolist() == [1, 1, 2] and count_runs(dst, length, region) == 2
    chunks = plan_staged(dst + 1000, dst, length, 1000, region)
    assert [(c.write_dst.tolist(), c.write_length.tolist()) for c in chunks] == [([0, 200], [200, 100])]


def test_runs_join_touching_destinations_only_and_overlaps_are_refused() -> None:
    src = np.array([100, 0, 50], dtype=np.int64)
    dst = np.array([10, 0, 30], dtype=np.int64)
    length = np.array([10, 10, 5], dtype=np.int64)
    order, run_start, run_length = destination_runs(dst, length)
    assert order.tolist() == [1, 0, 2] and run_start.tolist() == [0, 2] and run_length.tolist() == [20, 5]
    with pytest.raises(ValueError, match="overlap"):
        destination_runs(np.array([0, 5], dtype=np.int64), np.array([10, 10], dtype=np.int64))
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_staged(src, dst, length, 0)
    assert plan_staged(src[:0], dst[:0], length[:0], 10) == []


def test_the_rule_stages_many_small_pieces_into_few_runs_and_nothing_else() -> None:
    rule = StagingRule(descriptor_cost_s=30e-6, gather_cost_s_per_byte=0.2e-9)
    assert rule.stage(descriptors=224, runs=28, nbytes=8 << 20)  # a head split of 8 MiB
    assert not rule.stage(descriptors=28, runs=28, nbytes=8 << 20)  # nothing to gather
    assert not rule.stage(descriptors=2, runs=1, nbytes=64 << 20)  # the copy costs more than one descriptor
    assert not StagingRule(descriptor_cost_s=0.0).stage(224, 28, 1)
    with pytest.raises(ValueError, match="costs"):
        StagingRule(descriptor_cost_s=-1.0)


@given(st.integers(1, 256), st.lists(st.tuples(st.booleans(), st.integers(1, 300), st.integers(0, 50)), max_size=80))
@settings(max_examples=300, deadline=None)
def test_the_allocator_never_lends_a_byte_twice_and_is_whole_again_when_all_is_freed(
    capacity: int, ops: list[tuple[bool, int, int]]
) -> None:
    ring = RangeAllocator(capacity)
    lent: dict[int, int] = {}
    for lend, size, pick in ops:
        if lend or not lent:
            size = min(size, capacity)
            offset = ring.allocate(size)
            if offset is None:
                continue
            assert offset >= 0 and offset + size <= capacity
            for other, other_size in lent.items():
                assert offset + size <= other or other + other_size <= offset
            lent[offset] = size
        else:
            offset = sorted(lent)[pick % len(lent)]
            ring.free(offset)
            del lent[offset]
        assert ring.in_use == sum(lent.values())
    for offset in list(lent):
        ring.free(offset)
    assert ring.in_use == 0 and ring.allocate(capacity) == 0


def test_the_allocator_refuses_impossible_sizes_and_unknown_frees_and_reuses_any_freed_gap() -> None:
    ring = RangeAllocator(100)
    with pytest.raises(ValueError, match="cannot lend 101"):
        ring.allocate(101)
    with pytest.raises(KeyError, match="offset 5"):
        ring.free(5)
    assert ring.allocate(30) == 0 and ring.allocate(30) == 30 and ring.allocate(30) == 60
    assert ring.allocate(30) is None
    ring.free(30)  # freed out of order: its gap is lent again at once
    assert ring.allocate(20) == 30 and ring.allocate(10) == 50 and ring.allocate(10) == 90
    with pytest.raises(ValueError, match=">= 1 byte"):
        RangeAllocator(0)
