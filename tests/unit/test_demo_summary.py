"""The pure helpers of `kvsvc demo`: byte formatting, the summary rows and the JSON result (its percentiles are
`workers.stats.percentile`, tested in `test_stats`)."""

from __future__ import annotations

import pytest

from workers.demo.report import format_bytes, summary_rows
from workers.demo.runner import DemoOptions, DemoResult


@pytest.mark.parametrize(
    ("count", "text"),
    [(0, "0 B"), (512, "512 B"), (1536, "1.5 KiB"), (16 * 2**20, "16 MiB"), (2**30, "1 GiB"), (300 * 2**30, "300 GiB")],
)
def test_format_bytes_uses_binary_units(count: int, text: str) -> None:
    assert format_bytes(count) == text


def test_result_is_ok_only_when_every_request_finished_and_verified() -> None:
    assert DemoResult(requests=2, finished=2, verified=2).ok
    assert not DemoResult(requests=2, finished=2, verified=1).ok
    assert not DemoResult(requests=2, finished=1, failed=1, verified=1).ok
    assert not DemoResult(requests=2, finished=2, verified=2, errors=["late"]).ok
    assert not DemoResult(requests=0).ok


def test_json_carries_the_documented_keys_and_goodput_over_transfer_seconds_in_gb_per_s() -> None:
    result = DemoResult(
        requests=2, finished=2, verified=2, bytes=10**9, kv_bytes=2 * 10**9, seconds=9.0, transfer_seconds=4.0
    )
    result.latencies_ms.extend([10.0, 30.0])
    payload = result.to_json(DemoOptions())
    keys = ("ok", "requests", "verified", "bytes", "seconds", "transfer_seconds", "goodput_gbps", "p50_ms", "p99_ms")
    for key in (*keys, "descriptors"):
        assert key in payload
    assert "homogeneous" not in payload and "ratio_to_homogeneous" not in payload
    assert payload["ok"] is True
    assert payload["goodput_gbps"] == 0.5
    assert payload["p50_ms"] == 30.0  # nearest rank: the upper of two
    assert "P pp2×tp1" in payload["layout"]


def test_a_comparison_carries_the_homogeneous_run_its_layout_and_the_ratio() -> None:
    options = DemoOptions(prefill_pp=3, prefill_tp=2, decode_pp=2, decode_tp=4, decode_block_size=32)
    result = DemoResult(requests=2, finished=2, verified=2, kv_bytes=3 * 10**9, transfer_seconds=2.0)
    result.homogeneous = DemoResult(requests=2, finished=2, verified=2, kv_bytes=3 * 10**9, transfer_seconds=1.5)
    payload = result.to_json(options)
    assert payload["ratio_to_homogeneous"] == 0.75
    assert payload["homogeneous"]["goodput_gbps"] == 2.0
    assert "D pp3×tp2 (block 16)" in payload["homogeneous"]["layout"]
    rows = dict(summary_rows(result))
    assert rows["ratio to homogeneous"] == "0.75"
    assert rows["homogeneous goodput"].startswith("2.000 GB/s (2 / 2 verified")
    assert result.ok
    result.homogeneous.errors.append("a check failed")
    assert not result.ok  # a failed comparison run fails the command


def test_the_homogeneous_options_lay_d_out_as_p_and_keep_the_bytes() -> None:
    options = DemoOptions(prefill_pp=1, prefill_tp=4, prefill_block_size=32, decode_pp=3, decode_tp=1)
    mirror = options.homogeneous()
    assert (mirror.decode_pp, mirror.decode_tp, mirror.decode_block_size) == (1, 4, 32)
    assert mirror.request_kv_bytes() == options.request_kv_bytes()
    assert (mirror.prefill_pp, mirror.prefill_tp, mirror.requests, mirror.tokens) == (1, 4, 64, 512)


def test_json_latencies_are_null_when_nothing_finished() -> None:
    payload = DemoResult(requests=3).to_json()
    assert payload["p50_ms"] is None and payload["p99_ms"] is None and payload["ok"] is False


def test_summary_rows_name_every_figure_of_the_table() -> None:
    result = DemoResult(
        requests=4, finished=4, verified=4, bytes=2**20, descriptors=1234, seconds=2.0, transfer_seconds=0.5
    )
    result.latencies_ms.extend([1.0, 2.0, 3.0, 4.0])
    rows = dict(summary_rows(result))
    assert list(rows) == [
        "requests",
        "verified",
        "bytes",
        "seconds",
        "transfer seconds",
        "goodput",
        "latency p50",
        "latency p99",
        "descriptors",
        "hosts",
        "transport",
    ]
    assert rows["hosts"] == rows["transport"] == "-"
    result.planes = ["samehost"]
    assert dict(summary_rows(result))["transport"] == "same-host plane (process_vm_writev)"
    result.hosts = {"prefill": "10.213.0.1", "decode": "10.213.0.2"}
    assert dict(summary_rows(result))["hosts"] == "prefill 10.213.0.1, decode 10.213.0.2"
    assert rows["verified"] == "4 / 4"
    assert rows["bytes"] == "1 MiB (1,048,576)"
    assert rows["descriptors"] == "1,234"
    assert rows["latency p50"] == "3.0 ms"
