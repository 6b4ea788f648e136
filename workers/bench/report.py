"""What `kvsvc bench` reports: per-scenario medians and paired ratios, the layer-wise comparison, and the JSON
summary `--json` ends with. Plain dataclasses; filled in by `workers.bench.runner`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from kvsvc.engine.metrics import STAGED
from workers.bench.models import Sizes

# The performance targets (for a 2-core machine): key of the summary, the bound, and whether it is a floor.
TARGETS: Final = (
    ("ratio_to_raw", 0.9, True),  # large scenario
    ("ratio_to_peer_style", 2.0, True),  # large scenario
    ("small_requests_per_s", 5000.0, True),
    ("small_ratio_to_raw", 0.8, True),  # against the raw call of the plane kvsvc used
    ("ratio_to_memcpy", 0.5, True),  # large scenario
    ("descriptors_per_request", "run_bound_per_request", False),  # large: no more than block runs x layers
)


class Target(NamedTuple):
    name: str
    value: float
    bound: float
    floor: bool  # the value must be >= bound (else <=)

    @property
    def met(self) -> bool:
        return self.value >= self.bound if self.floor else self.value <= self.bound


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
    transport: str = "mooncake"  # the plane kvsvc's writes took (its ratio_to_raw pairs it with that plane's call)
    raw_mooncake_gbps: float = 0.0
    raw_samehost_gbps: float = 0.0  # 0: D offered no same-host plane
    # kvsvc's CPU per request by kind of thread (`runner.THREAD_ROLES`: each engine's loop, and its other threads:
    # the same-host copy thread or Mooncake's), in microseconds: where a burst of small requests spends its time.
    cpu_us_per_request: dict[str, float] = field(default_factory=dict)

    @property
    def ratio_to_memcpy(self) -> float:
        return self.kvsvc_gbps / self.memcpy_gbps if self.memcpy_gbps else 0.0


# Each layout scenario's targets: its ratio to the homogeneous run of the same bytes, and its descriptors against
# the bound (contiguous destination runs per request).
LAYOUT_RATIO_TARGET: Final = 0.8


# The parts of staged writes the services time, as their statistics name them (`kvsvc.engine.metrics.STAGED`)
STAGE_PARTS: Final = tuple(key for _, key in STAGED)


@dataclass
class LayoutResult:
    """A layout pair that splits heads or blocks, paired per repetition with a homogeneous run of the same bytes
    (P tp1 -> D tp1, HND, one block size). Medians over the repetitions; `cpu_s_per_gb` counts every worker of
    both engines, gather copies included."""

    name: str
    layout: str
    reps: int
    requests: int
    bytes_per_rep: int
    gbps: float
    homogeneous_gbps: float
    ratio_to_homogeneous: float
    descriptors_per_request: float
    direct_descriptors_per_request: float  # what the direct plan would submit
    descriptor_bound_per_request: float  # contiguous D block runs x layers, summed over the pairs carrying data
    staged_writes_per_request: float
    cpu_s_per_gb: float
    homogeneous_cpu_s_per_gb: float
    # CPU s/GB per kind of thread of both engines (`p_loop`, `p_threads`, `d_loop`, `d_threads`): the loops run the
    # service and the copies, the other threads are mostly Mooncake's transfer threads
    cpu_split_s_per_gb: dict[str, float]
    homogeneous_cpu_split_s_per_gb: dict[str, float]
    # The share of the machine's CPU time (every process, the CPUs the bench may use) busy during the layout runs and
    # during the homogeneous runs; and the ratio_to_homogeneous the layout run could reach at its measured CPU cost
    # if it kept every one of those CPUs busy: cores / cpu_s_per_gb / homogeneous_gbps, an estimate from medians (a
    # ceiling well below the target says the cores are short at this CPU cost, however the work is scheduled).
    machine_busy: float
    homogeneous_machine_busy: float
    cpu_ceiling_ratio: float
    verified: bool
    failures: int
    transport: str = "mooncake"  # the plane P's writes took (`kvsvc.core.data_planes.Route.kind`)
    # Mean ms of each part of the staged writes over the layout runs, the parts observed (`STAGE_PARTS`; they
    # overlap, see `kvsvc.service.context.ServiceContext`): where a split layout's time goes
    stage_ms: dict[str, float] = field(default_factory=dict)

    def targets(self) -> list[Target]:
        ratio = Target(f"{self.name}.ratio_to_homogeneous", self.ratio_to_homogeneous, LAYOUT_RATIO_TARGET, True)
        if self.transport == "samehost":
            return [ratio]  # a piece costs a microsecond there: the rule writes pieces of 8 KiB and up direct
        bound = self.descriptor_bound_per_request
        return [ratio, Target(f"{self.name}.descriptors_per_request", self.descriptors_per_request, bound, False)]


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
    layouts: list[LayoutResult] = field(default_factory=list)

    def scenario(self, name: str) -> ScenarioResult:
        return next(s for s in self.scenarios if s.name == name)

    def targets(self) -> list[Target]:
        """Each of `TARGETS` against this run's figure. Informative: one noisy run can miss one."""
        summary = self._headline()
        large = self.scenario("large")
        found = []
        for name, bound, floor in TARGETS:
            limit = float(getattr(large, bound)) if isinstance(bound, str) else bound
            found.append(Target(name, float(summary[name]), limit, floor))
        return found + [t for layout in self.layouts for t in layout.targets()]

    def summary(self) -> dict[str, Any]:
        """The JSON object `kvsvc bench --json` ends with."""
        targets = self.targets()
        return self._headline() | {
            "targets": {t.name: {"value": t.value, "bound": t.bound, "met": t.met} for t in targets},
            "targets_met": all(t.met for t in targets),
        }

    def _headline(self) -> dict[str, Any]:
        large, small = self.scenario("large"), self.scenario("small")
        return {
            "transport": large.transport,
            "raw_mooncake_gbps": large.raw_mooncake_gbps,
            "raw_samehost_gbps": large.raw_samehost_gbps,
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
            "hetero_reps": self.sizes.hetero_reps,
            "model": self.sizes.model.name,
            "scenarios": {
                s.name: {k: v for k, v in vars(s).items() if k not in ("name", "spans", "ratio_to_peer")}
                | {"ratio_to_peer_style": s.ratio_to_peer}
                for s in self.scenarios
            }
            | {x.name: {k: v for k, v in vars(x).items() if k != "name"} for x in self.layouts},
        }


