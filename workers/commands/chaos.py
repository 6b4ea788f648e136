"""`kvsvc chaos`: load with random aborts plus injected faults (process faults; link faults across two network hosts).

Imports argparse and the standard library at module level; rich and the runtime (`workers.chaos`) only inside
`main_with_args`, so `kvsvc --help` stays fast. Invariants: the run stops by itself (every wait has a deadline,
`--timeout` bounds the whole run) and every worker process is reaped on every exit path, Ctrl-C included; exit code
0 iff nothing was lost or leaked and every finished request verified; with `--json` the last stdout line is the
result object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from kvsvc.core.data_planes import SETTINGS

if TYPE_CHECKING:
    from rich.table import Table

    from workers.chaos import ChaosResult

_FAULT_NAMES: Final = ("kill", "freeze", "restart", "cut")
_NET_FAULT_NAMES: Final = ("partition", "loss1", "loss5", "linkdown", "hostgone")  # workers.chaos_spec.NET_FAULTS


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _faults(text: str) -> tuple[str, ...] | None:
    """None for "all" (which faults depends on --hosts)."""
    if text in ("", "none"):
        return ()
    if text == "all":
        return None
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    known = _FAULT_NAMES + _NET_FAULT_NAMES
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown faults {unknown}; choose from {', '.join(known)}")
    return names


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "chaos",
        help="load with random aborts and injected faults on a P and a D engine; audits losses and leaks",
        description="Starts a P engine and a D engine (worker processes, real Mooncake over loopback), pushes "
        "--requests requests of random sizes through them with --abort-rate of them aborted at random moments on "
        "either side, and injects each of --faults during the load: kill a P worker, freeze one (SIGSTOP) and "
        "resume it, restart the P engine, cut D's control connections through the admin endpoint; with --hosts netns "
        "also partition P's link, drop 1 %% or 5 %% of its packets, take its link down, and retire the P host for "
        "good (a replacement P on a third host takes over). Verifies every "
        "finished request byte for byte, checks every failed one has all its blocks invalid, and that no request "
        "was lost, no hold and no block leaked. Exit code 0 iff all of that holds.",
    )
    add_arguments(parser)
    parser.set_defaults(func=main_with_args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--requests", type=_positive, default=10_000, help="requests over the whole run (default 10000)")
    add(
        "--faults",
        type=_faults,
        default=None,
        help="comma list of kill,freeze,restart,cut and, with --hosts netns, partition,loss1,loss5,linkdown,hostgone "
        "(hostgone last); all (default: every fault the hosts allow); none",
    )
    add(
        "--transport",
        choices=SETTINGS,
        default="auto",
        help="the data plane of P's writes: auto (default: the same-host plane on one host, else Mooncake), "
        "mooncake, or samehost",
    )
    add(
        "--hosts",
        choices=("local", "netns"),
        default="local",
        help="local (default): both engines on loopback; netns: P and D on two network hosts (namespaces joined "
        "by a private link; needs root), which allows the link faults",
    )
    add("--outage", type=float, default=4.0, help="seconds a partition or a link down lasts (default 4)")
    add("--loss-seconds", type=float, default=6.0, help="seconds packet loss lasts, under load (default 6)")
    add("--concurrency", type=_positive, default=16, help="receives in flight (default 16)")
    add("--max-tokens", type=_positive, default=64, help="request sizes are uniform in [1, this] (default 64)")
    add("--abort-rate", type=float, default=0.10, help="fraction of requests aborted (default 0.10)")
    add("--freeze", type=float, default=6.0, help="seconds a frozen P worker stays stopped (default 6)")
    add("--prefill-tp", type=_positive, default=2, help="P tensor-parallel size (default 2)")
    add("--decode-tp", type=_positive, default=1, help="D tensor-parallel size (default 1)")
    add("--seed", type=int, default=0, help="random seed of sizes, aborts and moments (default 0)")
    add("--timeout", type=float, default=1800.0, help="give up after this many seconds (default 1800)")
    add("--json", action="store_true", help="print one JSON object (the last stdout line) instead of tables")


def summary_tables(result: ChaosResult) -> tuple[Table, Table]:
    """The per-phase table and the audit table printed at the end of a run."""
    from rich.table import Table

    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    phases = Table(title="kvsvc chaos: phases", title_justify="left")
    for column in ("phase", "requests", "verified", "failed", "aborted P/D", "hit", "hit failed (unaborted)", "probes"):
        phases.add_column(column, justify="right" if column != "phase" else "left")
    for column in ("fail s (bound)", "recovery s", "P lost", "seconds"):
        phases.add_column(column, justify="right")
    for p in result.phases:
        phases.add_row(
            p.name,
            str(p.requests),
            str(p.verified),
            str(p.failed),
            f"{p.aborted_p}/{p.aborted_d}",
            str(p.affected),
            f"{p.affected_failed} ({p.hit_failed_not_aborted})",
            f"{p.probes_failed}/{p.probes} failed",
            f"{secs(p.fail_s)} ({secs(p.bound_s)})",
            secs(p.recovery_s),
            str(p.p_lost_in_restart),
            f"{p.seconds:.1f}",
        )
    audit = Table(title="kvsvc chaos: audit", title_justify="left", show_header=False)
    audit.add_column("what", style="bold")
    audit.add_column("value", justify="right")
    for what, value in (
        ("requests lost", result.requests_lost),
        ("holds leaked", result.holds_leaked),
        ("P blocks leaked", result.p_blocks_leaked),
        ("D blocks leaked", result.d_blocks_leaked),
        ("duplicate reports", result.duplicate_reports),
        ("late reports ignored", result.late_reports_ignored),
        ("seconds", f"{result.seconds:.1f} (engines started in {result.startup_seconds:.1f})"),
    ):
        audit.add_row(what, str(value))
    status = "[green]OK: nothing lost or leaked, every finished request verified[/]" if result.ok else "[red]FAILED[/]"
    audit.caption = status if not result.errors else f"{status}: {result.errors[0]}"
    return phases, audit


def main_with_args(args: argparse.Namespace) -> int:
    """Run chaos for parsed arguments; returns the exit code (0 iff `ChaosResult.ok`)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from workers.chaos import ChaosOptions, run_chaos
    from workers.chaos_spec import default_service

    err = Console(stderr=True)
    try:
        options = ChaosOptions(
            requests=args.requests,
            faults=tuple(args.faults)
            if args.faults is not None
            else _FAULT_NAMES + (_NET_FAULT_NAMES if args.hosts == "netns" else ()),
            hosts=args.hosts,
            outage_s=args.outage,
            loss_s=args.loss_seconds,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            abort_rate=args.abort_rate,
            freeze_s=args.freeze,
            prefill_tp=args.prefill_tp,
            decode_tp=args.decode_tp,
            fault_worker=min(1, args.prefill_tp - 1),
            seed=args.seed,
            timeout_s=args.timeout,
            service=dataclasses.replace(default_service(), transport=args.transport),
        )
    except ValueError as exc:
        err.print(f"[red]kvsvc chaos:[/] {exc}")
        return 2
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        disable=args.json or not sys.stderr.isatty(),
        transient=True,
    )
    task = progress.add_task("chaos", total=options.requests)

    def on_progress(result: ChaosResult) -> None:
        phase = result.phases[-1].name if result.phases else "starting"
        done = sum(p.finished + p.failed - p.probes_failed for p in result.phases)
        progress.update(task, description=phase, completed=done)

    try:
        with progress:
            result = run_chaos(options, on_progress)
    except KeyboardInterrupt:
        err.print("interrupted: every worker process was stopped")
        return 130
    except Exception as exc:  # a start failure or a worker that failed a command: one line, no trace
        message = f"{type(exc).__name__}: {exc}"
        if args.json:
            print(json.dumps({"ok": False, "error": message}))
        else:
            err.print(f"[red]kvsvc chaos failed:[/] {message}")
        return 1
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        console = Console()
        for table in summary_tables(result):
            console.print(table)
        for error in result.errors[1:10]:
            console.print(f"[red]error:[/] {error}")
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`kvsvc chaos` with `argv` (the arguments after `chaos`); for tests and `python -m workers.commands.chaos`."""
    parser = argparse.ArgumentParser(prog="kvsvc chaos")
    add_arguments(parser)
    return main_with_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
