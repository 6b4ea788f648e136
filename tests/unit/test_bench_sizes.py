"""The arithmetic behind `kvsvc bench`: model shapes and request sizes, the peers' one-descriptor-per-(layer, block,
K/V half) split of a plan, the paired ratios and the CPU split by thread. The measuring itself runs in
tests/integration/test_bench.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvsvc.cli.plan import synthetic_engine
from kvsvc.core.layout import CROSS_LAYER, block_geometry
from kvsvc.core.messages import WorkerMetadata
from kvsvc.core.planner import plan_transfer
from workers.bench.measure import RAW_METHODS, RAW_SAMEHOST, cpu_jiffies, paired_ratio, run_orders, split_per_half
from workers.bench.models import DEFAULT_MODEL, MODELS, QUICK, TINY, ModelShape
from workers.bench.report import Target
from workers.bench.runner import _thread_split

KiB, MiB = 1 << 10, 1 << 20


def test_model_shapes_give_the_peer_descriptor_sizes_the_docs_quote() -> None:
    qwen, llama = MODELS["qwen2.5-7b"], MODELS["llama3-8b"]
    assert DEFAULT_MODEL == "qwen2.5-7b"
    # one (layer, block, K/V half) = block_bytes / layers / 2
    assert qwen.block_bytes() // qwen.num_layers // 2 == 16 * KiB
    assert llama.block_bytes() // llama.num_layers // 2 == 32 * KiB
    assert qwen.block_bytes(tp_size=2) * 2 == qwen.block_bytes()


def test_request_sizes_round_down_to_whole_blocks_and_never_to_zero() -> None:
    assert QUICK.model.name == DEFAULT_MODEL
    assert QUICK.large_blocks == 16 * MiB // (896 * KiB) == 18
    assert QUICK.hetero_blocks == 4
    assert TINY.large_blocks == TINY.hetero_blocks == 2
    huge = ModelShape("huge", num_layers=200, num_kv_heads=64, head_size=256, block_size=64)
    assert dataclasses.replace(QUICK, model=huge).large_blocks == 1


def _one(name: str, tp_rank: int = 0, **kw: Any) -> WorkerMetadata:
    args: dict[str, Any] = dict(
        pp_size=1, tp_size=1, num_layers=3, num_kv_heads=4, head_size=8, block_size=4, num_blocks=32, layer_gap=4096
    )
    args.update(kw)
    base = 0x1000 if name == "P" else 0x10_0000_0000
    return synthetic_engine(name, base_addr=base, **args)[(0, tp_rank)]


@pytest.mark.parametrize(
    ("p_kw", "d_kw"),
    [
        ({}, {}),  # per-layer both sides: one run per layer, cut into blocks and halves
        ({"layout": CROSS_LAYER}, {"layout": CROSS_LAYER}),  # one run for every layer, cut likewise
        ({}, {"layout": CROSS_LAYER}),  # mixed layouts: the planner's pieces are cut on both sides' boundaries
        ({}, {"tp_size": 2}),  # a head split: pieces are already smaller than a half, nothing left to cut
    ],
)
def test_split_per_half_tiles_the_plan_in_pieces_within_one_half(p_kw: dict[str, Any], d_kw: dict[str, Any]) -> None:
    p, d = _one("P", **p_kw), _one("D", **d_kw)
    plan = plan_transfer(p, d, [2, 3, 4, 5], [7, 8, 9, 10])
    pieces = split_per_half(plan, p, d)
    assert sum(x[2] for x in pieces) == sum(x[2] for x in plan)
    expanded = [(s + i, t + i) for s, t, n in plan for i in range(0, n, 64)]
    assert [(s + i, t + i) for s, t, n in pieces for i in range(0, n, 64)] == expanded  # same bytes, same order
    halves = {block_geometry(p).half_stride, block_geometry(d).half_stride}
    assert all(x[2] <= min(halves) for x in pieces)
    if not d_kw.get("tp_size"):  # same heads on both sides: exactly one piece per (layer, block, K/V half)
        assert len(pieces) == p.num_layers * 4 * 2


def test_paired_ratio_is_the_median_of_per_repetition_speedups() -> None:
    assert paired_ratio([2.0, 3.0, 4.0], [1.0, 1.0, 1.0]) == 3.0  # kvsvc three times as fast, in the median rep
    assert paired_ratio([1.0, 1.0, 10.0], [2.0, 2.0, 1.0]) == 0.5  # one noisy repetition does not move it
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])


def test_run_orders_start_with_kvsvc_hold_every_run_once_and_vary_who_follows_whom() -> None:
    orders = run_orders(40, seed=1000)
    assert orders == run_orders(40, seed=1000)  # seeded: every bench run measures the same orders
    assert orders[0][0] == "kvsvc"
    assert all(sorted(o) == sorted(["kvsvc", *RAW_METHODS, RAW_SAMEHOST, "peer"]) for o in orders)
    after_peer = {o[o.index("peer") + 1] for o in orders if o[-1] != "peer"}
    assert len(after_peer) > 1  # kvsvc does not always run right after the peers' way


def test_a_target_is_met_on_its_side_of_the_bound() -> None:
    assert Target("ratio_to_raw", 0.9, 0.9, True).met and not Target("ratio_to_raw", 0.89, 0.9, True).met
    assert Target("descriptors_per_request", 28, 28, False).met
    assert not Target("descriptors_per_request", 29, 28, False).met


def test_the_cpu_split_counts_only_threads_seen_in_both_readings() -> None:
    """A thread that ended (or started) between the readings would otherwise count all its time, or minus it."""
    before = {("p_loop", 1, "1"): 2.0, ("p_threads", 1, "7"): 5.0, ("d_threads", 2, "9"): 1.0}
    after = {("p_loop", 1, "1"): 2.5, ("d_threads", 2, "9"): 1.25, ("d_loop", 2, "2"): 4.0}
    assert _thread_split(before, after) == {"p_loop": 0.5, "p_threads": 0.0, "d_loop": 0.0, "d_threads": 0.25}


def test_the_busy_ticks_count_only_the_cpus_given_and_leave_out_idle_iowait_and_guest() -> None:
    """The aggregate `cpu` line and CPUs outside the set would count time the bench could not use."""
    stat = (
        "cpu  100 100 100 100 100 100 100 100 100 100\n"
        "cpu0 1 2 3 40 5 6 7 8 90 90\n"
        "cpu1 10 20 30 400 50 60 70 80 900 900\n"
        "intr 12345 0 0\n"
        "cpu_other 1 1 1 1\n"
    )
    assert cpu_jiffies(stat, {0}) == (1 + 2 + 3 + 6 + 7 + 8, 72)
    assert cpu_jiffies(stat, {0, 1}) == (27 + 270, 72 + 720)
    assert cpu_jiffies(stat, {5}) == (0, 0)
