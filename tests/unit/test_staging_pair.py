"""Staged writes through the byte-exact simulator: for generated pairs of layouts (TP and PP changes, block sizes
both ways, every layout that pairs, GQA replication, MLA), a transfer staged by `StagingRule` lands the same bytes
as the direct plan, in one write per contiguous destination run, and every protocol report is the same."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvsvc.core.errors import TopologyError
from kvsvc.core.layout import LAYOUTS
from kvsvc.core.planner import check_compatible
from kvsvc.core.staging_plans import StagingRule
from kvsvc.testing.pair import PeerPair
from kvsvc.testing.sim import EngineSpec

ALWAYS = StagingRule(gather_cost_s_per_byte=0.0, scatter_cost_s_per_byte=0.0)  # stage whenever it saves a descriptor


@st.composite
def layout_pairs(draw: st.DrawFn) -> tuple[EngineSpec, EngineSpec]:
    mla = draw(st.integers(0, 5)) == 0
    heads = draw(st.sampled_from([2, 4]))

    def spec(layout: str) -> EngineSpec:
        return EngineSpec(
            tp_size=draw(st.sampled_from([1, 2, 4])),
            pp_size=draw(st.sampled_from([1, 2])),
            num_layers=4,
            num_kv_heads=1 if mla else heads,
            head_size=4,
            block_size=draw(st.sampled_from([2, 4, 8])),
            num_blocks=48,
            layout=layout,
            is_mla=mla,
        )

    p = spec(draw(st.sampled_from(LAYOUTS)))
    d = spec(draw(st.sampled_from(LAYOUTS)))
    return p, d


def assume_compatible(p: EngineSpec, d: EngineSpec, *, staged: bool = False) -> None:
    """Skip the example (hypothesis `assume`) when some P and D worker cannot pair: the hello refuses those.
    `staged`: both sides publish staging regions (`PeerPair(windows=True)`), which lets P take a transposition."""
    try:
        probe = PeerPair(p, d, staging=ALWAYS, windows=True) if staged else PeerPair(p, d)
        for src in probe.p.metas.values():
            for dst in probe.d.metas.values():
                check_compatible(src, dst)
    except TopologyError:
        assume(False)


def _run(p: EngineSpec, d: EngineSpec, tokens: int, staging: StagingRule | None, chunk: int) -> PeerPair:
    pair = PeerPair(p, d, staging=staging, staging_bytes=chunk)
    pair.start_send("p-t", "t", list(range(2, 2 + -(-tokens // p.block_size))), tokens)
    pair.start_recv("d-t", "t", list(range(5, 5 + -(-tokens // d.block_size))), tokens)
    pair.run_until_idle()
    pair.take_reports()
    return pair


@given(layout_pairs(), st.integers(1, 40), st.sampled_from([64, 1000, 1 << 20]))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_staged_transfer_lands_byte_exact_in_no_more_writes_than_the_direct_one(
    pair_specs: tuple[EngineSpec, EngineSpec], tokens: int, staging_bytes: int
) -> None:
    p, d = pair_specs
    assume_compatible(p, d)
    direct = _run(p, d, tokens, None, staging_bytes)
    staged = _run(p, d, tokens, ALWAYS, staging_bytes)
    for pair in (direct, staged):
        pair.assert_received("t")
        pair.assert_reported_once(["p-t"], ["d-t"])
        assert all(pair.bytes_written_twice(w) == 0 for w in pair.receivers)
        assert pair.violations == []
    s_direct, s_staged = direct.statistics(), staged.statistics()
    assert s_staged.writes_done == s_direct.writes_done and s_staged.writes_failed == 0
    if staging_bytes == 1 << 20:  # one chunk per write: staged exactly where it saves descriptors
        assert s_staged.descriptors <= s_direct.descriptors
        assert (s_staged.writes_staged > 0) == (s_staged.descriptors < s_direct.descriptors)


def test_a_head_split_is_staged_into_one_write_per_layer_and_block_run() -> None:
    p, d = EngineSpec(tp_size=1, num_layers=4), EngineSpec(tp_size=2, num_layers=4)
    direct = _run(p, d, 16, None, 1 << 20).statistics()
    staged = _run(p, d, 16, ALWAYS, 1 << 20).statistics()
    # Direct: per D worker, one descriptor per (layer, block, K/V half); staged: per (layer, run of D blocks).
    assert direct.descriptors == 2 * 4 * 4 * 2
    assert staged.descriptors == 2 * 4 and staged.writes_staged == 2


def test_a_staged_run_stops_where_one_layer_tensor_ends_and_the_next_begins() -> None:
    # D's last block of layer L and block 0 of layer L+1 touch in memory; a run across them would leave the
    # registered tensor (the transport refuses such a descriptor).
    p, d = EngineSpec(tp_size=1, num_blocks=16), EngineSpec(tp_size=2, num_blocks=16)
    pair = PeerPair(p, d, staging=ALWAYS)
    pair.start_send("p-t", "t", [0, 1], 8)
    pair.start_recv("d-t", "t", [15, 0], 8)
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_received("t")
    assert pair.violations == []
    assert pair.statistics().writes_staged == 2


@pytest.mark.parametrize(
    ("p_layout", "d_layout", "tp"),
    [("HND", "NHD", 1), ("NHD", "HND", 2), ("NHD", "HND_CROSS_LAYER", 1), ("HNC", "KV_NHD", 2)],
)
def test_the_same_heads_in_two_orders_are_gathered_byte_exact(p_layout: str, d_layout: str, tp: int) -> None:
    # P publishes its region (it has a staging rule), so the pair is accepted; D lends no windows.
    pair = PeerPair(EngineSpec(tp_size=tp, layout=p_layout), EngineSpec(tp_size=tp, layout=d_layout), staging=ALWAYS)
    pair.start_send("p-t", "t", [2, 3, 4], 11)
    pair.start_recv("d-t", "t", [7, 5, 9], 11)
    pair.run_until_idle()
    pair.take_reports()
    pair.assert_received("t")
    pair.assert_reported_once(["p-t"], ["d-t"])
    assert pair.violations == [] and pair.statistics().writes_staged == tp
    with pytest.raises(TopologyError, match="needs a staging region on P"):
        PeerPair(EngineSpec(tp_size=tp, layout=p_layout), EngineSpec(tp_size=tp, layout=d_layout))
