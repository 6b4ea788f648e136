"""The parent half of `kvsvc bench`: start the engines, run every scenario and its baselines in one run, summarise.

Imports `kvsvc` (planner, layout), `workers.executor` and `workers.bench.worker`. Invariants: kvsvc and every
baseline move the same bytes between the same two Mooncake engines (the P worker's and the D workers'), described by
the same plan (`plan_transfer`); the peers' way moves them as one descriptor per (layer, block, K/V half); the
handshake and each engine's first write happen before anything is timed; the runs of kvsvc and the baselines
alternate, in an order that rotates, so noise hits them alike; every figure is the median over the repetitions and
every ratio the median of per-repetition ratios; the first repetition of kvsvc is verified byte for byte on D (a
sample of the requests in the small scenario) before a baseline writes.
"""

from __future__ import annotations

import random
import statistics
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvsvc.layout import block_geometry
from kvsvc.messages import WorkerMetadata
from kvsvc.planner import plan_transfer
from workers.bench.models import DEFAULT_MODEL, MODELS, ModelShape
from workers.bench.worker import (
    BenchRequest,
    Collect,
    Compute,
    CpuTime,
    Desc,
    HoldMany,
    PeerStyleWrite,
    RawWrite,
    RecvMany,
)
from workers.executor import EngineConfig, Executor, start_all
from workers.process import Verify
from workers.synthetic import VerifyResult

RAW_METHODS = ("submit_poll", "batch")
PEER_MAX_REQUESTS = 400  # requests the peers' way is timed on (a prefix of the scenario's)
GB = 1e9


