"""kvsvc's stats on vLLM's side (`KvsvcStats`, `KvsvcPromMetrics`): the workers' and the engine core's stats
aggregate (counters summed, per-request samples concatenated), and each sample lands in its bounded series."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from kvsvc.core.messages import FAILURE_CAUSES
from kvsvc.vllm.connector import KvsvcPromMetrics, KvsvcStats

LABELS = ["model_name", "engine"]


def _metrics(registry: CollectorRegistry) -> KvsvcPromMetrics:
    types: dict[type[Any], Any] = {
        prometheus_client.Gauge: functools.partial(prometheus_client.Gauge, registry=registry),
        prometheus_client.Counter: functools.partial(prometheus_client.Counter, registry=registry),
        prometheus_client.Histogram: functools.partial(prometheus_client.Histogram, registry=registry),
    }
    config: Any = SimpleNamespace(kv_transfer_config=None)
    return KvsvcPromMetrics(config, types, LABELS, {0: ["m", "0"], 1: ["m", "1"]})


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"model_name": "m", **labels})
    return 0.0 if value is None else value


def test_stats_of_two_workers_sum_counters_and_concatenate_samples() -> None:
    a = KvsvcStats(data={"bytes": 10, "loads": [[0.1, 0.0, 0.05, 0.05, 1e6]]})
    b = KvsvcStats(data={"bytes": 5, "load_failed_expired": 1, "loads": [[0.2, 0.1, 0.05, 0.05, 2e6]]})
    merged = a.aggregate(b)
    assert isinstance(merged, KvsvcStats)
    assert merged.data == {
        "bytes": 15,
        "load_failed_expired": 1,
        "loads": [[0.1, 0.0, 0.05, 0.05, 1e6], [0.2, 0.1, 0.05, 0.05, 2e6]],
    }
    assert merged.reduce() == {"bytes": 15, "load_failed_expired": 1, "loads": 2, "mean load ms": 150.0}
    assert KvsvcStats().is_empty() and not merged.is_empty()


def test_each_load_lands_in_its_phase_bytes_and_speed_series_of_its_engine_and_failures_under_their_cause() -> None:
    registry = CollectorRegistry()
    metrics = _metrics(registry)
    metrics.observe(
        {
            "bytes": 100,
            "loads": [[0.4, 0.1, 0.1, 0.2, 4e8], [0.01, 0.0, 0.005, 0.0, 1e3]],
            "load_failed_transport": 2,
            "load_failed_refused_params": 1,
            "computed_locally": 1,
            "ttft_kv_share": [0.25],
            "unknown_key": 7,
        },
        engine_idx=1,
    )
    engine = {"engine": "1"}
    assert _value(registry, "kvsvc_sent_bytes_total", **engine) == 100
    assert _value(registry, "kvsvc_load_seconds_count", phase="total", **engine) == 2
    assert _value(registry, "kvsvc_load_seconds_sum", phase="total", **engine) == pytest.approx(0.41)
    assert _value(registry, "kvsvc_load_seconds_sum", phase="handshake", **engine) == pytest.approx(0.1)
    assert _value(registry, "kvsvc_load_seconds_sum", phase="queue", **engine) == pytest.approx(0.105)
    assert _value(registry, "kvsvc_load_seconds_sum", phase="write", **engine) == pytest.approx(0.2)
    assert _value(registry, "kvsvc_load_bytes_sum", **engine) == pytest.approx(4e8 + 1e3)
    # A load P did not time has no speed: one observation, 2 GB/s.
    assert _value(registry, "kvsvc_load_gbps_count", **engine) == 1
    assert _value(registry, "kvsvc_load_gbps_sum", **engine) == pytest.approx(2.0)
    assert _value(registry, "kvsvc_load_failures_total", cause="transport", **engine) == 2
    assert _value(registry, "kvsvc_load_failures_total", cause="refused_params", **engine) == 1
    assert _value(registry, "kvsvc_computed_locally_total", **engine) == 1
    assert _value(registry, "kvsvc_ttft_kv_share_sum", **engine) == pytest.approx(0.25)
    assert _value(registry, "kvsvc_load_seconds_count", phase="total", engine="0") == 0  # the other engine's


def test_the_series_are_bounded_whatever_the_stats_say() -> None:
    registry = CollectorRegistry()
    metrics = _metrics(registry)
    before = {(s.name, tuple(sorted(s.labels.items()))) for m in registry.collect() for s in m.samples}
    metrics.observe({f"load_failed_{i}": 1 for i in range(50)} | {"loads": [[0.1, 0, 0, 0.1, 1.0]]}, engine_idx=0)
    metrics.observe({"bytes": 1}, engine_idx=7)  # an engine vLLM did not name: nothing
    after = {(s.name, tuple(sorted(s.labels.items()))) for m in registry.collect() for s in m.samples}
    assert after == before
    causes = {s.labels["cause"] for m in registry.collect() for s in m.samples if "cause" in s.labels}
    assert causes == {*FAILURE_CAUSES, "refused_params"}
