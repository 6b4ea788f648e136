"""`kvsvc bench --json` on tiny sizes: it runs every scenario and baseline and ends stdout with one JSON object that
holds every headline key with a sane type. Never asserts a figure against a target (benchmarks print, tests check
shape).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest

from workers.bench.report import TARGETS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NUMBERS = (
    "ratio_to_raw",
    "ratio_to_peer_style",
    "ratio_to_memcpy",
    "small_ratio_to_raw",
    "small_requests_per_s",
    "small_raw_requests_per_s",
    "descriptors_per_request",
    "raw_gbps",
    "kvsvc_gbps",
    "peer_style_gbps",
    "memcpy_gbps",
    "layerwise_ms",
    "whole_request_ms",
    "layerwise_ratio",
)
SCENARIO_NUMBERS = ("kvsvc_gbps", "raw_gbps", "peer_gbps", "p50_ms", "p99_ms", "kvsvc_cpu_s_per_gb")


def bench_json(*args: str, timeout_s: float) -> dict[str, Any]:
    """`kvsvc bench ARGS --tiny --json` in a process of its own: the JSON object ending its stdout (exit 0 asserted)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvsvc.cli", "bench", *args, "--tiny", "--json"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return summary


def test_bench_json_has_every_key_with_sane_types() -> None:
    summary = bench_json("--quick", timeout_s=170)
    for key in NUMBERS:
        value = summary[key]
        assert isinstance(value, int | float) and not isinstance(value, bool), key
        assert math.isfinite(value) and value > 0, (key, value)
    assert summary["verified"] is True
    assert summary["model"] == "tiny" and summary["reps"] == summary["small_reps"] == summary["hetero_reps"] == 1
    assert summary["failures"] == 0
    layouts = {"hetero_tp_up", "hetero_tp_down", "block_mismatch", "nhd_hetero_tp"}
    assert set(summary["scenarios"]) == {"large", "small", "hetero_tp"} | layouts
    targets = summary["targets"]
    # The descriptor bound is a target where a descriptor is dear: on Mooncake, not on the same-host plane.
    bounded = summary["transport"] == "mooncake"
    kinds = ("ratio_to_homogeneous", "descriptors_per_request") if bounded else ("ratio_to_homogeneous",)
    layout_targets = {f"{n}.{k}" for n in layouts for k in kinds}
    assert set(targets) == {name for name, _, _ in TARGETS} | layout_targets
    for name in layouts:
        layout = summary["scenarios"].pop(name)
        assert layout["verified"] is True and layout["failures"] == 0, name
        for key in ("ratio_to_homogeneous", "descriptors_per_request", "descriptor_bound_per_request", "cpu_s_per_gb"):
            assert math.isfinite(layout[key]) and layout[key] > 0, (name, key)
        assert layout["descriptors_per_request"] <= layout["direct_descriptors_per_request"], name
        for key in ("machine_busy", "homogeneous_machine_busy"):  # a share of ticks read around every round
            assert 0 <= layout[key] <= 1, (name, key, layout[key])
        assert math.isfinite(layout["cpu_ceiling_ratio"]) and layout["cpu_ceiling_ratio"] > 0, name
        for split in ("cpu_split_s_per_gb", "homogeneous_cpu_split_s_per_gb"):  # every kind of thread ran
            assert set(layout[split]) == {"p_loop", "p_threads", "d_loop", "d_threads"}, (name, split)
            # D's other threads (Mooncake's) may do nothing at all when P copies over the same-host plane.
            assert all(math.isfinite(v) and v >= 0 for v in layout[split].values()), (name, split, layout[split])
            assert layout[split]["p_loop"] > 0 and layout[split]["d_loop"] > 0, (name, split, layout[split])
        assert (
            not bounded or targets[f"{name}.descriptors_per_request"]["bound"] == layout["descriptor_bound_per_request"]
        )
    assert all(isinstance(t["met"], bool) and math.isfinite(t["value"]) for t in targets.values())
    assert targets["descriptors_per_request"]["bound"] == summary["scenarios"]["large"]["run_bound_per_request"]
    assert summary["targets_met"] is all(t["met"] for t in targets.values())
    for name, scenario in summary["scenarios"].items():
        for key in SCENARIO_NUMBERS:
            assert isinstance(scenario[key], float) and math.isfinite(scenario[key]), (name, key)
        assert scenario["raw_method"] in ("submit_poll", "batch", "samehost")
        assert scenario["transport"] in ("mooncake", "samehost")
        assert scenario["descriptors_per_request"] <= scenario["naive_descriptors_per_request"]


def test_poll_latency_reports_both_ways_at_every_copy_duration() -> None:
    from workers.bench.poll_latency import DURATIONS_S

    rows = bench_json("--poll-latency", timeout_s=120)["poll_latency"]
    assert {(r["way"], r["copy_us"]) for r in rows} == {
        (way, d * 1e6) for way in ("kvsvc", "loop_timers") for d in DURATIONS_S
    }
    # Every event was seen after it completed (the stand-in's time), never before: a delay is never negative.
    assert all(r["late_us_p50"] >= 0 and r["late_us_p90"] >= r["late_us_p50"] for r in rows)