@dataclass(frozen=True)
class Sizes:
    """How big each scenario is; `quick` keeps the whole run under 40 s on 2 cores. Request sizes are targets in
    bytes, rounded down to whole blocks of the model (at least one)."""

    reps: int  # of the large and heterogeneous-TP scenarios (a repetition takes well under a second)
    small_reps: int
    large_requests: int
    large_request_bytes: int
    hetero_requests: int
    hetero_request_bytes: int
    small_requests: int
    layerwise_iterations: int
    layer_time_s: float
    model: ModelShape = MODELS[DEFAULT_MODEL]
    # the small scenario's own cross-layer model: 64 KiB one-block requests (8 layers, 2 heads of 64, block 16)
    small_layers: int = 8
    small_kv_heads: int = 2
    small_head_size: int = 64
    small_block_size: int = 16

    @property
    def large_blocks(self) -> int:
        return max(1, self.large_request_bytes // self.model.block_bytes())

    @property
    def hetero_blocks(self) -> int:
        return max(1, self.hetero_request_bytes // self.model.block_bytes())


MiB = 1 << 20
QUICK = Sizes(
    reps=9,
    small_reps=5,
    large_requests=4,
    large_request_bytes=16 * MiB,
    hetero_requests=8,
    hetero_request_bytes=4 * MiB,
    small_requests=2000,
    layerwise_iterations=3,
    layer_time_s=0.004,
)
FULL = Sizes(
    reps=11,
    small_reps=7,
    large_requests=8,
    large_request_bytes=32 * MiB,
    hetero_requests=16,
    hetero_request_bytes=4 * MiB,
    small_requests=10000,
    layerwise_iterations=5,
    layer_time_s=0.004,
)
_TINY_MODEL = ModelShape("tiny", num_layers=2, num_kv_heads=2, head_size=16, block_size=4)
TINY = Sizes(  # the test's sizes: every code path, seconds of work
    reps=1,
    small_reps=1,
    large_requests=2,
    large_request_bytes=2 * _TINY_MODEL.block_bytes(),
    hetero_requests=2,
    hetero_request_bytes=2 * _TINY_MODEL.block_bytes(),
    small_requests=20,
    layerwise_iterations=1,
    layer_time_s=0.001,
    model=_TINY_MODEL,
    small_layers=2,
    small_head_size=16,
    small_block_size=4,
)


@dataclass
class ScenarioResult:
    """Medians over the repetitions of one scenario (GB/s are 1e9 bytes per second). The ratios are medians of
    per-repetition ratios, each kvsvc run against the baseline runs that follow it, so that load changing between
    repetitions cancels; they can differ a little from the ratio of the medians."""

    name: str
    reps: int
    requests: int
    bytes_per_rep: int
    kvsvc_gbps: float
    raw_gbps: float
    raw_method: str
    peer_gbps: float
    memcpy_gbps: float
    kvsvc_requests_per_s: float
    raw_requests_per_s: float
    peer_requests_per_s: float
    p50_ms: float
    p99_ms: float
    descriptors_per_request: float
    naive_descriptors_per_request: float
    run_bound_per_request: float  # contiguous block runs x layers, per D worker
    kvsvc_cpu_s_per_gb: float
    raw_cpu_s_per_gb: float
    peer_cpu_s_per_gb: float
    ratio_to_raw: float
    ratio_to_peer: float
    verified: bool
    failures: int
    spans: dict[str, list[float]] = field(default_factory=dict)

    @property
    def ratio_to_memcpy(self) -> float:
        return self.kvsvc_gbps / self.memcpy_gbps if self.memcpy_gbps else 0.0


@dataclass
class LayerwiseResult:
    """Time from the end of the last layer's compute to the request complete on D (medians, ms)."""

    layer_ms: float
    whole_ms: float
    layer_time_ms: float
    layers: int
    request_bytes: int

    @property
    def ratio(self) -> float:
        return self.layer_ms / self.whole_ms if self.whole_ms else 0.0


@dataclass
class BenchReport:
    sizes: Sizes
    scenarios: list[ScenarioResult]
    layerwise: LayerwiseResult
    startup_s: float
    total_s: float

    def scenario(self, name: str) -> ScenarioResult:
        return next(s for s in self.scenarios if s.name == name)

    def summary(self) -> dict[str, Any]:
        """The JSON object `kvsvc bench --json` ends with."""
        large, small = self.scenario("large"), self.scenario("small")
        return {
            "ratio_to_raw": large.ratio_to_raw,
            "ratio_to_peer_style": large.ratio_to_peer,
            "ratio_to_memcpy": large.ratio_to_memcpy,
            "raw_gbps": large.raw_gbps,
            "kvsvc_gbps": large.kvsvc_gbps,
            "peer_style_gbps": large.peer_gbps,
            "memcpy_gbps": large.memcpy_gbps,
            "descriptors_per_request": large.descriptors_per_request,
            "naive_descriptors_per_request": large.naive_descriptors_per_request,
            "small_ratio_to_raw": small.ratio_to_raw,
            "small_requests_per_s": small.kvsvc_requests_per_s,
            "small_raw_requests_per_s": small.raw_requests_per_s,
            "small_ratio_to_peer_style": small.ratio_to_peer,
            "small_descriptors_per_request": small.descriptors_per_request,
            "layerwise_ms": self.layerwise.layer_ms,
            "whole_request_ms": self.layerwise.whole_ms,
            "layerwise_ratio": self.layerwise.ratio,
            "verified": all(s.verified for s in self.scenarios),
            "failures": sum(s.failures for s in self.scenarios),
            "reps": self.sizes.reps,
            "small_reps": self.sizes.small_reps,
            "model": self.sizes.model.name,
            "scenarios": {
                s.name: {k: v for k, v in vars(s).items() if k not in ("name", "spans", "ratio_to_peer")}
                | {"ratio_to_peer_style": s.ratio_to_peer}
                for s in self.scenarios
            },
        }


# -- geometry helpers -----------------------------------------------------------------------------------------


def split_per_half(descs: Sequence[Desc], src: WorkerMetadata, dst: WorkerMetadata) -> list[Desc]:
    """Cut a plan into one descriptor per (layer, block, K/V half), as a planner that never merges would emit.

    K/V halves tile each layer tensor (or the cross-layer pool) from its start, so cuts fall every `half_stride`
    bytes from the tensor's base, on either side.
    """
    s_bases, s_half = sorted(src.base_addrs), block_geometry(src).half_stride
    d_bases, d_half = sorted(dst.base_addrs), block_geometry(dst).half_stride
    out: list[Desc] = []
    for s, d, length in descs:
        end = s + length
        while s < end:
            step = min(end - s, _to_cut(s, s_bases, s_half), _to_cut(d, d_bases, d_half))
            out.append((s, d, step))
            s, d = s + step, d + step
    return out


def _to_cut(addr: int, bases: Sequence[int], half: int) -> int:
    """Bytes from `addr` to the next K/V-half boundary of the tensor that holds it."""
    base = bases[bisect_right(bases, addr) - 1]
    return half - (addr - base) % half


def run_bound(blocks: Sequence[int], layers: int) -> int:
    """Contiguous block runs times layers: the descriptor count DESIGN's target allows per request."""
    runs = sum(1 for i, b in enumerate(blocks) if i == 0 or b != blocks[i - 1] + 1)
    return runs * layers


# -- the runner -----------------------------------------------------------------------------------------------


class BenchRunner:
    """Starts the engines (`start`), runs the scenarios (`run`), and closes them (`close`)."""

    def __init__(self, sizes: Sizes, progress: Callable[[str], None] = lambda _: None) -> None:
        self.sizes = sizes
        self.progress = progress
        z, m = sizes, sizes.model
        hnd = dict(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_size=m.head_size, block_size=m.block_size)
        hnd_blocks = max(z.large_requests * z.large_blocks, z.hetero_requests * z.hetero_blocks) + 4
        small = dict(
            num_layers=z.small_layers,
            num_kv_heads=z.small_kv_heads,
            head_size=z.small_head_size,
            block_size=z.small_block_size,
            layout="HND_CROSS_LAYER",
            num_blocks=z.small_requests + 4,
        )
        self.p = Executor(EngineConfig(engine_id="bench-p", role="prefill", num_blocks=hnd_blocks, **hnd))  # type: ignore[arg-type]
        self.d = Executor(EngineConfig(engine_id="bench-d", role="decode", num_blocks=hnd_blocks, **hnd))  # type: ignore[arg-type]
        self.d2 = Executor(
            EngineConfig(engine_id="bench-d-tp2", role="decode", num_blocks=hnd_blocks, tp_size=2, **hnd)  # type: ignore[arg-type]
        )
        self.px = Executor(EngineConfig(engine_id="bench-px", role="prefill", **small))  # type: ignore[arg-type]
        self.dx = Executor(EngineConfig(engine_id="bench-dx", role="decode", **small))  # type: ignore[arg-type]
        self.executors = [self.p, self.d, self.d2, self.px, self.dx]

    def start(self) -> None:
        start_all(self.executors)

    def close(self) -> None:
        for executor in self.executors:
            executor.close()

    def run(self) -> BenchReport:
        began = time.perf_counter()
        t0 = time.perf_counter()
        self.progress("starting engines")
        self.start()
        startup = time.perf_counter() - t0
        z = self.sizes
        scenarios = []
        self.progress("large")
        scenarios.append(self._scenario("large", self.p, self.d, z.large_requests, z.large_blocks, 1000, 1.0, z.reps))
        self.progress("small")
        share = 64 / z.small_requests  # of the requests verified
        scenarios.append(self._scenario("small", self.px, self.dx, z.small_requests, 1, 100000, share, z.small_reps))
        self.progress("heterogeneous TP")
        scenarios.append(
            self._scenario("hetero_tp", self.p, self.d2, z.hetero_requests, z.hetero_blocks, 2000, 1.0, z.reps)
        )
        self.progress("layer-wise")
        layerwise = self._layerwise()
        return BenchReport(z, scenarios, layerwise, startup, time.perf_counter() - began)

    # -- one scenario ---------------------------------------------------------------------------------------

    def _scenario(
        self,
        name: str,
        p: Executor,
        d: Executor,
        count: int,
        blocks: int,
        seed0: int,
        verify_share: float,
        reps: int,
    ) -> ScenarioResult:
        p_meta = p.metas[(0, 0)]
        d_metas = [d.metas[(0, tp)] for tp in range(d.config.tp_size)]
        peers = [m.transport_addr for m in d_metas]
        tokens = blocks * p_meta.block_size
        shapes = [
            (list(range(i * blocks, (i + 1) * blocks)), list(range(i * blocks, (i + 1) * blocks)), seed0 + i)
            for i in range(count)
        ]
        plans = [[plan_transfer(p_meta, dm, pb, db, tokens) for dm in d_metas] for pb, db, _ in shapes]
        total_bytes = sum(length for per_req in plans for plan in per_req for _, _, length in plan)
        raw_descs: list[list[Desc]] = [
            [(x[0], x[1], x[2]) for per_req in plans for x in per_req[j]] for j in range(len(d_metas))
        ]
        naive = [
            [split_per_half(plan, p_meta, dm) for plan, dm in zip(per_req, d_metas, strict=True)] for per_req in plans
        ]
        naive_desc = sum(len(b) for per_req in naive for b in per_req) / count / len(d_metas)
        # The peers' way runs at a few hundred one-block requests a second here: time a prefix, report rates.
        peer_count = min(count, PEER_MAX_REQUESTS)
        peer_peers = [peers[j] for _ in plans[:peer_count] for j in range(len(d_metas))]
        peer_batches = [batch for per_req in naive[:peer_count] for batch in per_req]
        peer_bytes = sum(x[2] for batch in peer_batches for x in batch)
        kv_desc = sum(len(plan) for per_req in plans for plan in per_req) / count / len(d_metas)
        layers = p_meta.num_layers
        bound = statistics.mean(run_bound(db, layers) for _, db, _ in shapes)

        # Warm-up: the handshake and each engine's first write to its peers, untimed.
        self._kvsvc_round(p, d, f"{name}-warm", shapes[:1], fill=True)
        self._raw(p, d, RawWrite(peers, [[x[0]] if x else [] for x in raw_descs], "submit_poll"))
        self._raw(p, d, PeerStyleWrite(peer_peers[:1], peer_batches[:1]))

        memcpy = _memcpy_gbps(total_bytes, reps)
        spans: dict[str, list[float]] = {"kvsvc": [], "peer": [], **{m: [] for m in RAW_METHODS}}
        cpu: dict[str, list[float]] = {k: [] for k in spans}
        latencies: list[float] = []
        verified, failures = True, 0
        for rep, runs in enumerate(run_orders(reps, seed0)):
            for run in runs:
                if run == "kvsvc":
                    round_ = self._kvsvc_round(p, d, f"{name}-{rep}", shapes, fill=rep == 0)
                    span, used, bad = round_["span"], round_["cpu"], round_["failed"]
                    latencies.extend(round_["latencies"])
                    if rep == 0:
                        verified = self._verify(d, shapes, tokens, verify_share)
                elif run == "peer":
                    span, used, bad = self._raw(p, d, PeerStyleWrite(peer_peers, peer_batches))
                else:
                    span, used, bad = self._raw(p, d, RawWrite(peers, raw_descs, run))
                spans[run].append(span)
                cpu[run].append(used)
                failures += bad
        med = {k: statistics.median(v) for k, v in spans.items()}
        raw_method = min(RAW_METHODS, key=lambda m: med[m])
        gb = total_bytes / GB
        peer_share = peer_bytes / total_bytes  # the peers' way is timed on a prefix of the requests
        latencies.sort()
        return ScenarioResult(
            name=name,
            reps=reps,
            requests=count,
            bytes_per_rep=total_bytes,
            kvsvc_gbps=gb / med["kvsvc"],
            raw_gbps=gb / med[raw_method],
            raw_method=raw_method,
            peer_gbps=peer_bytes / GB / med["peer"],
            memcpy_gbps=memcpy,
            kvsvc_requests_per_s=count / med["kvsvc"],
            raw_requests_per_s=count / med[raw_method],
            peer_requests_per_s=peer_count / med["peer"],
            p50_ms=1e3 * _quantile(latencies, 0.5),
            p99_ms=1e3 * _quantile(latencies, 0.99),
            descriptors_per_request=kv_desc,
            naive_descriptors_per_request=naive_desc,
            run_bound_per_request=bound,
            kvsvc_cpu_s_per_gb=statistics.median(cpu["kvsvc"]) / gb,
            raw_cpu_s_per_gb=statistics.median(cpu[raw_method]) / gb,
            peer_cpu_s_per_gb=statistics.median(cpu["peer"]) / (peer_bytes / GB),
            ratio_to_raw=paired_ratio(spans[raw_method], spans["kvsvc"]),
            ratio_to_peer=paired_ratio(spans["peer"], [k * peer_share for k in spans["kvsvc"]]),
            verified=verified,
            failures=failures,
            spans=spans,
        )

    def _kvsvc_round(
        self, p: Executor, d: Executor, tag: str, shapes: Sequence[tuple[list[int], list[int], int]], *, fill: bool
    ) -> dict[str, Any]:
        """Hold every request on P (untimed), then receive them all on D at once; span from the first start_recv
        on any D worker to the last completion."""
        tokens_of = p.metas[(0, 0)].block_size
        p_reqs: list[BenchRequest] = [
            (f"p-{tag}-{i}", f"{tag}-{i}", pb, len(pb) * tokens_of, seed) for i, (pb, _, seed) in enumerate(shapes)
        ]
        d_reqs: list[BenchRequest] = [
            (f"d-{tag}-{i}", f"{tag}-{i}", db, len(db) * tokens_of, seed) for i, (_, db, seed) in enumerate(shapes)
        ]
        p.call(0, HoldMany(p_reqs, fill=fill), timeout_s=120)
        p_cpu0 = _cpu(p.call(0, CpuTime()))
        d_cpu0 = [_cpu(r) for r in d.broadcast(RecvMany(p.engine_id, p.url, d_reqs))]
        outs = d.broadcast(Collect([r[0] for r in d_reqs], timeout_s=120), timeout_s=150)
        p_cpu1 = _cpu(p.call(0, CpuTime()))
        started = [min(_field(o, "started")[r[0]] for o in outs) for r in d_reqs]
        ended = [max(_field(o, "ended").get(r[0], float("nan")) for o in outs) for r in d_reqs]
        failed = sum(len(_field(o, "failed")) for o in outs)
        d_cpu = sum(_cpu(o) - c for o, c in zip(outs, d_cpu0, strict=True))
        return {
            "span": max(ended) - min(started),
            "latencies": [e - s for s, e in zip(started, ended, strict=True)],
            "cpu": d_cpu + p_cpu1 - p_cpu0,
            "failed": failed,
        }

    def _raw(self, p: Executor, d: Executor, command: RawWrite | PeerStyleWrite) -> tuple[float, float, int]:
        d_cpu0 = sum(_cpu(r) for r in d.broadcast(CpuTime()))
        result = p.call(0, command, timeout_s=300)
        d_cpu1 = sum(_cpu(r) for r in d.broadcast(CpuTime()))
        assert isinstance(result, dict)
        used = result["cpu"] - result["cpu_start"] + d_cpu1 - d_cpu0
        return float(result["span"]), float(used), int(result["failures"])

    def _verify(
        self, d: Executor, shapes: Sequence[tuple[list[int], list[int], int]], tokens: int, share: float
    ) -> bool:
        step = max(1, round(1 / share)) if share < 1 else 1
        ok = True
        for _, db, seed in list(shapes)[::step]:
            for result in d.broadcast(Verify(seed, db, tokens)):
                ok = ok and isinstance(result, VerifyResult) and result.ok
        return ok

    # -- layer-wise -----------------------------------------------------------------------------------------

    def _layerwise(self) -> LayerwiseResult:
        z = self.sizes
        p, d = self.p, self.d
        blocks = list(range(z.large_blocks))
        tokens = len(blocks) * p.metas[(0, 0)].block_size
        layers = p.metas[(0, 0)].num_layers
        request_bytes = sum(x[2] for x in plan_transfer(p.metas[(0, 0)], d.metas[(0, 0)], blocks, blocks, tokens))
        results: dict[str, list[float]] = {"layer": [], "whole": []}
        for it in range(z.layerwise_iterations):
            for mode in ("layer", "whole"):
                tid = f"lw-{mode}-{it}"
                p.call(0, HoldMany([(f"p-{tid}", tid, blocks, tokens, 7)], fill=it == 0, ready=mode))
                d.broadcast(RecvMany(p.engine_id, p.url, [(f"d-{tid}", tid, blocks, tokens, 7)]))
                time.sleep(0.05)  # D's request reaches P before the compute starts, as in a running engine
                ends = _field(p.call(0, Compute([tid], z.layer_time_s, layers)), "ends")
                out = d.broadcast(Collect([f"d-{tid}"]))
                end = max(_field(o, "ended")[f"d-{tid}"] for o in out)
                results[mode].append(end - ends[tid])
        return LayerwiseResult(
            layer_ms=1e3 * statistics.median(results["layer"]),
            whole_ms=1e3 * statistics.median(results["whole"]),
            layer_time_ms=1e3 * z.layer_time_s,
            layers=layers,
            request_bytes=request_bytes,
        )


# -- small helpers --------------------------------------------------------------------------------------------


def _memcpy_gbps(nbytes: int, reps: int) -> float:
    """One-thread memcpy of `nbytes` (numpy's copyto), both buffers touched first; median of `reps`."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    spans = []
    for _ in range(max(reps, 3)):
        start = time.perf_counter()
        np.copyto(dst, src)
        spans.append(time.perf_counter() - start)
    return nbytes / GB / statistics.median(spans)


def run_orders(reps: int, seed: int) -> list[list[str]]:
    """The order of kvsvc and the baselines in each repetition: a fresh seeded shuffle each time, so that no run
    always follows the same one (a rotation would keep kvsvc right after the peers' 10 threads, whose aftermath
    slows the next run); the first starts with kvsvc, whose bytes are verified before a baseline overwrites them."""
    rng = random.Random(seed)
    orders = []
    for rep in range(reps):
        runs = [*RAW_METHODS, "peer"]
        rng.shuffle(runs)
        runs.insert(0 if rep == 0 else rng.randrange(len(runs) + 1), "kvsvc")
        orders.append(runs)
    return orders


def paired_ratio(baseline_spans: Sequence[float], kvsvc_spans: Sequence[float]) -> float:
    """Median over repetitions of kvsvc's speed over the baseline's, for the same bytes: baseline span / kvsvc span."""
    return statistics.median(b / k for b, k in zip(baseline_spans, kvsvc_spans, strict=True))


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _cpu(result: object) -> float:
    return float(_field(result, "cpu"))


def _field(result: object, key: str) -> Any:
    if not isinstance(result, dict):
        raise TypeError(f"bench command answered {type(result).__name__}, not a dict")
    return result[key]


__all__ = [
    "FULL",
    "QUICK",
    "RAW_METHODS",
    "TINY",
    "BenchReport",
    "BenchRunner",
    "Sizes",
    "paired_ratio",
    "run_orders",
    "split_per_half",
]
