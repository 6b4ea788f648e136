"""KV-cache geometry of one worker: which heads and layers it holds and where each byte of a block lives.

Pure module: imports only the standard library and `kvsvc.errors`/`kvsvc.messages` (no numpy, torch, asyncio).
Invariants: head ownership follows DESIGN §2 (`H_local = max(1, K // tp)`, replicated when `tp > K`); byte offsets
match the torch tensors HND `(num_blocks, 2, H_local, block_size, head_size)`, NHD
`(num_blocks, 2, block_size, H_local, head_size)` and MLA `(num_blocks, block_size, head_size)`, C-contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, NamedTuple

from kvsvc.errors import TopologyError
from kvsvc.messages import WorkerMetadata

DTYPE_SIZES: Final[dict[str, int]] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
LAYOUTS: Final = ("HND", "NHD")


def dtype_size(dtype: str) -> int:
    """Bytes per element of a torch dtype name such as `"bfloat16"` (a `torch.` prefix is accepted).

    Raises:
        TopologyError: the dtype is not one kvsvc knows.
    """
    name = dtype.removeprefix("torch.")
    try:
        return DTYPE_SIZES[name]
    except KeyError:
        raise TopologyError(f"unknown KV dtype {dtype!r}; known: {', '.join(DTYPE_SIZES)}") from None


def check_kv_heads(total_kv_heads: int, tp_size: int, side: str = "") -> None:
    """Check that `tp_size` workers can share `total_kv_heads` heads evenly (split or replicated).

    Raises:
        TopologyError: `K % tp != 0` while `tp <= K`, or `tp % K != 0` while `tp > K`, or a size below 1.
    """
    who = f"{side} " if side else ""
    if total_kv_heads < 1 or tp_size < 1:
        raise TopologyError(f"{who}num_kv_heads {total_kv_heads} and tp_size {tp_size} must both be >= 1")
    if tp_size <= total_kv_heads and total_kv_heads % tp_size:
        raise TopologyError(f"{who}tp_size {tp_size} does not divide num_kv_heads {total_kv_heads}")
    if tp_size > total_kv_heads and tp_size % total_kv_heads:
        raise TopologyError(
            f"{who}num_kv_heads {total_kv_heads} does not divide tp_size {tp_size} (replicated KV heads)"
        )


def kv_heads_per_rank(total_kv_heads: int, tp_size: int) -> int:
    """`H_local`: KV heads each TP rank stores (at least one: ranks replicate heads when `tp > K`)."""
    return max(1, total_kv_heads // tp_size)


def heads_of_rank(tp_rank: int, tp_size: int, total_kv_heads: int) -> range:
    """Global KV heads TP rank `tp_rank` holds, in local order.

    Raises:
        TopologyError: `K` and `tp_size` do not divide evenly (see `check_kv_heads`).
        ValueError: `tp_rank` is outside `[0, tp_size)`.
    """
    check_kv_heads(total_kv_heads, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    if tp_size > total_kv_heads:
        head = tp_rank * total_kv_heads // tp_size
        return range(head, head + 1)
    per_rank = total_kv_heads // tp_size
    return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)


def holders_of_head(head: int, tp_size: int, total_kv_heads: int) -> range:
    """TP ranks that hold global KV head `head`, in rank order (several when the KV is replicated).

    Raises:
        TopologyError: `K` and `tp_size` do not divide evenly.
        ValueError: `head` is outside `[0, K)`.
    """
    check_kv_heads(total_kv_heads, tp_size)
    if not 0 <= head < total_kv_heads:
        raise ValueError(f"head {head} outside [0, {total_kv_heads})")
    if tp_size > total_kv_heads:
        copies = tp_size // total_kv_heads
        return range(head * copies, (head + 1) * copies)
    rank = head // (total_kv_heads // tp_size)
    return range(rank, rank + 1)


def even_layer_split(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """`[start, end)` per PP stage, as vLLM splits by default: the remainder goes to the stages before the last.

    Raises:
        ValueError: `pp_size < 1`, or fewer layers than stages.
    """
    if pp_size < 1 or num_layers < pp_size:
        raise ValueError(f"cannot split {num_layers} layers over pp_size {pp_size}")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    split: list[tuple[int, int]] = []
    start = 0
    for size in sizes:
        split.append((start, start + size))
        start += size
    return split


def check_layer_split(split: Sequence[tuple[int, int]], num_layers: int) -> None:
    """Accept any explicit split whose stages are non-empty, in order, and tile `[0, num_layers)`.

    Raises:
        ValueError: a stage is empty, a gap or overlap between stages, or the split does not end at num_layers.
    """
    expected_start = 0
    for stage, (start, end) in enumerate(split):
        if start != expected_start or end <= start:
            raise ValueError(f"stage {stage} holds [{start}, {end}); expected a non-empty range from {expected_start}")
        expected_start = end
    if expected_start != num_layers:
        raise ValueError(f"layer split {list(split)} ends at {expected_start}, not at num_layers {num_layers}")


class BlockGeometry(NamedTuple):
    """Byte strides inside one layer's KV tensor of one worker; an element is one token of one head of one half."""

    halves: int  # 2 (K and V), or 1 for MLA
    local_heads: int
    block_size: int
    element_bytes: int  # head_size * dtype size
    block_bytes: int
    half_stride: int
    head_stride: int
    token_stride: int


def kv_cache_shape(meta: WorkerMetadata) -> tuple[int, ...]:
    """The torch shape of one layer's KV tensor of this worker.

    Raises:
        TopologyError: the layout is neither HND nor NHD (non-MLA), or K does not divide over tp.
    """
    if meta.is_mla:
        return (meta.num_blocks, meta.block_size, meta.head_size)
    check_kv_heads(meta.num_kv_heads, meta.tp_size)
    heads = kv_heads_per_rank(meta.num_kv_heads, meta.tp_size)
    if meta.layout == "HND":
        return (meta.num_blocks, 2, heads, meta.block_size, meta.head_size)
    if meta.layout == "NHD":
        return (meta.num_blocks, 2, meta.block_size, heads, meta.head_size)
    raise TopologyError(f"unknown KV layout {meta.layout!r}; known: {', '.join(LAYOUTS)}")


def block_geometry(meta: WorkerMetadata) -> BlockGeometry:
    """Strides of this worker's per-layer KV tensor.

    Raises:
        TopologyError: unknown dtype or layout, or K does not divide over tp.
    """
    element = meta.head_size * dtype_size(meta.dtype)
    shape = kv_cache_shape(meta)
    bs = meta.block_size
    if meta.is_mla:
        return BlockGeometry(1, 1, bs, element, bs * element, bs * element, bs * element, element)
    heads = kv_heads_per_rank(meta.num_kv_heads, meta.tp_size)
    half = heads * bs * element
    if meta.layout == "HND":
        return BlockGeometry(2, heads, bs, element, 2 * half, half, bs * element, element)
    assert shape[3] == heads
    return BlockGeometry(2, heads, bs, element, 2 * half, half, element, heads * element)


def block_bytes(meta: WorkerMetadata) -> int:
    """Bytes of one block of one layer (K and V halves together, or the MLA latent).

    Raises:
        TopologyError: unknown dtype or layout, or K does not divide over tp.
    """
    return block_geometry(meta).block_bytes


def layer_bytes(meta: WorkerMetadata) -> int:
    """Bytes of one layer's whole KV tensor (`num_blocks` blocks).

    Raises:
        TopologyError: unknown dtype or layout, or K does not divide over tp.
    """
    return block_bytes(meta) * meta.num_blocks
