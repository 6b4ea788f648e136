"""KV-cache geometry of one worker: which heads and layers it holds and where each byte of a block lives.

Pure module: imports only the standard library, numpy (for `Int64Array`, the descriptor tables' column type) and
`kvsvc.core.errors`/`kvsvc.core.messages` (no torch, asyncio).
Invariants: head ownership follows docs/design.md (`H_local = max(1, K // tp)`, replicated when `tp > K`); byte
offsets match C-contiguous torch tensors. Per-layer layouts have one tensor per local layer (`base_addrs` holds one
address per layer):

| layout        | one layer's tensor                              | who uses it                                    |
|---------------|-------------------------------------------------|------------------------------------------------|
| `HND`         | `(num_blocks, 2, H_local, block_size, head)`    | FlashInfer (HND), kvsvc's own workers          |
| `NHD`         | `(num_blocks, 2, block_size, H_local, head)`    | FlashInfer (NHD)                               |
| `KV_HND`      | `(2, num_blocks, H_local, block_size, head)`    | FlashAttention with the HND stride order       |
| `KV_NHD`      | `(2, num_blocks, block_size, H_local, head)`    | FlashAttention (vLLM's default on GPU)         |
| `HNC`         | `(num_blocks, H_local, block_size, 2 * head)`   | vLLM 0.32+ on GPU, `LBHNC`: K then V per cell  |
| `NHC`         | `(num_blocks, block_size, H_local, 2 * head)`   | vLLM 0.32+ on GPU, `LBNHC`                     |
| `HND_FUSED`   | `(num_blocks, H_local, block_size, 2 * head)`   | vLLM's CPU backend                             |
| MLA           | `(num_blocks, block_size, head)`                | any MLA backend (`is_mla`; the layout is unused)|

`HND_FUSED` keeps K and V of one (block, head) together in an order of its own (it depends on the CPU's
instruction set), so such a chunk is opaque: it is only ever copied whole, into the same layout with the same
block size. The cross-layer layout `CROSS_LAYER` ("HND_CROSS_LAYER") has one tensor per worker with every local
layer inside each block, `(num_blocks, local_layers, 2, H_local, block_size, head_size)`, or `(num_blocks,
local_layers, block_size, head_size)` for MLA; `base_addrs` then holds one address, the tensor's start. Inside a
block of one layer the cross-layer pool orders bytes as HND does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

from kvsvc.core.errors import TopologyError
from kvsvc.core.messages import WorkerMetadata

# A table of byte addresses, lengths or region ids: descriptors travel as int64 columns.
Int64Array = npt.NDArray[np.int64]

DTYPE_SIZES: Final[dict[str, int]] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
CROSS_LAYER: Final = "HND_CROSS_LAYER"
FUSED: Final = "HND_FUSED"
PER_LAYER_LAYOUTS: Final = ("HND", "NHD", "KV_HND", "KV_NHD", "HNC", "NHC", FUSED)
LAYOUTS: Final = (*PER_LAYER_LAYOUTS, CROSS_LAYER)
# Layouts whose K and V planes are the outermost axis of a layer's tensor: a block's K and V halves lie apart.
KV_FIRST_LAYOUTS: Final = ("KV_HND", "KV_NHD")
# Layouts that keep a token's K and V of one head side by side (a "cell" of 2 x head_size).
KV_CELL_LAYOUTS: Final = ("HNC", "NHC")
# Layouts with tokens outside heads inside a block.
_NHD_ORDER: Final = ("NHD", "KV_NHD", "NHC")


def is_cross_layer(meta: WorkerMetadata) -> bool:
    """Whether the worker keeps all its local layers in one cross-layer pool (MLA included)."""
    return meta.layout == CROSS_LAYER


def is_fused(meta: WorkerMetadata) -> bool:
    """Whether the worker's (block, head) chunks are opaque (`HND_FUSED`): copied whole or not at all."""
    return meta.layout == FUSED and not meta.is_mla