# -- with the KV on a GPU ---------------------------------------------------------------------------------------

CUDA_IPC: Final = "cuda_ipc"  # the GPU plane's `Route.kind`
GPU_PLANE: Final = "plane"  # the pair's own plane called alone on kvsvc's descriptors (CUDA IPC on one host)
GPU_TORCH: Final = "torch_copy"  # torch's `copy_` into D's memory as mapped in P (only on the CUDA IPC plane)
GPU_MOONCAKE: Final = "mooncake_tcp"  # Mooncake's TCP transport on the same GPU memory


@dataclass
class GpuScenarioResult:
    """One scenario with every engine's KV on the GPU: GB/s per way (`kvsvc` and the baselines that ran, keyed
    `GPU_PLANE`, `GPU_TORCH`, `GPU_MOONCAKE`), and kvsvc's speed over each baseline's (`ratios`, medians of
    per-repetition ratios: baseline span / kvsvc span, > 1 means kvsvc is faster)."""

    name: str
    reps: int
    requests: int
    bytes_per_rep: int
    transport: str
    gbps: dict[str, float]
    ratios: dict[str, float]
    p50_ms: float
    p99_ms: float
    descriptors_per_request: float
    verified: bool
    failures: int


@dataclass
class GpuLayerwiseResult:
    """The layer-wise comparison on the GPU, and each baseline's time to move the same request whole once the
    compute ended (`baseline_ms`); `ratios` are baseline ms / kvsvc's layer-wise ms (> 1: kvsvc done sooner)."""

    layerwise: LayerwiseResult
    baseline_ms: dict[str, float]
    ratios: dict[str, float]
    failures: int = 0


