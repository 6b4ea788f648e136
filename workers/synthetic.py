"""A synthetic model: KV as a known function of (request seed, layer, K/V half, head, token, dim), and its checker.

Imports torch and the pure core only. Invariants: every value is a small integer (|v| <= 125), exact in bf16, fp16
and fp32, so a byte-exact comparison is meaningful; values depend on the token's index in the request, never on
block size or block ids, so P and D with different layouts agree on what each token's KV must be; a value is
`pattern[code(seed, layer, half, head, token), dim]`, a lookup into a fixed table, which keeps `fill` one gather.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

from kvsvc.layout import heads_of_rank
from kvsvc.messages import WorkerMetadata

_MASK31: Final = (1 << 31) - 1
# Distinct row patterns: a row written to the wrong (layer, half, head, token) is missed only when both codes
# collide, 1 in 4093; a systematic misplacement moves many rows and cannot hide.
_PATTERN_ROWS: Final = 4093
_INT_VIEW: Final = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Where the first wrong element is: global layer, half (0 = K, 1 = V), global head, token, dim."""

    layer: int
    half: int
    head: int
    token: int
    dim: int
    expected: float
    actual: float


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """The outcome of checking one request's KV on one worker: `mismatches` elements of `checked` differ."""

    ok: bool
    checked: int
    mismatches: int
    first: Mismatch | None = None


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer finaliser; every product stays below 2**62, so int64 never overflows."""
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK31
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _MASK31
    return x ^ (x >> 15)


@functools.lru_cache(maxsize=16)
def _patterns(head_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    rows = torch.arange(_PATTERN_ROWS, dtype=torch.int64).unsqueeze(1)
    dims = torch.arange(head_size, dtype=torch.int64).unsqueeze(0)
    values = _mix((rows * 0x10001 + dims * 0x3B9 + 0x5F3759) & _MASK31) % 251 - 125
    return values.to(dtype).to(device)


def _codes(seed: int, layer: int, heads: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Row codes `(2, H, num_tokens)` of one layer for the given global heads."""
    base = (seed * 0x9E3779B1 + layer * 0x85EBCA77) & _MASK31
    halves = torch.arange(2, dtype=torch.int64).view(2, 1, 1)
    tokens = torch.arange(num_tokens, dtype=torch.int64).view(1, 1, -1)
    x = (base + halves * 0x27D4EB2F + heads.view(1, -1, 1) * 0x01000193 + tokens * 0x5BD1E995) & _MASK31
    return _mix(x) % _PATTERN_ROWS