def head_order(meta: WorkerMetadata) -> str:
    """How a block of one layer orders heads and tokens: "HND" (heads outer: HND, KV_HND, HNC, the fused and the
    cross-layer layouts) or "NHD" (tokens outer: NHD, KV_NHD, NHC).

    MLA has one latent per token, so its order is "HND" whatever the layout says.
    """
    return "NHD" if meta.layout in _NHD_ORDER and not meta.is_mla else "HND"


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
    """Byte strides inside one layer's KV tensor of one worker; an element is one token of one head of one half.

    Every layout is the same four axes (block, half, head, token) with its own strides, so block b, half s,
    local head h, slot t of a layer starts at `layer_base + b*block_stride + s*half_stride + h*head_stride +
    t*token_stride` and is `element_bytes` long.
    """

    halves: int  # 2 (K and V), or 1 for MLA and for the fused layout (K and V inside one opaque element)
    local_heads: int
    block_size: int
    element_bytes: int  # head_size * dtype size; twice that in the fused layout
    block_bytes: int  # K and V of one block of one layer (vLLM's block_len)
    half_stride: int  # K to V: inside the block, or a whole K plane away in the KV_* layouts
    head_stride: int
    token_stride: int
    block_stride: int  # block b to b + 1 of one layer: block_bytes (half of it KV_*), layers x that cross-layer


def kv_cache_shape(meta: WorkerMetadata) -> tuple[int, ...]:
    """The torch shape of one KV tensor of this worker: one layer's, or the whole cross-layer pool's.

    Raises:
        TopologyError: the layout is not one of `LAYOUTS` (non-MLA), K does not divide over tp, or a
            cross-layer pool has an empty layer range.
    """
    cross = is_cross_layer(meta)
    if cross and meta.num_layers < 1:
        raise TopologyError(
            f"{CROSS_LAYER} pool of an empty layer range [{meta.start_layer}, {meta.end_layer}) has no shape"
        )
    layers = (meta.num_layers,) if cross else ()
    if meta.is_mla:
        return (meta.num_blocks, *layers, meta.block_size, meta.head_size)
    check_kv_heads(meta.num_kv_heads, meta.tp_size)
    heads = kv_heads_per_rank(meta.num_kv_heads, meta.tp_size)
    nb, bs, hs = meta.num_blocks, meta.block_size, meta.head_size
    shapes = {
        "HND": (nb, *layers, 2, heads, bs, hs),
        CROSS_LAYER: (nb, *layers, 2, heads, bs, hs),
        "NHD": (nb, 2, bs, heads, hs),
        "KV_HND": (2, nb, heads, bs, hs),
        "KV_NHD": (2, nb, bs, heads, hs),
        "HNC": (nb, heads, bs, 2 * hs),
        "NHC": (nb, bs, heads, 2 * hs),
        FUSED: (nb, heads, bs, 2 * hs),
    }
    shape = shapes.get(meta.layout)
    if shape is not None:
        return shape
    raise TopologyError(f"unknown KV layout {meta.layout!r}; known: {', '.join(LAYOUTS)}")


def block_geometry(meta: WorkerMetadata) -> BlockGeometry:
    """Strides of one layer's blocks of this worker, in its per-layer tensor or inside the cross-layer pool.

    Raises:
        TopologyError: unknown dtype or layout, K does not divide over tp, or a cross-layer pool has an empty
            layer range.
    """
    element = meta.head_size * dtype_size(meta.dtype)
    kv_cache_shape(meta)  # validates the layout and the heads
    layers = meta.num_layers if is_cross_layer(meta) else 1
    bs = meta.block_size
    if meta.is_mla:
        block = bs * element
        return BlockGeometry(1, 1, bs, element, block, block, block, element, layers * block)
    heads = kv_heads_per_rank(meta.num_kv_heads, meta.tp_size)
    half = heads * bs * element
    if meta.layout == FUSED:
        fused = 2 * element
        return BlockGeometry(1, heads, bs, fused, 2 * half, 2 * half, bs * fused, fused, 2 * half)
    hnd = head_order(meta) == "HND"
    if meta.layout in KV_CELL_LAYOUTS:
        cell = 2 * element
        head_stride, token_stride = (bs * cell, cell) if hnd else (cell, heads * cell)
        return BlockGeometry(2, heads, bs, element, 2 * half, element, head_stride, token_stride, 2 * half)
    head_stride, token_stride = (bs * element, element) if hnd else (element, heads * element)
    if meta.layout in KV_FIRST_LAYOUTS:
        half_stride, block_stride = meta.num_blocks * half, half
    else:
        half_stride, block_stride = half, layers * 2 * half
    return BlockGeometry(2, heads, bs, element, 2 * half, half_stride, head_stride, token_stride, block_stride)


