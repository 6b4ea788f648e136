"""Sliding windows at many prompt lengths, and a P of one process feeding a D at PP 2, between real vLLM engines.

The model has six layers, two sliding-window layers then one full-attention layer, twice, with a window of 96
tokens: vLLM makes two sliding-window KV cache groups beside the full one, and a window that has passed a block
puts vLLM's null block (id 0) in front of each window group's list on D, once per block passed. The null block is
no block of the request: nothing is written into it and its repeats are no repeated id.

The prompt lengths are drawn around block and window boundaries (`boundary_lengths`), many per engine start, from a
seed that changes with every run and is named in every failure (`KVSVC_VLLM_SEED` replays one): the suite, not a
user, finds the next length that breaks. D must produce a single engine's tokens for every length; as the negative
control, a P with other weights must change them. P runs in one process (its engine stepped by its main thread,
kvsvc's service on a thread beside it) and feeds D at PP 1 and at PP 2 (one process per stage) on the same host: the
same-host plane's check of each D stage's process must answer within the hello's budget, or the pair falls back to
Mooncake in time.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.vllm.test_vllm_connector import assert_clean, prompts
from workers.vllm.engines import EngineConfig, VllmEngine, boundary_lengths, started_engines, write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
WINDOW = 96
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
SEED = int(os.environ.get("KVSVC_VLLM_SEED", random.SystemRandom().randrange(1 << 30)))


def lengths(salt: int, count: int = 14) -> list[int]:
    return boundary_lengths(BLOCK, WINDOW, count, SEED + salt, longest=700)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmEngine]]:
    """A single engine (no connector), P and P with other weights (its holds expire after 3 s), D at PP 1 and at
    PP 2."""
    root = tmp_path_factory.mktemp("windows")
    shape: dict[str, Any] = {"num_hidden_layers": 6, "sliding_window": WINDOW, "layer_types": LAYER_TYPES}
    model = str(write_tiny_llama(root / "windows", seed=0, **shape))
    other = str(write_tiny_llama(root / "windows-other", seed=1, **shape))
    configs = {
        "base": EngineConfig(model),
        "P": EngineConfig(model, "kv_producer"),
        "P_other": EngineConfig(other, "kv_producer", extra_config={"hold_timeout_s": 3}),
        "D": EngineConfig(model, "kv_consumer"),
        "D_pp2": EngineConfig(model, "kv_consumer", pipeline_parallel_size=2),
    }
    with started_engines(configs, root, timeout_s=400) as started:
        yield started


def test_vllm_groups_the_model_in_two_window_groups_and_a_full_one(engines: dict[str, VllmEngine]) -> None:
    log = engines["P"].log_path.read_text()
    assert "kvsvc: 3 KV cache groups" in log, log[-4000:]
    assert log.count("'sliding_window'") >= 2


@pytest.mark.parametrize(("d_name", "salt"), [("D", 0), ("D_pp2", 1)])
def test_d_generates_a_single_engines_tokens_at_lengths_around_block_and_window_boundaries(
    engines: dict[str, VllmEngine], d_name: str, salt: int
) -> None:
    p, d = engines["P"], engines[d_name]
    sizes = lengths(salt)
    batch = prompts(10 + 40 * salt, sizes, seed=SEED + salt)
    want = [o.token_ids for o in engines["base"].generate(batch, max_tokens=6)]
    failed_before = sum(int(w["receiver"]["failed"]) for w in d.stats(workers=d_name != "D")["workers"])
    got = d.generate(batch, max_tokens=6, params=p.prefill(batch))
    wrong = [n for n, g, w in zip(sizes, got, want, strict=True) if g.token_ids != w]
    assert not wrong, f"seed {SEED + salt}: D's tokens differ from a single engine's at lengths {wrong}"
    stats = assert_clean(d)
    if d_name != "D":
        stats = d.stats(workers=True)
    failed = sum(int(w["receiver"]["failed"]) for w in stats["workers"]) - failed_before
    assert failed == 0, f"seed {SEED + salt}: {failed} receives failed at lengths {sizes}: {d.log_tail()}"
    if d_name == "D":  # one process: its flow's figures are at hand
        loads = list(stats["flow"]["recent_loads"].values())[-len(batch) :]
        assert loads == [[0, n - 1 if n > 1 else n] for n in sizes], f"seed {SEED + salt}"  # D computes the last
    assert_clean(p)


def test_p_with_other_weights_changes_d_tokens(engines: dict[str, VllmEngine]) -> None:
    """The negative control: the same comparison fails when the KV comes from a model with other weights."""
    sizes = [n for n in lengths(2) if n > 1]
    batch = prompts(200, sizes, seed=SEED + 2)
    want = [o.token_ids for o in engines["base"].generate(batch, max_tokens=6)]
    got = engines["D"].generate(batch, max_tokens=6, params=engines["P_other"].prefill(batch))
    same = [n for n, g, w in zip(sizes, got, want, strict=True) if g.token_ids == w]
    assert not same, f"seed {SEED + 2}: KV of other weights went unnoticed at lengths {same}"
    assert_clean(engines["D"])
    assert_clean(engines["P_other"])