@dataclass
class GpuReport:
    """A GPU run, whole or as far as it got (`complete` False: the parts measured so far; `layerwise` None until
    that part ran)."""

    sizes: Sizes
    scenarios: list[GpuScenarioResult]
    layerwise: GpuLayerwiseResult | None
    startup_s: float
    total_s: float
    layouts: list[LayoutResult] = field(default_factory=list)
    device: str = "cuda"  # where the engines kept their KV
    complete: bool = True

    def summary(self) -> dict[str, Any]:
        """The JSON object `kvsvc bench --device cuda --json` ends with (`gpu_summary`)."""
        return gpu_summary(self)


def gpu_summary(report: GpuReport) -> dict[str, Any]:
    """The figures of a GPU run as one JSON-ready object: the headline ratios of the large scenario (kvsvc over
    torch's copy, over Mooncake's TCP, over the plane alone; absent where that baseline did not run), the layer-wise
    figures, each layout's ratio to homogeneous and the mean ms of its staged parts, and every scenario in full.
    `verified` holds only when every scenario and layout measured verified; `failures` sums them all. A report not
    `complete` gives the figures of the parts it has, no others."""
    ratio_keys = {GPU_TORCH: "kvsvc_over_torch_copy", GPU_MOONCAKE: "kvsvc_over_mooncake_tcp",
                  GPU_PLANE: "kvsvc_over_plane"}  # fmt: skip
    found: dict[str, Any] = {"device": report.device, "complete": report.complete, "model": report.sizes.model.name}
    found["reps"] = report.sizes.reps
    large = next((s for s in report.scenarios if s.name == "large"), None)
    if large is not None:
        found["transport"] = large.transport
        found["kvsvc_gbps"] = large.gbps["kvsvc"]
        found |= {f"{key}_gbps": large.gbps[key] for key in (GPU_PLANE, GPU_TORCH, GPU_MOONCAKE) if key in large.gbps}
        found |= {ratio_keys[key]: value for key, value in large.ratios.items()}
    lw = report.layerwise
    if lw is not None:
        found["layerwise_ms"] = lw.layerwise.layer_ms
        found["whole_request_ms"] = lw.layerwise.whole_ms
        found["layerwise_ratio"] = lw.layerwise.ratio
        found["layerwise_baseline_ms"] = dict(lw.baseline_ms)
        found["layerwise_ratios"] = {ratio_keys[k]: v for k, v in lw.ratios.items()}
    return found | {
        "split_over_homogeneous": {x.name: x.ratio_to_homogeneous for x in report.layouts},
        "split_stage_ms": {x.name: x.stage_ms for x in report.layouts if x.stage_ms},
        "verified": all(s.verified for s in report.scenarios) and all(x.verified for x in report.layouts),
        "failures": sum(s.failures for s in report.scenarios)
        + (lw.failures if lw is not None else 0)
        + sum(x.failures for x in report.layouts),
        "startup_s": report.startup_s,
        "total_s": report.total_s,
        "scenarios": {s.name: {k: v for k, v in vars(s).items() if k != "name"} for s in report.scenarios}
        | {x.name: {k: v for k, v in vars(x).items() if k != "name"} for x in report.layouts},
    }


__all__ = [
    "CUDA_IPC",
    "GPU_MOONCAKE",
    "GPU_PLANE",
    "GPU_TORCH",
    "LAYOUT_RATIO_TARGET",
    "STAGE_PARTS",
    "BenchReport",
    "GpuLayerwiseResult",
    "GpuReport",
    "GpuScenarioResult",
    "LayerwiseResult",
    "LayoutResult",
    "ScenarioResult",
    "gpu_summary",
]
