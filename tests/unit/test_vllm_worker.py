"""The worker side of the vLLM connector: vLLM's KV cache tensors, built on the CPU in every shape the connector
accepts, mapped to kvsvc layouts; and the reporting rules vLLM's scheduler asserts on (against a fake service).

Each accepted tensor is checked byte for byte: the planner's geometry of the detected layout must name the very
element the tensor holds for (block, K/V, head, token). Unknown shapes and strides are refused with both named.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import msgspec
import pytest
import torch

from kvsvc.core.errors import KVSvcError, KVSvcTimeout, TopologyError
from kvsvc.core.groups import state_bytes
from kvsvc.core.layout import block_geometry, pool_regions
from kvsvc.core.messages import ConvPart, KVGroup, MambaState, WorkerMetadata
from kvsvc.core.outputs import KVConnectorOutput
from kvsvc.core.receiver import RecvRequest
from kvsvc.core.sender import SendRequest
from kvsvc.service.config import ServiceConfig
from kvsvc.vllm.config import ConnectorConfig
from kvsvc.vllm.flow import StepMetadata
from kvsvc.vllm.kv_layout import (
    GroupView,
    TensorView,
    UnknownKVLayout,
    check_pipeline,
    detect_layout,
    kv_groups_of,
    layer_index,
    merge_regions,
)
from kvsvc.vllm.worker import WorkerIdentity, WorkerSide, describe_kv_caches

NB, BS, H, D = 6, 4, 2, 8  # blocks, block size, KV heads (this worker's), head size


def view(t: torch.Tensor, device: str = "cpu") -> TensorView:
    return TensorView(tuple(t.shape), tuple(t.stride()), device)


def canonical() -> torch.Tensor:
    """Distinct values per (block, half, head, token, dim): the truth every layout is checked against."""
    return torch.arange(NB * 2 * H * BS * D, dtype=torch.float32).view(NB, 2, H, BS, D)


def in_layout(layout: str) -> torch.Tensor:
    """`canonical()`'s values as vLLM would lay them out (dense, or with the strides vLLM gives such a view)."""
    c = canonical()
    if layout == "HND":  # FlashInfer HND: logical [B, 2, N, H, D] with HND strides
        return c.clone().permute(0, 1, 3, 2, 4)
    if layout == "NHD":  # FlashInfer NHD
        return c.permute(0, 1, 3, 2, 4).contiguous()
    if layout == "KV_NHD":  # FlashAttention [2, B, N, H, D]
        return c.permute(1, 0, 3, 2, 4).contiguous()
    if layout == "KV_HND":  # FlashAttention with the HND stride order: logical [2, B, N, H, D]
        return c.permute(1, 0, 2, 3, 4).contiguous().permute(0, 1, 3, 2, 4)
    if layout in ("HNC", "HND_FUSED"):  # [B, H, N, K|V]
        return c.permute(0, 2, 3, 1, 4).contiguous().view(NB, H, BS, 2 * D)
    if layout == "NHC":  # 0.32's 4-D view [B, H, N, C] over LBNHC memory
        return c.permute(0, 3, 2, 1, 4).contiguous().view(NB, BS, H, 2 * D).transpose(1, 2)
    raise AssertionError(layout)


