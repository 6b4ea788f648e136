"""The parent half of `kvsvc bench`: start the engines, run every scenario and its baselines in one run, summarise.

Imports `kvsvc` (planner), `workers.executor`, `workers.bench.worker` (the worker-side commands) and the bench's
`models` (sizes), `measure` (arithmetic) and `report` (results), and `workers.stats` (the percentile the demo
reports too). Invariants: kvsvc and every
baseline move the same bytes between the same two Mooncake engines (the P worker's and the D workers'), described by
the same plan (`plan_transfer`); the peers' way moves them as one descriptor per (layer, block, K/V half); the
handshake and each engine's first write happen before anything is timed; the runs of kvsvc and the baselines
alternate, in a shuffled order (`run_orders`), so noise hits them alike; every figure is the median over the
repetitions and every ratio the median of per-repetition ratios; the first repetition of kvsvc is verified byte for
byte on D (a sample of the requests in the small scenario) before a baseline writes.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from kvsvc.core.layout import pool_regions
from kvsvc.core.planner import Descriptor, plan_transfer, plan_transfer_arrays
from kvsvc.service import ServiceConfig
from kvsvc.transport.mooncake import MooncakeConfig
from workers.bench.measure import (
    GB,
    RAW_METHODS,
    RAW_SAMEHOST,
    cpu_jiffies,
    memcpy_gbps,
    paired_ratio,
    run_bound,
    run_orders,
    split_per_half,
)
from workers.bench.models import Sizes
from workers.bench.report import (
    CUDA_IPC,
    GPU_MOONCAKE,
    GPU_PLANE,
    GPU_TORCH,
    STAGE_PARTS,
    BenchReport,
    GpuLayerwiseResult,
    GpuReport,
    GpuScenarioResult,
    LayerwiseResult,
    LayoutResult,
    ScenarioResult,
)
from workers.bench.worker import (
    BenchRequest,
    Collect,
    Compute,
    CpuTime,
    Desc,
    HoldMany,
    PeerStyleWrite,
    PlaneWrite,
    RawWrite,
    RecvMany,
    TorchCopy,
)
from workers.executor import EngineConfig, Executor, start_all
from workers.process import Peers, Verify
from workers.stats import percentile
from workers.synthetic import VerifyResult

THREAD_ROLES = ("p_loop", "p_threads", "d_loop", "d_threads")  # `_thread_cpu`'s keys, both engines
PEER_MAX_REQUESTS = 400  # requests the peers' way is timed on (a prefix of the scenario's)
STAGING_BYTES = 64 << 20  # the staging region of the layout scenarios' workers


# -- the runner -----------------------------------------------------------------------------------------------


# Every bench engine runs Mooncake from its start, whatever plane kvsvc's writes take: the raw Mooncake baselines
# write through each worker's engine.
_WITH_MOONCAKE: Final = MooncakeConfig(on_demand=False)


class BenchRunner:
    """Starts the engines (`start`), runs the scenarios (`run`), and closes them (`close`)."""

    def __init__(
        self,
        sizes: Sizes,
        progress: Callable[[str], None] = lambda _: None,
        transport: str = "auto",
        device: str = "cpu",
    ) -> None:
        """`transport`: every engine's `ServiceConfig.transport` (the plane kvsvc's writes take); `device`: where
        every engine keeps its KV and staging region ("cpu", or "cuda": the host's first GPU, for `run_gpu`)."""
        self.sizes = sizes
        self.progress = progress
        self.device = device
        z, m = sizes, sizes.model
        hnd: dict[str, Any] = dict(
            device=device,
            num_layers=m.num_layers,
            num_kv_heads=m.num_kv_heads,
            head_size=m.head_size,
            block_size=m.block_size,
            service=ServiceConfig(transport=transport),
            transport=_WITH_MOONCAKE,
        )
        hnd_blocks = max(z.large_requests * z.large_blocks, z.hetero_requests * z.hetero_blocks) + 4
        small = dict(
            device=device,
            service=ServiceConfig(transport=transport),
            transport=_WITH_MOONCAKE,
            num_layers=z.small_layers,
            num_kv_heads=z.small_kv_heads,
            head_size=z.small_head_size,
            block_size=z.small_block_size,
            layout="HND_CROSS_LAYER",
            num_blocks=z.small_requests + 4,
        )
        self.p = Executor(EngineConfig(engine_id="bench-p", role="prefill", num_blocks=hnd_blocks, **hnd))
        self.d = Executor(EngineConfig(engine_id="bench-d", role="decode", num_blocks=hnd_blocks, **hnd))
        self.d2 = Executor(
            EngineConfig(engine_id="bench-d-tp2", role="decode", num_blocks=hnd_blocks, tp_size=2, **hnd)
        )
        self.px = Executor(EngineConfig(engine_id="bench-px", role="prefill", **small))  # type: ignore[arg-type]
        self.dx = Executor(EngineConfig(engine_id="bench-dx", role="decode", **small))  # type: ignore[arg-type]
        # The layout scenarios: engines with a staging region, D engines that split heads or blocks differently.
        lay: dict[str, Any] = dict(hnd, num_blocks=z.hetero_requests * z.hetero_blocks + 4)
        staged = STAGING_BYTES
        self.ps = Executor(EngineConfig(engine_id="bench-ps", staging_bytes=staged, **lay))
        self.ps2 = Executor(EngineConfig(engine_id="bench-ps2", tp_size=2, staging_bytes=staged, **lay))
        self.dh = Executor(EngineConfig(engine_id="bench-dh", role="decode", staging_bytes=staged, **lay))
        self.dh2 = Executor(EngineConfig(engine_id="bench-dh2", role="decode", tp_size=2, staging_bytes=staged, **lay))
        wide = dict(lay, block_size=2 * m.block_size)
        self.dwide = Executor(EngineConfig(engine_id="bench-dwide", role="decode", staging_bytes=staged, **wide))
        nhd = dict(lay, layout="NHD")
        self.pn = Executor(EngineConfig(engine_id="bench-pn", staging_bytes=staged, **nhd))
        self.dn2 = Executor(EngineConfig(engine_id="bench-dn2", role="decode", tp_size=2, staging_bytes=staged, **nhd))
        self.executors = [self.p, self.d] + ([] if device == "cuda" else [self.d2, self.px, self.dx])
        self.executors += [self.ps, self.ps2, self.dh, self.dh2, self.dwide, self.pn, self.dn2]
        # On a GPU, every split layout also without staging regions: the plane's own copies of a direct plan (2D
        # copies of its pitched rows) beside the staged and windowed ways, so one run says which way the rule should
        # pick there.
        self.direct: list[tuple[str, Executor, Executor, str]] = []
        if device == "cuda":

            def bare(name: str, role: str = "prefill", **shape: Any) -> Executor:
                return Executor(EngineConfig(engine_id=f"bench-{name}-direct", role=role, **{**lay, **shape}))

            ps_d, ps2_d, pn_d = bare("ps"), bare("ps2", tp_size=2), bare("pn", layout="NHD")
            dh_d, dh2_d = bare("dh", "decode"), bare("dh2", "decode", tp_size=2)
            dwide_d = bare("dwide", "decode", block_size=2 * m.block_size)
            dn2_d = bare("dn2", "decode", tp_size=2, layout="NHD")
            self.direct = [
                ("hetero_tp_up_direct", ps_d, dh2_d, "HND, P tp1 -> D tp2, no staging region"),
                ("hetero_tp_down_direct", ps2_d, dh_d, "HND, P tp2 -> D tp1, no staging region"),
                ("block_mismatch_direct", ps_d, dwide_d, "HND, P block b -> D block 2b, no staging region"),
                ("nhd_hetero_tp_direct", pn_d, dn2_d, "NHD, P tp1 -> D tp2, no staging region"),
            ]
            self.executors += [ps_d, ps2_d, pn_d, dh_d, dh2_d, dwide_d, dn2_d]

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
        layouts = self._layouts()
        return BenchReport(z, scenarios, layerwise, startup, time.perf_counter() - began, layouts)

    def _layouts(self, measured: Callable[[LayoutResult], object] = lambda _: None) -> list[LayoutResult]:
        """Every layout scenario, each handed to `measured` as it ends."""
        z = self.sizes
        layouts = []
        for name, p, d, layout in (
            ("hetero_tp_up", self.ps, self.dh2, "HND, P tp1 -> D tp2"),
            ("hetero_tp_down", self.ps2, self.dh, "HND, P tp2 -> D tp1"),
            ("block_mismatch", self.ps, self.dwide, "HND, P block b -> D block 2b"),
            ("nhd_hetero_tp", self.pn, self.dn2, "NHD, P tp1 -> D tp2"),
            *self.direct,
        ):
            self.progress(name)
            layouts.append(self._layout(name, layout, p, d, z.hetero_requests, z.hetero_blocks, z.hetero_reps))
            measured(layouts[-1])
        return layouts

    # -- on a GPU -------------------------------------------------------------------------------------------

    def run_gpu(self, so_far: Callable[[GpuReport], None] = lambda _: None) -> GpuReport:
        """The run with every engine's KV on the GPU: the large scenario and the layer-wise one against the pair's
        own plane, torch's copy into the same mapping and Mooncake's TCP on the same memory; the layout scenarios
        against homogeneous. `so_far` is given the report of the parts measured so far after each part."""
        began = time.perf_counter()
        self.progress("starting engines (KV on the GPU)")
        self.start()
        startup = time.perf_counter() - began
        z = self.sizes
        scenarios: list[GpuScenarioResult] = []
        layerwise: GpuLayerwiseResult | None = None
        layouts: list[LayoutResult] = []

        def report(complete: bool) -> GpuReport:
            spent = time.perf_counter() - began
            # Copies: a report handed over stays as it was when the later parts are measured.
            return GpuReport(z, list(scenarios), layerwise, startup, spent, list(layouts), self.device, complete)

        self.progress("large")
        scenarios.append(self._gpu_scenario("large", self.p, self.d, z.large_requests, z.large_blocks, 1000, z.reps))
        so_far(report(False))
        self.progress("layer-wise")
        layerwise = self._gpu_layerwise()
        so_far(report(False))

        def measured(layout: LayoutResult) -> None:
            layouts.append(layout)
            so_far(report(False))

        self._layouts(measured)
        return report(True)

    def _gpu_baselines(
        self, p: Executor, d: Executor, descs: list[list[Desc]], tcp_descs: list[list[Desc]] | None = None
    ) -> dict[str, Any]:
        """The commands that move `descs[j]` (for D worker j) each baseline's way: the pair's own plane, torch's
        copy (only where that plane is CUDA IPC) and Mooncake's TCP to D's `transport_addr` (`tcp_descs` when given:
        a part of the bytes, since TCP would take minutes over all of them)."""
        d_metas = [d.metas[(0, tp)] for tp in range(d.config.tp_size)]
        plane = _plane(p)
        commands: dict[str, Any] = {}
        if plane != "mooncake":
            sessions = _local_sessions(p, d)
            commands[GPU_PLANE] = PlaneWrite("local", sessions, descs)
            if plane == CUDA_IPC:
                commands[GPU_TORCH] = TorchCopy(sessions, descs)
        mooncake = [m.transport_addr for m in d_metas]
        tcp = descs if tcp_descs is None else tcp_descs
        commands[GPU_MOONCAKE] = PlaneWrite("primary", mooncake, tcp, [pool_regions(m) for m in d_metas])
        return commands

    def _gpu_scenario(
        self, name: str, p: Executor, d: Executor, count: int, blocks: int, seed0: int, reps: int
    ) -> GpuScenarioResult:
        d_metas = [d.metas[(0, tp)] for tp in range(d.config.tp_size)]
        tokens, shapes, plans, total_bytes, descs = _contiguous_requests(p, d, count, blocks, seed0)
        self._kvsvc_round(p, d, f"{name}-warm", shapes[:1], fill=True)
        plane = _plane(p)
        first = [[(x[0], x[1], x[2]) for x in plans[0][j]] for j in range(len(d_metas))]
        first_bytes = sum(length for per_d in first for _, _, length in per_d)
        baselines = self._gpu_baselines(p, d, descs, first)
        volume = {k: total_bytes for k in baselines} | {"kvsvc": total_bytes, GPU_MOONCAKE: first_bytes}
        for command in baselines.values():  # each way's first call (mappings, Mooncake's connection), untimed
            self._raw(p, d, command)
        spans: dict[str, list[float]] = {"kvsvc": [], **{k: [] for k in baselines}}
        latencies: list[float] = []
        verified, failures = True, 0
        rng = random.Random(seed0)
        for rep in range(reps):
            order = list(baselines)
            rng.shuffle(order)
            order.insert(0 if rep == 0 else rng.randrange(len(order) + 1), "kvsvc")
            for run in order:
                if run == "kvsvc":
                    round_ = self._kvsvc_round(p, d, f"{name}-{rep}", shapes, fill=rep == 0)
                    span, bad = round_["span"], round_["failed"]
                    latencies.extend(round_["latencies"])
                    if rep == 0:
                        verified = self._verify(d, shapes, tokens, 1.0)
                else:
                    span, _, bad = self._raw(p, d, baselines[run])
                spans[run].append(span)
                failures += int(bad)
        return GpuScenarioResult(
            name=name,
            reps=reps,
            requests=count,
            bytes_per_rep=total_bytes,
            transport=plane,
            gbps={k: volume[k] / GB / statistics.median(v) for k, v in spans.items()},
            # Speed over speed, paired per repetition: a baseline that moved a part is scaled to the whole.
            ratios={
                k: paired_ratio([span * total_bytes / volume[k] for span in v], spans["kvsvc"])
                for k, v in spans.items()
                if k != "kvsvc"
            },
            p50_ms=1e3 * percentile(latencies, 50),
            p99_ms=1e3 * percentile(latencies, 99),
            descriptors_per_request=sum(len(x) for x in descs) / count / len(d_metas),
            verified=verified,
            failures=failures,
        )

    def _gpu_layerwise(self) -> GpuLayerwiseResult:
        """The layer-wise comparison, and each baseline's time to move the same request once its compute ended
        (the whole request then, as a program without kvsvc would): medians over the iterations."""
        layerwise = self._layerwise()
        p, d = self.p, self.d
        blocks = list(range(self.sizes.large_blocks))
        tokens = len(blocks) * p.metas[(0, 0)].block_size
        plan = plan_transfer(p.metas[(0, 0)], d.metas[(0, 0)], blocks, blocks, tokens)
        baselines = self._gpu_baselines(p, d, [[(x[0], x[1], x[2]) for x in plan]])
        spans: dict[str, list[float]] = {k: [] for k in baselines}
        failures = 0
        for _ in range(max(3, self.sizes.layerwise_iterations)):
            for key, command in baselines.items():
                span, _, bad = self._raw(p, d, command)
                spans[key].append(span)
                failures += int(bad)
        baseline_ms = {k: 1e3 * statistics.median(v) for k, v in spans.items()}
        return GpuLayerwiseResult(
            layerwise,
            baseline_ms=baseline_ms,
            ratios={k: ms / layerwise.layer_ms for k, ms in baseline_ms.items() if layerwise.layer_ms > 0},
            failures=failures,
        )

    # -- layouts that split heads or blocks -----------------------------------------------------------------

    def _layout(
        self, name: str, layout: str, p: Executor, d: Executor, count: int, blocks: int, reps: int
    ) -> LayoutResult:
        """`count` requests of `blocks` P blocks from `p` to `d`, each repetition paired with the same bytes moved
        P tp1 -> D tp1 (HND, one block size: `ps` -> `dh`)."""
        bs_p, bs_d = p.config.block_size, d.config.block_size
        tokens = blocks * bs_p
        d_blocks = -(-tokens // bs_d)
        reqs = [
            (list(range(i * blocks, (i + 1) * blocks)), list(range(i * d_blocks, (i + 1) * d_blocks)), 3000 + i)
            for i in range(count)
        ]
        homo = [(pb, pb, seed) for pb, _, seed in reqs]
        # The bound: contiguous runs of D blocks x layers, for each (P worker, D worker) pair that carries data;
        # what a write into contiguous destination memory needs, D-side staging included where D's is strided.
        direct = bound = 0
        for pm in p.metas.values():
            for dm in d.metas.values():
                layers = min(pm.end_layer, dm.end_layer) - max(pm.start_layer, dm.start_layer)
                for pb, db, _ in reqs:
                    _, _, length = plan_transfer_arrays(pm, dm, pb, db, tokens)
                    direct += int(length.size)
                    bound += run_bound(db, layers) if length.size else 0
        total_bytes = count * tokens * 2 * p.config.num_layers * p.config.num_kv_heads * p.config.head_size * 2
        self._round(p, d, f"{name}-warm", reqs[:1], tokens, fill=True)
        self._round(self.ps, self.dh, f"{name}-hwarm", homo[:1], tokens, fill=True)
        runs: dict[str, list[dict[str, float]]] = {"layout": [], "homogeneous": []}
        verified = True
        rng = random.Random(4000)
        for rep in range(reps):
            order = ["layout", "homogeneous"] if rep == 0 or rng.random() < 0.5 else ["homogeneous", "layout"]
            for which in order:  # a seeded coin decides which goes first, so neither always follows the other
                if which == "layout":
                    runs[which].append(self._round(p, d, f"{name}-{rep}", reqs, tokens, fill=rep == 0))
                    if rep == 0:
                        verified = self._verify(d, [(pb, db, seed) for pb, db, seed in reqs], tokens, 1.0)
                else:
                    runs[which].append(self._round(self.ps, self.dh, f"{name}-h{rep}", homo, tokens, fill=rep == 0))
        gb = total_bytes / GB
        lay, hom = runs["layout"], runs["homogeneous"]
        cpu_s_per_gb = statistics.median(r["cpu"] for r in lay) / gb
        homogeneous_gbps = gb / statistics.median(r["span"] for r in hom)
        return LayoutResult(
            name=name,
            layout=layout,
            reps=reps,
            requests=count,
            bytes_per_rep=total_bytes,
            gbps=gb / statistics.median(r["span"] for r in lay),
            homogeneous_gbps=homogeneous_gbps,
            ratio_to_homogeneous=statistics.median(h["span"] / x["span"] for x, h in zip(lay, hom, strict=True)),
            descriptors_per_request=statistics.median(r["descriptors"] for r in lay) / count,
            direct_descriptors_per_request=direct / count,
            descriptor_bound_per_request=bound / count,
            staged_writes_per_request=statistics.median(r["staged"] for r in lay) / count,
            cpu_s_per_gb=cpu_s_per_gb,
            homogeneous_cpu_s_per_gb=statistics.median(r["cpu"] for r in hom) / gb,
            cpu_split_s_per_gb={k: statistics.median(r[k] for r in lay) / gb for k in THREAD_ROLES},
            homogeneous_cpu_split_s_per_gb={k: statistics.median(r[k] for r in hom) / gb for k in THREAD_ROLES},
            stage_ms=stage_means_ms(lay),
            machine_busy=_busy_share(lay),
            homogeneous_machine_busy=_busy_share(hom),
            cpu_ceiling_ratio=len(_cpus()) / cpu_s_per_gb / homogeneous_gbps if cpu_s_per_gb > 0 else 0.0,
            verified=verified,
            failures=int(sum(r["failed"] for r in lay + hom)),
            transport=_plane(p),
        )

    def _round(
        self, p: Executor, d: Executor, tag: str, reqs: Sequence[tuple[list[int], list[int], int]], tokens: int, *,
        fill: bool,
    ) -> dict[str, float]:  # fmt: skip
        """Hold every request on every P worker (untimed), receive them all on D at once; the span from the first
        start_recv to the last completion, the CPU of every worker of both engines, P's descriptors and staged
        writes, and both engines' staged parts (`_stage_sums`)."""
        p_reqs: list[BenchRequest] = [
            (f"p-{tag}-{i}", f"{tag}-{i}", pb, tokens, seed) for i, (pb, _, seed) in enumerate(reqs)
        ]
        d_reqs: list[BenchRequest] = [
            (f"d-{tag}-{i}", f"{tag}-{i}", db, tokens, seed) for i, (_, db, seed) in enumerate(reqs)
        ]
        p.broadcast(HoldMany(p_reqs, fill=fill), timeout_s=120)
        before = p.statistics()
        d_before = d.statistics()
        p_cpu0 = sum(_cpu(r) for r in p.broadcast(CpuTime()))
        threads0 = _thread_cpu(p, "p") | _thread_cpu(d, "d")
        machine0 = _machine_jiffies()
        d_cpu0 = [_cpu(r) for r in d.broadcast(RecvMany(p.engine_id, p.url, d_reqs))]
        outs = d.broadcast(Collect([r[0] for r in d_reqs], timeout_s=120), timeout_s=150)
        machine1 = _machine_jiffies()
        threads1 = _thread_cpu(p, "p") | _thread_cpu(d, "d")
        p_cpu1 = sum(_cpu(r) for r in p.broadcast(CpuTime()))
        started = min(min(_field(o, "started").values()) for o in outs)
        ended = max(max(_field(o, "ended").values(), default=started) for o in outs)
        after = _settled(p, before)
        stages = _stage_sums([*after, *zip(d.statistics(), d_before, strict=True)])
        return {
            "span": ended - started,
            "cpu": sum(_cpu(o) - c for o, c in zip(outs, d_cpu0, strict=True)) + p_cpu1 - p_cpu0,
            "failed": float(sum(len(_field(o, "failed")) for o in outs)),
            "descriptors": float(sum(int(a["descriptors_sent"]) - int(b["descriptors_sent"]) for a, b in after)),
            "staged": float(sum(int(a["staged_writes"]) - int(b["staged_writes"]) for a, b in after)),
            **_thread_split(threads0, threads1),
            "busy_jiffies": float(machine1[0] - machine0[0]),
            "all_jiffies": float(machine1[1] - machine0[1]),
            **stages,
        }

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
        local_peers = [m.samehost_addr for m in d_metas] if all(m.samehost_addr for m in d_metas) else []
        tokens, shapes, plans, total_bytes, raw_descs = _contiguous_requests(p, d, count, blocks, seed0)
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
        plane = _plane(p)  # what the pairs chose at the hello, as P's peer table says

        memcpy = memcpy_gbps(total_bytes, reps)
        spans: dict[str, list[float]] = {"kvsvc": [], "peer": [], RAW_SAMEHOST: [], **{m: [] for m in RAW_METHODS}}
        cpu: dict[str, list[float]] = {k: [] for k in spans}
        latencies: list[float] = []
        threads: list[dict[str, float]] = []  # kvsvc's CPU seconds per kind of thread, each repetition
        verified, failures = True, 0
        for rep, runs in enumerate(run_orders(reps, seed0)):
            for run in runs:
                if run == "kvsvc":
                    round_ = self._kvsvc_round(p, d, f"{name}-{rep}", shapes, fill=rep == 0)
                    span, used, bad = round_["span"], round_["cpu"], round_["failed"]
                    latencies.extend(round_["latencies"])
                    threads.append(round_["threads"])
                    if rep == 0:
                        verified = self._verify(d, shapes, tokens, verify_share)
                elif run == "peer":
                    span, used, bad = self._raw(p, d, PeerStyleWrite(peer_peers, peer_batches))
                elif run == RAW_SAMEHOST:
                    if not local_peers:  # D offers no same-host plane: nothing to compare with
                        continue
                    span, used, bad = self._raw(p, d, RawWrite(local_peers, raw_descs, run))
                else:
                    span, used, bad = self._raw(p, d, RawWrite(peers, raw_descs, run))
                spans[run].append(span)
                cpu[run].append(used)
                failures += bad
        med = {k: statistics.median(v) for k, v in spans.items() if v}
        mooncake_method = min(RAW_METHODS, key=lambda m: med[m])
        # kvsvc is paired with the raw call of the plane it used.
        raw_method = RAW_SAMEHOST if plane == "samehost" else mooncake_method
        gb = total_bytes / GB
        peer_share = peer_bytes / total_bytes  # the peers' way is timed on a prefix of the requests
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
            p50_ms=1e3 * percentile(latencies, 50),
            p99_ms=1e3 * percentile(latencies, 99),
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
            transport=plane,
            raw_mooncake_gbps=gb / med[mooncake_method],
            raw_samehost_gbps=gb / med[RAW_SAMEHOST] if RAW_SAMEHOST in med else 0.0,
            cpu_us_per_request={k: 1e6 * statistics.median(t[k] for t in threads) / count for k in THREAD_ROLES},
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
        threads0 = _thread_cpu(p, "p") | _thread_cpu(d, "d")
        d_cpu0 = [_cpu(r) for r in d.broadcast(RecvMany(p.engine_id, p.url, d_reqs))]
        outs = d.broadcast(Collect([r[0] for r in d_reqs], timeout_s=120), timeout_s=150)
        threads1 = _thread_cpu(p, "p") | _thread_cpu(d, "d")
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
            "threads": _thread_split(threads0, threads1),
        }

    def _raw(
        self, p: Executor, d: Executor, command: RawWrite | PeerStyleWrite | PlaneWrite | TorchCopy
    ) -> tuple[float, float, int]:
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


def _settled(p: Executor, before: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """P's statistics once its counters stopped moving (a write's counters land a step after D saw it end),
    paired with `before`; gives up after 5 s."""
    deadline = time.monotonic() + 5.0
    last = p.statistics()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = p.statistics()
        settled = [s["descriptors_sent"] for s in now] == [s["descriptors_sent"] for s in last]
        last = now  # the reading checked: what a write's other chunks finished meanwhile counts too
        if settled and not any(s["writes_in_flight"] for s in now):
            break
    return list(zip(last, before, strict=True))


def _stage_sums(pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, float]:
    """For each of `STAGE_PARTS`, the observations and seconds the workers added between their (after, before)
    statistics: `<part>_n` and `<part>_s`."""
    sums: dict[str, float] = {}
    for part in STAGE_PARTS:
        sums[f"{part}_n"] = float(sum(sum(a[part]["counts"]) - sum(b[part]["counts"]) for a, b in pairs))
        sums[f"{part}_s"] = float(sum(a[part]["total"] - b[part]["total"] for a, b in pairs))
    return sums


def stage_means_ms(rounds: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each part's mean in ms over `rounds` (a chunk's for P's parts, a round's for D's scatter), the parts observed
    at all."""
    means = {}
    for part in STAGE_PARTS:
        n = sum(r[f"{part}_n"] for r in rounds)
        if n:
            means[part] = 1e3 * sum(r[f"{part}_s"] for r in rounds) / n
    return means


def _thread_cpu(executor: Executor, side: str) -> dict[tuple[str, int, str], float]:
    """CPU seconds so far of each thread of the engine's worker processes, keyed (`<side>_loop` for a process's main
    thread: its event loop, the service's Python, the gather and scatter copies on CPU, or `<side>_threads` for any
    other: Mooncake's transfer threads above all; pid; tid). From the kernel's per-thread run time
    (`/proc/<pid>/task/<tid>/schedstat`, in ns); empty where there is no /proc."""
    times: dict[tuple[str, int, str], float] = {}
    for handle in executor.workers:
        pid = handle.pid
        if pid is None:  # never started
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                    run_ns = int(stat.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # a thread that ended meanwhile
            kind = f"{side}_loop" if tid == str(pid) else f"{side}_threads"
            times[(kind, pid, tid)] = run_ns / 1e9
    return times


def _thread_split(
    before: dict[tuple[str, int, str], float], after: dict[tuple[str, int, str], float]
) -> dict[str, float]:
    """CPU seconds between two `_thread_cpu` readings per kind of thread (`THREAD_ROLES`), over the threads seen in
    both: one that ended or started between them is left out rather than counted with half its time."""
    split = dict.fromkeys(THREAD_ROLES, 0.0)
    for key, seconds in after.items():
        if key in before:
            split[key[0]] += seconds - before[key]
    return split


def _cpus() -> set[int]:
    """The CPUs this process (and so every worker it starts) may run on."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _machine_jiffies() -> tuple[int, int]:
    """(busy, all) clock ticks so far of the CPUs in `_cpus()`, every process counted (`/proc/stat`); (0, 0) where
    there is no /proc."""
    try:
        with open("/proc/stat") as stat:
            return cpu_jiffies(stat.read(), _cpus())
    except OSError:
        return 0, 0


def _busy_share(rounds: Sequence[dict[str, float]]) -> float:
    """The share of the CPUs' time they were busy during `rounds`, summed over them (a clock tick is 10 ms, about
    half a quick round)."""
    total = sum(r["all_jiffies"] for r in rounds)
    return sum(r["busy_jiffies"] for r in rounds) / total if total > 0 else 0.0


def _contiguous_requests(
    p: Executor, d: Executor, count: int, blocks: int, seed0: int
) -> tuple[int, list[tuple[list[int], list[int], int]], list[list[list[Descriptor]]], int, list[list[Desc]]]:
    """`count` requests of `blocks` consecutive blocks on both sides (request i at blocks i*blocks.., seed seed0+i):
    their tokens, shapes `(P blocks, D blocks, seed)`, plans per D worker, total bytes, and every request's
    descriptors per D worker in one list each."""
    p_meta = p.metas[(0, 0)]
    d_metas = [d.metas[(0, tp)] for tp in range(d.config.tp_size)]
    tokens = blocks * p_meta.block_size
    shapes = [
        (list(range(i * blocks, (i + 1) * blocks)), list(range(i * blocks, (i + 1) * blocks)), seed0 + i)
        for i in range(count)
    ]
    plans = [[plan_transfer(p_meta, dm, pb, db, tokens) for dm in d_metas] for pb, db, _ in shapes]
    total_bytes = sum(length for per_req in plans for plan in per_req for _, _, length in plan)
    descs: list[list[Desc]] = [
        [(x[0], x[1], x[2]) for per_req in plans for x in per_req[j]] for j in range(len(d_metas))
    ]
    return tokens, shapes, plans, total_bytes, descs


def _plane(p: Executor) -> str:
    """The plane P's writes to its D workers take: the one every pair chose ("samehost", "cuda_ipc"), else
    "mooncake"."""
    planes = p.planes()
    return planes.pop() if len(planes) == 1 else "mooncake"


def _local_sessions(p: Executor, d: Executor) -> list[str]:
    """The session of each D worker (tp order) on the plane its pair chose, from P's peer table (worker 0's).

    Raises:
        ValueError: P's worker 0 has no hello from one of D's workers.
    """
    rows = p.call(0, Peers())
    assert isinstance(rows, list)
    found = {
        int(row["peer_tp_rank"]): str(row["session"])
        for row in rows
        if row["direction"] == "from_d" and row["peer_engine_id"] == d.engine_id and row.get("session")
    }
    missing = [tp for tp in range(d.config.tp_size) if tp not in found]
    if missing:
        raise ValueError(f"P {p.engine_id!r} worker 0 has no session of D {d.engine_id!r} tp ranks {missing}")
    return [found[tp] for tp in range(d.config.tp_size)]


def _cpu(result: object) -> float:
    return float(_field(result, "cpu"))


def _field(result: object, key: str) -> Any:
    if not isinstance(result, dict):
        raise TypeError(f"bench command answered {type(result).__name__}, not a dict")
    return result[key]


__all__ = ["BenchRunner"]
