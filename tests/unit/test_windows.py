"""D-side staging, pure and simulated: P's stream into a window (`window_plan`) and D's scatter out of it
(`scatter_plan`) put every byte where the direct plan would, D working from the destination bytes alone (not P's
block ids); the rule picks the cheapest way; and through the byte-exact simulator, for generated layout pairs, a
transfer through windows lands the same bytes as a direct one, reports once, and gives every window back, also
under aborts, expiry and failed writes. A pair whose scatter is skipped is the negative control."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption

from kvsvc.core.layout import block_geometry, pool_regions
from kvsvc.core.messages import TransferRequest
from kvsvc.core.planner import check_window, plan_transfer_arrays
from kvsvc.core.staging_plans import (
    StagingRule,
    Way,
    plan_staged,
    plan_window,
    region_ids,
    scatter_plan,
    shift_chunks,
    stream_round,
    window_plan,
    window_round_bytes,
    window_rounds,
)
from kvsvc.testing.pair import PeerPair
from kvsvc.testing.sim import EngineSpec

from .test_staging_pair import assume_compatible, layout_pairs
from .test_staging_plans import DST_SIZE, SRC_SIZE, _direct, plans

ALWAYS = StagingRule(gather_cost_s_per_byte=0.0, scatter_cost_s_per_byte=0.0)  # any way that saves a descriptor


@given(plans(), st.integers(0, 1000))
@settings(max_examples=200, deadline=None)
def test_the_window_stream_and_its_scatter_put_every_byte_where_the_direct_plan_does(
    plan: tuple[np.ndarray, np.ndarray, np.ndarray], window: int
) -> None:
    src, dst, length = plan
    memory = np.random.default_rng(1).integers(1, 256, SRC_SIZE, dtype=np.uint8)
    staging = np.zeros(window + int(length.sum()), dtype=np.uint8)
    w_src, w_dst, w_len = window_plan(src, dst, length, window)
    for s, d, n in zip(w_src.tolist(), w_dst.tolist(), w_len.tolist(), strict=True):
        staging[d : d + n] = memory[s : s + n]
    out = np.zeros(DST_SIZE, dtype=np.uint8)
    offset, s_dst, s_len = scatter_plan(dst, length)  # D knows the destination bytes only
    for o, d, n in zip(offset.tolist(), s_dst.tolist(), s_len.tolist(), strict=True):
        out[d : d + n] = staging[window + o : window + o + n]
    assert np.array_equal(out, _direct(src, dst, length, memory))
    assert int(w_len.sum()) == int(s_len.sum()) == int(length.sum())
    assert w_src.size <= src.size  # pieces next to each other in P and in the stream share a descriptor


@given(plans(), st.integers(2, 300))
@settings(max_examples=200, deadline=None)
def test_a_share_through_a_smaller_window_in_rounds_lands_every_byte(
    plan: tuple[np.ndarray, np.ndarray, np.ndarray], window: int
) -> None:
    src, dst, length = plan
    memory = np.random.default_rng(2).integers(1, 256, SRC_SIZE, dtype=np.uint8)
    share = int(length.sum())
    size, rounds = window_round_bytes(share, window), window_rounds(share, window)
    assert size <= window and rounds * size >= share > (rounds - 1) * size
    staging = np.zeros(window, dtype=np.uint8)
    out = np.zeros(DST_SIZE, dtype=np.uint8)
    w_src, w_offset, w_len = window_plan(src, dst, length, 0)
    s_offset, s_dst, s_len = scatter_plan(dst, length)
    moved = 0
    for index in range(rounds):  # P fills a half, D empties it before P fills it again
        half = (index % 2) * size
        staging[half : half + size] = 0  # what D left there must not matter
        for s, o, n in zip(*(c.tolist() for c in stream_round(w_offset, w_src, w_len, index, size)), strict=True):
            staging[half + o : half + o + n] = memory[s : s + n]
            moved += n
        for d, o, n in zip(*(c.tolist() for c in stream_round(s_offset, s_dst, s_len, index, size)), strict=True):
            out[d : d + n] = staging[half + o : half + o + n]
    assert moved == share
    assert np.array_equal(out, _direct(src, dst, length, memory))


def test_a_window_too_small_for_any_round_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot move"):
        window_round_bytes(10, 1)
    assert window_round_bytes(10, 10) == 10 and window_rounds(10, 10) == 1
    assert window_round_bytes(10, 4) == 2 and window_rounds(10, 4) == 5


def test_pieces_from_two_source_tensors_never_share_a_window_descriptor() -> None:
    src = np.array([0, 100], dtype=np.int64)
    dst = np.array([0, 100], dtype=np.int64)
    length = np.array([100, 100], dtype=np.int64)
    assert window_plan(src, dst, length, 0)[0].size == 1
    assert window_plan(src, dst, length, 0, np.array([0, 1], dtype=np.int64))[0].size == 2


def test_the_rule_picks_the_cheapest_way_and_only_ways_the_regions_allow() -> None:
    rule = StagingRule(descriptor_cost_s=30e-6, gather_cost_s_per_byte=1e-9, scatter_cost_s_per_byte=1e-9)
    # A head split into fewer D processes (P tp2 -> D tp1): strided in D, contiguous in P.
    assert rule.way(448, 448, 56, 2 << 20, gather=True, scatter=True) is Way.SCATTER
    assert rule.way(448, 448, 56, 2 << 20, gather=True, scatter=False) is Way.DIRECT
    # The other way round (P tp1 -> D tp2): strided in P, contiguous in D.
    assert rule.way(224, 56, 224, 2 << 20, gather=True, scatter=True) is Way.GATHER
    # Strided on both sides, small: both copies.
    assert rule.way(4096, 4096, 4096, 64 << 10, gather=True, scatter=True) is Way.BOTH
    # Already few descriptors: direct, with or without regions.
    assert rule.way(28, 28, 28, 16 << 20, gather=True, scatter=True) is Way.DIRECT
    assert Way.SCATTER.scatters and Way.BOTH.scatters and not Way.GATHER.scatters


def test_the_default_rule_scatters_a_window_share_of_few_runs_and_leaves_contiguous_d_runs_to_a_gather_alone() -> None:
    """The bench's head splits of 2 MiB shares, one run per layer of 28: a share strided in D but in few runs in P
    goes into a window straight from P's blocks (gathering it first would hold its first byte back for longer than
    27 descriptors cost); one in many runs in P is gathered into the window; one contiguous in D is not scattered."""
    rule = StagingRule()
    assert rule.way(448, 448, 28, 2 << 20, gather=True, scatter=True) is Way.SCATTER  # P tp2 -> D tp1
    assert rule.way(448, 448, 28, 2 << 20, gather=False, scatter=True) is Way.SCATTER  # P has no region
    assert rule.way(448, 448, 448, 2 << 20, gather=True, scatter=True) is Way.BOTH  # P's pieces apart too
    assert rule.way(224, 28, 224, 2 << 20, gather=True, scatter=True) is Way.GATHER  # P tp1 -> D tp2
    assert rule.way(868, 28, 868, 2 << 20, gather=True, scatter=True) is Way.GATHER  # block 16 -> 32


def _pair(p: EngineSpec, d: EngineSpec, tokens: int, windows: bool, staging_bytes: int = 1 << 20) -> PeerPair:
    pair = PeerPair(p, d, staging=ALWAYS if windows else None, staging_bytes=staging_bytes, windows=windows)
    pair.start_send("p-t", "t", list(range(2, 2 + -(-tokens // p.block_size))), tokens)
    pair.start_recv("d-t", "t", list(range(5, 5 + -(-tokens // d.block_size))), tokens)
    return pair


@given(layout_pairs(), st.integers(1, 40), st.sampled_from([1024, 4096, 1 << 20]))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_transfer_through_windows_lands_byte_exact_and_gives_every_window_back(
    pair_specs: tuple[EngineSpec, EngineSpec], tokens: int, staging_bytes: int
) -> None:
    p, d = pair_specs
    assume_compatible(p, d, staged=True)
    windowed = _pair(p, d, tokens, windows=True, staging_bytes=staging_bytes)
    pairs = [windowed]
    direct = None
    try:
        assume_compatible(p, d)
        direct = _pair(p, d, tokens, windows=False)
        pairs.append(direct)
    except UnsatisfiedAssumption:
        pass  # only P's staging region makes the pair possible (a transposition): nothing direct to compare
    for pair in pairs:
        pair.run_until_idle()
        pair.take_reports()
        pair.assert_received("t")
        pair.assert_reported_once(["p-t"], ["d-t"])
        assert all(pair.bytes_written_twice(w) == 0 for w in pair.receivers)
        assert pair.violations == []
    s_windowed = windowed.statistics()
    assert s_windowed.windows_lent == 0 and s_windowed.writes_failed == 0
    if direct is not None and staging_bytes == 1 << 20:  # every share fits a window: never more than direct
        assert s_windowed.descriptors <= direct.statistics().descriptors


def test_a_head_split_into_fewer_processes_goes_through_windows_in_one_write_per_layer() -> None:
    p, d = EngineSpec(tp_size=2, num_layers=4), EngineSpec(tp_size=1, num_layers=4)
    direct = _pair(p, d, 16, windows=False)
    direct.run_until_idle()
    scattered = _pair(p, d, 16, windows=True)
    scattered.run_until_idle()
    scattered.assert_received("t")
    s_direct, s_scattered = direct.statistics(), scattered.statistics()
    # Direct: per P worker, one descriptor per (layer, block, K/V) half of D's block; through a window, each P
    # worker's blocks are one run per layer (K and V together), or one gathered chunk.
    assert s_direct.descriptors == 2 * 4 * 4 * 2
    assert s_scattered.scatters == 2 and s_scattered.descriptors <= 2 * 4
    assert s_scattered.windows_lent == 0


def test_negative_control_a_window_never_scattered_leaves_d_without_the_kv() -> None:
    pair = _pair(EngineSpec(tp_size=2), EngineSpec(tp_size=1), 16, windows=True)
    pair._scatter = lambda *args: None  # type: ignore[method-assign]
    pair.run_until_idle()
    pair.take_reports()
    with pytest.raises(AssertionError):
        pair.assert_received("t")


@pytest.mark.parametrize("fault", ["abort", "expire", "failed write", "lost answer"])
def test_faults_during_a_windowed_transfer_report_once_and_give_the_window_back(fault: str) -> None:
    pair = _pair(EngineSpec(tp_size=2), EngineSpec(tp_size=1), 16, windows=True)
    if fault == "failed write":
        pair.fail_write = lambda write: write.p == (0, 0)
    elif fault == "lost answer":
        pair.drop = lambda envelope: envelope.to == "D" and envelope.p == (0, 1)
    elif fault == "abort":
        pair.stall_write = lambda write: True  # the writes into the windows are in flight
    pair.step()
    pair.run_until_idle()
    if fault == "abort":
        pair.abort_recv("d-t")
        pair.finish_stalled()  # P's writes end; P answers D's abort
    if fault in ("expire", "lost answer"):
        pair.stall_write = None
        pair.advance(1000.0)
        pair.expire()
    pair.run_until_idle()
    pair.advance(1000.0)
    pair.expire()
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_reported_once(["p-t"], ["d-t"])
    assert pair.violations == []
    assert pair.statistics().windows_lent == 0
    if fault != "expire":
        assert pair.outcomes("d-t")


def test_a_window_outside_ds_published_region_is_refused_with_both_ranges() -> None:
    pair = PeerPair(EngineSpec(tp_size=2), EngineSpec(tp_size=1), staging=ALWAYS, windows=True)
    lend = pair._windowed

    def outside(d: tuple[int, int], p: tuple[int, int], request: TransferRequest) -> TransferRequest:
        request = lend(d, p, request)
        return msgspec.structs.replace(request, window_addr=request.window_addr + (1 << 30))

    pair._windowed = outside  # type: ignore[method-assign]
    pair.start_send("p-t", "t", [0, 1, 2, 3], 16)
    pair.start_recv("d-t", "t", [4, 5, 6, 7], 16)
    pair.run_until_idle()
    pair.advance(1000.0)
    pair.expire()
    pair.run_until_idle()
    reports = pair.take_reports()
    reasons = " ".join(r.reason for r in reports if r.reason)
    assert "outside D's staging region" in reasons, reports
    assert pair.statistics().windows_lent == 0


def test_check_window_takes_none_or_a_range_inside_the_region() -> None:
    meta = PeerPair(EngineSpec(), EngineSpec(), staging=ALWAYS, windows=True).d.metas[(0, 0)]
    check_window(meta, 0, 0)
    check_window(meta, meta.staging_addr, meta.staging_size)
    check_window(meta, meta.staging_addr, 512, 1 << 20)  # rounds of 256 bytes
    for addr, size in ((meta.staging_addr, 0), (meta.staging_addr - 1, 8), (meta.staging_addr + 1, meta.staging_size)):
        with pytest.raises(ValueError, match="outside D's staging region"):
            check_window(meta, addr, size)
    with pytest.raises(ValueError, match="rounds of half the window, at least 256"):
        check_window(meta, meta.staging_addr, 2, 10)  # a P worker must not write a share two bytes at a time
    with pytest.raises(ValueError, match="more than 65536 rounds"):
        check_window(meta, meta.staging_addr, 512, 256 * 65537)
    with pytest.raises(ValueError, match="share of -1"):
        check_window(meta, meta.staging_addr, 512, -1)


def test_a_p_worker_that_predates_windows_gets_none() -> None:
    # It would ignore the window and write the blocks, and D would scatter an empty window over them.
    p, d = EngineSpec(tp_size=2), EngineSpec(tp_size=1)
    pair = PeerPair(p, d, staging=ALWAYS, windows=True)
    old = msgspec.structs.replace(pair.p.metas[(0, 0)], accepts_windows=False)
    assert plan_window(old, pair.d.metas[(0, 0)], [0, 1, 2, 3], 16, 0, ALWAYS, 1 << 20) is None
    assert plan_window(pair.p.metas[(0, 0)], pair.d.metas[(0, 0)], [0, 1, 2, 3], 16, 0, ALWAYS, 1 << 20)


@given(layout_pairs(), st.integers(1, 40), st.integers(0, 8))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_window_plan_of_a_block_run_is_the_plan_of_blocks_from_zero_shifted(
    pair_specs: tuple[EngineSpec, EngineSpec], tokens: int, first: int
) -> None:
    # What D's window plan cache relies on: only the destinations move, by whole blocks.
    p, d = pair_specs
    assume_compatible(p, d)
    pair = PeerPair(p, d, staging=ALWAYS, windows=True)
    count = -(-tokens // d.block_size)
    assume(first + count <= d.num_blocks)
    for p_meta in pair.p.metas.values():
        for d_meta in pair.d.metas.values():
            unit = plan_window(p_meta, d_meta, list(range(count)), tokens, 0, ALWAYS, 1 << 20)
            moved = plan_window(p_meta, d_meta, list(range(first, first + count)), tokens, 0, ALWAYS, 1 << 20)
            if unit is None or moved is None:
                assert unit is moved
                continue
            stride = block_geometry(d_meta).block_stride
            assert (unit.nbytes, unit.window_bytes, unit.way) == (moved.nbytes, moved.window_bytes, moved.way)
            assert np.array_equal(unit.offset, moved.offset) and np.array_equal(unit.length, moved.length)
            assert np.array_equal(unit.dst + first * stride, moved.dst)


def test_a_transposition_is_gathered_into_ds_head_order() -> None:
    # The same 4 heads per rank, HND on P and NHD on D: every (token, head) is its own piece; P gathers them.
    p, d = EngineSpec(layout="HND"), EngineSpec(layout="NHD")
    pair = _pair(p, d, 16, windows=True)
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_received("t")
    stats = pair.statistics()
    # Gathered on P: at most one write per layer of D's consecutive blocks (one, when D lends a window too).
    assert stats.writes_staged == 1 and stats.descriptors <= 4
    assert pair.violations == []


@given(layout_pairs(), st.integers(1, 40), st.integers(0, 8), st.integers(0, 8), st.sampled_from([512, 4096, 1 << 20]))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_window_stream_of_a_block_run_is_the_stream_of_blocks_from_zero_shifted(
    pair_specs: tuple[EngineSpec, EngineSpec], tokens: int, p_first: int, d_first: int, chunk_bytes: int
) -> None:
    # What P's cache of window streams and their staged forms relies on (`BlockWriter._stream`): the stream of
    # blocks from zero, its sources moved by whole P blocks, and its staged chunks moved to the window's address.
    p, d = pair_specs
    assume_compatible(p, d, staged=True)
    pair = PeerPair(p, d, staging=ALWAYS, windows=True)
    n_src, n_dst = -(-tokens // p.block_size), -(-tokens // d.block_size)
    assume(p_first + n_src <= p.num_blocks and d_first + n_dst <= d.num_blocks)
    window = 1 << 40
    for p_meta in pair.p.metas.values():
        regions = [start for start, _ in pool_regions(p_meta)]
        for d_meta in pair.d.metas.values():
            unit = plan_transfer_arrays(p_meta, d_meta, range(n_src), range(n_dst), tokens)
            moved = plan_transfer_arrays(
                p_meta, d_meta, range(p_first, p_first + n_src), range(d_first, d_first + n_dst), tokens
            )
            if unit[0].size == 0:
                assert moved[0].size == 0
                continue
            shift = p_first * block_geometry(p_meta).block_stride
            base = window_plan(*unit, 0, region_ids(unit[0], regions))
            want = window_plan(*moved, 0, region_ids(moved[0], regions))
            assert np.array_equal(base[0] + shift, want[0])
            assert np.array_equal(base[1], want[1]) and np.array_equal(base[2], want[2])
            staged = shift_chunks(plan_staged(*base, chunk_bytes), shift, window)
            fresh = plan_staged(want[0], window + want[1], want[2], chunk_bytes)
            assert len(staged) == len(fresh)
            for a, b in zip(staged, fresh, strict=True):
                assert a.nbytes == b.nbytes
                for column in ("gather_src", "gather_offset", "gather_length", "write_offset", "write_dst"):
                    assert np.array_equal(getattr(a, column), getattr(b, column))


@pytest.mark.parametrize("lie", [-1, 1, 4096])  # (far larger: the Sender refuses the rounds first)
def test_a_share_size_d_claims_that_ps_plan_does_not_make_is_refused_naming_both(lie: int) -> None:
    pair = PeerPair(EngineSpec(tp_size=2), EngineSpec(tp_size=1), staging=ALWAYS, windows=True)
    lend = pair._windowed

    def lying(d: tuple[int, int], p: tuple[int, int], request: TransferRequest) -> TransferRequest:
        request = lend(d, p, request)
        return msgspec.structs.replace(request, share_bytes=request.share_bytes + lie)

    pair._windowed = lying  # type: ignore[method-assign]
    pair.start_send("p-t", "t", [0, 1, 2, 3], 16)
    pair.start_recv("d-t", "t", [4, 5, 6, 7], 16)
    pair.run_until_idle()
    pair.advance(1000.0)
    pair.run_until_idle()
    reports = pair.take_reports()
    reasons = " ".join(r.reason for r in reports if r.reason)
    assert "D planned a share of" in reasons and "this P worker writes it" in reasons, reports
    assert pair.statistics().writes_done == 0 and pair.statistics().windows_lent == 0
