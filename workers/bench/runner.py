"""The parent half of `kvsvc bench`: start the engines, run every scenario and its baselines in one run, summarise.

Imports `kvsvc` (planner), `workers.executor`, `workers.bench.worker` (the worker-side commands) and the bench's
`models` (sizes), `measure` (arithmetic) and `report` (results). Invariants: kvsvc and every
baseline move the same bytes between the same two Mooncake engines (the P worker's and the D workers'), described by
the same plan (`plan_transfer`); the peers' way moves them as one descriptor per (layer, block, K/V half); the
handshake and each engine's first write happen before anything is timed; the runs of kvsvc and the baselines
alternate, in a shuffled order (`run_orders`), so noise hits them alike; every figure is the median over the
repetitions and every ratio the median of per-repetition ratios; the first repetition of kvsvc is verified byte for
byte on D (a sample of the requests in the small scenario) before a baseline writes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvsvc.planner import plan_transfer
from workers.bench.measure import (
    GB,
    RAW_METHODS,
    memcpy_gbps,
    paired_ratio,
    quantile,
    run_bound,
    run_orders,
    split_per_half,
)
from workers.bench.models import Sizes
from workers.bench.report import BenchReport, LayerwiseResult, ScenarioResult
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

PEER_MAX_REQUESTS = 400  # requests the peers' way is timed on (a prefix of the scenario's)


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
            self._scenario("hetero_tp", self.p, self.d2, z.hetero_requests, z.hetero_blocks, 2000, 1.0, z.hetero_reps)
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

        memcpy = memcpy_gbps(total_bytes, reps)
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
            p50_ms=1e3 * quantile(latencies, 0.5),
            p99_ms=1e3 * quantile(latencies, 0.99),
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


# -- answers ----------------------------------------------------------------------------------------------


def _cpu(result: object) -> float:
    return float(_field(result, "cpu"))


def _field(result: object, key: str) -> Any:
    if not isinstance(result, dict):
        raise TypeError(f"bench command answered {type(result).__name__}, not a dict")
    return result[key]


__all__ = ["BenchRunner"]