def expected_kv(
    seed: int, layer: int, heads: Sequence[int], num_tokens: int, head_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The KV the synthetic model writes for one layer: `(2, len(heads), num_tokens, head_size)` on the CPU."""
    codes = _codes(seed, layer, torch.tensor(list(heads), dtype=torch.int64), num_tokens)
    return _patterns(head_size, dtype, torch.device("cpu"))[codes]


def _hnd(layer: torch.Tensor, meta: WorkerMetadata) -> torch.Tensor:
    if meta.is_mla or meta.layout not in ("HND", "NHD"):
        raise ValueError(f"the synthetic model writes HND or NHD KV, not layout {meta.layout!r} (is_mla={meta.is_mla})")
    return layer if meta.layout == "HND" else layer.transpose(2, 3)


def _check_request(layers: Sequence[torch.Tensor], meta: WorkerMetadata, block_ids: Sequence[int], n: int) -> int:
    """Number of blocks that hold the request's `n` tokens.

    Raises:
        ValueError: the layers do not match `meta`, or the blocks cannot hold the tokens or lie outside the pool.
    """
    if len(layers) != meta.num_layers:
        raise ValueError(f"{len(layers)} layer tensors for {meta.num_layers} local layers")
    used = -(-n // meta.block_size)
    if n < 0 or used > len(block_ids):
        raise ValueError(f"{n} tokens do not fit {len(block_ids)} blocks of {meta.block_size} tokens")
    bad = [b for b in block_ids[:used] if not 0 <= b < meta.num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:8]} outside the pool of {meta.num_blocks} blocks")
    return used


def fill(layers: Sequence[torch.Tensor], meta: WorkerMetadata, seed: int, block_ids: Sequence[int], num_tokens: int) -> None:
    """Write request `seed`'s KV for tokens `[0, num_tokens)` into `block_ids` of every local layer and head.

    The last block is written whole (its tail holds the values of tokens past the end): P owns those slots.

    Raises:
        ValueError: layers and metadata disagree, the blocks cannot hold the tokens, or the layout is not HND/NHD.
    """
    used = _check_request(layers, meta, block_ids, num_tokens)
    if used == 0:
        return
    device = layers[0].device
    ids = torch.tensor(list(block_ids[:used]), dtype=torch.int64, device=device)
    heads = torch.tensor(list(heads_of_rank(meta.tp_rank, meta.tp_size, meta.num_kv_heads)), dtype=torch.int64)
    table = _patterns(meta.head_size, layers[0].dtype, device)
    bs = meta.block_size
    for local, layer in enumerate(layers):
        codes = _codes(seed, meta.start_layer + local, heads, used * bs).to(device)
        values = table[codes]  # (2, H, used*bs, hd)
        blocks = values.view(2, len(heads), used, bs, meta.head_size).permute(2, 0, 1, 3, 4)
        _hnd(layer, meta)[ids] = blocks


def verify(
    layers: Sequence[torch.Tensor], meta: WorkerMetadata, seed: int, block_ids: Sequence[int], num_tokens: int
) -> VerifyResult:
    """Check every element of every local layer and head, tokens `[0, num_tokens)`, against request `seed`'s KV.

    Comparison is bitwise (the integer view of the dtype), so `-0.0` vs `0.0` or a NaN payload counts as wrong.

    Raises:
        ValueError: layers and metadata disagree, the blocks cannot hold the tokens, or the layout is not HND/NHD.
    """
    used = _check_request(layers, meta, block_ids, num_tokens)
    if used == 0:
        return VerifyResult(ok=True, checked=0, mismatches=0)
    device = layers[0].device
    ids = torch.tensor(list(block_ids[:used]), dtype=torch.int64, device=device)
    head_list = list(heads_of_rank(meta.tp_rank, meta.tp_size, meta.num_kv_heads))
    heads = torch.tensor(head_list, dtype=torch.int64)
    table = _patterns(meta.head_size, layers[0].dtype, device)
    as_int = _INT_VIEW[layers[0].element_size()]
    checked = mismatches = 0
    first: Mismatch | None = None
    for local, layer in enumerate(layers):
        expected = table[_codes(seed, meta.start_layer + local, heads, num_tokens).to(device)]
        got = _hnd(layer, meta)[ids].permute(1, 2, 0, 3, 4).reshape(2, len(head_list), used * meta.block_size, -1)
        actual = got[:, :, :num_tokens].contiguous()
        wrong = expected.view(as_int) != actual.view(as_int)
        checked += wrong.numel()
        count = int(wrong.sum().item())
        if count and first is None:
            half, h, token, dim = (int(i) for i in wrong.nonzero()[0].tolist())
            first = Mismatch(
                meta.start_layer + local,
                half,
                head_list[h],
                token,
                dim,
                float(expected[half, h, token, dim].item()),
                float(actual[half, h, token, dim].item()),
            )
        mismatches += count
    return VerifyResult(ok=mismatches == 0, checked=checked, mismatches=mismatches, first=first)


def ready_after_fill(device: torch.device) -> Awaitable[None] | None:
    """The completion future of the KV just written on `device`: None on the CPU (the data is there already).

    On CUDA it records an event on the current stream; uses `kvsvc.streams` when that module exists, else polls
    the event from the running loop. Must be called on the event loop that awaits the result.
    """
    if device.type != "cuda":
        return None
    try:
        streams: Any = importlib.import_module("kvsvc.streams")
    except ImportError:
        streams = None
    if streams is not None and hasattr(streams, "record_event") and hasattr(streams, "completion_future"):
        future: Awaitable[None] = streams.completion_future(streams.record_event())
        return future
    event = torch.cuda.Event()
    event.record()
    return _poll_event(event)


async def _poll_event(event: torch.cuda.Event) -> None:
    while not event.query():
        await asyncio.sleep(0.0005)
