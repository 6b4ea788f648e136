"""`kvsvc.core.formats`: which pairs of cache formats move, which convert, and that a converted write lands, byte for
byte, P's values in D's format where a same-format write would land P's bytes.

The conversion's proof between real engines is tests/vllm/test_vllm_fp8.py; here the planner's view, the gather's
conversion on real memory and the refusals.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.cli.plan import synthetic_engine
from kvsvc.core.errors import TopologyError
from kvsvc.core.formats import Conversion, as_written, conversion, converts, fp8_values, truncation_table
from kvsvc.core.layout import CROSS_LAYER, FUSED, layer_bytes
from kvsvc.core.messages import ConvPart, KVGroup, MambaState, WorkerMetadata
from kvsvc.core.planner import check_compatible, plan_transfer_arrays
from kvsvc.core.staging_plans import StagingRule, plan_staged, plan_window, region_ids
from kvsvc.service import gather as gather_module
from kvsvc.service.gather import TorchGather
from kvsvc.service.writing import PlanCache

E4M3 = ("fp8_e4m3", "float8_e4m3fn")


def worker(name: str, dtype: str, cache_dtype: str = "auto", *, staging: int = 0, **kw: Any) -> WorkerMetadata:
    args: dict[str, Any] = dict(
        pp_size=1, tp_size=1, num_layers=4, num_kv_heads=4, head_size=16, block_size=16, num_blocks=16
    )
    args.update(kw)
    base = 0x1000 if name == "P" else 0x10_0000_0000
    meta = synthetic_engine(name, base_addr=base, dtype=dtype, layer_gap=1 << 20, **args)[(0, 0)]
    quantized = cache_dtype.startswith("fp8")
    scales = [(1.0, 1.0)] * meta.num_layers if quantized else []
    return msgspec.structs.replace(
        meta,
        cache_dtype=cache_dtype,
        kv_scales=scales,
        staging_addr=0x9000_0000 if staging else 0,
        staging_size=staging,
    )


def p_float(dtype: str = "float32", **kw: Any) -> WorkerMetadata:
    return worker("P", dtype, staging=1 << 20, **kw)


def d_fp8(cache_dtype: str = "fp8_e4m3", **kw: Any) -> WorkerMetadata:
    return worker("D", "uint8", cache_dtype, **kw)


def refused(src: WorkerMetadata, dst: WorkerMetadata, *values: str) -> None:
    with pytest.raises(TopologyError) as info:
        check_compatible(src, dst)
    for value in values:
        assert value in str(info.value), str(info.value)


def test_a_float_p_with_a_staging_region_converts_into_an_fp8_d() -> None:
    for dtype in ("bfloat16", "float16", "float32"):
        for fmt in ("fp8", "fp8_e4m3", "fp8_e5m2"):
            check_compatible(p_float(dtype), d_fp8(fmt))
            assert converts(p_float(dtype), d_fp8(fmt))
    assert not converts(d_fp8(), d_fp8())  # one format: bytes move as they are
    found = conversion(p_float("bfloat16"), d_fp8("fp8_e5m2"))
    assert found is not None and (found.source, found.target, found.ratio) == ("bfloat16", "float8_e5m2", 2)
    assert conversion(d_fp8(), d_fp8()) is None


def test_what_cannot_be_converted_is_refused_naming_both_formats() -> None:
    refused(worker("P", "uint8", "fp8_e4m3"), d_fp8("fp8_e5m2"), "'fp8_e4m3' (fp8_e4m3) != D", "'fp8_e5m2'")
    refused(worker("P", "uint8", "fp8_e4m3", staging=1 << 20), worker("D", "bfloat16"), "(fp8_e4m3) != D")
    refused(p_float("bfloat16"), worker("D", "float16"), "P dtype 'bfloat16' != D dtype 'float16'")
    refused(worker("P", "float32"), d_fp8(), "P converts in its staging region and has none", "staging_bytes")
    refused(p_float(layout=CROSS_LAYER), d_fp8(), f"P holds layout {CROSS_LAYER}")
    refused(p_float(), d_fp8(layout=CROSS_LAYER), f"D holds layout {CROSS_LAYER}")
    refused(p_float(is_mla=True, num_kv_heads=1), d_fp8(is_mla=True, num_kv_heads=1), "P holds MLA")
    mamba = MambaState(
        conv_parts=[ConvPart(channels=8, groups=2)], conv_width=3, conv_dtype="float32", ssm_heads=2, ssm_head_bytes=64
    )
    groups = [KVGroup(kind="full", layers=[0, 2]), KVGroup(kind="mamba", layers=[1, 3], mamba=mamba)]
    hybrid = msgspec.structs.replace(p_float(), kv_groups=groups)
    refused(hybrid, msgspec.structs.replace(d_fp8(), kv_groups=groups), "a Mamba state")
    split = msgspec.structs.replace(d_fp8(), kv_scales=[(1.0, 1.0), (0.5, 0.25), (1.0, 1.0), (1.0, 1.0)])
    refused(p_float(), split, "layer 1 has k_scale 0.5 != v_scale 0.25")
    # A D that says fp8 but stores more than a byte a value: P would read more source than it writes.
    wide = worker("D", "bfloat16", "fp8_e4m3")
    refused(p_float(), wide, "(fp8_e4m3, dtype 'bfloat16')", "a byte per value")
    # Two of P's layers over one tensor (a hybrid's groups) take one scale.
    p = p_float()
    shared = msgspec.structs.replace(p, base_addrs=[p.base_addrs[0], p.base_addrs[0], *p.base_addrs[2:]])
    scaled = msgspec.structs.replace(d_fp8(), kv_scales=[(1.0, 1.0), (2.0, 2.0), (1.0, 1.0), (1.0, 1.0)])
    refused(shared, scaled, "share one tensor but D scales them 1.0 and 2.0")


def test_scales_and_roundings_a_peer_publishes_are_checked() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        scales = [(1.0, 1.0), (bad, 1.0), (1.0, 1.0), (1.0, 1.0)]
        refused(p_float(), msgspec.structs.replace(d_fp8(), kv_scales=scales), "layer 1's KV scales", "finite and > 0")
    refused(p_float(), msgspec.structs.replace(d_fp8(), cache_rounding="up"), "unknown cache_rounding 'up'")


def test_a_converting_pair_is_planned_in_bytes_of_ds_format_from_ps_own_addresses() -> None:
    p, d = p_float("float32"), d_fp8()
    view = as_written(p, d)
    assert (view.dtype, view.cache_dtype, view.base_addrs) == ("uint8", "fp8_e4m3", p.base_addrs)
    assert as_written(d_fp8(), d) == d_fp8()
    src, dst, length = plan_transfer_arrays(p, d, [3, 4], [7, 8], 20)
    same = plan_transfer_arrays(view, d, [3, 4], [7, 8], 20)
    assert all(np.array_equal(a, b) for a, b in zip((src, dst, length), same, strict=True))
    assert int(length.sum()) == 4 * 2 * 2 * 4 * 16 * 16  # layers x blocks x (K, V) x heads x slots x head, 1 B each
    found = conversion(p, d)
    assert found is not None
    real, nbytes, layer = found.sources(src, length)
    starts = np.asarray(p.base_addrs)
    assert np.array_equal(layer, np.searchsorted(starts, src, side="right") - 1)
    assert np.array_equal(real - starts[layer], (src - starts[layer]) * 4) and np.array_equal(nbytes, length * 4)
    # D's windows would scatter P's bytes as they are: a converting pair never gets one.
    assert plan_window(p, d, [7, 8], 20, 0, StagingRule(), 1 << 20) is None


def test_a_converting_pairs_plan_is_always_staged_and_refuses_a_window() -> None:
    from kvsvc.core.messages import WorkerRef
    from kvsvc.core.sender import Submit

    p, d = p_float(), d_fp8()
    cache = PlanCache()
    ref = WorkerRef(engine_id="D", incarnation="i", pp_rank=0, tp_rank=0)
    command = Submit(transfer_id="t", dst=ref, src_block_ids=[0], dst_block_ids=[0], num_tokens=16)
    table, _ = cache.descriptors(p, d, command)
    assert cache.conversion is not None
    never = StagingRule(descriptor_cost_s=0.0)  # staging never pays: the gather converts all the same
    chunks = cache.staged(d, table, never, 1 << 16)
    assert chunks is not None and sum(c.nbytes for c in chunks) == int(table[:, 2].sum())
    windowed = dataclasses.replace(command, window_addr=0x9000_0000, window_bytes=1 << 16, share_bytes=4096)
    with pytest.raises(ValueError, match="P converts its KV"):
        cache.descriptors(p, d, windowed)
    rounds = dataclasses.replace(command, window_addr=0x9000_0000, window_bytes=512, share_bytes=4096)
    with pytest.raises(ValueError, match="P converts its KV"):
        cache.stream(p, d, rounds)  # a share in rounds asks for the stream itself


def nearest(values: np.ndarray, target: str) -> np.ndarray:
    """`values` in fp8 `target` rounded to nearest, ties to the even code, and saturated, by search."""
    table = torch.arange(128, dtype=torch.uint8).view(getattr(torch, target)).float().numpy()
    finite = table[: int(np.flatnonzero(np.isfinite(table))[-1]) + 1]
    magnitude = np.minimum(np.abs(values.astype(np.float64)), finite[-1])
    below = np.searchsorted(finite, magnitude, side="right") - 1
    above = np.minimum(below + 1, finite.size - 1)
    gap_below, gap_above = magnitude - finite[below], finite[above] - magnitude
    up = (gap_above < gap_below) | ((gap_above == gap_below) & (below % 2 == 1))
    code = np.where(up, above, below)
    return (code | np.where(np.signbit(values), 0x80, 0)).astype(np.uint8)


def truncated(values: np.ndarray, target: str) -> np.ndarray:
    """`values` in fp8 `target` rounded toward zero and saturated, by search over every finite value of the
    format (not by a cast)."""
    dtype = getattr(torch, target)
    table = torch.arange(128, dtype=torch.uint8).view(dtype).float().numpy()
    finite = int(np.flatnonzero(np.isfinite(table))[-1]) + 1  # e4m3fn's 0x7f is NaN, e5m2's 0x7c on are not finite
    magnitude = np.searchsorted(table[:finite], np.minimum(np.abs(values), table[finite - 1]), side="right") - 1
    return (magnitude | np.where(np.signbit(values), 0x80, 0)).astype(np.uint8)


@settings(deadline=None, max_examples=40)
@given(
    layout=st.sampled_from(["HND", "NHD", "KV_HND", "KV_NHD", FUSED]),
    source=st.sampled_from(["bfloat16", "float16", "float32"]),
    target=st.sampled_from(["fp8_e4m3", "fp8_e5m2"]),
    blocks=st.lists(st.integers(1, 15), min_size=1, max_size=5, unique=True),
    tokens_short=st.integers(0, 15),
    layer_scales=st.lists(st.sampled_from([1.0, 0.5, 2.0, 0.125]), min_size=3, max_size=3),
    chunk=st.sampled_from([256, 4096, 1 << 20]),
    rounding=st.sampled_from(["zero", "nearest"]),
    step=st.sampled_from([3, 64, gather_module.CONVERT_VALUES]),
)
def test_a_converted_write_lands_ps_values_in_ds_format_byte_for_byte(
    layout: str,
    source: str,
    target: str,
    blocks: list[int],
    tokens_short: int,
    layer_scales: list[float],
    chunk: int,
    rounding: str,
    step: int,
) -> None:
    """Real memory on both sides: P's layers as float tensors, D's as bytes, a staging tensor; the planner's view,
    `plan_staged`, `TorchGather.convert` and a memmove per write run stand for P's write. Every D block written
    holds P's block's values divided by its layer's scale, rounded as D's engine rounds, and no other byte of D
    changed."""
    geometry: dict[str, Any] = dict(num_layers=3, num_kv_heads=2, head_size=8, block_size=8, num_blocks=16)
    shape = {
        "HND": (16, 2, 2, 8, 8),
        "NHD": (16, 2, 8, 2, 8),
        "KV_HND": (2, 16, 2, 8, 8),
        "KV_NHD": (2, 16, 8, 2, 8),
        FUSED: (16, 2, 8, 16),
    }[layout]
    gen = torch.Generator().manual_seed(len(blocks) * 31 + tokens_short)
    values = torch.randn(shape, generator=gen) * 3
    values.view(-1)[::97] *= 1e4  # past every fp8 format's largest value: saturated
    p_layers = [values.roll(i).to(getattr(torch, source)) for i in range(3)]
    d_layers = [torch.full(shape, 0x5A, dtype=torch.uint8) for _ in range(3)]
    staging = torch.zeros(1 << 16, dtype=torch.uint8)
    p = msgspec.structs.replace(
        worker("P", source, layout=layout, **geometry),
        base_addrs=[t.data_ptr() for t in p_layers],
        staging_addr=staging.data_ptr(),
        staging_size=staging.numel(),
    )
    d = msgspec.structs.replace(
        worker("D", "uint8", target, layout=layout, **geometry),
        base_addrs=[t.data_ptr() for t in d_layers],
        kv_scales=[(s, s) for s in layer_scales],
        cache_rounding=rounding,
    )
    assert layer_bytes(d) == d_layers[0].numel()
    dst_blocks = [(b * 7) % 16 or 1 for b in blocks]
    if len(set(dst_blocks)) != len(dst_blocks):
        dst_blocks = blocks
    num_tokens = len(blocks) * 8 - tokens_short % 8
    src, dst, length = plan_transfer_arrays(p, d, blocks, dst_blocks, num_tokens)
    found = conversion(p, d)
    assert found is not None
    region = region_ids(dst, [t.data_ptr() for t in d_layers])
    gather = TorchGather(p_layers, staging)

    async def write() -> None:
        for c in plan_staged(src, dst, length, min(chunk, staging.numel()), region):
            at = staging.data_ptr()
            await gather.convert(found, c.gather_src, at + c.gather_offset, c.gather_length)
            for offset, to, n in zip(
                c.write_offset.tolist(), c.write_dst.tolist(), c.write_length.tolist(), strict=True
            ):
                ctypes.memmove(to, at + offset, n)

    kept, gather_module.CONVERT_VALUES = gather_module.CONVERT_VALUES, step  # a layer in steps of `step` values
    try:
        asyncio.run(write())
    finally:
        gather_module.CONVERT_VALUES = kept
    block_dim = 1 if layout.startswith("KV_") else 0
    for i in range(3):
        quantize = truncated if rounding == "zero" else nearest
        want = quantize(p_layers[i].float().numpy() / np.float32(layer_scales[i]), QUANT[target])
        got = d_layers[i].numpy()
        for s, t in zip(blocks, dst_blocks, strict=True):
            assert np.array_equal(np.take(got, t, block_dim), np.take(want, s, block_dim)), (i, s, t)
        untouched = [b for b in range(16) if b not in dst_blocks]
        assert np.all(np.take(got, untouched, block_dim) == 0x5A)


QUANT = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def test_the_conversion_sources_map_each_piece_into_its_layers_tensor() -> None:
    found = Conversion("float32", "float8_e4m3fn", 4, 448.0, True, (0x1000, 0x9000), (1.0, 0.5), size=0x1000)
    real, nbytes, layer = found.sources(np.array([0x1000, 0x1010, 0x9004]), np.array([16, 8, 4]))
    assert real.tolist() == [0x1000, 0x1040, 0x9010] and nbytes.tolist() == [64, 32, 16] and layer.tolist() == [0, 0, 1]
    for addr, n in ((0xFFF, 1), (0x1000 + 0x400 - 4, 8)):  # below every layer; past a layer's view
        with pytest.raises(ValueError, match="outside P's layers' view"):
            found.sources(np.array([addr]), np.array([n]))


@pytest.mark.parametrize("source", ["bfloat16", "float16"])
@pytest.mark.parametrize("target", ["float8_e4m3fn", "float8_e5m2"])
def test_the_truncation_table_truncates_every_pattern(source: str, target: str) -> None:
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(getattr(torch, source)).float().numpy()
    finite = np.isfinite(values)
    got = truncation_table(source, target)
    assert np.array_equal(got[finite], truncated(values[finite], target))
    assert np.all(got[np.isnan(values)] & 0x7F == 0x7F)  # NaN stays NaN
    limit = truncated(np.array([np.inf]), target)[0]
    assert np.all(got[np.isinf(values)] & 0x7F == limit)  # infinity saturates


@pytest.mark.parametrize("target", ["float8_e4m3fn", "float8_e5m2"])
def test_the_fp8_values_from_the_formats_definition_are_torchs(target: str) -> None:
    ours = fp8_values(target)
    theirs = torch.arange(128, dtype=torch.uint8).view(getattr(torch, target)).float().numpy()
    finite = np.isfinite(theirs)
    assert np.array_equal(ours[finite], theirs[finite]) and np.all(np.isnan(ours[~finite]))


def test_rocms_e4m3_is_published_as_a_format_of_its_own_and_pairs_only_with_its_like() -> None:
    from kvsvc.vllm.kv_caches import published_cache_dtype

    assert published_cache_dtype("fp8", "torch.float8_e4m3fn") == "fp8"
    assert published_cache_dtype("fp8_e4m3", "torch.float8_e4m3fnuz") == "fp8_e4m3fnuz"
    assert published_cache_dtype("fp8", "float8_e4m3fnuz") == "fp8_e4m3fnuz"
    assert published_cache_dtype("fp8_e5m2", "torch.float8_e4m3fnuz") == "fp8_e5m2"
    assert published_cache_dtype("auto", "torch.float8_e4m3fnuz") == "auto"
    rocm = worker("D", "uint8", "fp8_e4m3fnuz")
    check_compatible(worker("P", "uint8", "fp8_e4m3fnuz"), rocm)
    refused(worker("P", "uint8", "fp8_e4m3"), rocm, "'fp8_e4m3' (fp8_e4m3) != D kv_cache_dtype 'fp8_e4m3fnuz'")
    refused(p_float(), rocm, "only a P in bfloat16, float16, float32 converts")
