"""What a chaos run is asked (`ChaosOptions`, the faults, the short deadlines) and what it answers (`PhaseResult`,
`ChaosResult` and their JSON). Plain data: `workers.chaos` runs it. Imports the service config and the engine
config only; starts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from kvsvc.service import ServiceConfig
from kvsvc.transport.mooncake import MooncakeConfig
from workers.executor import EngineConfig

FAULTS: Final = ("kill", "freeze", "restart", "cut")
# Faults of the link between two network hosts (`hosts="netns"` only). `hostgone` must come last: it retires the P
# host for good and the run goes on with a replacement P engine on a third host.
NET_FAULTS: Final = ("partition", "loss1", "loss5", "linkdown", "hostgone")
HOSTS: Final = ("local", "netns")


def default_service() -> ServiceConfig:
    """Short deadlines, so a fault's bound is seconds and a run ends by itself."""
    return ServiceConfig(
        hold_timeout_s=10.0,
        recv_timeout_s=5.0,
        early_request_timeout_s=4.0,
        abort_grace_s=15.0,
        handshake_timeout_s=5.0,
        close_drain_timeout_s=10.0,
    )


@dataclass(frozen=True)
class ChaosOptions:
    """One run: the load, the faults and the two engines' layout."""

    requests: int = 10_000  # regular requests over the whole run, split evenly over the phases
    faults: tuple[str, ...] = FAULTS
    concurrency: int = 16
    max_tokens: int = 64
    abort_rate: float = 0.10
    abort_window_s: float = 0.02  # an abort is issued at a uniformly random moment this long after the submit
    probes: int = 4  # parked receives started just before each fault
    freeze_s: float = 6.0
    outage_s: float = 4.0  # how long a partition or a link down lasts before it heals
    loss_s: float = 6.0  # how long packet loss lasts, load going on meanwhile
    hosts: str = "local"  # "netns": P and D on separate network hosts (`kvsvc.engine.netns`), for NET_FAULTS
    staging_bytes: int = 0  # each worker's staging region: P gathers there, D lends windows (a TP change uses them)
    fault_worker: int = 1  # index of the P worker killed or frozen
    prefill_tp: int = 2
    decode_tp: int = 1
    prefill_block_size: int = 4
    decode_block_size: int = 8
    num_blocks: int = 2048
    seed: int = 0
    timeout_s: float = 1800.0
    service: ServiceConfig = field(default_factory=default_service)
    transport: MooncakeConfig = field(default_factory=MooncakeConfig)  # every worker's Mooncake engine

    def __post_init__(self) -> None:
        unknown = sorted(set(self.faults) - set(FAULTS) - set(NET_FAULTS))
        if unknown:
            raise ValueError(f"unknown faults {unknown}; known: {list(FAULTS + NET_FAULTS)}")
        if self.hosts not in HOSTS:
            raise ValueError(f"hosts must be one of {HOSTS}, got {self.hosts!r}")
        net = [f for f in self.faults if f in NET_FAULTS]
        if net and self.hosts != "netns":
            raise ValueError(f"faults {net} act on a network link: they need hosts='netns' (--hosts netns)")
        if "hostgone" in self.faults and self.faults.index("hostgone") != len(self.faults) - 1:
            raise ValueError("hostgone retires the P host for good: it must be the last fault")
        if not 0 <= self.abort_rate <= 1:
            raise ValueError(f"abort_rate must be in [0, 1], got {self.abort_rate}")
        if self.requests < 1 or self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("requests, concurrency and max_tokens must be >= 1")
        if self.outage_s <= 0 or self.loss_s <= 0 or self.freeze_s <= 0:
            raise ValueError(
                f"outage_s, loss_s and freeze_s must be > 0, got {self.outage_s}, {self.loss_s}, {self.freeze_s}"
            )
        if not 0 <= self.fault_worker < self.prefill_tp:
            raise ValueError(f"fault_worker {self.fault_worker} is not a P worker (prefill_tp {self.prefill_tp})")

    def fault_bound_s(self, fault: str) -> float:
        """The longest a request hit by `fault` may take to be reported failed, from the fault: the receive
        deadline, then the abort grace (a frozen or unreachable P cannot confirm), then a handshake; plus the
        outage itself for a freeze, a partition or a link down (P confirms the abort once it is back), and the
        loss window for packet loss (requests submitted during it count as hit)."""
        service = self.service
        bound = service.recv_timeout_s + service.abort_grace_s + service.handshake_timeout_s
        extra = {"freeze": self.freeze_s, "partition": self.outage_s, "linkdown": self.outage_s}
        extra |= {"loss1": self.loss_s, "loss5": self.loss_s}
        return bound + extra.get(fault, 0.0)

    def engine_configs(self) -> tuple[EngineConfig, EngineConfig]:
        common: dict[str, Any] = dict(
            num_layers=4, num_kv_heads=4, head_size=16, num_blocks=self.num_blocks, transport=self.transport
        )
        return (
            EngineConfig(
                engine_id="chaos-p",
                role="prefill",
                tp_size=self.prefill_tp,
                block_size=self.prefill_block_size,
                service=self.service,
                staging_bytes=self.staging_bytes,
                **common,
            ),
            EngineConfig(
                engine_id="chaos-d",
                role="decode",
                tp_size=self.decode_tp,
                block_size=self.decode_block_size,
                service=self.service,
                staging_bytes=self.staging_bytes,
                **common,
            ),
        )


