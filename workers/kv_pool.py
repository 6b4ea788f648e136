"""One worker's KV pool: a torch tensor per local layer in any per-layer layout of `kvsvc.core.layout` (HND
`(num_blocks, 2, H_local, block_size, head_size)`, NHD, KV_HND, KV_NHD, HNC, NHC, HND_FUSED), or one cross-layer pool
`(num_blocks, local_layers, 2, H_local, block_size, head_size)` (`HND_CROSS_LAYER`).

Imports torch and the pure core (`kvsvc.core.layout`, `kvsvc.core.messages`) only. Invariants: the layers are views of
one contiguous buffer whenever it can be allocated, so the transport registers a single region; `base_addrs` of the
pool's `WorkerMetadata` are the layers' `data_ptr()`s in layer order, and each layer's size is `layer_bytes(meta)`.
The cross-layer pool is always one buffer, `base_addrs` holds its start, and `layers` are strided per-layer views
(HND order inside a block), so the synthetic model fills and checks it like an HND pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from kvsvc.core.layout import (
    CROSS_LAYER,
    FUSED,
    LAYOUTS,
    check_kv_heads,
    check_layer_split,
    dtype_size,
    even_layer_split,
    kv_cache_shape,
    layer_bytes,
)
from kvsvc.core.messages import WorkerMetadata


@dataclass(frozen=True, slots=True)
class WorkerShape:
    """What a worker's pool looks like, before it exists: the engine's geometry plus this worker's ranks."""

    engine_id: str
    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int
    start_layer: int
    end_layer: int
    num_kv_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    dtype: str = "bfloat16"
    layout: str = "HND"


