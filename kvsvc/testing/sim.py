"""Simulated KV pools for tests: an engine's workers as numpy byte arenas, and the known bytes a transfer carries.

Rules: `SimEngine` gives each worker real `WorkerMetadata` whose addresses name its arena, either fake addresses
(for planning and memmove in pure tests) or the arena's real address (for real transports in one process).
`kv_pattern` is a function of (transfer, layer, half, head, token, byte) that is never 0, so an untouched zeroed
byte is always told apart. Pure: numpy and kvsvc's pure core only.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from kvsvc.core.layout import block_geometry, even_layer_split, heads_of_rank, is_cross_layer, layer_addrs, layer_bytes
from kvsvc.core.messages import Worker, WorkerMetadata, WorkerRef

ByteArray = npt.NDArray[np.uint8]
IntArray = npt.NDArray[np.int64]
_WORKER_STRIDE = 1 << 36  # fake address distance between two workers' arenas


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Shape of one simulated engine. P and D must agree on the model (layers, heads, head size, dtype, MLA)."""

    tp_size: int = 1
    pp_size: int = 1
    num_layers: int = 4
    num_kv_heads: int = 4
    head_size: int = 4
    dtype: str = "bfloat16"
    block_size: int = 4
    num_blocks: int = 16
    layout: str = "HND"
    is_mla: bool = False
    layer_split: tuple[tuple[int, int], ...] | None = None  # [start, end) per PP stage; default even split


class SimEngine:
    """One engine's workers: their `WorkerMetadata` and a zeroed byte arena per worker that the addresses name."""

    def __init__(self, engine_id: str, spec: EngineSpec, base_addr: int | None, incarnation: str = "1") -> None:
        """`base_addr` None places each worker's arena at its real address (for a real transport); otherwise the
        workers get fake addresses from `base_addr` on, far apart."""
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.spec = spec
        self.metas: dict[Worker, WorkerMetadata] = {}
        self.arenas: dict[Worker, ByteArray] = {}
        self.bases: dict[Worker, int] = {}
        split = spec.layer_split or tuple(even_layer_split(spec.num_layers, spec.pp_size))
        index = 0
        for pp, (start, end) in enumerate(split):
            for tp in range(spec.tp_size):
                meta = WorkerMetadata(
                    engine_id=engine_id,
                    incarnation=incarnation,
                    pp_rank=pp,
                    pp_size=len(split),
                    tp_rank=tp,
                    tp_size=spec.tp_size,
                    start_layer=start,
                    end_layer=end,
                    num_kv_heads=spec.num_kv_heads,
                    head_size=spec.head_size,
                    dtype=spec.dtype,
                    block_size=spec.block_size,
                    num_blocks=spec.num_blocks,
                    layout=spec.layout,
                    is_mla=spec.is_mla,
                    base_addrs=[],
                )
                size = layer_bytes(meta)
                if size * (end - start) > _WORKER_STRIDE:
                    raise ValueError(f"simulated pool of {size * (end - start)} bytes is too large")
                arena = np.zeros(size * (end - start), dtype=np.uint8)
                base = arena.ctypes.data if base_addr is None else base_addr + index * _WORKER_STRIDE
                addrs = [base] if is_cross_layer(meta) else [base + i * size for i in range(end - start)]
                self.metas[(pp, tp)] = msgspec.structs.replace(meta, base_addrs=addrs)
                self.arenas[(pp, tp)] = arena
                self.bases[(pp, tp)] = base
                index += 1

    def ref(self, worker: Worker) -> WorkerRef:
        return WorkerRef.of(self.metas[worker])

    def span(self, worker: Worker, addr: int, length: int) -> slice:
        """The arena slice that `[addr, addr + length)` names.

        Raises:
            AssertionError: the range leaves the worker's pool (a planner bug).
        """
        offset = addr - self.bases[worker]
        arena = self.arenas[worker]
        if offset < 0 or offset + length > arena.size:
            raise AssertionError(f"[{addr:#x}, +{length}) lies outside worker {worker}'s pool of {self.engine_id!r}")
        return slice(offset, offset + length)

    def tokens(self, worker: Worker, layer: int, block_ids: list[int], num_tokens: int) -> ByteArray:
        """A copy of tokens `[0, num_tokens)` of global `layer` in `block_ids`, axes (token, half, head, byte)."""
        blocks, slots = self._index(worker, block_ids, num_tokens)
        return self._view(worker, layer)[blocks, :, :, slots, :]

    def write_tokens(
        self, worker: Worker, layer: int, block_ids: list[int], num_tokens: int, values: ByteArray
    ) -> None:
        """Store `values` (axes as `tokens` returns them) into tokens `[0, num_tokens)` of `layer`."""
        blocks, slots = self._index(worker, block_ids, num_tokens)
        self._view(worker, layer)[blocks, :, :, slots, :] = values

    def _index(self, worker: Worker, block_ids: list[int], num_tokens: int) -> tuple[IntArray, IntArray]:
        bs = self.metas[worker].block_size
        tokens = np.arange(num_tokens, dtype=np.int64)
        return np.asarray(block_ids, dtype=np.int64)[tokens // bs], tokens % bs

    def _view(self, worker: Worker, layer: int) -> ByteArray:
        """Layer `layer`'s tensor as bytes, axes (block, half, head, slot, byte) whatever the layout: a strided
        view built from the planner's own block geometry."""
        meta = self.metas[worker]
        g = block_geometry(meta)
        start = layer_addrs(meta)[layer - meta.start_layer] - self.bases[worker]
        shape = (meta.num_blocks, g.halves, g.local_heads, g.block_size, g.element_bytes)
        strides = (g.block_stride, g.half_stride, g.head_stride, g.token_stride, 1)
        view: ByteArray = np.lib.stride_tricks.as_strided(
            self.arenas[worker][start:], shape=shape, strides=strides, writeable=True
        )
        return view

    def heads(self, worker: Worker) -> list[int]:
        meta = self.metas[worker]
        if meta.is_mla:
            return [0]
        return list(heads_of_rank(meta.tp_rank, meta.tp_size, meta.num_kv_heads))


def kv_pattern(transfer_id: str, layer: int, heads: list[int], num_tokens: int, halves: int, nbytes: int) -> ByteArray:
    """The known bytes of a transfer's KV, a function of (transfer, layer, half, head, token, byte), never 0."""
    salt = zlib.crc32(transfer_id.encode())
    t = np.arange(num_tokens, dtype=np.int64)[:, None, None, None]
    s = np.arange(halves, dtype=np.int64)[None, :, None, None]
    h = np.asarray(heads, dtype=np.int64)[None, None, :, None]
    b = np.arange(nbytes, dtype=np.int64)[None, None, None, :]
    x = (salt ^ (layer * 0x9E3779B1) ^ (s * 0x85EBCA77) ^ (h * 0xC2B2AE3D) ^ (t * 0x27D4EB2F) ^ (b * 0x165667B1)) & (
        0xFFFFFFFF
    )
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    return (x % 255 + 1).astype(np.uint8)
