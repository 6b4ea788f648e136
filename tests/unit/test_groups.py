"""Hybrid models' KV cache groups in the pure core: which blocks of each group move, and a byte-exact simulator of
Mamba state slots between P and D at any two TP sizes (hypothesis), with the bad inputs refused naming values."""

from __future__ import annotations

import random
from collections.abc import Callable
from math import lcm

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsvc.cli.plan import synthetic_engine
from kvsvc.core.errors import TopologyError
from kvsvc.core.groups import (
    CHUNKED_LOCAL,
    FULL,
    MAMBA,
    SLIDING_WINDOW,
    ConvPart,
    KVGroup,
    MambaState,
    blocks_to_move,
    check_groups,
    check_same_groups,
    first_read_token,
    leading_null_blocks,
    plan_state,
    state_bytes,
    window_first_token,
)
from kvsvc.core.layout import block_geometry, dtype_size, layer_addrs, layer_bytes
from kvsvc.core.messages import WorkerMetadata
from kvsvc.core.planner import plan_transfer, sources_of
from kvsvc.vllm.kv_layout import GroupView, kv_groups_of

TP_SIZES = (1, 2, 4, 8)


# -- blocks of each group ------------------------------------------------------------------------------------------


@given(
    window=st.integers(1, 300),
    block_size=st.sampled_from([1, 4, 16, 32]),
    tokens=st.integers(1, 2000),
    extra=st.integers(0, 3),
)
def test_a_sliding_window_group_moves_the_blocks_of_its_window_and_at_most_one_more(
    window: int, block_size: int, tokens: int, extra: int
) -> None:
    group = KVGroup(kind=SLIDING_WINDOW, layers=[0], sliding_window=window)
    needed = -(-tokens // block_size)
    moved = blocks_to_move(group, needed + extra, block_size, tokens)
    attended = {t // block_size for t in range(max(0, tokens - window), tokens)}
    assert attended <= set(moved)  # every token the next one attends to lands on D
    assert len(moved) <= -(-window // block_size) + 1
    assert moved.stop == needed  # nothing past the prompt's blocks
    full = blocks_to_move(KVGroup(kind=FULL, layers=[0]), needed + extra, block_size, tokens)
    assert full == range(needed) and set(moved) <= set(full)


@given(
    chunk=st.sampled_from([16, 32, 48, 64, 128, 8192]),
    block_size=st.sampled_from([4, 16, 32]),
    d_block_size=st.sampled_from([4, 16, 32]),
    tokens=st.integers(1, 2000),
)
def test_a_chunked_local_group_moves_the_blocks_of_the_next_tokens_chunk(
    chunk: int, block_size: int, d_block_size: int, tokens: int
) -> None:
    # Token `tokens` (the one D computes next) attends to its chunk's tokens before it; nothing earlier is read,
    # and vLLM has made those blocks its null block on both sides.
    group = KVGroup(kind=CHUNKED_LOCAL, layers=[0], attention_chunk=chunk)
    start = tokens // chunk * chunk
    assert first_read_token(group, tokens) == start
    needed = -(-tokens // block_size)
    moved = blocks_to_move(group, needed, block_size, tokens)
    assert {t // block_size for t in range(start, tokens)} <= set(moved) and moved.stop == needed
    assert moved.start == start // block_size  # the blocks before hold no token D reads
    first = window_first_token(group, tokens, block_size, d_block_size)
    assert first <= start and first % block_size == first % d_block_size == 0
    nulls = [0] * (start // block_size)
    assert leading_null_blocks(group, [*nulls, *range(1, needed - len(nulls) + 1)], 0) == len(nulls)


def test_a_chunked_local_group_needs_its_chunk_and_only_that_kind_has_one() -> None:
    with pytest.raises(TopologyError, match="attention_chunk 0 does not fit the kind"):
        check_groups([KVGroup(kind=CHUNKED_LOCAL, layers=[0])], 1)
    with pytest.raises(TopologyError, match="attention_chunk 64 does not fit the kind"):
        check_groups([KVGroup(kind=FULL, layers=[0], attention_chunk=64)], 1)
    views = [
        GroupView("FullAttentionSpec", ("model.layers.3.self_attn.attn",)),
        GroupView("ChunkedLocalAttentionSpec", tuple(f"model.layers.{i}.self_attn.attn" for i in range(3)), 0, 64),
    ]
    assert kv_groups_of(views) == [
        KVGroup(kind=FULL, layers=[3]),
        KVGroup(kind=CHUNKED_LOCAL, layers=[0, 1, 2], attention_chunk=64),
    ]


def test_a_mamba_group_moves_its_last_slot_and_a_short_block_list_is_refused() -> None:
    state = MambaState(conv_parts=[ConvPart(8, 2)], conv_width=3, conv_dtype="float32", ssm_heads=2, ssm_head_bytes=16)
    group = KVGroup(kind=MAMBA, layers=[1], mamba=state)
    assert blocks_to_move(group, 3, 16, 40) == range(2, 3)
    with pytest.raises(TopologyError, match="no state slot"):
        blocks_to_move(group, 0, 16, 40)
    with pytest.raises(TopologyError, match="40 tokens need 3 blocks of 16; the request has 2"):
        blocks_to_move(KVGroup(kind=FULL, layers=[0]), 2, 16, 40)


def test_groups_that_miss_a_layer_or_misfit_their_kind_are_refused_naming_it() -> None:
    state = MambaState(conv_parts=[ConvPart(8, 2)], conv_width=3, conv_dtype="float32", ssm_heads=2, ssm_head_bytes=16)
    good = [KVGroup(kind=FULL, layers=[0, 2]), KVGroup(kind=MAMBA, layers=[1], mamba=state)]
    check_groups(good, 3)
    with pytest.raises(TopologyError, match=r"layers \[2\] are in no group"):
        check_groups([KVGroup(kind=FULL, layers=[0, 1])], 3)
    with pytest.raises(TopologyError, match="layer 1 is in group 0 too"):
        check_groups([KVGroup(kind=FULL, layers=[0, 1]), KVGroup(kind=MAMBA, layers=[1], mamba=state)], 2)
    with pytest.raises(TopologyError, match="sliding_window 0 does not fit"):
        check_groups([KVGroup(kind=SLIDING_WINDOW, layers=[0])], 1)
    with pytest.raises(TopologyError, match="a Mamba state is required"):
        check_groups([KVGroup(kind=MAMBA, layers=[0])], 1)
    with pytest.raises(TopologyError, match="unknown kind"):
        check_groups([KVGroup(kind="linear", layers=[0])], 1)
    other = [good[0], KVGroup(kind=SLIDING_WINDOW, layers=[1], sliding_window=128)]
    with pytest.raises(TopologyError, match=r"KV cache group 1 differs: P .*mamba.*, D .*sliding_window"):
        check_same_groups(good, other)
    with pytest.raises(TopologyError, match="P has 2 KV cache groups, D 1"):
        check_same_groups(good, good[:1])


# -- Mamba state slots, byte exact ---------------------------------------------------------------------------------


def _holds(groups: int, tp: int, rank: int) -> list[int]:
    """vLLM's split, written out: a rank holds `groups / tp` groups, or, with more ranks than groups, the one
    group `rank * groups // tp` (Mamba2 extends its B/C groups so that each rank has one)."""
    if groups >= tp:
        return list(range(rank * groups // tp, (rank + 1) * groups // tp))
    return [rank * groups // tp]


def _rank_slot(state: MambaState, whole: list[bytes], ssm: bytes, tp: int, rank: int) -> bytes:
    """What rank `rank` of `tp` holds in its slot, cut from the whole model's state (`whole`: each conv part's
    bytes; `ssm`: every head's)."""
    row = state.conv_width * dtype_size(state.conv_dtype)
    out = b""
    for part, data in zip(state.conv_parts, whole, strict=True):
        unit = part.channels // part.groups * row
        out += b"".join(data[g * unit : (g + 1) * unit] for g in _holds(part.groups, tp, rank))
    head = state.ssm_head_bytes
    return out + b"".join(ssm[h * head : (h + 1) * head] for h in _holds(state.ssm_heads, tp, rank))


@st.composite
def states(draw: st.DrawFn) -> MambaState:
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        groups = draw(st.sampled_from([1, 2, 4, 8, 16]))
        parts.append(ConvPart(groups * draw(st.integers(1, 3)), groups))
    heads = draw(st.sampled_from([0, 1, 2, 4, 8, 16]))  # 0: a short conv, which keeps no SSM state
    return MambaState(
        conv_parts=parts,
        conv_width=draw(st.integers(1, 4)),
        conv_dtype=draw(st.sampled_from(["bfloat16", "float32"])),
        ssm_heads=heads,
        ssm_head_bytes=draw(st.integers(1, 48)) if heads else 0,
    )


@given(state=states(), p_size=st.sampled_from(TP_SIZES), d_size=st.sampled_from(TP_SIZES), seed=st.integers(0, 99))
def test_every_d_rank_gets_exactly_its_slice_of_every_conv_part_and_ssm_head(
    state: MambaState, p_size: int, d_size: int, seed: int
) -> None:
    rng = random.Random(seed)
    row = state.conv_width * dtype_size(state.conv_dtype)
    whole = [rng.randbytes(p.channels * row) for p in state.conv_parts]
    ssm = rng.randbytes(state.ssm_heads * state.ssm_head_bytes)
    p_slots = [_rank_slot(state, whole, ssm, p_size, r) for r in range(p_size)]
    assert all(len(s) == state_bytes(state, p_size) for s in p_slots)
    for d_rank in range(d_size):
        slot = bytearray(state_bytes(state, d_size))
        written = [0] * len(slot)
        for p_rank in range(p_size):
            for run in plan_state(state, (p_rank, p_size), (d_rank, d_size)):
                chunk = p_slots[p_rank][run.src_offset : run.src_offset + run.length]
                assert len(chunk) == run.length  # inside P's slot
                slot[run.dst_offset : run.dst_offset + run.length] = chunk
                for i in range(run.dst_offset, run.dst_offset + run.length):
                    written[i] += 1
        assert bytes(slot) == _rank_slot(state, whole, ssm, d_size, d_rank)
        assert set(written) == {1}  # every byte of D's slot written once, by one P rank


def test_the_same_tp_on_both_sides_is_one_run_per_slot() -> None:
    # Mamba2 at 8 heads of 8 channels, 4 B/C groups of 16 channels: x, B, C.
    parts = [ConvPart(64, 8), ConvPart(64, 4), ConvPart(64, 4)]
    state = MambaState(conv_parts=parts, conv_width=3, conv_dtype="bfloat16", ssm_heads=8, ssm_head_bytes=64 * 128 * 4)
    for tp in (1, 2, 4):
        for rank in range(tp):
            assert plan_state(state, (rank, tp), (rank, tp)) == [(0, 0, state_bytes(state, tp))]
            assert all(not plan_state(state, (other, tp), (rank, tp)) for other in range(tp) if other != rank)


def test_sizes_that_do_not_split_over_a_sides_tp_are_refused_naming_them() -> None:
    state = MambaState(conv_parts=[ConvPart(6, 3)], conv_width=3, conv_dtype="float32", ssm_heads=4, ssm_head_bytes=8)
    with pytest.raises(TopologyError, match="conv part 0: 3 groups do not split over TP 2"):
        plan_state(state, (0, 1), (0, 2))
    odd_heads = MambaState(
        conv_parts=[ConvPart(8, 8)], conv_width=3, conv_dtype="float32", ssm_heads=6, ssm_head_bytes=8
    )
    with pytest.raises(TopologyError, match="SSM heads: 6 groups do not split over TP 4"):
        plan_state(odd_heads, (0, 1), (0, 4))
    uneven = MambaState(conv_parts=[ConvPart(7, 2)], conv_width=3, conv_dtype="float32", ssm_heads=4, ssm_head_bytes=8)
    with pytest.raises(TopologyError, match="conv part 0: 7 channels are not 2 equal groups"):
        state_bytes(uneven, 2)


# -- state slots through the planner, byte exact -------------------------------------------------------------------

SLOT_STATE = MambaState(
    conv_parts=[ConvPart(16, 4), ConvPart(4, 2), ConvPart(4, 2)],  # Mamba2's x (4 heads), B and C (2 groups)
    conv_width=3,
    conv_dtype="float32",
    ssm_heads=4,
    ssm_head_bytes=32,
)


def _hybrid_engine(
    name: str, tp: int, state: MambaState = SLOT_STATE, heads: int = 8, head_size: int = 8
) -> dict[tuple[int, int], WorkerMetadata]:
    """Layer 0 keeps Mamba state, layer 1 full attention; addresses are offsets into one arena per worker."""
    engine = synthetic_engine(
        name, pp_size=1, tp_size=tp, num_layers=2, num_kv_heads=heads, head_size=head_size, dtype="float16",
        block_size=16, num_blocks=8, base_addr=0, layer_gap=0,
    )  # fmt: skip
    groups = [KVGroup(kind=MAMBA, layers=[0], mamba=state), KVGroup(kind=FULL, layers=[1])]
    return {key: msgspec.structs.replace(meta, kv_groups=groups) for key, meta in engine.items()}


def _end(engine: dict[tuple[int, int], WorkerMetadata]) -> int:
    return max(layer_addrs(m)[-1] + layer_bytes(m) for m in engine.values())


def _moved(
    p_engine: dict[tuple[int, int], WorkerMetadata],
    d_engine: dict[tuple[int, int], WorkerMetadata],
    p_arena: bytearray,
    p_ids: list[int],
    d_ids: list[int],
) -> tuple[bytearray, list[int]]:
    """Every D worker's plan from every P worker carried out over 40 tokens: D's arena, and how often each byte was
    written."""
    d_arena, writes = bytearray(_end(d_engine)), [0] * _end(d_engine)
    for d_meta in d_engine.values():
        for p_meta in p_engine.values():
            for src, dst, length in plan_transfer(p_meta, d_meta, p_ids, d_ids, 40):
                d_arena[dst : dst + length] = p_arena[src : src + length]
                writes[dst : dst + length] = [w + 1 for w in writes[dst : dst + length]]
    return d_arena, writes


@given(
    tps=st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2), (4, 2), (1, 4), (4, 4)]),
    p_slot=st.integers(1, 7),
    d_slot=st.integers(1, 7),
    seed=st.integers(0, 99),
)
def test_the_planner_writes_every_d_ranks_state_slot_byte_exact(
    tps: tuple[int, int], p_slot: int, d_slot: int, seed: int
) -> None:
    p_tp, d_tp = tps
    rng = random.Random(seed)
    row = SLOT_STATE.conv_width * dtype_size(SLOT_STATE.conv_dtype)
    whole = [rng.randbytes(part.channels * row) for part in SLOT_STATE.conv_parts]
    ssm = rng.randbytes(SLOT_STATE.ssm_heads * SLOT_STATE.ssm_head_bytes)
    p_engine, d_engine = _hybrid_engine("P", p_tp), _hybrid_engine("D", d_tp)
    # 40 tokens in 3 blocks, the groups in turn: the Mamba group's slot behind the null block, then the attention's.
    p_ids = [0, 0, p_slot, *[i for i in range(1, 8) if i != p_slot][:3]]
    d_ids = [0, 0, d_slot, *[i for i in range(1, 8) if i != d_slot][:3]]
    p_arena = bytearray(_end(p_engine))
    for (_, p_rank), p_meta in p_engine.items():
        slot = layer_addrs(p_meta)[0] + p_slot * block_geometry(p_meta).block_stride
        data = _rank_slot(SLOT_STATE, whole, ssm, p_tp, p_rank)
        p_arena[slot : slot + len(data)] = data
    d_arena, writes = _moved(p_engine, d_engine, p_arena, p_ids, d_ids)
    for (_, d_rank), d_meta in d_engine.items():
        state = layer_addrs(d_meta)[0]  # layer 0's tensor
        slot = state + d_slot * block_geometry(d_meta).block_stride
        want = _rank_slot(SLOT_STATE, whole, ssm, d_tp, d_rank)
        assert bytes(d_arena[slot : slot + len(want)]) == want
        assert set(writes[slot : slot + len(want)]) == {1}  # every byte of the slot once
        assert sum(writes[state : state + layer_bytes(d_meta)]) == state_bytes(SLOT_STATE, d_tp)  # nothing else
        assert sources_of(d_meta, p_engine)  # routing counts the state's sources


# -- Gated DeltaNet state, as vLLM shapes and splits it, through the planner ---------------------------------------


def _gdn_of(dims: tuple[int, int, int, int], width: int, tp: int) -> MambaState:
    """The state kvsvc describes from vLLM's per-rank shapes (DS layout) of a GDN layer at `tp`."""
    k_heads, v_heads, k_dim, v_dim = dims
    view = GroupView(
        "MambaSpec", ("model.layers.0.linear_attn",), mamba_type="GDN_ATTN",
        shapes=(((2 * k_heads * k_dim + v_heads * v_dim) // tp, width), (v_heads // tp, v_dim, k_dim)),
        dtypes=("bfloat16", "float32"), tp_size=tp, conv_layout="DS", gdn_dims=dims,
    )  # fmt: skip
    (group,) = kv_groups_of([view])
    assert group.mamba is not None
    return group.mamba


def _vllm_gdn_slot(parts: list[bytes], recurrent: bytes, tp: int, rank: int) -> bytes:
    """vLLM's slot of rank `rank` of `tp`, written out as its weight loader and shapes split it: of each of Q, K
    and V (`parts`, the whole model's channel rows) the rank's contiguous `1 / tp` of the channels, one after
    another, then its `1 / tp` of the value heads' recurrent state."""
    out = b"".join(data[rank * len(data) // tp : (rank + 1) * len(data) // tp] for data in parts)
    return out + recurrent[rank * len(recurrent) // tp : (rank + 1) * len(recurrent) // tp]


def _assert_slots_move(
    state: MambaState, tps: tuple[int, int], slots: tuple[int, int], vllm_slot: Callable[[int, int], bytes]
) -> None:
    """Fill each P rank's state slot (`slots[0]`) with `vllm_slot(tp, rank)`, vLLM's bytes for that rank, run every
    plan, and check each D rank's slot (`slots[1]`): its own `vllm_slot` bytes, each written once, by one P rank,
    and nothing else of the state tensor written."""
    p_tp, d_tp = tps
    p_engine, d_engine = _hybrid_engine("P", p_tp, state, 12, 32), _hybrid_engine("D", d_tp, state, 12, 32)
    p_slot, d_slot = slots
    p_ids = [0, 0, p_slot, *[i for i in range(1, 8) if i != p_slot][:3]]
    d_ids = [0, 0, d_slot, *[i for i in range(1, 8) if i != d_slot][:3]]
    p_arena = bytearray(_end(p_engine))
    for (_, p_rank), p_meta in p_engine.items():
        slot = layer_addrs(p_meta)[0] + p_slot * block_geometry(p_meta).block_stride
        data = vllm_slot(p_tp, p_rank)
        assert len(data) == state_bytes(state, p_tp)
        p_arena[slot : slot + len(data)] = data
    d_arena, writes = _moved(p_engine, d_engine, p_arena, p_ids, d_ids)
    for (_, d_rank), d_meta in d_engine.items():
        tensor = layer_addrs(d_meta)[0]
        slot = tensor + d_slot * block_geometry(d_meta).block_stride
        want = vllm_slot(d_tp, d_rank)
        assert bytes(d_arena[slot : slot + len(want)]) == want
        assert set(writes[slot : slot + len(want)]) == {1}  # every byte of the slot once, by one P rank
        assert sum(writes[tensor : tensor + layer_bytes(d_meta)]) == len(want)  # nothing else in the state tensor


# Every pair of TP sizes 1 to 4 that the planner takes: one divides the other (3 against 2 or 4 is refused).
TP_PAIRS_TO_4 = [(p, d) for p in range(1, 5) for d in range(1, 5) if max(p, d) % min(p, d) == 0]


@given(
    tps=st.sampled_from(TP_PAIRS_TO_4),
    key_heads_per_lcm=st.integers(1, 2),
    v_per_k=st.integers(1, 2),
    k_dim=st.integers(1, 3),
    v_dim=st.integers(1, 3),
    width=st.integers(1, 3),
    slots=st.tuples(st.integers(1, 7), st.integers(1, 7)),
    seed=st.integers(0, 99),
)
def test_gdn_state_moves_byte_exact_between_any_tp_sizes_from_1_to_4(
    tps: tuple[int, int],
    key_heads_per_lcm: int,
    v_per_k: int,
    k_dim: int,
    v_dim: int,
    width: int,
    slots: tuple[int, int],
    seed: int,
) -> None:
    p_tp, d_tp = tps
    k_heads = lcm(p_tp, d_tp) * key_heads_per_lcm
    dims = (k_heads, k_heads * v_per_k, k_dim, v_dim)
    state = _gdn_of(dims, width, p_tp)
    assert _gdn_of(dims, width, d_tp) == state  # both sides describe one model alike (check_same_groups)
    rng = random.Random(seed)
    row = width * 2  # bfloat16 conv state
    parts = [rng.randbytes(k_heads * k_dim * row) for _ in "QK"] + [rng.randbytes(dims[1] * v_dim * row)]
    recurrent = rng.randbytes(dims[1] * v_dim * k_dim * 4)
    _assert_slots_move(state, tps, slots, lambda tp, rank: _vllm_gdn_slot(parts, recurrent, tp, rank))


@given(
    tps=st.sampled_from(TP_PAIRS_TO_4),
    channels_per_lcm=st.integers(1, 8),
    width=st.integers(1, 3),
    slots=st.tuples(st.integers(1, 7), st.integers(1, 7)),
    seed=st.integers(0, 99),
)
def test_short_conv_state_moves_byte_exact_between_any_tp_sizes_from_1_to_4(
    tps: tuple[int, int], channels_per_lcm: int, width: int, slots: tuple[int, int], seed: int
) -> None:
    p_tp, d_tp = tps
    channels = lcm(p_tp, d_tp) * channels_per_lcm

    def described(tp: int) -> MambaState:
        view = GroupView(
            "MambaSpec", ("model.layers.0.conv",), mamba_type="SHORT_CONV", shapes=((channels // tp, width),),
            dtypes=("float32",), tp_size=tp, conv_layout="DS",
        )  # fmt: skip
        (group,) = kv_groups_of([view])
        assert group.mamba is not None
        return group.mamba

    state = described(p_tp)
    assert described(d_tp) == state
    conv = random.Random(seed).randbytes(channels * width * 4)
    # A rank's slot is its contiguous slice of the channel rows.
    _assert_slots_move(state, tps, slots, lambda tp, rank: _vllm_gdn_slot([conv], b"", tp, rank))


def test_gdn_state_in_the_time_step_major_layout_is_refused_between_two_tp_sizes() -> None:
    state = msgspec.structs.replace(_gdn_of((4, 8, 2, 2), 3, 2), conv_layout="SD")
    assert plan_state(state, (0, 2), (0, 2)) == [(0, 0, state_bytes(state, 2))]
    with pytest.raises(
        TopologyError, match=r"P TP 2 and D TP 1 split the Mamba conv state.*VLLM_SSM_CONV_STATE_LAYOUT"
    ):
        plan_state(state, (0, 2), (0, 1))