def engine_shapes(
    *,
    engine_id: str,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    num_blocks: int,
    pp_size: int = 1,
    tp_size: int = 1,
    layer_split: list[tuple[int, int]] | None = None,
    dtype: str = "bfloat16",
    layout: str = "HND",
) -> list[WorkerShape]:
    """The shapes of an engine's `pp_size * tp_size` workers, indexed `pp_rank * tp_size + tp_rank`.

    Raises:
        ValueError: the layer split does not tile `[0, num_layers)` over `pp_size` stages, or an unknown layout.
        TopologyError: `num_kv_heads` and `tp_size` do not divide evenly, or an unknown dtype.
    """
    check_kv_heads(num_kv_heads, tp_size, engine_id)
    dtype_size(dtype)
    if layout not in LAYOUTS:
        raise ValueError(f"engine {engine_id}: KV layout {layout!r} is not one of {LAYOUTS}")
    split = layer_split if layer_split is not None else even_layer_split(num_layers, pp_size)
    if len(split) != pp_size:
        raise ValueError(f"layer split {split} has {len(split)} stages, pp_size is {pp_size}")
    check_layer_split(split, num_layers)
    return [
        WorkerShape(
            engine_id,
            pp,
            pp_size,
            tp,
            tp_size,
            start,
            end,
            num_kv_heads,
            head_size,
            block_size,
            num_blocks,
            dtype,
            layout,
        )
        for pp, (start, end) in enumerate(split)
        for tp in range(tp_size)
    ]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name such as `"bfloat16"`.

    Raises:
        ValueError: torch has no dtype of that name.
    """
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torch has no dtype {name!r}")
    return dtype


class KVPool:
    """The KV tensors of one worker and the metadata that describes them (see module docstring)."""

    def __init__(self, shape: WorkerShape, incarnation: str, device: str = "cpu") -> None:
        """Allocate the pool (zeroed).

        Raises:
            ValueError: unknown dtype or layout, or an empty layer range.
            TopologyError: the heads do not divide over tp.
            torch.OutOfMemoryError / RuntimeError: not even one layer fits.
        """
        if shape.layout not in LAYOUTS:
            raise ValueError(f"KVPool holds one of the layouts {LAYOUTS}, not {shape.layout!r}")
        if shape.end_layer <= shape.start_layer:
            raise ValueError(f"worker holds no layers: [{shape.start_layer}, {shape.end_layer})")
        self.shape = shape
        draft = WorkerMetadata(
            engine_id=shape.engine_id,
            incarnation=incarnation,
            pp_rank=shape.pp_rank,
            pp_size=shape.pp_size,
            tp_rank=shape.tp_rank,
            tp_size=shape.tp_size,
            start_layer=shape.start_layer,
            end_layer=shape.end_layer,
            num_kv_heads=shape.num_kv_heads,
            head_size=shape.head_size,
            dtype=shape.dtype.removeprefix("torch."),
            block_size=shape.block_size,
            num_blocks=shape.num_blocks,
            layout=shape.layout,
            is_mla=False,
            base_addrs=[],
        )
        dtype = torch_dtype(shape.dtype)
        layer_shape = kv_cache_shape(draft)
        num_layers = shape.end_layer - shape.start_layer
        self.buffer: torch.Tensor | None
        self.layers: list[torch.Tensor]
        if shape.layout == CROSS_LAYER:
            # One tensor with every local layer inside each block: there is no per-layer fallback.
            self.buffer = torch.zeros(layer_shape, dtype=dtype, device=device)
            self.layers = list(self.buffer.unbind(1))
            self.meta = msgspec.structs.replace(draft, base_addrs=[self.buffer.data_ptr()])
            return
        try:
            self.buffer = torch.zeros((num_layers, *layer_shape), dtype=dtype, device=device)
            self.layers = list(self.buffer.unbind(0))
        except (torch.OutOfMemoryError, RuntimeError):
            # A GPU without one free stretch of that size may still hold the layers apart: one region each.
            self.buffer = None
            self.layers = [torch.zeros(layer_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.meta = msgspec.structs.replace(draft, base_addrs=[t.data_ptr() for t in self.layers])
        size = layer_bytes(self.meta)
        assert all(t.numel() * t.element_size() == size for t in self.layers)

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def regions(self) -> list[tuple[int, int]]:
        """`(address, length)` of the memory to register with the transport: one region when contiguous."""
        if self.buffer is not None:
            return [(self.buffer.data_ptr(), self.buffer.numel() * self.buffer.element_size())]
        size = layer_bytes(self.meta)
        return [(addr, size) for addr in self.meta.base_addrs]

    def hnd(self, local_layer: int) -> torch.Tensor:
        """Layer `local_layer` as an HND view `(num_blocks, 2, H_local, block_size, head_size)`, whatever the layout."""
        return hnd_view(self.layers[local_layer], self.shape.layout)


def hnd_view(layer: torch.Tensor, layout: str) -> torch.Tensor:
    """One layer's tensor (or a cross-layer pool's per-layer view) as `(num_blocks, 2, H_local, block_size,
    head_size)`. The fused layout's (block, head) chunk is opaque to kvsvc; the synthetic workers store each token
    as its K then its V there, which this view exposes as the two halves.

    Raises:
        ValueError: an unknown layout.
    """
    if layout in ("HND", CROSS_LAYER):
        return layer
    if layout == "NHD":
        return layer.transpose(2, 3)
    if layout == "KV_HND":
        return layer.transpose(0, 1)
    if layout == "KV_NHD":
        return layer.permute(1, 0, 3, 2, 4)
    if layout in (FUSED, "HNC"):
        blocks, heads, block_size, cell = layer.shape
        return layer.view(blocks, heads, block_size, 2, cell // 2).permute(0, 3, 1, 2, 4)
    if layout == "NHC":
        blocks, block_size, heads, cell = layer.shape
        return layer.view(blocks, block_size, heads, 2, cell // 2).permute(0, 3, 2, 1, 4)
    raise ValueError(f"no HND view of layout {layout!r}; known: {', '.join(LAYOUTS)}")
