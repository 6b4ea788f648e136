"""A synthetic model: KV as a known function of (request seed, layer, K/V half, head, token, dim), and its checker.

Imports torch, the pure core and `workers.kv_pool` only. Invariants: every value is a small integer (|v| <= 125),
exact in bf16, fp16 and fp32, so a byte-exact comparison is meaningful; values depend on the token's index in the
request, never on block size or block ids, so P and D with different layouts agree on what each token's KV must be;
a value is `pattern[head_code(seed, layer, half, head) + token_code(seed, token), dim]`: one gather from a fixed table.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

from kvsvc.core.layout import heads_of_rank
from kvsvc.core.messages import WorkerMetadata
from kvsvc.transport.streams import completion_future, record_event
from workers.kv_pool import hnd_view

_MASK31: Final = (1 << 31) - 1
# A row's code is head_code + token_code, each in [0, _CODES): a row written to the wrong (layer, half, head, token)
# is missed only when the two codes collide (about 1 in 4096); a systematic misplacement moves many rows and shows.
_CODES: Final = 4096
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
    """A 31-bit integer finaliser; every product stays below 2**62, so int64 never overflows. Slow per element
    on the CPU (torch shifts are not vectorised): use it on small tensors only."""
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK31
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _MASK31
    return x ^ (x >> 15)


@functools.lru_cache(maxsize=16)
def _patterns(head_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`(2 * _CODES - 1, head_size)` rows of small integers: row `head_code + token_code` is a token's KV."""
    rows = torch.arange(2 * _CODES - 1, dtype=torch.int64).unsqueeze(1)
    dims = torch.arange(head_size, dtype=torch.int64).unsqueeze(0)
    values = _mix((rows * 0x10001 + dims * 0x3B9 + 0x5F3759) & _MASK31) % 251 - 125
    return values.to(dtype).to(device)


def _head_codes(seed: int, layer: int, heads: Sequence[int]) -> torch.Tensor:
    """Codes `(2, H)` in `[0, _CODES)` of each (half, global head) of one layer of one request."""
    base = (seed * 0x9E3779B1 + layer * 0x85EBCA77) & _MASK31
    halves = torch.arange(2, dtype=torch.int64).view(2, 1)
    head_ids = torch.tensor(list(heads), dtype=torch.int64).view(1, -1)
    return _mix((base + halves * 0x27D4EB2F + head_ids * 0x01000193) & _MASK31) % _CODES


def _token_codes(seed: int, num_tokens: int) -> torch.Tensor:
    """Codes `(num_tokens,)` in `[0, _CODES)` of each token of one request."""
    tokens = torch.arange(num_tokens, dtype=torch.int64)
    return _mix((seed * 0x5BD1E995 + 0x6A09E667 + tokens * 0x01000193) & _MASK31) % _CODES