def block_bytes(meta: WorkerMetadata) -> int:
    """Bytes of one block of one layer (K and V halves together, or the MLA latent), for every layout.

    This is vLLM's `block_len`. A block of the cross-layer pool, all local layers, is `num_layers` times it.

    Raises:
        TopologyError: unknown dtype or layout, or K does not divide over tp.
    """
    return block_geometry(meta).block_bytes


def layer_bytes(meta: WorkerMetadata) -> int:
    """Bytes of one layer's KV over the whole pool: `num_blocks * block_bytes`, for every layout.

    In a per-layer layout that is one contiguous tensor, a registered region; in the cross-layer pool the layer is
    strided (one `block_bytes` slice per block), so use `pool_regions` for what to register or check addresses
    against, and `pool_bytes` for the pool's size.

    Raises:
        TopologyError: unknown dtype or layout, or K does not divide over tp.
    """
    return block_bytes(meta) * meta.num_blocks


def pool_bytes(meta: WorkerMetadata) -> int:
    """Bytes of all the worker's KV: `layer_bytes * num_layers`, whether in per-layer tensors or one pool.

    Raises:
        TopologyError: unknown dtype or layout, or K does not divide over tp.
    """
    return layer_bytes(meta) * max(0, meta.num_layers)


def check_base_addrs(meta: WorkerMetadata, side: str = "") -> None:
    """Check that `base_addrs` has one address per local layer, or exactly one for the cross-layer pool.

    Raises:
        TopologyError: the count is wrong; the message names `side` (a worker's name) and the layout.
    """
    who = f"{side}: " if side else ""
    if is_cross_layer(meta):
        if len(meta.base_addrs) != 1:
            raise TopologyError(
                f"{who}{len(meta.base_addrs)} base_addrs for layout {CROSS_LAYER}; it needs 1, the pool's start"
            )
    elif len(meta.base_addrs) != meta.num_layers:
        raise TopologyError(f"{who}{len(meta.base_addrs)} base_addrs for {meta.num_layers} layers")


def layer_addrs(meta: WorkerMetadata) -> list[int]:
    """Address of block 0 of each local layer, in layer order; block b of layer i is at `+ b * block_stride`.

    Raises:
        TopologyError: unknown dtype or layout, K does not divide over tp, or `check_base_addrs` refuses.
    """
    check_base_addrs(meta)
    if not is_cross_layer(meta):
        return list(meta.base_addrs)
    size = block_bytes(meta)
    return [meta.base_addrs[0] + i * size for i in range(meta.num_layers)]


def pool_regions(meta: WorkerMetadata) -> list[tuple[int, int]]:
    """The worker's registered KV memory, as `(start_addr, length)` in `base_addrs` order.

    One region per layer tensor in a per-layer layout (once, where layers of a hybrid model's groups share one),
    one region for the cross-layer pool.

    Raises:
        TopologyError: unknown dtype or layout, K does not divide over tp, or `check_base_addrs` refuses.
    """
    check_base_addrs(meta)
    if is_cross_layer(meta):
        return [(meta.base_addrs[0], pool_bytes(meta))]
    size = layer_bytes(meta)
    # Only a hybrid model's groups share tensors; elsewhere a repeated address is a pool no memory can be, which
    # registering it says.
    addrs = dict.fromkeys(meta.base_addrs) if meta.kv_groups else meta.base_addrs
    return [(addr, size) for addr in addrs]