def meta_of(layout: str, t: torch.Tensor) -> WorkerMetadata:
    return WorkerMetadata(
        engine_id="E", incarnation="i", pp_rank=0, pp_size=1, tp_rank=0, tp_size=1, start_layer=0, end_layer=1,
        num_kv_heads=H, head_size=D, dtype="float32", block_size=BS, num_blocks=NB, layout=layout, is_mla=False,
        base_addrs=[t.data_ptr()],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("layout", "device"),
    [
        ("HND", "cpu"),
        ("NHD", "cpu"),
        ("KV_NHD", "cpu"),
        ("KV_HND", "cpu"),
        ("HND_FUSED", "cpu"),
        ("HNC", "cuda"),
        ("NHC", "cuda"),
    ],
)
def test_each_vllm_layout_is_detected_and_its_geometry_names_every_element(layout: str, device: str) -> None:
    t = in_layout(layout)
    found = detect_layout(view(t, device), head_size=D, local_heads=H, is_mla=False)
    assert (found.layout, found.num_blocks, found.block_size, found.local_heads) == (layout, NB, BS, H)
    g = block_geometry(meta_of(layout, t))
    flat = torch.as_strided(t, (t.numel(),), (1,), t.storage_offset())  # the tensor's memory in address order
    truth = canonical()
    for b, s, h, tok in [(0, 0, 0, 0), (5, 1, 1, 3), (2, 1, 0, 1), (3, 0, 1, 2)]:
        if g.halves == 1:  # fused: K and V of a token together in one opaque element
            offset = b * g.block_stride + h * g.head_stride + tok * g.token_stride
            got = flat[offset // 4 : offset // 4 + 2 * D]
            assert sorted(got.tolist()) == sorted(torch.cat([truth[b, 0, h, tok], truth[b, 1, h, tok]]).tolist())
        else:
            offset = b * g.block_stride + s * g.half_stride + h * g.head_stride + tok * g.token_stride
            assert torch.equal(flat[offset // 4 : offset // 4 + D], truth[b, s, h, tok])


def test_mla_latent_in_three_or_four_dimensions() -> None:
    three = torch.zeros(NB, BS, 576)
    four = three.view(NB, 1, BS, 576)
    for t in (three, four):
        found = detect_layout(view(t), head_size=576, local_heads=1, is_mla=True)
        assert (found.is_mla, found.num_blocks, found.block_size) == (True, NB, BS)
    with pytest.raises(UnknownKVLayout, match=r"MLA KV cache tensor with shape \[6, 4, 512\]"):
        detect_layout(view(torch.zeros(NB, BS, 512)), head_size=576, local_heads=1, is_mla=True)


@pytest.mark.parametrize(
    ("shape", "strides", "device"),
    [
        ((NB, H, BS, 3 * D), None, "cpu"),  # not K and V of this head size
        ((NB, H + 1, BS, 2 * D), None, "cpu"),  # another number of heads than this worker holds
        ((NB, 3, BS, H, D), None, "cpu"),  # no K/V axis
        ((NB, H, BS, 2 * D), (H * BS * 2 * D + 16, BS * 2 * D, 2 * D, 1), "cpu"),  # padded blocks
        ((NB, H, BS, 2 * D), (BS * H * 2 * D, 2 * D, H * 2 * D, 1), "cpu"),  # token-major on the CPU: not vLLM's
    ],
)
def test_unknown_layouts_are_refused_naming_shape_and_strides(
    shape: tuple[int, ...], strides: tuple[int, ...] | None, device: str
) -> None:
    t = torch.zeros(shape) if strides is None else torch.empty_strided(shape, strides)
    with pytest.raises(UnknownKVLayout) as info:
        detect_layout(view(t, device), head_size=D, local_heads=H, is_mla=False)
    assert f"shape {list(t.shape)}" in str(info.value) and f"strides {list(t.stride())}" in str(info.value)
    assert isinstance(info.value, TopologyError)


def identity(**kw: object) -> WorkerIdentity:
    base: dict[str, object] = dict(
        engine_id="E", incarnation="1", pp_rank=0, pp_size=1, tp_rank=0, tp_size=2, total_kv_heads=4,
        head_size=D, is_mla=False, block_size=BS,
    )  # fmt: skip
    base.update(kw)
    return WorkerIdentity(**base)  # type: ignore[arg-type]


def cpu_caches(layers: list[int], blocks: int = NB) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: one buffer, a [B, H, N, 2D] view per layer, back to back."""
    buffer = torch.zeros(len(layers), blocks, H, BS, 2 * D)
    return {f"model.layers.{layer}.self_attn.attn": buffer[i] for i, layer in enumerate(layers)}


def test_vllm_cpu_caches_describe_one_worker_and_register_one_region() -> None:
    caches = cpu_caches([4, 5, 6])
    meta, regions = describe_kv_caches(caches, identity(pp_rank=1, pp_size=2))
    assert (meta.layout, meta.start_layer, meta.end_layer, meta.num_blocks) == ("HND_FUSED", 4, 7, NB)
    assert (meta.num_kv_heads, meta.head_size, meta.dtype, meta.pp_rank) == (4, D, "float32", 1)
    assert meta.base_addrs == [caches[f"model.layers.{i}.self_attn.attn"].data_ptr() for i in (4, 5, 6)]
    first = caches["model.layers.4.self_attn.attn"]
    assert regions == [(first.data_ptr(), 3 * first.numel() * 4)]


def test_worker_caches_that_cannot_be_moved_are_refused_at_start() -> None:
    with pytest.raises(TopologyError, match=r"layers \[0, 2\] are not one range"):
        describe_kv_caches(cpu_caches([0, 2]), identity())
    with pytest.raises(TopologyError, match="blocks of 4 tokens, vLLM schedules blocks of 16"):
        describe_kv_caches(cpu_caches([0, 1]), identity(block_size=16))
    shared = torch.zeros(NB, H, BS, 2 * D)
    with pytest.raises(TopologyError, match="share one KV cache tensor"):
        describe_kv_caches({"layers.0.attn": shared, "layers.1.attn": shared}, identity())
    mixed = {**cpu_caches([0]), "model.layers.1.self_attn.attn": torch.zeros(NB + 1, H, BS, 2 * D)}
    with pytest.raises(TopologyError, match="disagree"):
        describe_kv_caches(mixed, identity())
    with pytest.raises(UnknownKVLayout, match=r"shape \[6, 2, 4, 16\]"):
        describe_kv_caches(cpu_caches([0]), identity(total_kv_heads=8))  # 4 heads per rank expected, 2 found
    with pytest.raises(TopologyError, match="no KV cache tensors"):
        describe_kv_caches({}, identity())


def test_a_hybrid_models_groups_share_tensors_and_are_published() -> None:
    # vLLM's hybrid manager: layer 0 (sliding window) and layer 1 (full) are views of one buffer, as are 2 and 3.
    buffers = [torch.zeros(NB, H, BS, 2 * D) for _ in range(2)]
    caches = {f"model.layers.{i}.self_attn.attn": buffers[i // 2] for i in range(4)}
    views = [
        GroupView("SlidingWindowSpec", ("model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"), 64),
        GroupView("FullAttentionSpec", ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")),
    ]
    groups = kv_groups_of(views)
    assert groups == [
        KVGroup(kind="sliding_window", layers=[0, 2], sliding_window=64),
        KVGroup(kind="full", layers=[1, 3]),
    ]
    meta, regions = describe_kv_caches(caches, identity(kv_groups=tuple(groups)))
    assert meta.kv_groups == groups and meta.base_addrs[0] == meta.base_addrs[1]
    assert pool_regions(meta) == [(b.data_ptr(), b.numel() * 4) for b in buffers]
    assert sum(length for _, length in regions) == sum(b.numel() * 4 for b in buffers)
    # One group sharing a tensor is KV sharing: refused.
    one_group = (KVGroup(kind="full", layers=[0, 1, 2, 3]),)
    with pytest.raises(TopologyError, match=r"layers \[0, 1\] share one KV cache tensor within one KV cache group"):
        describe_kv_caches(caches, identity(kv_groups=one_group))
    # One full group is what every peer takes for granted: nothing published.
    assert kv_groups_of([GroupView("FullAttentionSpec", ("model.layers.0.attn",))]) == []


def test_groups_kvsvc_cannot_move_refuse_the_start_naming_spec_and_layers() -> None:
    full = GroupView("FullAttentionSpec", ("model.layers.0.attn",))
    mamba1 = GroupView("MambaSpec", ("model.layers.1.mixer", "model.layers.2.mixer"), mamba_type="MAMBA1")
    with pytest.raises(TopologyError, match=r"group 1 is a MambaSpec \(MAMBA1\) \(2 layers, first model.layers.1"):
        kv_groups_of([full, mamba1])
    # A GDN layer whose config lacks its sizes: the group and its layers named before what is missing.
    gdn = GroupView("MambaSpec", ("model.layers.1.linear_attn", "model.layers.2.linear_attn"), mamba_type="GDN_ATTN")
    with pytest.raises(TopologyError, match=r"group 1 is a MambaSpec \(GDN_ATTN\) \(2 layers, first model.layers.1"
                       r".*: Gated DeltaNet state .* gives no linear_num_key_heads"):  # fmt: skip
        kv_groups_of([full, gdn])
    with pytest.raises(TopologyError, match=r"group 1 is a CircularBufferSpec"):
        kv_groups_of([full, GroupView("CircularBufferSpec", ("model.layers.1.attn",))])


def test_an_mla_group_is_full_attention_published_as_mla_and_never_mixed() -> None:
    # vLLM 0.32's MLA cache: one latent of 576 per token, a [blocks, 1, block_size, 576] tensor per layer.
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(3))
    assert kv_groups_of([GroupView("MLAAttentionSpec", names)]) == []  # one full group: nothing published
    caches = {name: torch.zeros(NB, 1, BS, 576) for name in names}
    meta, _ = describe_kv_caches(caches, identity(is_mla=True, head_size=576, total_kv_heads=1))
    assert (meta.is_mla, meta.num_kv_heads, meta.head_size, meta.num_blocks, meta.kv_groups) == (True, 1, 576, NB, [])
    sliding = GroupView("SlidingWindowSpec", ("model.layers.3.self_attn.attn",), 64)
    with pytest.raises(TopologyError, match=r"specs \['MLAAttentionSpec', 'SlidingWindowSpec'\]: kvsvc moves an MLA"):
        kv_groups_of([GroupView("MLAAttentionSpec", names), sliding])


def test_a_mamba2_group_is_described_from_vllms_shapes_at_any_tp_and_conv_layout() -> None:
    # The tiny Granite-4.0-H: 16 heads of 32, d_state 16, one B/C group, conv kernel 4.
    shapes = {1: ((3, 544), (16, 32, 16)), 2: ((3, 288), (8, 32, 16))}  # B/C replicated at TP 2
    states = []
    for tp, (conv, ssm) in shapes.items():
        for layout in ("SD", "DS"):
            view = GroupView(
                "MambaSpec", ("model.layers.0.mixer",), mamba_type="MAMBA2", shapes=(conv if layout == "SD" else
                conv[::-1], ssm), dtypes=("float32", "float32"), n_groups=1, tp_size=tp, conv_layout=layout,
            )  # fmt: skip
            (group,) = kv_groups_of([view])
            assert group.mamba is not None
            assert state_bytes(group.mamba, tp) == (conv[1] * 3 + ssm[0] * ssm[1] * ssm[2]) * 4
            states.append(msgspec.structs.replace(group.mamba, conv_layout="DS"))
    assert all(state == states[0] for state in states)  # one model, whatever the TP or layout
    assert states[0].conv_parts == [ConvPart(512, 16), ConvPart(16, 1), ConvPart(16, 1)]
    wrong = GroupView("MambaSpec", ("model.layers.0.mixer",), mamba_type="MAMBA2", shapes=((3, 540), (16, 32, 16)),
                      dtypes=("float32", "float32"), n_groups=1)  # fmt: skip
    with pytest.raises(TopologyError, match="540 channels per rank"):
        kv_groups_of([wrong])


QWEN3_NEXT_GDN = (16, 32, 128, 128)  # key heads, value heads, key head dim, value head dim


def _gdn_view(tp: int, layout: str, dims: tuple[int, ...] = QWEN3_NEXT_GDN, **changes: object) -> GroupView:
    """A Gated DeltaNet group as vLLM 0.32 shapes it per rank (`gated_delta_net_state_shape`, conv kernel 4)."""
    k_heads, v_heads, k_dim, v_dim = dims
    conv = (3, (2 * k_heads * k_dim + v_heads * v_dim) // tp)
    view = GroupView(
        "MambaSpec", ("model.layers.0.linear_attn", "model.layers.2.linear_attn"), mamba_type="GDN_ATTN",
        shapes=(conv if layout == "SD" else conv[::-1], (v_heads // tp, v_dim, k_dim)),
        dtypes=("bfloat16", "float32"), tp_size=tp, conv_layout=layout, gdn_dims=dims,
    )  # fmt: skip
    return dataclasses.replace(view, **changes)  # type: ignore[arg-type]


def test_a_gdn_group_is_q_k_and_v_by_heads_and_recurrent_state_per_value_head_at_any_tp_and_layout() -> None:
    states = []
    for tp in (1, 2, 4, 8, 16):
        for layout in ("SD", "DS"):
            view = _gdn_view(tp, layout)
            (group,) = kv_groups_of([view])
            assert group.mamba is not None and group.layers == [0, 2]
            conv, recurrent = view.shapes
            assert state_bytes(group.mamba, tp) == conv[0] * conv[1] * 2 + recurrent[0] * 128 * 128 * 4
            states.append(msgspec.structs.replace(group.mamba, conv_layout="DS"))
    assert all(state == states[0] for state in states)  # one model, whatever the TP or layout
    key = ConvPart(16 * 128, 16)
    assert states[0].conv_parts == [key, key, ConvPart(32 * 128, 32)]
    assert (states[0].conv_width, states[0].ssm_heads, states[0].ssm_head_bytes) == (3, 32, 128 * 128 * 4)


def test_gdn_is_refused_wherever_vllms_shapes_are_not_the_configs() -> None:
    with pytest.raises(TopologyError, match=r"config gives no linear_num_key_heads"):
        kv_groups_of([_gdn_view(1, "DS", gdn_dims=())])
    with pytest.raises(TopologyError, match=r"2 key heads and 4 value heads: they do not split over TP 4"):
        kv_groups_of([_gdn_view(4, "DS", (4, 4, 8, 8), gdn_dims=(2, 4, 8, 8))])
    # Another GDN_ATTN layer (Kimi Linear's KDA, ...) shapes its state its own way: not the config's sizes.
    with pytest.raises(TopologyError, match=r"shapes \(\(4000, 3\), \(16, 128, 128\)\) \(DS\) at TP 2: the config's "
                       r"16 key heads of 128 and 32 value heads of 128 give a conv state of 4096 channels and a "
                       r"recurrent state of \(16, 128, 128\)"):  # fmt: skip
        kv_groups_of([_gdn_view(2, "DS", shapes=((4000, 3), (16, 128, 128)))])
    with pytest.raises(TopologyError, match=r"at TP 2: .* recurrent state of \(16, 128, 128\)"):
        kv_groups_of([_gdn_view(2, "DS", shapes=((4096, 3), (16, 128, 64)))])
    with pytest.raises(TopologyError, match=r"expected conv and recurrent"):
        kv_groups_of([_gdn_view(1, "DS", dtypes=("bfloat16",))])
    with pytest.raises(TopologyError, match=r"Mamba2, Gated DeltaNet and short-conv groups only"):
        kv_groups_of([_gdn_view(1, "DS", mamba_type="MAMBA1")])


def test_a_short_conv_group_is_contiguous_channels_with_no_ssm_state_at_any_tp_and_layout() -> None:
    # The tiny LFM2: a conv window of 2 steps over 256 channels, float32.
    states = []
    for tp in (1, 2, 4):
        for layout in ("SD", "DS"):
            conv = (2, 256 // tp)
            view = GroupView(
                "MambaSpec", ("model.layers.0.conv", "model.layers.2.conv"), mamba_type="SHORT_CONV",
                shapes=(conv if layout == "SD" else conv[::-1],), dtypes=("float32",), tp_size=tp, conv_layout=layout,
            )  # fmt: skip
            (group,) = kv_groups_of([view])
            assert group.mamba is not None and group.layers == [0, 2]
            assert state_bytes(group.mamba, tp) == 2 * 256 // tp * 4
            states.append(msgspec.structs.replace(group.mamba, conv_layout="DS"))
    assert all(state == states[0] for state in states)  # one model, whatever the TP or layout
    assert (states[0].conv_parts, states[0].ssm_heads, states[0].ssm_head_bytes) == ([ConvPart(256, 256)], 0, 0)
    two = GroupView("MambaSpec", ("model.layers.0.conv",), mamba_type="SHORT_CONV", shapes=((2, 256), (4, 8)),
                    dtypes=("float32", "float32"))  # fmt: skip
    with pytest.raises(TopologyError, match=r"group 0 is a MambaSpec \(SHORT_CONV\).*shapes \(\(2, 256\), \(4, 8\)\).*"
                       r"expected one conv window"):  # fmt: skip
        kv_groups_of([two])


def test_mamba_state_at_pp_above_1_is_refused_at_start_naming_the_layers() -> None:
    state = MambaState(conv_parts=[ConvPart(8, 2)], conv_width=3, conv_dtype="float32", ssm_heads=2, ssm_head_bytes=8)
    groups = [KVGroup(kind="mamba", layers=[0, 2], mamba=state), KVGroup(kind="full", layers=[1, 3])]
    check_pipeline(groups, 1)
    check_pipeline([KVGroup(kind="sliding_window", layers=[0], sliding_window=8), KVGroup(kind="full", layers=[1])], 2)
    with pytest.raises(TopologyError, match=r"pipeline_parallel_size 2 with Mamba state \(layers \[0, 2\]\)"):
        check_pipeline(groups, 2)


def test_mamba_layers_are_raw_pages_checked_against_the_attention_pages() -> None:
    (group,) = kv_groups_of([GroupView(
        "MambaSpec", ("model.layers.0.mixer",), mamba_type="MAMBA2", shapes=((3, 8), (2, 2, 2)),
        dtypes=("float32", "float32"), n_groups=1, tp_size=2,
    )])  # fmt: skip
    assert group.mamba is not None
    slot = state_bytes(group.mamba, 2)  # 160 bytes in a page of H * BS * 2D * 4 bytes
    buffer = torch.zeros(NB, H, BS, 2 * D)
    pages = buffer.view(torch.int8).view(NB, 1, 1, -1)[..., :slot]
    caches = {"model.layers.0.mixer": pages, "model.layers.1.self_attn.attn": buffer}
    groups = (group, KVGroup(kind="full", layers=[1]))
    meta, _ = describe_kv_caches(caches, identity(kv_groups=groups))
    assert meta.base_addrs == [buffer.data_ptr()] * 2 and meta.kv_groups == list(groups)
    with pytest.raises(TopologyError, match=r"Mamba state tensor 'model.layers.0.mixer' of shape \[6, 1, 1, 100\]"):
        describe_kv_caches({**caches, "model.layers.0.mixer": pages[..., :100]}, identity(kv_groups=groups))
    with pytest.raises(TopologyError, match="keep only Mamba state"):
        describe_kv_caches({"model.layers.0.mixer": pages}, identity(kv_groups=(msgspec.structs.replace(group),)))


def test_layer_names_and_region_merging() -> None:
    assert layer_index("model.layers.12.self_attn.attn") == 12
    with pytest.raises(ValueError, match="one integer"):
        layer_index("model.decoder.attn")
    assert merge_regions([(100, 10), (0, 50), (50, 10), (200, 5), (104, 2)]) == [(0, 60), (100, 10), (200, 5)]


def test_the_metadata_of_a_detected_worker_round_trips_the_wire() -> None:
    meta, _ = describe_kv_caches(cpu_caches([0, 1]), identity())
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=WorkerMetadata) == meta


class FakeService:
    """Stands in for the worker's `ServiceThread`: what its `get_finished` reports next, and what it was asked."""

    def __init__(self) -> None:
        self.next = KVConnectorOutput()
        self.calls: list[str] = []
        self.refuse_recv: set[str] = set()
        self.refuse_send: set[str] = set()
        self.crash: set[str] = set()  # start_recv / start_send raise what no contract names
        self.late: list[Any] | None = None  # when a list: a busy loop, work handed to it runs at `catch_up`
        self.secrets: list[str] = []  # what each start_send / start_recv was given
        self.waits: list[float] = []  # what each get_finished was told to wait for news

    def get_finished(self, wait_s: float = 0.0, step_s: float = 0.0) -> KVConnectorOutput:
        self.waits.append(wait_s)
        report, self.next = self.next, KVConnectorOutput()
        return report

    def call(self, fn: Any) -> Any:
        async def on_loop() -> Any:  # the real service runs `fn` on its event loop
            return fn(self)

        if self.late is not None:  # a busy loop: the caller's deadline passes, and `fn` still runs when it is free
            self.late.append(on_loop)
            raise KVSvcTimeout("kvsvc loop did not answer within 30 s")
        return asyncio.run(on_loop())

    def post(self, fn: Any) -> None:
        async def on_loop() -> Any:
            return fn(self)

        if self.late is not None:
            self.late.append(on_loop)
        else:
            asyncio.run(on_loop())

    def catch_up(self) -> None:
        """The loop frees up and runs the calls that timed out."""
        for on_loop in self.late or ():
            asyncio.run(on_loop())
        self.late = None

    def recv(self, request: RecvRequest) -> None:
        req_id = request.req_id
        self.secrets.append(request.secret)
        if req_id in self.refuse_recv:
            raise ValueError(f"block ids of {req_id} outside the pool")
        if req_id in self.crash:
            raise RuntimeError(f"a defect met {req_id}")
        self.calls.append(f"recv {req_id}")

    def send(self, request: SendRequest, ready: object) -> None:
        req_id = request.req_id
        self.secrets.append(request.secret)
        if req_id in self.refuse_send:
            raise ValueError(f"block ids of {req_id} outside the pool")
        if req_id in self.crash:
            raise RuntimeError(f"a defect met {req_id}")
        self.calls.append(f"send {req_id}")
        self.ready = ready

    def abort(self, req_id: str) -> None:
        self.calls.append(f"abort {req_id}")

    def failure_reason(self, req_id: str) -> str | None:
        return f"P answered TransferFailed for {req_id}"


def worker_with(service: FakeService, **config: Any) -> WorkerSide:
    side = WorkerSide(ConnectorConfig(**config), ServiceConfig(), identity())
    side._thread = service  # type: ignore[assignment]
    return side


def pushing_p(service: FakeService, push_min_tokens: int = 0) -> WorkerSide:
    """A pushing P's worker on CPU, with three local layers, streaming requests from `push_min_tokens` on."""
    side = worker_with(service, mode="push", push_min_tokens=push_min_tokens)
    side._layer_of = {f"model.layers.{i}.attn": i for i in range(3)}
    return side


def test_a_send_is_reported_only_once_vllm_saw_its_request_finish() -> None:
    service = FakeService()
    side = worker_with(service)
    side.end_step(StepMetadata(sends=(SendRequest("p1", "p1", (1, 2), 40, "k" * 22),)))
    assert service.secrets == ["k" * 22]  # the hold's secret is the one the scheduler drew
    service.next = KVConnectorOutput(finished_sending={"p1"})  # D fetched it before vLLM finished the request
    assert side.transfer_results(set()).finished_sending == set()
    assert side.transfer_results({"p1", "other"}).finished_sending == {"p1"}
    assert side.transfer_results({"p1"}).finished_sending == set()  # once


def test_a_send_refused_by_a_busy_loop_is_still_reported_and_nothing_stays_held() -> None:
    # The hook returns at once and the work runs on the loop once it frees up: a send it refused must still reach
    # vLLM (which keeps the request's blocks until it hears of the id), once, like the send it started.
    service = FakeService()
    service.refuse_send = {"p2"}
    service.late = []
    side = worker_with(service)
    sends = tuple(SendRequest(f"p{i}", f"p{i}", (i,), 4, "k" * 22) for i in (1, 2))
    side.end_step(StepMetadata(sends=sends))
    assert service.calls == []  # the step went on: nothing ran yet
    service.catch_up()
    assert service.calls == ["send p1"]
    assert side.transfer_results({"p1", "p2"}).finished_sending == {"p2"}
    service.next = KVConnectorOutput(finished_sending={"p1"})
    assert side.transfer_results(set()).finished_sending == {"p1"}
    assert side.transfer_results(set()).finished_sending == set()
    assert side.reported_sending == 2 and side.reports.waiting == 0


def test_a_receive_started_or_refused_by_a_busy_loop_is_still_reported_once() -> None:
    # The same for receives: vLLM waits for each id it handed in until it is reported, so a receive that a busy
    # loop starts (or fails to start) once it frees up must still be reported, failed or not.
    service = FakeService()
    service.refuse_recv = {"d2"}
    service.late = []
    side = worker_with(service)
    recvs = tuple(RecvRequest(f"d{i}", f"t{i}", "P", "http://p", (i, 10 + i), 40, 0, "k" * 22) for i in (1, 2))
    side.begin_step(StepMetadata(recvs=recvs))
    assert side.transfer_results(set()).finished_recving == set()  # nothing ran yet: nothing to report
    service.catch_up()
    assert service.calls == ["recv d1"]
    results = side.transfer_results(set())
    assert (results.finished_recving, results.failed_recving) == ({"d2"}, {"d2"})
    assert side.load_errors() == {2, 12}
    service.next = KVConnectorOutput(finished_recving={"d1"})
    assert side.transfer_results(set()).finished_recving == {"d1"}
    service.next = KVConnectorOutput(finished_recving={"d1"})
    assert side.transfer_results(set()).finished_recving == set()
    assert side.reported_recving == 2 and side.reports.waiting == 0


def test_a_start_that_raises_what_no_contract_names_fails_that_transfer_alone() -> None:
    # The work runs on the loop after the hook returned, so nothing it raises could reach vLLM: each id must get
    # its outcome there, and the others of the step still start.
    service = FakeService()
    service.crash = {"d1", "p1"}
    side = worker_with(service)
    recvs = tuple(RecvRequest(f"d{i}", f"t{i}", "P", "http://p", (i,), 4, 0, "k" * 22) for i in (1, 2))
    side.begin_step(StepMetadata(recvs=recvs))
    side.end_step(StepMetadata(sends=tuple(SendRequest(f"p{i}", f"p{i}", (i,), 4, "k" * 22) for i in (1, 2))))
    assert service.calls == ["recv d2", "send p2"]
    results = side.transfer_results({"p1", "p2"})
    assert (results.finished_recving, results.failed_recving, results.finished_sending) == ({"d1"}, {"d1"}, {"p1"})
    assert side.load_errors() == {1}


class FakeEvent:
    recorded = 0

    def record(self) -> None:
        FakeEvent.recorded += 1

    def query(self) -> bool:
        return True


def test_on_gpu_a_send_waits_for_each_layer_event_or_for_one_after_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    service = FakeService()
    side = worker_with(service)
    side._device = "cuda"
    side._layer_of = {f"model.layers.{i}.attn": i for i in range(3)}
    step = StepMetadata(sends=(SendRequest("p1", "p1", (1, 2), 40, "k" * 22),))
    # vLLM 0.32's order: bind, the forward, then start_load_kv (which must not forget the forward's events), then
    # wait_for_save.
    side.bind_step(step)
    for i in range(3):
        side.layer_saved(f"model.layers.{i}.attn", step)
    side.begin_step(step)
    side.end_step(step)
    assert isinstance(service.ready, list) and len(service.ready) == 3  # layer-wise: one future per layer
    side.bind_step(step)
    side.layer_saved("model.layers.0.attn", step)  # a CUDA graph replayed the other layers: no event of theirs
    recorded = FakeEvent.recorded
    side.end_step(step)
    assert FakeEvent.recorded == recorded + 1 and not isinstance(service.ready, list)  # one event after it all
    side._device = "cpu"
    side.end_step(step)
    assert service.ready is None  # the CPU forward is over when the hook runs


def test_a_pushing_p_on_cpu_starts_its_sends_at_the_bind_before_the_forward_each_layer_ready_once_written() -> None:
    # D's fetch already waits at a pushing P: the send starts with the step, and each layer's write with the layer.
    service = FakeService()
    side = pushing_p(service)
    step = StepMetadata(sends=(SendRequest("p1", "p1", (1, 2), 40, "k" * 22),))
    side.bind_step(step)  # vLLM binds a step's metadata before its forward
    assert service.calls == ["send p1"]  # before any layer was computed
    layers = list(side._layers_ready)
    assert len(layers) == 3 and not any(f.done() for f in layers)
    side.layer_saved("model.layers.1.attn", step)
    assert [f.done() for f in layers] == [False, True, False]
    side.layer_saved("model.layers.0.attn", step)
    side.begin_step(step)  # start_load_kv comes after the forward in vLLM 0.32: it starts nothing more
    assert [f.done() for f in layers] == [True, True, False] and service.calls == ["send p1"]
    side.end_step(step)  # layer 2 never named (a state layer, say): written once the forward ended
    assert all(f.done() for f in layers) and service.calls == ["send p1"]  # not started again
    pulling = worker_with(FakeService())
    pulling._layer_of = side._layer_of
    pulling.bind_step(step)
    pulling.begin_step(step)
    assert pulling._thread.calls == []  # type: ignore[union-attr]  # a pulling P holds after the forward


def test_a_pushing_p_streams_only_prompts_of_push_min_tokens_and_writes_shorter_ones_after_the_forward() -> None:
    # Per-layer writes stretch a short prompt's forward more than its whole write after it costs: below the bound the
    # send starts after the forward, ready at once, as a pulling P's; the long prompt of the same step streams.
    service = FakeService()
    side = pushing_p(service, push_min_tokens=64)
    long, short = (
        SendRequest("long", "long", (1, 2, 3), 64, "k" * 22),
        SendRequest("short", "short", (4,), 63, "k" * 22),
    )
    step = StepMetadata(sends=(short, long))
    side.bind_step(step)
    assert service.calls == ["send long"] and isinstance(service.ready, list)  # one future per layer
    layers = list(side._layers_ready)
    side.layer_saved("model.layers.0.attn", step)
    side.end_step(step)
    assert all(f.done() for f in layers) and service.calls == ["send long", "send short"]
    assert service.ready is None  # the short one's KV is written: ready at once
    assert side.streamed_layers == 1
    # Where vLLM never calls wait_for_save, the next bind starts the short ones as written.
    other = StepMetadata(sends=(SendRequest("s2", "s2", (5,), 10, "k" * 22),))
    side.bind_step(other)
    assert service.calls == ["send long", "send short"]
    side.bind_step(StepMetadata())
    assert service.calls == ["send long", "send short", "send s2"]
    with pytest.raises(ValueError, match="push_min_tokens"):
        ConnectorConfig(push_min_tokens=-1)


def test_a_forward_that_raised_fails_the_layers_it_had_not_written_and_a_pull_send_waits_on_that_failure() -> None:
    # vLLM calls wait_for_save from a `finally`: the forward's exception is in flight there, and the KV of the layers
    # it did not reach was never written, so no send may take those blocks as ready (D would load them).
    service = FakeService()
    side = pushing_p(service)
    step = StepMetadata(sends=(SendRequest("p1", "p1", (1, 2), 40, "k" * 22),))
    side.bind_step(step)
    layers = list(side._layers_ready)
    side.layer_saved("model.layers.0.attn", step)
    side.end_step(step, failed=RuntimeError("out of memory in layer 1"))
    assert layers[0].result() is None  # written before the failure: still good
    assert [type(f.exception()) for f in layers[1:]] == [RuntimeError, RuntimeError]
    pulling = worker_with(FakeService())
    pulling.end_step(step, failed=RuntimeError("out of memory"))
    assert pulling._thread.ready is not None  # type: ignore[union-attr]  # not "written": it waits, and fails
    pulling.end_step(step)
    assert pulling._thread.ready is None  # type: ignore[union-attr]  # the negative: a forward that ended


def test_failed_receives_are_finished_too_with_their_blocks_in_the_same_step(caplog: pytest.LogCaptureFixture) -> None:
    service = FakeService()
    service.refuse_recv = {"d3"}
    side = worker_with(service)
    recvs = tuple(RecvRequest(f"d{i}", f"t{i}", "P", "http://p", (i, 10 + i), 40, 0, "k" * 22) for i in (1, 2, 3))
    side.begin_step(StepMetadata(recvs=recvs))
    assert service.calls == ["recv d1", "recv d2"]
    service.next = KVConnectorOutput(
        finished_recving={"d1"}, failed_recving={"d2"}, invalid_block_ids={2, 12}, kv_connector_stats={"bytes": 5}
    )
    with caplog.at_level(logging.WARNING, logger="kvsvc.vllm.worker"):
        results = side.transfer_results(set())
    assert results.finished_recving == {"d1", "d2", "d3"} and results.failed_recving == {"d2", "d3"}
    # The service's reason is logged: vLLM only learns that the blocks are invalid.
    assert [r.getMessage() for r in caplog.records if "failed, its blocks" in r.getMessage()] == [
        "kvsvc: receive of d2 failed, its blocks are reported invalid: P answered TransferFailed for d2"
    ]
    assert side.load_errors() == {2, 12, 3, 13}
    assert side.load_errors() == set()
    assert side.take_stats() == {"bytes": 5, "received": 1, "receive_failures": 2}
    service.next = KVConnectorOutput(finished_recving={"d1", "stranger"})  # a repeat, and an id never started
    assert side.transfer_results(set()).finished_recving == set()


def test_an_idle_step_waits_for_news_only_while_a_transfer_is_owed() -> None:
    service = FakeService()
    side = worker_with(service)
    side.transfer_results(set(), idle=True)  # nothing handed in: no wait
    recv = RecvRequest("d1", "d1", "P", "http://p", (1,), 4, 0, "k" * 22)
    side.begin_step(StepMetadata(recvs=(recv,)))
    side.transfer_results(set(), idle=False)  # the step computed something: no wait
    side.transfer_results(set(), idle=True)  # d1 is owed: wait
    service.next = KVConnectorOutput(finished_recving={"d1"})
    assert side.transfer_results(set(), idle=True).finished_recving == {"d1"}
    side.transfer_results(set(), idle=True)  # nothing owed any more
    assert service.waits == [0.0, 0.0, 0.01, 0.01, 0.0]


@pytest.mark.parametrize("order", ["wait_for_save first", "get_transfer_results first"])
def test_each_send_is_reported_once_whichever_order_vllm_calls_the_hooks_in(order: str) -> None:
    # With drafts on, vLLM defers `wait_for_save` past `get_transfer_results`, so the step that names a request
    # finished reaches the report before its send reaches the service; without drafts the order is the reverse.
    service = FakeService()
    side = worker_with(service)
    step = StepMetadata(sends=(SendRequest("p1", "p1", (1, 2), 40, "k" * 22),))
    side.bind_step(step)
    if order == "wait_for_save first":
        side.end_step(step)
        assert side.transfer_results({"p1"}).finished_sending == set()
    else:
        assert side.transfer_results({"p1"}).finished_sending == set()
        assert service.calls == []  # the send has not started: the forward's drafts may still be writing
        side.end_step(step)
    assert service.calls == ["send p1"]
    service.next = KVConnectorOutput(finished_sending={"p1"})  # D fetched it
    assert side.transfer_results(set()).finished_sending == {"p1"}
    assert side.reports.waiting == 0 and side.reported_sending == 1


def test_sends_of_a_step_whose_wait_for_save_never_came_start_at_the_next_bind_and_are_reported() -> None:
    # vLLM returns from a PP rank that is not the last before `wait_for_save` when drafts are on.
    service = FakeService()
    side = worker_with(service)
    first = StepMetadata(sends=(SendRequest("p1", "p1", (1,), 4, "k" * 22),))
    side.bind_step(first)
    assert side.transfer_results({"p1"}).finished_sending == set()
    assert service.calls == []
    side.bind_step(StepMetadata(idle=True))
    assert service.calls == ["send p1"] and service.ready is None  # on CPU the forward wrote the KV
    service.next = KVConnectorOutput(finished_sending={"p1"})
    assert side.transfer_results(set()).finished_sending == {"p1"}
    assert side.reports.waiting == 0


def test_a_pushing_ps_layers_that_wait_for_save_never_named_are_written_at_the_next_bind() -> None:
    service = FakeService()
    side = pushing_p(service)
    side.bind_step(StepMetadata(sends=(SendRequest("p1", "p1", (1,), 4, "k" * 22),)))
    side.layer_saved("model.layers.0.attn", StepMetadata())
    layers = list(side._layers_ready)
    side.bind_step(StepMetadata())
    assert all(f.done() and f.exception() is None for f in layers)


def test_sends_that_never_reach_a_closed_service_are_owed_nothing() -> None:
    service = FakeService()
    side = worker_with(service)

    def closed(fn: Any) -> None:
        raise KVSvcError("the kvsvc service is closed")

    service.post = closed  # type: ignore[method-assign]
    step = StepMetadata(sends=(SendRequest("p1", "p1", (1,), 4, "k" * 22),))
    side.bind_step(step)
    with pytest.raises(KVSvcError):
        side.end_step(step)
    assert side.reports.waiting == 0


def test_a_draft_models_layers_come_after_the_targets_and_are_refused_by_name_where_they_cannot_move() -> None:
    assert layer_index("model.layers.4.self_attn.attn", 4) == 4  # EAGLE's head: vLLM numbers it after the target
    assert layer_index("draft_model.model.layers.1.self_attn.attn", 4) == 5
    assert layer_index("mtp.layers.0.self_attn.attn", 28) == 28
    with pytest.raises(ValueError, match=r"draft model's layer.*layer count is unknown"):
        layer_index("draft_model.model.layers.0.self_attn.attn")
    caches = cpu_caches([0, 1, 2])
    caches["draft_model.model.layers.0.self_attn.attn"] = caches.pop("model.layers.2.self_attn.attn")
    meta, _ = describe_kv_caches(caches, identity(num_layers=2))
    assert (meta.start_layer, meta.end_layer) == (0, 3)
    twice = cpu_caches([0, 1]) | {"model.layers.0.cross_attn.attn": cpu_caches([2])["model.layers.2.self_attn.attn"]}
    with pytest.raises(TopologyError, match=r"'model.layers.0.self_attn.attn' and 'model.layers.0.cross_attn.attn'"):
        describe_kv_caches(twice, identity(num_layers=2))
    wider = torch.zeros(NB, H, BS, 4 * D)  # another head size
    with pytest.raises(TopologyError, match=r"draft layer 'draft_model.model.layers.0.self_attn.attn' \(layer 2"):
        describe_kv_caches(
            cpu_caches([0, 1]) | {"draft_model.model.layers.0.self_attn.attn": wider}, identity(num_layers=2)
        )


def test_a_forward_that_raised_before_a_deferred_wait_for_save_sends_nothing_as_written() -> None:
    # With drafts on, vLLM's `finally` skips `wait_for_save` and calls `get_transfer_results` with the forward's
    # exception in flight: the step's sends must wait on that failure, never start as written at the next bind.
    failure = RuntimeError("out of memory in layer 1")
    service = FakeService()
    pulling = worker_with(service)
    step = StepMetadata(sends=(SendRequest("p1", "p1", (1, 2), 40, "k" * 22),))
    pulling.bind_step(step)
    pulling.transfer_results({"p1"}, failed=failure)
    assert service.calls == ["send p1"] and service.ready is not None  # it waits, and fails
    pulling.bind_step(StepMetadata())
    assert service.calls == ["send p1"]  # started once
    pushing = pushing_p(FakeService())
    pushing.bind_step(step)
    layers = list(pushing._layers_ready)
    pushing.layer_saved("model.layers.0.attn", step)
    pushing.transfer_results(set(), failed=failure)
    assert layers[0].result() is None and all(isinstance(f.exception(), RuntimeError) for f in layers[1:])