def expected_kv(
    seed: int, layer: int, heads: Sequence[int], num_tokens: int, head_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The KV the synthetic model writes for one layer: `(2, len(heads), num_tokens, head_size)` on the CPU."""
    codes = _head_codes(seed, layer, heads).unsqueeze(2) + _token_codes(seed, num_tokens).view(1, 1, -1)
    return _patterns(head_size, dtype, torch.device("cpu"))[codes]


def _hnd(layer: torch.Tensor, meta: WorkerMetadata) -> torch.Tensor:
    """One layer as an HND view (`workers.kv_pool.hnd_view`); MLA has no synthetic model."""
    if meta.is_mla:
        raise ValueError(f"the synthetic model writes K and V heads, not an MLA latent (layout {meta.layout!r})")
    return hnd_view(layer, meta.layout)


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ids as `(position in block_ids, first id, length)`."""
    runs: list[tuple[int, int, int]] = []
    for pos, block in enumerate(block_ids):
        if runs and block == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((pos, block, 1))
    return runs


def _check_request(
    layers: Sequence[torch.Tensor], meta: WorkerMetadata, block_ids: Sequence[int], num_tokens: int
) -> list[int]:
    """The blocks that hold the request's tokens.

    Raises:
        ValueError: the layers do not match `meta`, or the blocks cannot hold the tokens or lie outside the pool.
    """
    if len(layers) != meta.num_layers:
        raise ValueError(f"{len(layers)} layer tensors for {meta.num_layers} local layers")
    used = -(-num_tokens // meta.block_size)
    if num_tokens < 0 or used > len(block_ids):
        raise ValueError(f"{num_tokens} tokens do not fit {len(block_ids)} blocks of {meta.block_size} tokens")
    bad = [b for b in block_ids[:used] if not 0 <= b < meta.num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:8]} outside the pool of {meta.num_blocks} blocks")
    if len(set(block_ids[:used])) != used:
        raise ValueError(f"block ids {list(block_ids[:used])} repeat a block")
    return list(block_ids[:used])


def _block_codes(seed: int, layer: int, heads: Sequence[int], tokens: torch.Tensor, bs: int) -> torch.Tensor:
    """Row codes in block order `(blocks, 2, H, bs)` for token codes `tokens` (a multiple of `bs` long)."""
    return _head_codes(seed, layer, heads).view(1, 2, -1, 1) + tokens.view(-1, 1, 1, bs)


def fill(
    layers: Sequence[torch.Tensor], meta: WorkerMetadata, seed: int, block_ids: Sequence[int], num_tokens: int
) -> None:
    """Write request `seed`'s KV for tokens `[0, num_tokens)` into `block_ids` of every local layer and head.

    The last block is written whole (its tail holds the values of tokens past the end): P owns those slots.

    Raises:
        ValueError: layers and metadata disagree, the blocks cannot hold the tokens (or repeat one), or the layout
            is MLA or unknown.
    """
    ids = _check_request(layers, meta, block_ids, num_tokens)
    if not ids:
        return
    device = layers[0].device
    heads = heads_of_rank(meta.tp_rank, meta.tp_size, meta.num_kv_heads)
    table = _patterns(meta.head_size, layers[0].dtype, device)
    bs, hd, nh = meta.block_size, meta.head_size, len(heads)
    tokens = _token_codes(seed, len(ids) * bs)
    for local, layer in enumerate(layers):
        codes = _block_codes(seed, meta.start_layer + local, heads, tokens, bs).to(device)
        for pos, first, count in _runs(ids):
            run_codes = codes[pos : pos + count].reshape(-1)
            if meta.layout == "HND":
                # Gather straight into the pool: a run of consecutive blocks is one contiguous slice.
                torch.index_select(table, 0, run_codes, out=layer[first : first + count].view(-1, hd))
            else:
                values = torch.index_select(table, 0, run_codes).view(count, 2, nh, bs, hd)
                _hnd(layer, meta)[first : first + count] = values


def verify(
    layers: Sequence[torch.Tensor], meta: WorkerMetadata, seed: int, block_ids: Sequence[int], num_tokens: int
) -> VerifyResult:
    """Check every element of every local layer and head, tokens `[0, num_tokens)`, against request `seed`'s KV.

    Comparison is bitwise (the integer view of the dtype), so `-0.0` vs `0.0` or a NaN payload counts as wrong.

    Raises:
        ValueError: layers and metadata disagree, the blocks cannot hold the tokens (or repeat one), or the layout
            is MLA or unknown.
    """
    ids = _check_request(layers, meta, block_ids, num_tokens)
    if not ids:
        return VerifyResult(ok=True, checked=0, mismatches=0)
    device = layers[0].device
    heads = heads_of_rank(meta.tp_rank, meta.tp_size, meta.num_kv_heads)
    table = _patterns(meta.head_size, layers[0].dtype, device)
    as_int = _INT_VIEW[layers[0].element_size()]
    bs, hd, nh = meta.block_size, meta.head_size, len(heads)
    tokens = _token_codes(seed, len(ids) * bs)
    checked = mismatches = 0
    first: Mismatch | None = None
    for local, layer in enumerate(layers):
        codes = _block_codes(seed, meta.start_layer + local, heads, tokens, bs).to(device)
        view = _hnd(layer, meta)
        for pos, block, count in _runs(ids):
            # Only the slots of tokens below num_tokens: the tail of a partial last block is not the request's.
            valid = min(count * bs, num_tokens - pos * bs)
            full, rest = divmod(valid, bs)
            parts = [(0, full, bs)] if full else []
            if rest:
                parts.append((full, full + 1, rest))
            for lo, hi, slots in parts:
                actual = view[block + lo : block + hi, :, :, :slots]
                expected = torch.index_select(table, 0, codes[pos + lo : pos + hi, :, :, :slots].reshape(-1))
                expected = expected.view(hi - lo, 2, nh, slots, hd)
                wrong = expected.view(as_int) != actual.view(as_int)
                count_wrong = int(torch.count_nonzero(wrong).item())
                checked += wrong.numel()
                mismatches += count_wrong
                if count_wrong and first is None:
                    b, half, h, slot, dim = (int(i) for i in wrong.nonzero()[0].tolist())
                    first = Mismatch(
                        layer=meta.start_layer + local,
                        half=half,
                        head=heads[h],
                        token=(pos + lo + b) * bs + slot,
                        dim=dim,
                        expected=float(expected[b, half, h, slot, dim].item()),
                        actual=float(actual[b, half, h, slot, dim].item()),
                    )
    return VerifyResult(ok=mismatches == 0, checked=checked, mismatches=mismatches, first=first)


def ready_after_fill(device: torch.device) -> asyncio.Future[None] | None:
    """The completion future of the KV just written on `device`: None on the CPU (the data is there already), on
    CUDA a future of an event recorded on the current stream (`kvsvc.transport.streams`). Call it on the loop that
    awaits it.

    Raises:
        RuntimeError: no running event loop (CUDA only); whatever torch raises when recording fails.
    """
    if device.type != "cuda":
        return None
    return completion_future(record_event())
