"""Prometheus metrics of one engine: a per-engine registry, a collector over statistics snapshots, a latency histogram.

Imports: standard library, prometheus_client and `kvsvc.core.histogram`, nothing of kvsvc's service (statistics arrive
as plain dicts, the shape `statistics_dict` makes of a `ServiceStatistics`). Invariants: never touches
prometheus_client's global registry, so several engines can live in one process; a scrape renders exactly one
snapshot (set and rendered in one synchronous step); keys missing from a snapshot drop their samples, never fail
the scrape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvsvc.core.histogram import TRANSFER_BUCKETS
from kvsvc.core.messages import Worker

StatsDict = Mapping[str, object]
PeerRow = Mapping[str, object]
TransferRole = Literal["P", "D"]
# (role label, the statistics key of that role's `HistogramStatistics`)
DURATIONS: Final[tuple[tuple[TransferRole, str], ...]] = (("P", "send_durations"), ("D", "recv_durations"))
# (part label, the statistics key): P's layer-wise writes (`kvsvc.service.context.ServiceContext.layer_compute`...)
LAYER_WISE: Final[tuple[tuple[str, str], ...]] = (
    ("compute", "layer_compute"),
    ("copy", "layer_copy"),
    ("after_last_layer", "after_last_layer"),
)
# (part label, the statistics key): the parts of staged writes (`kvsvc.service.context.ServiceContext.staged_room`...)
STAGED: Final[tuple[tuple[str, str], ...]] = (
    ("room", "staged_room"),
    ("gather", "staged_gather"),
    ("write", "staged_write"),
    ("round_wait", "round_wait"),
    ("window_room", "window_room"),
    ("scatter", "window_scatter"),
)

# (metric name without `_total`, help, path into the statistics dict). Exported per worker (pp_rank, tp_rank).
COUNTERS: Final[tuple[tuple[str, str, tuple[str, ...]], ...]] = (
    ("kvsvc_sent_bytes", "Bytes P wrote into D workers' KV (completed writes).", ("bytes_sent",)),
    ("kvsvc_sent_descriptors", "Transfer descriptors P submitted in completed writes.", ("descriptors_sent",)),
    ("kvsvc_sent_transfers", "Writes to one D worker that completed.", ("transfers_sent",)),
    ("kvsvc_write_failures", "Writes to a D worker that failed (transport, plan or lost peer).", ("write_failures",)),
    ("kvsvc_protocol_errors", "Malformed or unexpected control frames and refused hellos.", ("protocol_errors",)),
    (
        "kvsvc_reconnects",
        "D's tries to reach a lost P worker again while receives waited on it (to end their wait early).",
        ("reconnects",),
    ),
    (
        "kvsvc_expired_holds",
        "P holds released by their deadline (D never asked for them).",
        ("sender", "expired_holds"),
    ),
    ("kvsvc_aborted_holds", "P holds released by an abort.", ("sender", "aborted_holds")),
    (
        "kvsvc_refused_secrets",
        "Requests, releases and aborts of a held transfer without its secret (a misconfigured or probing D).",
        ("sender", "refused_secrets"),
    ),
    (
        "kvsvc_early_served",
        "D requests that reached P before its hold, served from the hold's start (push mode's overlap).",
        ("sender", "early_served"),
    ),
    ("kvsvc_received_transfers", "Receives that finished with their KV landed.", ("receiver", "finished")),
    ("kvsvc_receive_failures", "Receives that failed (their blocks were reported invalid).", ("receiver", "failed")),
    ("kvsvc_receive_expiries", "Receives failed because a P worker never answered in time.", ("receiver", "expired")),
)
GAUGES: Final[tuple[tuple[str, str, tuple[str, ...]], ...]] = (
    ("kvsvc_holds", "Requests whose KV P holds for sending now.", ("sender", "holds")),
    ("kvsvc_early_requests", "D requests that arrived before P held their transfer.", ("sender", "early_requests")),
    ("kvsvc_receives_in_flight", "Receives D waits for now.", ("receiver", "receives")),
    (
        "kvsvc_receives_waiting_for_handshake",
        "Receives whose P engine's metadata is still being fetched.",
        ("receiver", "waiting_for_handshake"),
    ),
    ("kvsvc_writes_in_flight", "Writes submitted to the transport and not completed.", ("writes_in_flight",)),
    ("kvsvc_remote_engines", "Remote engines whose metadata this worker fetched or is fetching.", ("remote_engines",)),
)


def statistics_dict(stats: object) -> dict[str, object]:
    """The plain-dict form of a `ServiceStatistics` (nested dataclasses become dicts): what `EngineView`
    returns per worker and what this module reads.

    Raises:
        TypeError: `stats` is not a dataclass instance.
    """
    if not dataclasses.is_dataclass(stats) or isinstance(stats, type):
        raise TypeError(f"statistics_dict needs a dataclass instance, got {type(stats).__name__}")
    return dataclasses.asdict(stats)


def _lookup(stats: StatsDict, path: tuple[str, ...]) -> float | None:
    node: object = stats
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    # bool is an int, but a flag is not a count.
    if isinstance(node, int | float) and not isinstance(node, bool):
        return float(node)
    return None


def _worker_labels(worker: Worker) -> list[str]:
    return [str(worker[0]), str(worker[1])]


@dataclass(frozen=True)
class MetricsSnapshot:
    """What one scrape exports: per-worker statistics, per-peer rows (with the local `pp_rank`/`tp_rank`), readiness."""

    statistics: Mapping[Worker, StatsDict] = field(default_factory=dict)
    peers: Sequence[PeerRow] = ()
    ready: bool = False


class _SnapshotCollector(Collector):
    """Turns the latest snapshot into metric families; prometheus_client calls `collect` on every render."""

    def __init__(self, engine_id: str, incarnation: str, role: str) -> None:
        self._info = (engine_id, incarnation, role)
        self.snapshot = MetricsSnapshot()

    def collect(self) -> Iterator[Metric]:
        snapshot = self.snapshot
        info = GaugeMetricFamily(
            "kvsvc_engine_info",
            "This engine: id, incarnation (random per start) and role.",
            labels=["engine_id", "incarnation", "role"],
        )
        info.add_metric(list(self._info), 1.0)
        yield info
        ready = GaugeMetricFamily("kvsvc_ready", "1 when every worker registered its KV and the metadata is served.")
        ready.add_metric([], 1.0 if snapshot.ready else 0.0)
        yield ready
        workers = GaugeMetricFamily("kvsvc_workers", "Workers of this engine that reported statistics.")
        workers.add_metric([], float(len(snapshot.statistics)))
        yield workers
        yield from self._per_worker(snapshot.statistics)
        yield from self._per_peer(snapshot.peers)

    @staticmethod
    def _per_worker(statistics: Mapping[Worker, StatsDict]) -> Iterator[Metric]:
        labels = ["pp_rank", "tp_rank"]
        items = sorted(statistics.items())
        for name, doc, path in COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=labels)
            for worker, stats in items:
                if (value := _lookup(stats, path)) is not None:
                    counter.add_metric(_worker_labels(worker), value)
            yield counter
        for name, doc, path in GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            for worker, stats in items:
                if (value := _lookup(stats, path)) is not None:
                    gauge.add_metric(_worker_labels(worker), value)
            yield gauge
        peers = GaugeMetricFamily(
            "kvsvc_peers",
            "Control connections: to_p (this D worker to P workers), from_d.",
            labels=[*labels, "direction"],
        )
        for worker, stats in items:
            for direction, key in (("to_p", "outbound_peers"), ("from_d", "inbound_peers")):
                if (value := _lookup(stats, (key,))) is not None:
                    peers.add_metric([*_worker_labels(worker), direction], value)
        yield peers
        for side in ("send", "recv"):
            jobs = GaugeMetricFamily(
                f"kvsvc_{side}_jobs",
                f"{side.capitalize()} jobs (one per request and peer worker) by state.",
                labels=[*labels, "state"],
            )
            for worker, stats in items:
                table = stats.get("sender" if side == "send" else "receiver")
                states = table.get("jobs_by_state") if isinstance(table, Mapping) else None
                if isinstance(states, Mapping):
                    for state, count in sorted(states.items()):
                        if isinstance(count, int | float) and not isinstance(count, bool):
                            jobs.add_metric([*_worker_labels(worker), str(state)], float(count))
            yield jobs
        yield _histograms(
            HistogramMetricFamily(
                "kvsvc_transfer_duration_seconds",
                "Transfer durations measured by each worker. P: from a write's start (D's request met the held KV) to"
                " its last byte landed, per D worker; D: from start_recv to the KV landed.",
                labels=["pp_rank", "tp_rank", "role"],
            ),
            items,
            DURATIONS,
        )
        yield _histograms(
            HistogramMetricFamily(
                "kvsvc_layer_wise_seconds",
                "P's layer-wise writes: compute, from one layer's KV computed to the next one's (writes that waited"
                " for their layers); copy, from a layer's KV computed to its bytes landed; after_last_layer, from the"
                " last layer's KV computed to the write's last byte landed.",
                labels=["pp_rank", "tp_rank", "part"],
            ),
            items,
            LAYER_WISE,
        )
        yield _histograms(
            HistogramMetricFamily(
                "kvsvc_staged_seconds",
                "The parts of writes through staging regions, each timed when it completed; they overlap. P, per"
                " chunk: room, its wait for room in P's region; gather, its copy there; write, from there to its bytes"
                " landed on D. P, a share written in rounds into D's window: round_wait, each wait for D to empty half"
                " of it. D: window_room, a window's wait for room; scatter, a round's copy from the window into the"
                " blocks.",
                labels=["pp_rank", "tp_rank", "part"],
            ),
            items,
            STAGED,
        )

    @staticmethod
    def _per_peer(peers: Sequence[PeerRow]) -> Iterator[Metric]:
        handshakes = GaugeMetricFamily(
            "kvsvc_handshakes",
            "This D worker's control connections to P workers by handshake state (connecting, connected, failed).",
            labels=["pp_rank", "tp_rank", "state"],
        )
        peer_up = GaugeMetricFamily(
            "kvsvc_peer_connected",
            "1 per control connection that is up, 0 while it connects or after it failed; labelled by the peer.",
            labels=["pp_rank", "tp_rank", "direction", "peer", "incarnation"],
        )
        counts: dict[tuple[str, str, str], int] = {}
        # Rows shown without the admin token name a peer by its ranks alone, so several may share labels: summed.
        up: dict[tuple[str, ...], float] = {}
        for row in peers:
            local = [str(row.get("pp_rank", "")), str(row.get("tp_rank", ""))]
            state = str(row.get("state", ""))
            direction = str(row.get("direction", ""))
            if direction == "to_p":
                key = (local[0], local[1], state)
                counts[key] = counts.get(key, 0) + 1
            value = 1.0 if state == "connected" else 0.0
            if "peer" in row:
                peer_up.add_metric([*local, direction, str(row["peer"]), str(row.get("incarnation", ""))], value)
                continue
            labels = (*local, direction, f"[pp{row.get('peer_pp_rank', '')},tp{row.get('peer_tp_rank', '')}]", "")
            up[labels] = up.get(labels, 0.0) + value
        for labels, total in up.items():
            peer_up.add_metric(list(labels), total)
        for (pp, tp, state), count in sorted(counts.items()):
            handshakes.add_metric([pp, tp, state], float(count))
        yield handshakes
        yield peer_up


def _histograms(
    family: HistogramMetricFamily, items: Sequence[tuple[Worker, StatsDict]], series: Sequence[tuple[str, str]]
) -> Metric:
    """`family` from the histograms each worker keeps (`kvsvc.core.histogram`): one series per (label, statistics key)
    of `series` and worker."""
    for worker, stats in items:
        for role, key in series:
            hist = stats.get(key)
            if not isinstance(hist, Mapping):
                continue
            bounds, counts, total = hist.get("bounds"), hist.get("counts"), hist.get("total")
            if not isinstance(bounds, Sequence) or not isinstance(counts, Sequence) or len(counts) != len(bounds) + 1:
                continue
            cumulative, buckets = 0, []
            try:
                for bound, count in zip([*bounds, float("inf")], counts, strict=True):
                    cumulative += int(count)
                    buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(cumulative)))
                total_s = float(total or 0.0)
            except (TypeError, ValueError):  # a malformed snapshot drops the series, never the scrape
                continue
            family.add_metric([*_worker_labels(worker), role], buckets, total_s)
    return family


class EngineMetrics:
    """The metrics of one engine, in their own `CollectorRegistry` (`self.registry`).

    The admin app's `/metrics` handler reads the engine's statistics, hands them over with `render(snapshot)`,
    and serves the text. Transfer durations come from the workers' own histograms in those statistics, so an
    engine core feeds nothing; an embedding engine may register metrics of its own in `registry`.
    """

    def __init__(self, engine_id: str, incarnation: str, role: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = _SnapshotCollector(engine_id, incarnation, role)
        self.registry.register(self._collector)

    def render(self, snapshot: MetricsSnapshot) -> bytes:
        """The Prometheus text exposition of `snapshot`. Raises nothing of its own.

        Setting the snapshot and rendering happen without an await between them, so concurrent scrapes on one
        event loop never mix two snapshots. Other exporters of `registry` see the last snapshot rendered.
        """
        self._collector.snapshot = snapshot
        return generate_latest(self.registry)


__all__ = [
    "COUNTERS",
    "GAUGES",
    "TRANSFER_BUCKETS",
    "EngineMetrics",
    "MetricsSnapshot",
    "statistics_dict",
]
