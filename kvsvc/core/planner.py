"""Transfer planning: which P worker writes which D bytes, as coalesced `(src_addr, dst_addr, length)` runs.

Pure module: imports numpy and the core's layout, groups, formats, messages and errors (no torch, asyncio,
mooncake). Invariants (docs/design.md, "Geometry"): every (D worker, layer, head) has exactly one source P worker; a
plan writes only inside the listed D blocks and the (layer, head) slots its P worker sources; plans are maximal runs
sorted by source address; incompatibility is a `TopologyError` that names both sides' values. Any mix of
per-layer layouts (HND, NHD) and the cross-layer pool (`kvsvc.core.layout.CROSS_LAYER`) on the two sides is planned the
same way: each layer is a base address plus a block stride, and merging finds whatever is contiguous. The fused
layout (`kvsvc.core.layout.FUSED`) pairs only with itself at one block size, and its (block, head) chunks are copied
whole.

The vectorised end of the planner (`plan_runs`, `merge_runs`) turns (layers x token segments x elements) into
maximal byte runs: an element is one token of one head of one K/V half, `element_bytes` long on both sides; only
whole elements asked for are emitted; the output is sorted by source address and no two runs could merge (source
ranges are disjoint, so after sorting a mergeable pair is always adjacent).

The checks that keep a request inside what each side owns sit here too, so that one module says both where bytes go
and where they may go: block ids inside the pool (`check_block_ids`), a window inside D's staging region
(`check_window`), and the data plane's one address rule, which every plane (Mooncake, same-host, GPU, the fakes)
applies before it moves a byte. A write's descriptors come as tuples or as one (N, 3) int64 table (`Descriptors`), and
are refused (`InvalidDescriptor`) unless every source range lies inside registered local memory and every destination
range inside the peer's published regions (`checked_table`). A plan of thousands of pieces stays one table on the way
to the copy (a 4,032-piece table made tuples and back took 1.3 ms on the CI machine, where its device copies take
microseconds) and is checked whole. Which of the writes queued together on the same-host plane share one kernel call
is decided here as well (`coalesce`).
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

from kvsvc.core.errors import (
    ERR_ADDRESS_NOT_REGISTERED,
    ERR_ADDRESS_OVERLAPPED,
    ERR_FAILED,
    InvalidDescriptor,
    TopologyError,
    TransportError,
)
from kvsvc.core.formats import as_written, check_formats, check_scales, converts
from kvsvc.core.groups import (
    SlotRun,
    blocks_to_move,
    check_groups,
    check_same_groups,
    first_read_token,
    leading_null_blocks,
    plan_state,
    split_groups,
    state_bytes,
    window_first_token,
)
from kvsvc.core.layout import (
    FUSED,
    LAYOUTS,
    BlockGeometry,
    Int64Array,
    block_geometry,
    check_base_addrs,
    check_kv_heads,
    dtype_size,
    head_order,
    heads_of_rank,
    holders_of_head,
    is_cross_layer,
    is_fused,
    kv_heads_per_rank,
    layer_addrs,
)
from kvsvc.core.messages import KVGroup, MambaState, Worker, WorkerMetadata

_EMPTY: Int64Array = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


class Descriptor(NamedTuple):
    """One write: `length` bytes from the P address `src_addr` to the D address `dst_addr`."""

    src_addr: int
    dst_addr: int
    length: int


# Skips NamedTuple's per-call argument handling: building descriptors dominates planning time.
_new_descriptor = functools.partial(tuple.__new__, Descriptor)


def _name(side: str, meta: WorkerMetadata) -> str:
    return f"{side} worker (pp {meta.pp_rank}, tp {meta.tp_rank}) of {meta.engine_id!r}"


def _check_worker(side: str, meta: WorkerMetadata) -> None:
    who = _name(side, meta)
    if not (0 <= meta.tp_rank < meta.tp_size and 0 <= meta.pp_rank < meta.pp_size):
        raise TopologyError(f"{who}: rank outside its sizes (pp_size {meta.pp_size}, tp_size {meta.tp_size})")
    if not 0 <= meta.start_layer < meta.end_layer:
        raise TopologyError(f"{who}: empty or negative layer range [{meta.start_layer}, {meta.end_layer})")
    check_base_addrs(meta, who)
    if meta.block_size < 1 or meta.head_size < 1 or meta.num_blocks < 0:
        raise TopologyError(
            f"{who}: block_size {meta.block_size}, head_size {meta.head_size}, num_blocks {meta.num_blocks}"
        )
    dtype_size(meta.dtype)
    check_scales(meta, who)
    if meta.kv_groups:
        check_groups(meta.kv_groups, range(meta.start_layer, meta.end_layer), f"{who}: ")
    for i, group in enumerate(meta.kv_groups):
        if group.mamba is not None:
            slot, page = state_bytes(group.mamba, meta.tp_size), block_geometry(meta).block_stride
            if slot > page or is_cross_layer(meta):
                raise TopologyError(
                    f"{who}: KV cache group {i}'s Mamba state slot of {slot} bytes does not fit a block of "
                    f"{page} bytes of a per-layer layout ({meta.layout})"
                )
    # MLA ignores the layout unless it names the cross-layer pool, so any string passes there.
    if not meta.is_mla:
        if meta.layout not in LAYOUTS:
            raise TopologyError(f"{who}: unknown layout {meta.layout!r}; known: {', '.join(LAYOUTS)}")
        check_kv_heads(meta.num_kv_heads, meta.tp_size, who)


def check_compatible(src: WorkerMetadata, dst: WorkerMetadata) -> None:
    """Check that P worker `src` can write into D worker `dst` (whatever their ranks); the hello runs this.

    Any per-layer layout pairs with the cross-layer pool, which orders a block of one layer as HND does.

    Raises:
        TopologyError: a malformed side (the message names it: wrong count of base_addrs for its layout, unknown
            layout or dtype, KV scales that are not finite and positive...), or dtype, head_size, num_kv_heads or
            is_mla differ, or the cache formats (vLLM's `kv_cache_dtype`) or a shared layer's KV scales differ and P
            cannot convert its format into D's (`kvsvc.core.formats.check_formats`), or the TP sizes do not divide
            one another, or the two sides hold the same several heads per rank in different orders (NHD against
            HND or the cross-layer pool) and P has no staging region to gather the transposition in. The message
            names both values. Or the two sides group a hybrid model's layers differently (`kvsvc.core.groups`), or a
            Mamba state cannot be split between their TP sizes (its conv layout, or sizes TP does not divide).
    """
    _check_worker("P", src)
    _check_worker("D", dst)
    check_same_groups(src.kv_groups, dst.kv_groups, _layer_overlap(src, dst))
    check_formats(src, dst, _layer_overlap(src, dst), (_name("P", src), _name("D", dst)))
    # A converting pair's dtypes differ by design; `check_formats` decides whether they may.
    fields = (
        ("head_size", "is_mla", "num_kv_heads")
        if converts(src, dst)
        else ("dtype", "head_size", "is_mla", "num_kv_heads")
    )
    for field in fields:
        mine, theirs = getattr(src, field), getattr(dst, field)
        if field == "dtype":
            mine, theirs = mine.removeprefix("torch."), theirs.removeprefix("torch.")
        if mine != theirs:
            raise TopologyError(f"P {field} {mine!r} != D {field} {theirs!r} ({_name('P', src)}, {_name('D', dst)})")
    small, large = sorted((src.tp_size, dst.tp_size))
    if large % small:
        raise TopologyError(f"P tp_size {src.tp_size} and D tp_size {dst.tp_size} do not divide one another")
    for group in src.kv_groups if small != large else ():
        if group.mamba is not None:
            _runs_of_state(group.mamba, src, dst)
    if src.is_mla:
        return
    if is_fused(src) or is_fused(dst):
        # A fused chunk orders K and V in a way of its own: only the same layout at the same block size can take it.
        if src.layout != dst.layout:
            raise TopologyError(
                f"P layout {src.layout} cannot be copied into D layout {dst.layout}: {FUSED} keeps K and V of a"
                " (block, head) in an opaque order of its own, so both sides need it"
            )
        if src.block_size != dst.block_size:
            raise TopologyError(
                f"P block_size {src.block_size} != D block_size {dst.block_size}: layout {FUSED} is copied in whole"
                " (block, head) chunks, which needs one block size on both sides"
            )
    heads_p = kv_heads_per_rank(src.num_kv_heads, src.tp_size)
    heads_d = kv_heads_per_rank(dst.num_kv_heads, dst.tp_size)
    sizes = f"P tp_size {src.tp_size} holds {heads_p} heads per rank, D tp_size {dst.tp_size} holds {heads_d}"
    order_p, order_d = head_order(src), head_order(dst)
    # A head split of NHD cuts every token into its own piece, and a split across two head orders every (token,
    # head): a staged write gathers either into whole runs. The same heads in two orders make every (token, head) of
    # every block a piece of its own: only a P worker with a staging region (which it publishes) gathers that
    # transposition into D's order; written direct it would be one descriptor per head of every token.
    if heads_p == heads_d > 1 and order_p != order_d and not src.staging_size:
        raise TopologyError(
            f"P layout {src.layout} and D layout {dst.layout} order {heads_p} heads per block differently "
            f"({sizes}); copying would transpose every token, which needs a staging region on P"
        )


def _source_heads(src: WorkerMetadata, dst: WorkerMetadata) -> list[int]:
    if src.is_mla:
        # Every P rank holds the latent; D ranks spread over them round-robin.
        return [0] if dst.tp_rank % src.tp_size == src.tp_rank else []
    heads: list[int] = []
    for head in heads_of_rank(dst.tp_rank, dst.tp_size, dst.num_kv_heads):
        holders = holders_of_head(head, src.tp_size, src.num_kv_heads)
        if holders[dst.tp_rank % len(holders)] == src.tp_rank:
            heads.append(head)
    return heads


def source_heads(src: WorkerMetadata, dst: WorkerMetadata) -> list[int]:
    """Global KV heads of `dst` whose assigned source is `src` (MLA: `[0]` for the latent, or `[]`).

    Looks at heads only; `is_source` also needs the layer ranges to overlap.

    Raises:
        TopologyError: `check_compatible` refuses the pair.
    """
    check_compatible(src, dst)
    return _source_heads(src, dst)


def _layer_overlap(src: WorkerMetadata, dst: WorkerMetadata) -> range:
    return range(max(src.start_layer, dst.start_layer), min(src.end_layer, dst.end_layer))


def is_source(src: WorkerMetadata, dst: WorkerMetadata) -> bool:
    """Whether `src` writes anything into `dst`: their layers overlap and `src` sources one of its heads.

    Raises:
        TopologyError: `check_compatible` refuses the pair.
    """
    layers = _layer_overlap(src, dst)
    if not layers:
        return False
    if source_heads(src, dst):
        return True
    # Mamba state is split over every TP rank, so a P rank may hold state D needs while D takes its heads elsewhere.
    return any(
        group.mamba is not None and set(group.layers) & set(layers) and _state_runs(src, dst, group.mamba)
        for group in src.kv_groups
    )


def _state_runs(src: WorkerMetadata, dst: WorkerMetadata, state: MambaState) -> list[SlotRun]:
    return plan_state(state, (src.tp_rank, src.tp_size), (dst.tp_rank, dst.tp_size))


def _runs_of_state(state: MambaState, src: WorkerMetadata, dst: WorkerMetadata) -> None:
    """Raises `plan_state`'s TopologyError (a conv layout or sizes that two TP sizes cannot split), naming both."""
    try:
        _state_runs(src, dst, state)
    except TopologyError as exc:
        raise TopologyError(f"{_name('P', src)} -> {_name('D', dst)}: {exc}") from None


def check_block_ids(
    meta: WorkerMetadata, block_ids: Sequence[int], num_tokens: int, side: str, first_token: int = 0
) -> None:
    """Check one side's request before anything is planned or written: every listed block id lies in `meta`'s
    pool, D's ids are distinct (two token ranges must never share a block), the blocks can hold `num_tokens`, and
    `first_token` (the prefix D holds already) lies in `[0, num_tokens]`. The engine's calls, a D worker's request
    and the planner all check this one way. A hybrid model's ids list each KV cache group's blocks in turn
    (`kvsvc.core.groups.split_groups`); each group's list must hold the tokens, and D's distinct ids are those written:
    a sliding-window group's list starts with the engine's null block (`WorkerMetadata.null_block`) wherever the
    window has passed, as often as it has passed a block, and the null block is no block of the request: never
    written, never a repeat, and never standing for a token that D's window reads.

    Raises:
        ValueError: naming `side` ("P" or "D") and the offending ids or counts.
    """
    if num_tokens < 0:
        raise ValueError(f"{side}: num_tokens {num_tokens} is negative")
    bad = [b for b in block_ids if not 0 <= b < meta.num_blocks]
    if bad:
        raise ValueError(f"{side} block ids {bad[:8]} outside the pool of {meta.num_blocks} blocks")
    groups = meta.kv_groups
    lists = split_groups(block_ids, len(groups), f"{side}: ") if groups else [block_ids]
    written: list[int] = []
    for i, ids in enumerate(lists):
        where = f" of KV cache group {i}" if groups else ""
        if num_tokens > len(ids) * meta.block_size:
            raise ValueError(
                f"{side}: {len(ids)} block ids{where} hold fewer than {num_tokens} tokens of block_size "
                f"{meta.block_size} ({num_tokens} tokens do not fit them)"
            )
        if not groups:
            if side == "D":
                written += ids
            continue
        nulls = leading_null_blocks(groups[i], ids, meta.null_block, f"{side}: ")
        if nulls * meta.block_size > first_read_token(groups[i], num_tokens):
            reach = groups[i].sliding_window or groups[i].attention_chunk
            raise ValueError(
                f"{side}: the null block stands for tokens [0, {nulls * meta.block_size}){where}, but the "
                f"{groups[i].kind} reach of {reach} tokens after {num_tokens} reads from token "
                f"{first_read_token(groups[i], num_tokens)}"
            )
        if side == "D":
            moved = blocks_to_move(groups[i], len(ids), meta.block_size, num_tokens)
            first = max(nulls, first_token // meta.block_size)
            written += [ids[b] for b in moved if b >= first]
    if len(set(written)) != len(written):  # counted in one pass: a request's list comes from the peer, of any length
        repeated = sorted(b for b, n in Counter(written).items() if n > 1)[:8]
        raise ValueError(
            f"D block ids {repeated} appear more than once (repeated block id): two token ranges would share a block"
        )
    if not 0 <= first_token <= num_tokens:
        raise ValueError(f"{side}: first_token {first_token} outside [0, num_tokens {num_tokens}]")


def is_block_run(ids: Sequence[int], count: int) -> bool:
    """Whether the first `count` block ids are consecutive (a plan of them is a shift of the plan of `range(count)`,
    which the services cache)."""
    first = ids[0]
    return ids[count - 1] == first + count - 1 and (
        count <= 2 or list(ids[:count]) == list(range(first, first + count))
    )


# A window smaller than its share moves it in at most MAX_ROUNDS rounds of at least MIN_ROUND_BYTES, so a D worker
# cannot make P write a share a few bytes at a time.
MIN_ROUND_BYTES: Final = 256
MAX_ROUNDS: Final = 1 << 16


def check_window(meta: WorkerMetadata, window_addr: int, window_bytes: int, share_bytes: int = 0) -> None:
    """Check a request's window (`TransferRequest.window_addr`, `window_bytes`, `share_bytes`): none (all 0), or a
    range inside the staging region D worker `meta` published, for a share that fits it or moves through it in at
    most `MAX_ROUNDS` rounds of at least `MIN_ROUND_BYTES`.

    Raises:
        ValueError: naming the window, the share and the region or the limit.
    """
    if window_bytes == 0 and window_addr == 0 and share_bytes == 0:
        return
    if share_bytes < 0 or (share_bytes > window_bytes and not window_bytes // 2 >= MIN_ROUND_BYTES):
        raise ValueError(
            f"D window of {window_bytes} bytes for a share of {share_bytes}: a share larger than its window moves in "
            f"rounds of half the window, at least {MIN_ROUND_BYTES} bytes"
        )
    if share_bytes > window_bytes and -(-share_bytes // (window_bytes // 2)) > MAX_ROUNDS:
        raise ValueError(
            f"D window of {window_bytes} bytes for a share of {share_bytes}: more than {MAX_ROUNDS} rounds"
        )
    end = meta.staging_addr + meta.staging_size
    if window_bytes < 1 or not meta.staging_addr <= window_addr <= end - window_bytes:
        raise ValueError(
            f"D window [{window_addr:#x}, +{window_bytes}) lies outside D's staging region "
            f"[{meta.staging_addr:#x}, +{meta.staging_size})"
        )


# -- what a write may touch: the data plane's address rule -------------------------------------------------------------

Region = tuple[int, int]
"""`(addr, length)` of a registered or published memory range."""

# Up to this many rows a table is checked row by row: the array operations cost about 15 us whatever the rows, a
# row about 0.2 us (a one-block request is the many-small-requests path).
ROWS_CHECKED_ONE_BY_ONE: Final = 48

DescriptorTable = npt.NDArray[np.int64]
"""A write's descriptors as an (N, 3) int64 table, rows `(src_addr, dst_addr, length)`."""

Descriptors = Sequence[tuple[int, int, int]] | DescriptorTable
"""What `Transport.write` takes: `(src_addr, dst_addr, length)` tuples, or the same rows as a table."""


class AddressRanges:
    """Sorted, non-overlapping `[start, end)` ranges, with containment and overlap checks in O(log n)."""

    def __init__(self, regions: Iterable[Region] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._arrays: tuple[DescriptorTable, DescriptorTable] | None = None  # for `holds`, built when first asked
        for addr, length in regions:
            self.add(addr, length)

    def add(self, addr: int, length: int) -> None:
        """Add a range. Raises `TransportError` (code -7) when it overlaps one already there, or on length <= 0."""
        if length <= 0 or addr < 0:
            raise TransportError(f"region ({addr:#x}, {length}) is empty or negative", ERR_FAILED)
        i = bisect_right(self._starts, addr)
        if (i > 0 and self._ends[i - 1] > addr) or (i < len(self._starts) and self._starts[i] < addr + length):
            raise TransportError(
                f"region [{addr:#x}, {addr + length:#x}) overlaps a registered one", ERR_ADDRESS_OVERLAPPED
            )
        self._starts.insert(i, addr)
        self._ends.insert(i, addr + length)
        self._arrays = None

    def contains(self, addr: int, length: int) -> bool:
        """True when `[addr, addr + length)` lies inside one range."""
        i = bisect_right(self._starts, addr) - 1
        return i >= 0 and addr + length <= self._ends[i]

    def holds(self, addr: DescriptorTable, length: DescriptorTable) -> bool:
        """`contains` of every `[addr[i], addr[i] + length[i])` at once (lengths taken as positive)."""
        if self._arrays is None:
            self._arrays = (np.array(self._starts, dtype=np.int64), np.array(self._ends, dtype=np.int64))
        starts, ends = self._arrays
        i = np.searchsorted(starts, addr, side="right") - 1
        return bool(np.all(i >= 0) and np.all(addr + length <= ends[np.maximum(i, 0)]))

    def regions(self) -> list[Region]:
        return [(s, e - s) for s, e in zip(self._starts, self._ends, strict=True)]

    @property
    def total_bytes(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    def __len__(self) -> int:
        return len(self._starts)


def as_table(descriptors: Descriptors) -> DescriptorTable:
    """`descriptors` as an (N, 3) int64 table: a table is returned as it is, tuples are copied into one.

    Raises:
        InvalidDescriptor: they are not rows of three integers.
    """
    try:
        table = np.asarray(descriptors, dtype=np.int64)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidDescriptor(f"descriptors must be (src, dst, length) rows of integers: {exc}", ERR_FAILED) from None
    if table.size == 0:
        return table.reshape(0, 3)
    if table.ndim != 2 or table.shape[1] != 3:
        raise InvalidDescriptor(
            f"descriptors must be (src, dst, length) rows of integers, not of shape {table.shape}", ERR_FAILED
        )
    return table


def as_rows(descriptors: Descriptors) -> Sequence[tuple[int, int, int]]:
    """`descriptors` as `(src, dst, length)` tuples of Python ints, for an engine whose calls take them one by one."""
    if not isinstance(descriptors, np.ndarray):
        return descriptors
    src, dst, length = descriptors.reshape(-1, 3).T.tolist()
    return list(zip(src, dst, length, strict=True))


def check_table(table: DescriptorTable, local: AddressRanges, remote: AddressRanges | None, peer: str) -> int:
    """`check_descriptors` of a whole table at once: a handful of array operations whatever its length, then, only
    when something is wrong, the row by row check that names the first offending descriptor.

    Raises:
        InvalidDescriptor: as `check_descriptors`.
    """
    if remote is None or not len(table):
        return check_descriptors([], local, remote, peer)
    if len(table) <= ROWS_CHECKED_ONE_BY_ONE:
        return check_descriptors(table.tolist(), local, remote, peer)
    src, dst, length = table[:, 0], table[:, 1], table[:, 2]
    if bool(np.all(length > 0)) and local.holds(src, length) and remote.holds(dst, length):
        return int(length.sum())
    return check_descriptors(as_rows(table), local, remote, peer)


def checked_table(
    descriptors: Descriptors, local: AddressRanges, remote: AddressRanges | None, peer: str
) -> tuple[DescriptorTable, int]:
    """`descriptors` as a table and their total length, checked as `check_descriptors` does (tuples one by one, a
    table whole): what a plane that copies from a table does first.

    Raises:
        InvalidDescriptor: as `check_descriptors`, or rows that are not three integers.
    """
    if isinstance(descriptors, np.ndarray):
        table = as_table(descriptors)
        return table, check_table(table, local, remote, peer)
    total = check_descriptors(descriptors, local, remote, peer)
    return as_table(descriptors), total


def check_descriptors(
    descriptors: Sequence[tuple[int, int, int]],
    local: AddressRanges,
    remote: AddressRanges | None,
    peer: str,
) -> int:
    """Return the total length of `descriptors` if every one may be written to `peer`.

    Raises:
        InvalidDescriptor: unknown peer (`remote` is None), a length <= 0, a source range outside `local`, or a
            destination range outside `remote`; the message names the first offending descriptor.
    """
    if remote is None:
        raise InvalidDescriptor(f"unknown peer {peer!r}: add_peer it first", ERR_FAILED)
    total = 0
    for i, (src, dst, length) in enumerate(descriptors):
        if length <= 0:
            raise InvalidDescriptor(f"descriptor {i} to {peer}: length {length} is not positive", ERR_FAILED)
        if not local.contains(src, length):
            raise InvalidDescriptor(
                f"descriptor {i} to {peer}: source [{src:#x}, +{length}) is outside registered local memory",
                ERR_ADDRESS_NOT_REGISTERED,
            )
        if not remote.contains(dst, length):
            raise InvalidDescriptor(
                f"descriptor {i} to {peer}: destination [{dst:#x}, +{length}) is outside the peer's regions",
                ERR_ADDRESS_NOT_REGISTERED,
            )
        total += length
    return total


COALESCE_BYTES: Final = 128 << 20
"""The most bytes one same-host copy call merges from writes queued together: about 15-30 ms of the kernel's copy on
a 2-core host, near one forward of the D engines measured there, so a burst of requests lands within one D step and
is reported in one. Each call returns to a thread that must take the GIL back, which costs up to the interpreter's
5 ms switch interval while P's engine thread runs Python: a burst pays that once, not once per request."""
COALESCE_DESCRIPTORS: Final = 1024  # Linux's IOV_MAX iovecs a side: a merged group is one kernel call


def coalesce(
    writes: Sequence[tuple[Hashable, int, int]],
    max_bytes: int = COALESCE_BYTES,
    max_descriptors: int = COALESCE_DESCRIPTORS,
) -> list[range]:
    """The groups of `writes` (target, bytes, descriptors), queued in this order, that each go in one copy: runs of
    consecutive writes to one target, a write joining the run before it only while the run stays within `max_bytes`
    and `max_descriptors`. A write that would take its run past a bound starts the next run, and one over a bound
    goes alone: no call grows past the bounds but by a single write, and a write waits past its own bytes only for
    the rest of its group.

    Raises:
        ValueError: a bound below 1, or a write with negative bytes or descriptors (the values named).
    """
    if max_bytes < 1 or max_descriptors < 1:
        raise ValueError(
            f"coalescing bounds must be >= 1, got max_bytes {max_bytes}, max_descriptors {max_descriptors}"
        )
    groups: list[range] = []
    first, nbytes, pieces = 0, 0, 0
    for index, (target, size, count) in enumerate(writes):
        if size < 0 or count < 0:
            raise ValueError(f"write {index} to {target!r} has {size} bytes and {count} descriptors; both must be >= 0")
        joins = (
            index > first
            and target == writes[first][0]
            and nbytes + size <= max_bytes
            and pieces + count <= max_descriptors
        )
        if not joins and index > first:
            groups.append(range(first, index))
            first, nbytes, pieces = index, 0, 0
        nbytes, pieces = nbytes + size, pieces + count
    if writes:
        groups.append(range(first, len(writes)))
    return groups


def plan_transfer(
    src: WorkerMetadata,
    dst: WorkerMetadata,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    num_tokens: int | None = None,
    *,
    whole_blocks: bool = True,
    first_token: int = 0,
) -> list[Descriptor]:
    """The writes P worker `src` makes into D worker `dst` for tokens `[first_token, num_tokens)` of one request.

    `num_tokens` defaults to every slot of `dst_block_ids`. Token t lies in block `ids[t // block_size]` of each
    side's list; `first_token` > 0 skips a prefix D holds already (its own prefix cache), so the blocks before
    `first_token // block_size` are never written. Covers every layer both hold, for the heads
    `source_heads(src, dst)`; `[]` when `src` is no source of `dst`. Runs are maximal and sorted by source
    address. When both sides are cross-layer pools with the same block size, heads and layer range, a run of
    blocks contiguous on both sides is one descriptor for all layers; otherwise the layers both hold that lie next
    to one another inside a block on both sides still share one. With `whole_blocks`, a partial last block is
    completed up to the end of the current P and D blocks, for the sourced heads: the extra slots lie inside the
    listed blocks on both sides, D writes them before it reads them, and completing only merges pieces (K with V
    where every head goes; a head's run with the next block's in D, which a staged write gathers into one run per
    layer). The fused layout's last block is always completed, for the sourced heads, since its chunks cannot be
    cut.
    `plan_transfer_arrays` gives the same plan as arrays, which is several times cheaper when the plan has
    thousands of runs.

    Raises:
        TopologyError: `check_compatible` refuses the pair.
        ValueError: `num_tokens` is negative, `first_token` lies outside `[0, num_tokens]` (or inside a block of
            the fused layout, whose chunks cannot be cut), a block id list is too short or outside the pool, or a
            D block id repeats.
    """
    src_addrs, dst_addrs, lengths = plan_transfer_arrays(
        src, dst, src_block_ids, dst_block_ids, num_tokens, whole_blocks=whole_blocks, first_token=first_token
    )
    return list(map(_new_descriptor, zip(src_addrs.tolist(), dst_addrs.tolist(), lengths.tolist(), strict=True)))


def plan_transfer_arrays(
    src: WorkerMetadata,
    dst: WorkerMetadata,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    num_tokens: int | None = None,
    *,
    whole_blocks: bool = True,
    first_token: int = 0,
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """`plan_transfer` as three int64 arrays (source addresses, destination addresses, lengths).

    The transport's batch write takes three lists, so the service can skip building `Descriptor`s. Empty
    (read-only) arrays when `src` is no source of `dst`.

    Raises:
        TopologyError: `check_compatible` refuses the pair.
        ValueError: `num_tokens` is negative, `first_token` lies outside `[0, num_tokens]` (or inside a block of
            the fused layout, whose chunks cannot be cut), a block id list is too short or outside the pool, or a
            D block id repeats.
    """
    check_compatible(src, dst)
    src = as_written(src, dst)  # a converting pair is planned in bytes of D's format
    groups = src.kv_groups
    tokens = len(dst_block_ids) // max(1, len(groups)) * dst.block_size if num_tokens is None else num_tokens
    check_block_ids(src, src_block_ids, tokens, "P")
    check_block_ids(dst, dst_block_ids, tokens, "D", first_token)
    if is_fused(src) and first_token % src.block_size:
        raise ValueError(f"first_token {first_token} cuts a block of {src.block_size} tokens of layout {FUSED}")
    layers = _layer_overlap(src, dst)
    heads = _source_heads(src, dst)
    if not layers or tokens == first_token:
        return _EMPTY, _EMPTY, _EMPTY
    if not groups:
        if not heads:
            return _EMPTY, _EMPTY, _EMPTY
        return _plan_layers(
            src, dst, heads, list(layers), src_block_ids, dst_block_ids, tokens, whole_blocks, first_token
        )
    # Each KV cache group is its layers with its own block list, from its own first token; a block id belongs to
    # one group, so the groups' writes never overlap, and one sort puts them in source order.
    parts = []
    src_lists = split_groups(src_block_ids, len(groups), "P: ")
    dst_lists = split_groups(dst_block_ids, len(groups), "D: ")
    for group, src_ids, dst_ids in zip(groups, src_lists, dst_lists, strict=True):
        members = set(group.layers)
        mine = [layer for layer in layers if layer in members]
        if not mine:
            continue
        if group.mamba is not None:
            parts.append(_plan_state_slots(src, dst, group, mine, src_ids, dst_ids, tokens))
            continue
        # Nothing moves from or into a null block: where either side's window has passed, the other side's blocks
        # hold tokens D never reads (check_block_ids made sure of that).
        start = max(
            first_token,
            window_first_token(group, tokens, src.block_size, dst.block_size),
            leading_null_blocks(group, src_ids, src.null_block) * src.block_size,
            leading_null_blocks(group, dst_ids, dst.null_block) * dst.block_size,
        )
        if heads and start < tokens:
            parts.append(_plan_layers(src, dst, heads, mine, src_ids, dst_ids, tokens, whole_blocks, start))
    if not parts:
        return _EMPTY, _EMPTY, _EMPTY
    src_addrs, dst_addrs, lengths = (np.concatenate(column) for column in zip(*parts, strict=True))
    if is_cross_layer(src) and is_cross_layer(dst):
        # One region a side: a group's run may end where another group's begins on both sides (neighbouring
        # layers of one block), and plans are maximal runs.
        return merge_runs(src_addrs, dst_addrs, lengths)
    order = np.argsort(src_addrs, kind="stable")
    return src_addrs[order], dst_addrs[order], lengths[order]


def _plan_state_slots(
    src: WorkerMetadata,
    dst: WorkerMetadata,
    group: KVGroup,
    layers: list[int],
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    tokens: int,
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """The writes of a Mamba group's `layers`: the runs of P's state slot that D's rank takes (`plan_state`), from
    the slot after the request's tokens on each side. A slot is a block of the layer's tensor (the page its groups
    share), so it lies at the layer's base plus the slot's id times the block stride."""
    assert group.mamba is not None
    runs = _state_runs(src, dst, group.mamba)
    src_slot = src_ids[blocks_to_move(group, len(src_ids), src.block_size, tokens)[0]]
    dst_slot = dst_ids[blocks_to_move(group, len(dst_ids), dst.block_size, tokens)[0]]
    src_stride, dst_stride = block_geometry(src).block_stride, block_geometry(dst).block_stride
    src_all, dst_all = layer_addrs(src), layer_addrs(dst)
    rows = [
        (
            src_all[layer - src.start_layer] + src_slot * src_stride + run.src_offset,
            dst_all[layer - dst.start_layer] + dst_slot * dst_stride + run.dst_offset,
            run.length,
        )
        for layer in layers
        for run in runs
    ]
    table = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    return table[:, 0], table[:, 1], table[:, 2]


def _plan_layers(
    src: WorkerMetadata,
    dst: WorkerMetadata,
    heads: list[int],
    layers: list[int],
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    tokens: int,
    whole_blocks: bool,
    first_token: int,
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """`plan_transfer_arrays` for `layers` (global, held by both) and the sourced `heads`, the request checked."""
    gs, gd = block_geometry(src), block_geometry(dst)
    if src.is_mla:
        local_src, local_dst = [0], [0]
    else:
        first_src = heads_of_rank(src.tp_rank, src.tp_size, src.num_kv_heads).start
        first_dst = heads_of_rank(dst.tp_rank, dst.tp_size, dst.num_kv_heads).start
        local_src = [h - first_src for h in heads]
        local_dst = [h - first_dst for h in heads]
    # A fused chunk is opaque: it goes whole, whatever `whole_blocks` says (one block size on both sides).
    if is_fused(src) or (whole_blocks and not src.is_mla):
        last = tokens - 1
        tokens = min((last // gd.block_size + 1) * gd.block_size, (last // gs.block_size + 1) * gs.block_size)
    # Cross-layer pools become per-layer bases with a wider block stride; merging then joins the layers that
    # sit next to one another inside a block, on both sides, into one run.
    src_all, dst_all = layer_addrs(src), layer_addrs(dst)
    src_bases = [src_all[layer - src.start_layer] for layer in layers]
    dst_bases = [dst_all[layer - dst.start_layer] for layer in layers]
    return plan_runs(
        gs,
        gd,
        local_src,
        local_dst,
        src_bases,
        dst_bases,
        src_block_ids,
        dst_block_ids,
        tokens,
        first_token=first_token,
        src_one_region=is_cross_layer(src),
        dst_one_region=is_cross_layer(dst),
    )


def sources_of(dst: WorkerMetadata, src_engine: Mapping[Worker, WorkerMetadata]) -> list[Worker]:
    """The P workers, as sorted `(pp_rank, tp_rank)`, that D worker `dst` must ask for its KV.

    Raises:
        TopologyError: `check_compatible` refuses a pair.
    """
    return sorted(w for w, meta in src_engine.items() if is_source(meta, dst))


def expected_destinations(src: WorkerMetadata, dst_engine: Mapping[Worker, WorkerMetadata]) -> list[Worker]:
    """The D workers, as sorted `(pp_rank, tp_rank)`, that will ask P worker `src` for their share.

    Raises:
        TopologyError: `check_compatible` refuses a pair.
    """
    return sorted(w for w, meta in dst_engine.items() if is_source(src, meta))


def release_notifier(src: WorkerMetadata, dst_engine: Mapping[Worker, WorkerMetadata]) -> Worker | None:
    """The D worker that tells P worker `src` "nothing for you" when no D worker needs it, else None.

    It is the first D worker in `(pp_rank, tp_rank)` order whose layers overlap `src`'s; None also when no
    D worker overlaps at all (then the engines hold different layers and nobody can release it).

    Raises:
        TopologyError: `check_compatible` refuses a pair.
    """
    if expected_destinations(src, dst_engine):
        return None
    for worker in sorted(dst_engine):
        if _layer_overlap(src, dst_engine[worker]):
            return worker
    return None


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
