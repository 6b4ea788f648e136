"""Contract tests of `kvsvc.core.planner` (docs/design.md): source assignment, coalescing, routing and refusals.

Byte-level correctness of plans lives in test_simulator.py; this file pins the shapes, the descriptor counts of
the per-layer and cross-layer layouts, and the errors.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvsvc.cli.plan import synthetic_engine
from kvsvc.core.errors import TopologyError
from kvsvc.core.layout import CROSS_LAYER, block_bytes
from kvsvc.core.messages import ConvPart, KVGroup, MambaState, WorkerMetadata
from kvsvc.core.planner import (
    Descriptor,
    check_block_ids,
    check_compatible,
    expected_destinations,
    is_source,
    pitched_runs,
    plan_transfer,
    plan_transfer_arrays,
    release_notifier,
    source_heads,
    sources_of,
)
from kvsvc.core.staging_plans import count_runs


def engine(name: str = "P", **kw: Any) -> dict[tuple[int, int], WorkerMetadata]:
    args: dict[str, Any] = dict(
        pp_size=1, tp_size=1, num_layers=4, num_kv_heads=8, head_size=64, block_size=16, num_blocks=64, layer_gap=4096
    )
    args.update(kw)
    return synthetic_engine(name, base_addr=0x1000 if name == "P" else 0x10_0000_0000, **args)


def one(name: str = "P", rank: tuple[int, int] = (0, 0), **kw: Any) -> WorkerMetadata:
    return engine(name, **kw)[rank]


def test_descriptor_is_a_named_triple() -> None:
    d = Descriptor(1, 2, 3)
    assert d == (1, 2, 3) and (d.src_addr, d.dst_addr, d.length) == (1, 2, 3)


def test_same_layout_contiguous_blocks_is_one_descriptor_per_layer() -> None:
    p, d = one("P"), one("D")
    plan = plan_transfer(p, d, [4, 5, 6, 7], [10, 11, 12, 13])
    bb = block_bytes(p)
    assert plan == [Descriptor(p.base_addrs[i] + 4 * bb, d.base_addrs[i] + 10 * bb, 4 * bb) for i in range(4)]


def test_num_tokens_defaults_to_every_listed_d_block() -> None:
    p, d = one("P"), one("D")
    assert plan_transfer(p, d, [0, 1], [0, 1]) == plan_transfer(p, d, [0, 1], [0, 1], 32)
    assert sum(x.length for x in plan_transfer(p, d, [0, 1], [0, 1], 16)) == 4 * block_bytes(p)


def test_head_split_keeps_k_and_v_halves_apart_and_merges_nothing_else() -> None:
    p, d = one("P", tp_size=2), one("D", tp_size=4)
    plan = plan_transfer(p, d, [0, 1, 2], [0, 1, 2])
    assert len(plan) == 4 * 3 * 2
    assert all(x.length == 2 * 16 * 64 * 2 for x in plan)


def test_plans_are_sorted_deterministic_and_maximal() -> None:
    p, d = one("P", tp_size=2, block_size=32), one("D", rank=(0, 1), tp_size=4)
    ids_p, ids_d = [3, 1, 2], [5, 9, 6, 7, 8, 0]
    plan = plan_transfer(p, d, ids_p, ids_d, 90)
    assert plan == plan_transfer(p, d, ids_p, ids_d, 90) == sorted(plan)
    for a, b in itertools.pairwise(plan):
        assert not (a.src_addr + a.length == b.src_addr and a.dst_addr + a.length == b.dst_addr)
    src, dst, lengths = plan_transfer_arrays(p, d, ids_p, ids_d, 90)
    assert list(zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True)) == plan


def test_no_source_gives_an_empty_plan() -> None:
    p = engine("P", pp_size=2)
    d = engine("D", pp_size=2)
    assert plan_transfer(p[(0, 0)], d[(1, 0)], [0], [0]) == []
    assert not is_source(p[(0, 0)], d[(1, 0)])
    p_tp, d_tp = engine("P", tp_size=2), engine("D", tp_size=2)
    assert plan_transfer(p_tp[(0, 1)], d_tp[(0, 0)], [0], [0]) == []
    assert plan_transfer(p_tp[(0, 0)], d_tp[(0, 0)], [0], [0], 0) == []


def test_source_heads_split_and_gather() -> None:
    p, d = engine("P", tp_size=2), engine("D", tp_size=4)
    assert source_heads(p[(0, 1)], d[(0, 3)]) == [6, 7]
    assert source_heads(p[(0, 0)], d[(0, 3)]) == []
    p4, d1 = engine("P", tp_size=4), engine("D", tp_size=1)
    assert [source_heads(p4[(0, r)], d1[(0, 0)]) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_replicated_p_heads_spread_over_holders_by_d_rank() -> None:
    p = engine("P", tp_size=8, num_kv_heads=4)  # two P ranks per head
    d = engine("D", tp_size=2, num_kv_heads=4)
    assert [source_heads(p[(0, r)], d[(0, 0)]) for r in range(8)] == [[0], [], [1], [], [], [], [], []]
    assert [source_heads(p[(0, r)], d[(0, 1)]) for r in range(8)] == [[], [], [], [], [], [2], [], [3]]


def test_mla_d_ranks_round_robin_over_p_ranks() -> None:
    p = engine("P", tp_size=2, is_mla=True, num_kv_heads=1)
    d = engine("D", tp_size=4, is_mla=True, num_kv_heads=1)
    assert [sources_of(d[(0, r)], p) for r in range(4)] == [[(0, 0)], [(0, 1)], [(0, 0)], [(0, 1)]]
    assert source_heads(p[(0, 1)], d[(0, 3)]) == [0]


def test_routing_across_pp_stages() -> None:
    p = engine("P", pp_size=3, tp_size=2, num_layers=7)
    d = engine("D", pp_size=2, tp_size=4, num_layers=7)
    assert sources_of(d[(0, 1)], p) == [(0, 0), (1, 0)]
    assert sources_of(d[(1, 3)], p) == [(1, 1), (2, 1)]
    assert expected_destinations(p[(1, 0)], d) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert release_notifier(p[(1, 0)], d) is None


def test_release_notifier_is_the_first_overlapping_d_worker_of_an_idle_p_worker() -> None:
    p = engine("P", pp_size=2, tp_size=4, is_mla=True, num_kv_heads=1)
    d = engine("D", pp_size=2, tp_size=2, is_mla=True, num_kv_heads=1)
    idle = p[(1, 3)]
    assert expected_destinations(idle, d) == []
    assert release_notifier(idle, d) == (1, 0)
    assert release_notifier(p[(1, 1)], d) is None


def _refused(src: WorkerMetadata, dst: WorkerMetadata, *values: str) -> None:
    with pytest.raises(TopologyError) as info:
        check_compatible(src, dst)
    for value in values:
        assert value in str(info.value)
    with pytest.raises(TopologyError):
        plan_transfer(src, dst, [0], [0])


def test_fp8_formats_and_kv_scales_must_match_where_the_layers_meet() -> None:
    # An fp8 cache is uint8 in every format: only the published format and scales tell e4m3 from e5m2.
    def fp8(name: str, cache_dtype: str = "fp8_e4m3", scales: Any = ((1.0, 1.0),) * 4, **kw: Any) -> WorkerMetadata:
        meta = one(name, dtype="uint8", **kw)
        return msgspec.structs.replace(meta, cache_dtype=cache_dtype, kv_scales=list(scales))

    p = fp8("P")
    check_compatible(p, fp8("D"))
    check_compatible(p, fp8("D", "fp8"))  # vLLM's alias of fp8_e4m3
    check_compatible(one("P"), msgspec.structs.replace(one("D"), cache_dtype="auto"))  # "": the model's dtype
    check_compatible(
        msgspec.structs.replace(one("P"), cache_dtype="auto"), msgspec.structs.replace(one("D"), cache_dtype="bfloat16")
    )
    _refused(p, fp8("D", "fp8_e5m2"), "P kv_cache_dtype 'fp8_e4m3'", "D kv_cache_dtype 'fp8_e5m2'")
    scaled = [(1.0, 1.0), (1.0, 1.0), (0.5, 1.0), (1.0, 1.0)]
    _refused(p, fp8("D", scales=scaled), "layer 2", "(1.0, 1.0)", "(0.5, 1.0)")
    check_compatible(p, fp8("D", scales=scaled[:2], num_layers=2))  # only the layers both hold count
    _refused(fp8("P", scales=scaled[:1]), fp8("D"), "1 KV scales for 4 layers")


def test_mismatched_scalars_are_refused_naming_both_values() -> None:
    p = one("P")
    _refused(p, one("D", dtype="float16"), "P dtype 'bfloat16'", "D dtype 'float16'")
    _refused(p, one("D", head_size=128), "P head_size 64", "D head_size 128")
    _refused(p, one("D", num_kv_heads=4), "P num_kv_heads 8", "D num_kv_heads 4")
    _refused(p, one("D", is_mla=True), "P is_mla False", "D is_mla True")


def test_kv_cache_groups_must_match_and_a_mamba_slot_must_fit_a_block() -> None:
    full = [KVGroup(kind="full", layers=[0, 1, 2, 3])]
    halves = [KVGroup(kind="full", layers=[0, 1]), KVGroup(kind="full", layers=[2, 3])]
    p, d = one("P"), one("D")
    check_compatible(msgspec.structs.replace(p, kv_groups=full), msgspec.structs.replace(d, kv_groups=full))
    _refused(msgspec.structs.replace(p, kv_groups=full), msgspec.structs.replace(d, kv_groups=halves), "P has 1", "D 2")
    sliding = [KVGroup(kind="full", layers=[0, 2]), KVGroup(kind="sliding_window", layers=[1, 3], sliding_window=64)]
    check_compatible(msgspec.structs.replace(p, kv_groups=sliding), msgspec.structs.replace(d, kv_groups=sliding))
    _refused(msgspec.structs.replace(p, kv_groups=sliding), d, "P has 2 KV cache groups, D 0")
    wider = [sliding[0], msgspec.structs.replace(sliding[1], sliding_window=128)]
    _refused(msgspec.structs.replace(p, kv_groups=sliding), msgspec.structs.replace(d, kv_groups=wider), "64", "128")
    _refused(msgspec.structs.replace(p, kv_groups=sliding[:1]), d, "layers [1, 3] are in no group")
    state = MambaState(
        conv_parts=[ConvPart(channels=8, groups=2)], conv_width=3, conv_dtype="float32", ssm_heads=2, ssm_head_bytes=64
    )
    mamba = [sliding[0], KVGroup(kind="mamba", layers=[1, 3], mamba=state)]
    check_compatible(msgspec.structs.replace(p, kv_groups=mamba), msgspec.structs.replace(d, kv_groups=mamba))
    sd = [sliding[0], KVGroup(kind="mamba", layers=[1, 3], mamba=msgspec.structs.replace(state, conv_layout="SD"))]
    p2, d2 = one("P", tp_size=2), one("D", tp_size=2)
    check_compatible(msgspec.structs.replace(p2, kv_groups=sd), msgspec.structs.replace(d2, kv_groups=sd))
    _refused(
        msgspec.structs.replace(p2, kv_groups=sd),
        msgspec.structs.replace(d, kv_groups=sd),
        "P TP 2 and D TP 1 split the Mamba conv state",
        "it is SD (vLLM: VLLM_SSM_CONV_STATE_LAYOUT=DS)",
    )
    huge = [
        sliding[0],
        KVGroup(kind="mamba", layers=[1, 3], mamba=msgspec.structs.replace(state, ssm_head_bytes=1 << 20)),
    ]
    both = msgspec.structs.replace(p, kv_groups=huge), msgspec.structs.replace(d, kv_groups=huge)
    _refused(*both, "Mamba state slot of 2097248 bytes does not fit a block of", "P worker")


def test_two_pp_stages_compare_their_groups_on_the_layers_both_hold() -> None:
    p = msgspec.structs.replace(
        one("P"),
        kv_groups=[
            KVGroup(kind="full", layers=[0, 2]),
            KVGroup(kind="sliding_window", layers=[1, 3], sliding_window=8),
        ],
    )
    stage = msgspec.structs.replace(
        one("D"),
        pp_size=2,
        pp_rank=1,
        start_layer=2,
        end_layer=4,
        base_addrs=one("D").base_addrs[2:],
        kv_groups=[KVGroup(kind="full", layers=[2]), KVGroup(kind="sliding_window", layers=[3], sliding_window=8)],
    )
    check_compatible(p, stage)
    swapped = msgspec.structs.replace(
        stage,
        kv_groups=[KVGroup(kind="full", layers=[3]), KVGroup(kind="sliding_window", layers=[2], sliding_window=8)],
    )
    _refused(p, swapped, "KV cache group 0 differs")


def test_non_divisible_tp_is_refused_naming_both_sizes() -> None:
    _refused(one("P", tp_size=4, num_kv_heads=12), one("D", tp_size=6, num_kv_heads=12), "P tp_size 4", "D tp_size 6")


def test_uneven_heads_on_one_side_is_refused_naming_it() -> None:
    def six_heads(m: WorkerMetadata) -> WorkerMetadata:
        return msgspec.structs.replace(m, num_kv_heads=6)

    _refused(six_heads(one("P", tp_size=4)), six_heads(one("D", tp_size=2)), "P worker", "tp_size 4", "6")
    _refused(six_heads(one("P", tp_size=2)), six_heads(one("D", tp_size=4)), "D worker", "tp_size 4", "6")


def test_a_head_split_of_nhd_is_one_piece_per_token_and_two_head_orders_are_refused() -> None:
    plan = plan_transfer(one("P", layout="NHD"), one("D", tp_size=2, layout="NHD"), [0], [0])
    assert len(plan) == 4 * 2 * 16  # per layer, per K/V half, one piece per token of the block
    check_compatible(one("P", tp_size=4, layout="NHD"), one("D", tp_size=2, layout="NHD"))
    check_compatible(one("P", tp_size=2, layout="NHD"), one("D", tp_size=4))  # a split across two head orders
    check_compatible(one("P", tp_size=2, layout="NHD"), one("D", tp_size=1))
    _refused(one("P", tp_size=2, layout="NHD"), one("D", tp_size=2), "P layout NHD", "D layout HND", "transpose")


def test_different_head_order_with_several_heads_needs_a_staging_region_on_p() -> None:
    _refused(one("P", layout="NHD"), one("D", layout="HND"), "P layout NHD", "D layout HND", "staging region on P")
    check_compatible(one("P", tp_size=8, layout="NHD"), one("D", tp_size=8, layout="HND"))
    staged = msgspec.structs.replace(one("P", layout="NHD"), staging_addr=1 << 40, staging_size=1 << 20)
    check_compatible(staged, one("D", layout="HND"))  # P gathers the transposition into D's order


def test_the_fused_layout_pairs_only_with_itself_at_one_block_size() -> None:
    _refused(one("P", layout="HND_FUSED"), one("D", layout="HND"), "P layout HND_FUSED", "D layout HND", "opaque")
    _refused(one("P", layout="HND"), one("D", layout="HND_FUSED"), "P layout HND", "D layout HND_FUSED")
    _refused(
        one("P", layout="HND_FUSED", block_size=32),
        one("D", layout="HND_FUSED", block_size=64),
        "P block_size 32",
        "D block_size 64",
    )
    check_compatible(one("P", layout="HND_FUSED", tp_size=1), one("D", layout="HND_FUSED", tp_size=2))


def test_fused_chunks_go_whole_even_for_a_head_split_and_a_partial_block() -> None:
    p, d = one("P", layout="HND_FUSED"), one("D", layout="HND_FUSED", tp_size=2)
    plan = plan_transfer(p, d, [0, 1], [4, 5], 17, whole_blocks=False)
    # D's four heads of each of the two blocks, one (block, head-run) chunk each: 16 tokens x 2 x 64 x 2 bytes.
    chunk = 16 * 2 * 64 * 2
    assert sorted({x.length for x in plan}) == [4 * chunk]
    assert len(plan) == 4 * 2


def test_kv_first_layouts_write_k_and_v_planes_apart() -> None:
    p, d = one("P", layout="KV_NHD"), one("D", layout="KV_NHD")
    plan = plan_transfer(p, d, [2, 3, 4], [7, 8, 9])
    half = 16 * 8 * 64 * 2  # one block of K (or of V)
    plane = 64 * half  # the K plane of a layer: every block of it
    assert len(plan) == 4 * 2
    assert {x.length for x in plan} == {3 * half}
    k, v = plan[0], plan[1]
    assert (v.src_addr - k.src_addr, v.dst_addr - k.dst_addr) == (plane, plane)
    assert k.src_addr == p.base_addrs[0] + 2 * half and k.dst_addr == d.base_addrs[0] + 7 * half


def test_malformed_metadata_is_refused_naming_the_side() -> None:
    d = one("D")
    _refused(msgspec.structs.replace(one("P"), base_addrs=[1]), d, "P worker", "1 base_addrs for 4 layers")
    _refused(one("P"), msgspec.structs.replace(d, layout="XYZ"), "D worker", "'XYZ'")
    _refused(one("P"), msgspec.structs.replace(d, dtype="int4"), "int4")


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "tokens", "match"),
    [
        ([0], [0], -1, "negative"),
        ([0], [0, 1], 32, "P: 1 block ids"),
        ([0, 1], [0], 32, "D: 1 block ids"),
        ([0, 64], [0, 1], None, "outside"),
        ([0, 1], [3, 3], None, "repeated"),
    ],
)
def test_bad_requests_are_value_errors(src_ids: list[int], dst_ids: list[int], tokens: int | None, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        plan_transfer(one("P"), one("D"), src_ids, dst_ids, tokens)
    assert not isinstance(info.value, TopologyError)


def test_a_prefix_d_holds_already_is_skipped_and_bad_first_tokens_refused() -> None:
    p, d = one("P"), one("D")
    whole = plan_transfer(p, d, [0, 1, 2], [5, 6, 7], 48)
    tail = plan_transfer(p, d, [0, 1, 2], [5, 6, 7], 48, first_token=16)
    bb = block_bytes(p)
    assert tail == [Descriptor(x.src_addr + bb, x.dst_addr + bb, x.length - bb) for x in whole]
    assert plan_transfer(p, d, [0, 1, 2], [5, 6, 7], 48, first_token=48) == []
    with pytest.raises(ValueError, match="first_token 49 outside"):
        plan_transfer(p, d, [0, 1, 2], [5, 6, 7], 48, first_token=49)
    fused_p, fused_d = one("P", layout="HND_FUSED"), one("D", layout="HND_FUSED")
    with pytest.raises(ValueError, match="first_token 8 cuts a block of 16 tokens"):
        plan_transfer(fused_p, fused_d, [0, 1], [0, 1], 32, first_token=8)


def test_whole_blocks_only_completes_the_current_blocks() -> None:
    p, d = one("P"), one("D", block_size=32)
    plan = plan_transfer(p, d, [0, 1], [0], 20)
    assert sum(x.length for x in plan) == 4 * 32 * 2 * 8 * 64 * 2
    exact = plan_transfer(p, d, [0, 1], [0], 20, whole_blocks=False)
    assert sum(x.length for x in exact) == 4 * 20 * 2 * 8 * 64 * 2


def test_a_head_split_completes_its_last_block_so_a_gather_keeps_one_run_per_layer() -> None:
    """A request that ends inside a block: each D worker of a head split gets its heads' slots of the last block
    whole, so its destination is one run per layer as for whole blocks, where the exact plan breaks it at every head
    and K/V half of the last block (a gather's descriptors grow fourfold then)."""
    p = one("P", num_kv_heads=4)
    runs = {}
    for rank in range(2):
        d = one("D", (0, rank), num_kv_heads=4, tp_size=2)
        for whole in (True, False):
            _, dst, length = plan_transfer_arrays(p, d, [0, 1, 2], [5, 6, 7], 40, whole_blocks=whole)
            runs[rank, whole] = count_runs(dst, length)
            slots = 2 * 48 if whole else 2 * 40  # K and V, per head and layer
            assert int(length.sum()) == 4 * slots * 2 * 64 * 2  # layers * slots * local heads * head_size * bf16
    assert runs[0, True] == runs[1, True] == 4  # one per layer
    assert runs[0, False] == runs[1, False] == 4 * 4  # the last block's K and V of each head apart


def test_cross_layer_pools_move_a_run_of_contiguous_blocks_in_one_descriptor() -> None:
    p, d = one("P", layout=CROSS_LAYER), one("D", layout=CROSS_LAYER)
    stride = 4 * block_bytes(p)  # one block of the pool: all 4 layers
    assert plan_transfer(p, d, [4, 5, 6, 7], [10, 11, 12, 13]) == [
        Descriptor(p.base_addrs[0] + 4 * stride, d.base_addrs[0] + 10 * stride, 4 * stride)
    ]
    # A partial last block is completed, so it still merges with the rest.
    assert len(plan_transfer(p, d, [4, 5, 6, 7], [10, 11, 12, 13], 50)) == 1
    scattered = plan_transfer(p, d, [0, 1, 2, 3], [7, 8, 2, 5])
    assert [x.length for x in scattered] == [2 * stride, stride, stride]


def test_cross_layer_mla_pools_merge_all_layers_too() -> None:
    p = one("P", layout=CROSS_LAYER, is_mla=True, num_kv_heads=1, tp_size=2)
    d = one("D", layout=CROSS_LAYER, is_mla=True, num_kv_heads=1)
    assert len(plan_transfer(p, d, [0, 1, 2], [3, 4, 5])) == 1


def test_cross_layer_pp_change_gives_one_descriptor_per_block_per_overlap() -> None:
    p = engine("P", layout=CROSS_LAYER, pp_size=2, num_layers=4)
    d = one("D", layout=CROSS_LAYER, num_layers=4)
    bb = block_bytes(d)
    for stage in range(2):
        plan = plan_transfer(p[(stage, 0)], d, [0, 1, 2], [0, 1, 2])
        # Each P stage's 2 layers are contiguous inside every block on both sides, but D's blocks interleave
        # the layers of the other stage.
        assert [x.length for x in plan] == [2 * bb] * 3
        assert [x.dst_addr - d.base_addrs[0] for x in plan] == [b * 4 * bb + stage * 2 * bb for b in range(3)]


def test_mixed_layouts_merge_within_a_block_of_one_layer_only() -> None:
    pool, per_layer = one("P", layout=CROSS_LAYER), one("D")
    plan = plan_transfer(pool, per_layer, [0, 1, 2], [0, 1, 2])
    assert len(plan) == 4 * 3 and {x.length for x in plan} == {block_bytes(pool)}
    back = plan_transfer(one("P"), one("D", layout=CROSS_LAYER), [0, 1, 2], [0, 1, 2])
    assert len(back) == 4 * 3


def test_cross_layer_head_split_and_head_order_rules() -> None:
    plan = plan_transfer(one("P", tp_size=2, layout=CROSS_LAYER), one("D", tp_size=4, layout=CROSS_LAYER), [0], [0])
    assert len(plan) == 4 * 2  # K and V of each layer, one head range each
    check_compatible(one("P", tp_size=4), one("D", tp_size=2, layout=CROSS_LAYER))
    check_compatible(one("P", tp_size=8, layout="NHD"), one("D", tp_size=8, layout=CROSS_LAYER))
    _refused(one("P", layout="NHD"), one("D", layout=CROSS_LAYER), "P layout NHD", "D layout HND_CROSS_LAYER")
    check_compatible(one("P", tp_size=4, layout=CROSS_LAYER), one("D", tp_size=2, layout="NHD"))


def test_cross_layer_needs_exactly_one_base_addr_naming_the_side() -> None:
    pool = one("D", layout=CROSS_LAYER)
    _refused(one("P"), msgspec.structs.replace(pool, base_addrs=[1, 2]), "D worker", "2 base_addrs", CROSS_LAYER)
    _refused(msgspec.structs.replace(pool, base_addrs=[]), one("D"), "P worker", "0 base_addrs", CROSS_LAYER)
    # A per-layer worker publishing one address for its 4 layers is refused too.
    _refused(one("P"), msgspec.structs.replace(pool, layout="HND"), "D worker", "1 base_addrs for 4 layers")


def test_4096_tokens_of_32_cross_layer_layers_plan_to_one_descriptor_per_block_run() -> None:
    p = one("P", layout=CROSS_LAYER, num_layers=32, num_blocks=512, head_size=128)
    d = one("D", layout=CROSS_LAYER, num_layers=32, num_blocks=512, head_size=128)
    scattered = random.Random(0).sample(range(512), 256)
    assert len(plan_transfer(p, d, range(256), range(256), 4096)) == 1
    # Planning speed is shown by `kvsvc plan` (it prints the time), never asserted here.
    plan = plan_transfer(p, d, range(256), scattered, 4096)
    runs = 1 + sum(1 for a, b in itertools.pairwise(scattered) if b != a + 1)
    assert len(plan) == runs
    assert sum(x.length for x in plan) == 4096 * 32 * 2 * 8 * 128 * 2


def test_a_repeated_d_block_id_is_found_in_one_pass_over_any_length_of_list() -> None:
    # A D worker's request comes from the network: 400,000 ids with one repeat used to be counted id by id (about
    # 160 billion comparisons, past this test's timeout); now it is one pass, and the refusal names the repeat.
    d = engine("D", num_blocks=1 << 20)[(0, 0)]
    ids = [*range(400_000), 7]
    with pytest.raises(ValueError, match=r"D block ids \[7\] appear more than once"):
        check_block_ids(d, ids, len(ids) * d.block_size, "D")


@pytest.mark.parametrize("side", ["P", "D"])
def test_the_null_block_of_a_sliding_window_is_no_block_of_the_request(side: str) -> None:
    groups = [
        KVGroup(kind="full", layers=[0, 2]),
        KVGroup(kind="sliding_window", layers=[1], sliding_window=40),
        KVGroup(kind="sliding_window", layers=[3], sliding_window=40),
    ]
    meta = msgspec.structs.replace(engine(side)[(0, 0)], kv_groups=groups, null_block=0)
    # 96 tokens of 16: D's next step reads from token 57 (block 3), so vLLM dropped blocks 0-2 of each window's list,
    # one more than the blocks kvsvc would move for a window of 40 (from block 2).
    full, first, second = list(range(1, 7)), [0, 0, 0, 11, 12, 13], [0, 0, 0, 21, 22, 23]
    check_block_ids(meta, full + first + second, 96, side)  # six null blocks: no repeat, nothing written there
    with pytest.raises(ValueError, match="null block 0 stands at position 4"):
        check_block_ids(meta, [*full, 0, 0, 0, 11, 0, 13, *second], 96, side)
    with pytest.raises(ValueError, match="reads from token 57"):
        check_block_ids(meta, full + first + [0, 0, 0, 0, 22, 23], 96, side)
    if side == "D":  # an engine without a null block: id 0 is a block like any other, written twice here
        plain = msgspec.structs.replace(meta, null_block=-1)
        with pytest.raises(ValueError, match=r"D block ids \[0\] appear more than once"):
            check_block_ids(plain, full + first + second, 96, side)


# -- pitched runs (the GPU plane's 2D copies) ------------------------------------------------------------------


def _rows_of(runs: np.ndarray, rest: np.ndarray) -> list[tuple[int, int, int]]:
    rows = [(s, d, n) for s, d, n in rest.tolist()]
    for src, dst, width, height, src_pitch, dst_pitch in runs.tolist():
        rows += [(src + i * src_pitch, dst + i * dst_pitch, width) for i in range(height)]
    return sorted(rows)


stretch = st.tuples(
    st.integers(0, 64), st.integers(1, 12), st.integers(-2, 40), st.integers(-2, 40), st.integers(-1, 100)
)


@given(st.lists(stretch, max_size=8), st.integers(0, 9))
@example([(0, 1, 0, 0, -1)], 0)  # a first stretch that goes on from no earlier row
def test_pitched_runs_take_whole_rows_at_constant_pitches_and_leave_the_rest(
    stretches: list[tuple[int, int, int, int, int]], min_rows: int
) -> None:
    # Each stretch is `height` rows of `width` bytes at pitches width + extra (an extra below 0 breaks the pitch:
    # such rows overlap or step backwards and must stay single); stretches sit one after another, gap apart, or
    # (gap -1) go on from the previous stretch's last row at their own pitches, so two runs meet at a row.
    rows: list[tuple[int, int, int]] = []
    src, dst = 0, 1 << 40
    for width, height, extra_src, extra_dst, gap in stretches:
        shared = gap < 0 and bool(rows) and rows[-1][2] == width
        if shared:
            src, dst = rows[-1][0], rows[-1][1]
        rows += [
            (src + i * (width + extra_src), dst + i * (width + extra_dst), width) for i in range(int(shared), height)
        ]
        src += height * (width + abs(extra_src)) + max(gap, 0) + 64
        dst += 1 << 20
    rows.sort()
    table = np.array(rows, dtype=np.int64).reshape(-1, 3)
    runs, rest = pitched_runs(table, min_rows)
    assert _rows_of(runs, rest) == rows
    assert all(h >= max(2, min_rows) and w > 0 and sp >= w and dp >= w for _, _, w, h, sp, dp in runs.tolist())
    remaining = iter(rows)
    assert all(tuple(r) in remaining for r in rest.tolist())  # the rest keeps the table's order


def test_where_two_pitched_runs_meet_the_row_goes_to_the_first() -> None:
    first = [(i * 16, i * 16, 8) for i in range(10)]
    second = [(144 + i * 32, 144 + i * 64, 8) for i in range(1, 6)]  # goes on from row 9 at other pitches
    runs, rest = pitched_runs(np.array(first + second, dtype=np.int64), 4)
    assert runs.tolist() == [[0, 0, 8, 10, 16, 16], [176, 208, 8, 5, 32, 64]] and len(rest) == 0


def test_a_head_split_plan_is_one_pitched_run_per_layer() -> None:
    # P at TP 2 into D at TP 1 (HND): P's K and V of a block are next to one another, D's sit half a block apart, so
    # every row of a layer steps by one pitch on each side.
    p, d = one("P", tp_size=2), one("D")
    table = np.stack(plan_transfer_arrays(p, d, list(range(8)), list(range(8, 16))), axis=1)
    runs, rest = pitched_runs(table, 8)
    assert len(table) == 4 * 8 * 2 and runs[:, 3].tolist() == [16] * 4 and len(rest) == 0
    assert _rows_of(runs, rest) == sorted(map(tuple, table.tolist()))
