"""Specification of kvsvc.engine.metrics: per-engine registries, the snapshot collector, the workers' histograms."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvsvc.core.histogram import LatencyHistogram
from kvsvc.engine.metrics import COUNTERS, GAUGES, EngineMetrics, MetricsSnapshot, statistics_dict


@dataclass(frozen=True)
class _Sender:
    holds: int = 2
    early_requests: int = 1
    jobs_by_state: dict[str, int] = field(default_factory=lambda: {"writing": 1, "waiting": 3})
    finished_pending_report: int = 0
    expired_holds: int = 7
    aborted_holds: int = 1
    refused_secrets: int = 4
    early_served: int = 3


@dataclass(frozen=True)
class _Receiver:
    receives: int = 5
    waiting_for_handshake: int = 2
    jobs_by_state: dict[str, int] = field(default_factory=lambda: {"requested": 5})
    finished: int = 11
    failed: int = 3
    expired: int = 2


@dataclass(frozen=True)
class _Stats:
    """The shape of `ServiceStatistics`, without importing the service."""

    sender: _Sender = field(default_factory=_Sender)
    receiver: _Receiver = field(default_factory=_Receiver)
    inbound_peers: int = 1
    outbound_peers: int = 2
    remote_engines: int = 1
    writes_in_flight: int = 4
    bytes_sent: int = 1 << 20
    descriptors_sent: int = 32
    transfers_sent: int = 8
    write_failures: int = 1
    protocol_errors: int = 2
    reconnects: int = 3
    transport: dict[str, int] = field(default_factory=dict)


def samples(metrics: EngineMetrics, snapshot: MetricsSnapshot) -> dict[str, list[Sample]]:
    text = metrics.render(snapshot).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def by_worker(family: list[Sample]) -> dict[tuple[str, str], float]:
    return {(s.labels["pp_rank"], s.labels["tp_rank"]): s.value for s in family}


def test_statistics_dict_flattens_nested_dataclasses() -> None:
    d = statistics_dict(_Stats())
    assert d["bytes_sent"] == 1 << 20
    assert d["sender"] == {
        "holds": 2,
        "early_requests": 1,
        "jobs_by_state": {"writing": 1, "waiting": 3},
        "finished_pending_report": 0,
        "expired_holds": 7,
        "aborted_holds": 1,
        "refused_secrets": 4,
        "early_served": 3,
    }
    with pytest.raises(TypeError, match="dataclass instance"):
        statistics_dict({"bytes_sent": 1})


def test_every_documented_metric_is_exported_per_worker() -> None:
    metrics = EngineMetrics("p", "inc", "P")
    stats = {(0, 0): statistics_dict(_Stats()), (1, 0): statistics_dict(_Stats(bytes_sent=5))}
    got = samples(metrics, MetricsSnapshot(stats, [], ready=True))
    for name, _, _ in (*COUNTERS, *GAUGES):
        assert set(by_worker(got[name])) == {("0", "0"), ("1", "0")}, name
    assert by_worker(got["kvsvc_sent_bytes"]) == {("0", "0"): float(1 << 20), ("1", "0"): 5.0}
    assert by_worker(got["kvsvc_expired_holds"])[("0", "0")] == 7.0
    assert by_worker(got["kvsvc_refused_secrets"])[("0", "0")] == 4.0
    assert by_worker(got["kvsvc_receive_failures"])[("0", "0")] == 3.0
    assert by_worker(got["kvsvc_receive_expiries"])[("0", "0")] == 2.0
    assert by_worker(got["kvsvc_receives_in_flight"])[("0", "0")] == 5.0
    assert by_worker(got["kvsvc_writes_in_flight"])[("0", "0")] == 4.0
    assert [s.value for s in got["kvsvc_ready"]] == [1.0]
    assert [s.value for s in got["kvsvc_workers"]] == [2.0]
    [info] = got["kvsvc_engine_info"]
    assert info.labels == {"engine_id": "p", "incarnation": "inc", "role": "P"}


def test_counters_are_exposed_with_a_total_suffix() -> None:
    text = EngineMetrics("p", "i", "P").render(MetricsSnapshot({(0, 0): statistics_dict(_Stats())})).decode()
    assert 'kvsvc_sent_bytes_total{pp_rank="0",tp_rank="0"} 1.048576e+06' in text
    # prometheus_client names the family with or without the suffix depending on its version.
    assert re.search(r"^# TYPE kvsvc_sent_bytes(_total)? counter$", text, re.MULTILINE)


def test_job_states_and_peer_directions_become_labels() -> None:
    got = samples(EngineMetrics("p", "i", "P"), MetricsSnapshot({(0, 1): statistics_dict(_Stats())}))
    assert {s.labels["state"]: s.value for s in got["kvsvc_send_jobs"]} == {"waiting": 3.0, "writing": 1.0}
    assert {s.labels["state"]: s.value for s in got["kvsvc_recv_jobs"]} == {"requested": 5.0}
    assert {s.labels["direction"]: s.value for s in got["kvsvc_peers"]} == {"to_p": 2.0, "from_d": 1.0}


def test_peer_rows_give_handshake_states_and_per_peer_connection_gauges() -> None:
    peers = [
        {"pp_rank": 0, "tp_rank": 0, "direction": "to_p", "peer": "p[pp0,tp0]", "incarnation": "a", "state": s}
        for s in ("connected", "connecting", "connected")
    ] + [
        {
            "pp_rank": 0,
            "tp_rank": 0,
            "direction": "from_d",
            "peer": "d[pp0,tp0]",
            "incarnation": "b",
            "state": "connected",
        }
    ]
    got = samples(EngineMetrics("p", "i", "both"), MetricsSnapshot({}, peers))
    assert {s.labels["state"]: s.value for s in got["kvsvc_handshakes"]} == {"connected": 2.0, "connecting": 1.0}
    up = [(s.labels["direction"], s.labels["peer"], s.value) for s in got["kvsvc_peer_connected"]]
    assert ("from_d", "d[pp0,tp0]", 1.0) in up and ("to_p", "p[pp0,tp0]", 0.0) in up


def test_missing_or_non_numeric_keys_drop_samples_not_the_scrape() -> None:
    partial = {"bytes_sent": 9, "sender": {"holds": True}, "receiver": "oops", "write_failures": "x"}
    got = samples(EngineMetrics("p", "i", "P"), MetricsSnapshot({(0, 0): partial}))
    assert by_worker(got["kvsvc_sent_bytes"]) == {("0", "0"): 9.0}
    assert got.get("kvsvc_holds", []) == [] and got.get("kvsvc_write_failures", []) == []


def test_each_render_shows_only_the_latest_snapshot() -> None:
    metrics = EngineMetrics("p", "i", "P")
    samples(metrics, MetricsSnapshot({(0, 0): {"bytes_sent": 1}, (0, 1): {"bytes_sent": 2}}))
    got = samples(metrics, MetricsSnapshot({(0, 1): {"bytes_sent": 3}}))
    assert by_worker(got["kvsvc_sent_bytes"]) == {("0", "1"): 3.0}


def test_transfer_durations_come_from_each_workers_histogram() -> None:
    d_hist = LatencyHistogram()
    for seconds in (0.002, 0.2, 3.0):
        d_hist.observe(seconds)
    stats = {"send_durations": asdict(LatencyHistogram().statistics()), "recv_durations": asdict(d_hist.statistics())}
    got = samples(EngineMetrics("p", "i", "both"), MetricsSnapshot({(0, 1): stats}))
    rows = got["kvsvc_transfer_duration_seconds"]
    d = {(s.name, s.labels.get("le")): s.value for s in rows if s.labels["role"] == "D"}
    assert d[("kvsvc_transfer_duration_seconds_count", None)] == 3.0
    assert d[("kvsvc_transfer_duration_seconds_bucket", "0.25")] == 2.0
    assert d[("kvsvc_transfer_duration_seconds_bucket", "+Inf")] == 3.0
    assert d[("kvsvc_transfer_duration_seconds_sum", None)] == pytest.approx(3.202)
    assert {(s.labels["pp_rank"], s.labels["tp_rank"]) for s in rows} == {("0", "1")}
    p = {s.name: s.value for s in rows if s.labels["role"] == "P"}
    assert p["kvsvc_transfer_duration_seconds_count"] == 0.0


def test_staged_parts_come_from_p_s_chunks_and_d_s_scatters() -> None:
    gather, scatter = LatencyHistogram(), LatencyHistogram()
    for seconds in (0.0004, 0.003):
        gather.observe(seconds)
    scatter.observe(0.02)
    stats = {"staged_gather": asdict(gather.statistics()), "window_scatter": asdict(scatter.statistics())}
    got = samples(EngineMetrics("p", "i", "both"), MetricsSnapshot({(0, 0): stats}))
    counts = {s.labels["part"]: s.value for s in got["kvsvc_staged_seconds"] if s.name == "kvsvc_staged_seconds_count"}
    assert counts == {"gather": 2.0, "scatter": 1.0}  # a part a worker has no statistics for is left out


def test_a_malformed_histogram_drops_its_series_and_never_fails_the_scrape() -> None:
    bad = {"send_durations": {"bounds": [0.1], "counts": [1]}, "recv_durations": "nonsense"}
    got = samples(EngineMetrics("p", "i", "both"), MetricsSnapshot({(0, 0): bad}))
    assert got.get("kvsvc_transfer_duration_seconds", []) == []
    bad = {"send_durations": {"bounds": ["x"], "counts": [1, "two"], "total": "none"}}
    got = samples(EngineMetrics("p", "i", "both"), MetricsSnapshot({(0, 0): bad}))
    assert got.get("kvsvc_transfer_duration_seconds", []) == []


def test_engines_in_one_process_have_separate_registries_and_leave_the_global_one_alone() -> None:
    before = prometheus_client.generate_latest(prometheus_client.REGISTRY)
    a, b = EngineMetrics("a", "1", "P"), EngineMetrics("b", "2", "D")
    hist = LatencyHistogram()
    hist.observe(1.0)
    samples(a, MetricsSnapshot({(0, 0): {"send_durations": asdict(hist.statistics())}}))
    assert a.registry is not b.registry
    got_b = samples(b, MetricsSnapshot())
    assert [s.value for s in got_b.get("kvsvc_transfer_duration_seconds", []) if s.name.endswith("_count")] == []
    assert b"kvsvc_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)
    assert before.count(b"kvsvc_") == 0


def test_metric_names_are_kvsvc_prefixed_and_documented() -> None:
    text = EngineMetrics("p", "i", "P").render(MetricsSnapshot({(0, 0): statistics_dict(_Stats())})).decode()
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("kvsvc_"), family.name
        assert family.documentation, family.name
