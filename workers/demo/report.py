"""What `kvsvc demo` prints at the end of a run: the summary rows and the rich table around them.

Imports the standard library and `workers.stats` at module level, rich only inside `summary_table`; reads a
`workers.demo.runner.DemoResult` and changes nothing. Rule: the latency rows use `workers.stats.percentile` (nearest
rank), the same function as the JSON result and the bench, so every p99 the project prints means the same thing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.stats import percentile

PLANE_NAMES = {
    "samehost": "same-host plane (process_vm_writev)",
    "cuda_ipc": "GPU plane (CUDA IPC)",
    "mooncake": "Mooncake (TCP)",
}

if TYPE_CHECKING:
    from rich.table import Table

    from workers.demo.runner import DemoResult


def format_bytes(count: int) -> str:
    """`count` bytes in binary units with three significant figures ("1.5 KiB", "1 GiB", "512 B"). Raises nothing."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{count} B" if unit == "B" else f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def summary_rows(result: DemoResult) -> list[tuple[str, str]]:
    """(metric, value) rows of the final table. Raises nothing."""

    def ms(q: float) -> str:
        return f"{percentile(result.latencies_ms, q):.1f} ms" if result.latencies_ms else "-"

    return [
        ("requests", f"{result.requests}" + (f" ({result.failed} failed)" if result.failed else "")),
        ("verified", f"{result.verified} / {result.requests}"),
        ("bytes", f"{format_bytes(result.bytes)} ({result.bytes:,})"),
        ("seconds", f"{result.seconds:.2f} (engines started in {result.startup_seconds:.1f})"),
        ("transfer seconds", f"{result.transfer_seconds:.2f}"),
        ("goodput", f"{result.goodput_gbps:.3f} GB/s"),
        ("latency p50", ms(50)),
        ("latency p99", ms(99)),
        ("descriptors", f"{result.descriptors:,}"),
        ("hosts", ", ".join(f"{role} {address}" for role, address in result.hosts.items()) or "-"),
        ("transport", " + ".join(PLANE_NAMES.get(p, p) for p in result.planes) or "-"),
        *_comparison_rows(result),
    ]


def _comparison_rows(result: DemoResult) -> list[tuple[str, str]]:
    base = result.homogeneous
    if base is None:
        return []
    ratio = result.ratio_to_homogeneous
    checked = f"{base.verified} / {base.requests} verified" + ("" if base.ok else ", FAILED")
    return [
        ("homogeneous goodput", f"{base.goodput_gbps:.3f} GB/s ({checked}; {base.descriptors:,} descriptors)"),
        ("ratio to homogeneous", "-" if ratio is None else f"{ratio:.2f}"),
    ]


def summary_table(result: DemoResult) -> Table:
    """The rich table printed at the end of a run."""
    from rich.table import Table

    table = Table(show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for metric, value in summary_rows(result):
        table.add_row(metric, value)
    status = "[green]OK: every byte verified on every D worker[/]" if result.ok else "[red]FAILED[/]"
    if result.failure_reasons:
        # The first distinct reasons, so a layout the engines cannot share reads as that, not as N failures.
        reasons = [f"{count} x {why}" for why, count in list(result.failure_reasons.items())[:3]]
        table.caption = f"{status}: receives failed:\n" + "\n".join(reasons)
    else:
        table.caption = status if not result.errors else f"{status}: {result.errors[0]}"
    return table


__all__ = ["format_bytes", "summary_rows", "summary_table"]