@dataclass
class PhaseResult:
    """What one phase (plain load, or load with one fault) did. Times in seconds; `fail_s` is the longest time
    from the fault to the report of a request it made fail."""

    name: str
    requests: int = 0
    finished: int = 0
    verified: int = 0
    failed: int = 0
    aborted_p: int = 0
    aborted_d: int = 0
    affected: int = 0  # receives in flight (probes included) when the fault hit
    affected_failed: int = 0
    probes: int = 0
    probes_failed: int = 0
    after_fault: int = 0  # regular requests submitted once the fault was over
    after_fault_finished: int = 0
    p_lost_in_restart: int = 0
    packets_dropped: int | None = None  # partition, loss: what the fault's firewall rules dropped
    link_bytes_during: int | None = None  # partition, linkdown: bytes P's link sent while the fault lasted
    hit_failed_not_aborted: int = 0  # regular receives the fault made fail (no abort asked, not a probe)
    reasons: dict[str, int] = field(default_factory=dict)  # why those failed, counted (the first few reasons)
    fail_s: float | None = None
    bound_s: float | None = None
    recovery_s: float | None = None  # from the fault to the first later request that finished verified
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@dataclass
class ChaosResult:
    options: ChaosOptions
    phases: list[PhaseResult] = field(default_factory=list)
    requests_lost: int = 0  # submitted but never reported by one of the engines
    holds_leaked: int = 0  # sum of every worker's `holds` after the run settled
    p_blocks_leaked: int = 0
    d_blocks_leaked: int = 0
    duplicate_reports: int = 0  # ids an engine reported that it did not wait for (a repeat)
    late_reports_ignored: int = 0  # the aggregators' count of repeats after an id completed
    seconds: float = 0.0
    startup_seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        leaks = self.requests_lost + self.holds_leaked + self.p_blocks_leaked + self.d_blocks_leaked
        return not self.errors and leaks == 0 and self.duplicate_reports == 0 and self.late_reports_ignored == 0

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "requests": sum(p.requests for p in self.phases),
            "verified": sum(p.verified for p in self.phases),
            "failed": sum(p.failed for p in self.phases),
            "requests_lost": self.requests_lost,
            "holds_leaked": self.holds_leaked,
            "p_blocks_leaked": self.p_blocks_leaked,
            "d_blocks_leaked": self.d_blocks_leaked,
            "duplicate_reports": self.duplicate_reports,
            "late_reports_ignored": self.late_reports_ignored,
            "seconds": round(self.seconds, 3),
            "startup_seconds": round(self.startup_seconds, 3),
            "phases": [p.to_json() for p in self.phases],
            "errors": self.errors[:20],
        }


__all__ = ["FAULTS", "HOSTS", "NET_FAULTS", "ChaosOptions", "ChaosResult", "PhaseResult", "default_service"]
