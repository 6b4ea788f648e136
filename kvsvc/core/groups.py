"""KV cache groups of hybrid models: what kind of state each group of layers keeps, which of a request's blocks of
a group move from P to D, and which bytes of a Mamba state slot each P worker writes into each D worker's.

Pure module: standard library, msgspec and `kvsvc.core.errors`/`kvsvc.core.layout`/`kvsvc.core.messages` (where the
groups' wire types live) only (no numpy, torch, asyncio). A hybrid
model's layers fall into groups that share one block table each (vLLM's KV cache groups):

| kind             | a request keeps                               | what moves                                     |
|------------------|-----------------------------------------------|------------------------------------------------|
| `full`           | one block per `block_size` tokens             | every block of the prompt                      |
| `sliding_window` | the blocks of its last `window` tokens        | the last `cdiv(window, block_size) + 1` blocks |
| `chunked_local`  | the blocks of its current chunk                | the blocks from the next token's chunk start   |
| `mamba`          | one state slot (conv state, then SSM state)   | the slot holding the state after the prompt    |

A Mamba, Gated DeltaNet or short-conv state slot of one TP rank is its conv state, channel-major (vLLM's "DS" layout:
one row of `conv_width` elements per channel, the sub-projections one after another), then its SSM state (its slice of
the heads, each head's state contiguous; none for a short conv). A sub-projection is made of groups of channels (heads
for x, Q, K and V; the B/C groups of Mamba2; single channels of a short conv) and a rank holds `groups / tp` of them;
where TP exceeds the groups (Mamba2's single B/C group at TP 2), vLLM gives each rank one group, so ranks share it and
D takes it from the first P rank that holds it. Rules: groups that neither divide nor are divided by a side's TP, or
two sides that disagree on a group's kind, window or state, are a `TopologyError` naming the values; runs are byte
offsets within one slot, in source order, every byte of D's slot written by exactly one P rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import lcm
from typing import Final, NamedTuple

from msgspec.structs import replace

from kvsvc.core.errors import TopologyError
from kvsvc.core.layout import dtype_size
from kvsvc.core.messages import ConvPart, KVGroup, MambaState

FULL: Final = "full"
SLIDING_WINDOW: Final = "sliding_window"
CHUNKED_LOCAL: Final = "chunked_local"
MAMBA: Final = "mamba"
GROUP_KINDS: Final = (FULL, SLIDING_WINDOW, CHUNKED_LOCAL, MAMBA)
# Kinds whose blocks before the next token's reach are vLLM's null block (dropped as the request goes on).
DROPPING: Final = (SLIDING_WINDOW, CHUNKED_LOCAL)


class SlotRun(NamedTuple):
    """`length` bytes at `src_offset` in P's state slot go to `dst_offset` in D's."""

    src_offset: int
    dst_offset: int
    length: int


def check_groups(groups: Sequence[KVGroup], layers: int | range, side: str = "") -> None:
    """Every layer of `layers` (a count from 0, or a PP stage's range) in exactly one group, no other layer in any,
    and each group's fields fit its kind.

    Raises:
        TopologyError: naming the group and the value at fault.
    """
    wanted = range(layers) if isinstance(layers, int) else layers
    seen: dict[int, int] = {}
    for i, group in enumerate(groups):
        where = f"{side}group {i} ({group.kind})"
        if group.kind not in GROUP_KINDS:
            raise TopologyError(f"{where}: unknown kind; expected one of {', '.join(GROUP_KINDS)}")
        if (group.kind == SLIDING_WINDOW) != (group.sliding_window > 0):
            raise TopologyError(f"{where}: sliding_window {group.sliding_window} does not fit the kind")
        if (group.kind == CHUNKED_LOCAL) != (group.attention_chunk > 0):
            raise TopologyError(f"{where}: attention_chunk {group.attention_chunk} does not fit the kind")
        if (group.kind == MAMBA) != (group.mamba is not None):
            raise TopologyError(f"{where}: a Mamba state is required for kind mamba and only for it")
        for layer in group.layers:
            if layer not in wanted:
                raise TopologyError(f"{where}: layer {layer} outside layers [{wanted.start}, {wanted.stop})")
            if layer in seen:
                raise TopologyError(f"{where}: layer {layer} is in group {seen[layer]} too")
            seen[layer] = i
    if len(seen) != len(wanted):
        missing = sorted(set(wanted) - set(seen))
        raise TopologyError(f"{side}layers {missing[:8]} are in no group")


def check_same_groups(p: Sequence[KVGroup], d: Sequence[KVGroup], layers: range | None = None) -> None:
    """P and D must group the model's layers alike: the same kinds, windows and states, in order, and the same
    layers in each group, of `layers` (the layers both hold) when given: two PP stages hold their own layers.

    Raises:
        TopologyError: the first difference, with both sides' values.
    """
    if len(p) != len(d):
        raise TopologyError(f"P has {len(p)} KV cache groups, D {len(d)}")
    for i, (mine, theirs) in enumerate(zip(p, d, strict=True)):
        if layers is not None:
            mine = replace(mine, layers=[layer for layer in mine.layers if layer in layers])
            theirs = replace(theirs, layers=[layer for layer in theirs.layers if layer in layers])
        if mine != theirs:
            raise TopologyError(f"KV cache group {i} differs: P {mine!r}, D {theirs!r}")


def blocks_to_move(group: KVGroup, num_blocks: int, block_size: int, num_tokens: int) -> range:
    """Which of a request's `num_blocks` blocks of `group` (indices into its block list) hold what D needs after
    `num_tokens` tokens: all of them for full attention, those of the window for a sliding window (out-of-window
    blocks are vLLM's null block on both sides), the last one (the state slot) for Mamba.

    Raises:
        TopologyError: fewer blocks than the tokens need.
    """
    needed = -(-num_tokens // block_size)
    if group.kind == MAMBA:
        if num_blocks < 1:
            raise TopologyError("a Mamba group's request has no state slot")
        return range(num_blocks - 1, num_blocks)
    if num_blocks < needed:
        raise TopologyError(f"{num_tokens} tokens need {needed} blocks of {block_size}; the request has {num_blocks}")
    if group.kind == SLIDING_WINDOW:
        window_blocks = -(-group.sliding_window // block_size) + 1
        return range(max(0, needed - window_blocks), needed)
    if group.kind == CHUNKED_LOCAL:
        return range(first_read_token(group, num_tokens) // block_size, needed)
    return range(needed)


def first_read_token(group: KVGroup, num_tokens: int) -> int:
    """The first of a request's `num_tokens` tokens that D's next step reads in `group`: 0 but for a sliding window,
    where the query of token `num_tokens` attends to itself and the `sliding_window - 1` tokens before it (vLLM's
    `get_num_skipped_tokens` for a sliding window: what lies before is dropped, and its blocks become the null
    block); for a chunked local group, the start of that query's chunk (vLLM's `get_num_skipped_tokens` there)."""
    if group.kind == CHUNKED_LOCAL:
        return num_tokens // group.attention_chunk * group.attention_chunk
    if group.kind != SLIDING_WINDOW:
        return 0
    return max(0, num_tokens - group.sliding_window + 1)


def leading_null_blocks(group: KVGroup, ids: Sequence[int], null_block: int, side: str = "") -> int:
    """How many of a sliding-window group's block list `ids` are the engine's null block (`null_block`, -1 for an
    engine without one): those in front, where the window has passed. The null block holds no token of the request,
    so nothing is written into it nor read from it, and it may stand many times in one list. 0 for other kinds.

    Raises:
        ValueError: the null block stands after a block of the request (an engine drops a window's blocks from the
            front only), naming `side`, the group's kind and the position.
    """
    if group.kind not in DROPPING or null_block < 0:
        return 0
    lead = 0
    while lead < len(ids) and ids[lead] == null_block:
        lead += 1
    if null_block in ids[lead:]:
        at = lead + list(ids[lead:]).index(null_block)
        raise ValueError(
            f"{side}the null block {null_block} stands at position {at} of a sliding-window block list, after "
            f"block {ids[lead]} of the request (an engine drops only the blocks in front of its window)"
        )
    return lead


def window_first_token(group: KVGroup, num_tokens: int, src_block_size: int, dst_block_size: int) -> int:
    """The first token of a request's `num_tokens` that P writes into D for `group`: 0 for full attention; for a
    sliding window, the first token D's next step reads (`num_tokens - sliding_window`: a query attends to itself
    and the `sliding_window - 1` tokens before it), rounded down to a block boundary of both sides, and never before
    the window blocks either side keeps (`blocks_to_move`), which hold real blocks, not vLLM's null block.

    Raises:
        TopologyError: a Mamba group (its state slot moves whole, not tokens).
    """
    if group.kind == MAMBA:
        raise TopologyError("a Mamba group moves its state slot, not a range of tokens")
    if group.kind == CHUNKED_LOCAL:
        # The chunk's start lies in a block both sides keep: each holds the chunk of the tokens it has.
        return (
            first_read_token(group, num_tokens)
            // lcm(src_block_size, dst_block_size)
            * lcm(src_block_size, dst_block_size)
        )
    if group.kind != SLIDING_WINDOW:
        return 0
    step = lcm(src_block_size, dst_block_size)
    first = max(0, num_tokens - group.sliding_window) // step * step
    for block_size in (src_block_size, dst_block_size):
        needed = -(-num_tokens // block_size)
        kept = -(-group.sliding_window // block_size) + 1
        first = max(first, max(0, needed - kept) * block_size)
    return first


def split_groups(block_ids: Sequence[int], groups: int, side: str = "") -> list[Sequence[int]]:
    """A hybrid request's block ids, which list every KV cache group's blocks one group after another, all of one
    length (the form every kvsvc message and call carries them in), as one list per group.

    Raises:
        ValueError: the ids do not split into `groups` lists of one length (naming both counts).
    """
    if groups < 1 or len(block_ids) % groups:
        raise ValueError(f"{side}{len(block_ids)} block ids do not split into {groups} KV cache groups of one length")
    size = len(block_ids) // groups
    return [block_ids[i * size : (i + 1) * size] for i in range(groups)]


def _held(groups: int, tp_size: int, tp_rank: int, what: str) -> range:
    """The groups of a part of `groups` that rank `tp_rank` of `tp_size` holds: its share, or the one group it
    shares with other ranks when there are fewer groups than ranks.

    Raises:
        TopologyError: neither of `groups` and `tp_size` divides the other.
    """
    if groups % tp_size == 0:
        share = groups // tp_size
        return range(tp_rank * share, (tp_rank + 1) * share)
    if tp_size % groups == 0:
        group = tp_rank * groups // tp_size
        return range(group, group + 1)
    raise TopologyError(f"{what}: {groups} groups do not split over TP {tp_size}")


def _check_part(part: ConvPart, what: str) -> None:
    if part.groups < 1 or part.channels % part.groups:
        raise TopologyError(f"{what}: {part.channels} channels are not {part.groups} equal groups")


def state_bytes(state: MambaState, tp_size: int) -> int:
    """Bytes of one rank's state slot (conv state, then SSM state).

    Raises:
        TopologyError: a part's groups or the SSM heads do not split over `tp_size`.
    """
    row = state.conv_width * dtype_size(state.conv_dtype)
    conv = 0
    for i, part in enumerate(state.conv_parts):
        _check_part(part, f"conv part {i}")
        conv += len(_held(part.groups, tp_size, 0, f"conv part {i}")) * part.channels // part.groups * row
    return conv + len(_held(state.ssm_heads, tp_size, 0, "SSM heads")) * state.ssm_head_bytes


def _runs_of_part(
    groups: int, unit: int, p_tp: tuple[int, int], d_tp: tuple[int, int], what: str
) -> tuple[list[SlotRun], int, int]:
    """The runs (offsets within the part, in bytes of `unit` per group) that P rank `p_tp` writes of a part of
    `groups` into D rank `d_tp`, and the part's bytes on each side. D takes each group it holds from the first P
    rank that holds it."""
    (p_rank, p_size), (d_rank, d_size) = p_tp, d_tp
    mine, theirs = _held(groups, p_size, p_rank, what), _held(groups, d_size, d_rank, what)
    runs = []
    for g in theirs:
        if g in mine and _first_holder(groups, p_size, g) == p_rank:
            runs.append(SlotRun((g - mine.start) * unit, (g - theirs.start) * unit, unit))
    return runs, len(mine) * unit, len(theirs) * unit


def _first_holder(groups: int, tp_size: int, group: int) -> int:
    """The lowest rank of `tp_size` that holds `group` of `groups` (either divides the other)."""
    if groups % tp_size == 0:
        return group // (groups // tp_size)
    return -(-group * tp_size // groups)


def plan_state(state: MambaState, p_tp: tuple[int, int], d_tp: tuple[int, int]) -> list[SlotRun]:
    """The bytes of a state slot that P rank `p_tp = (rank, size)` writes into D rank `d_tp`'s slot: of each conv
    part and of the SSM heads, the groups D's rank holds that this P rank is the first to hold. Empty when the two
    ranks share nothing. At one TP size rank r holds what rank r holds: the whole slot, in any conv layout.

    Raises:
        TopologyError: a part's groups or the SSM heads do not split over either side's TP, or the TP sizes
            differ while the conv state is time-step-major ("SD": every rank's channels interleave per step).
    """
    if p_tp[1] == d_tp[1]:
        return [SlotRun(0, 0, state_bytes(state, p_tp[1]))] if p_tp[0] == d_tp[0] else []
    if state.conv_layout != "DS":
        raise TopologyError(
            f"P TP {p_tp[1]} and D TP {d_tp[1]} split the Mamba conv state, which needs its channel-major layout "
            f"(DS) on both sides; it is {state.conv_layout} (vLLM: VLLM_SSM_CONV_STATE_LAYOUT=DS)"
        )
    row = state.conv_width * dtype_size(state.conv_dtype)
    runs: list[SlotRun] = []
    src_base = dst_base = 0
    parts = [(p.groups, p.channels // p.groups * row, f"conv part {i}") for i, p in enumerate(state.conv_parts)]
    for i, part in enumerate(state.conv_parts):
        _check_part(part, f"conv part {i}")
    for groups, unit, what in [*parts, (state.ssm_heads, state.ssm_head_bytes, "SSM heads")]:
        part_runs, src_bytes, dst_bytes = _runs_of_part(groups, unit, p_tp, d_tp, what)
        runs += [SlotRun(src_base + r.src_offset, dst_base + r.dst_offset, r.length) for r in part_runs]
        src_base, dst_base = src_base + src_bytes, dst_base + dst_bytes
    return _merged(runs)


def _merged(runs: list[SlotRun]) -> list[SlotRun]:
    """`runs` with neighbours contiguous on both sides joined (homogeneous TP: one run per slot)."""
    out: list[SlotRun] = []
    for run in runs:
        if (
            out
            and out[-1].src_offset + out[-1].length == run.src_offset
            and (out[-1].dst_offset + out[-1].length == run.dst_offset)
        ):
            last = out.pop()
            run = SlotRun(last.src_offset, last.dst_offset, last.length + run.length)
        out.append(run)
    return out


__all__ = [
    "CHUNKED_LOCAL",
    "DROPPING",
    "FULL",
    "GROUP_KINDS",
    "MAMBA",
    "SLIDING_WINDOW",
    "ConvPart",
    "KVGroup",
    "MambaState",
    "SlotRun",
    "blocks_to_move",
    "check_groups",
    "check_same_groups",
    "first_read_token",
    "leading_null_blocks",
    "plan_state",
    "split_groups",
    "state_bytes",
    "window_first_token",
]
