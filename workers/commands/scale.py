"""`kvsvc scale`: one D engine fed by N P engines, for each N asked; what a worker holds and spends as N grows.

Imports argparse and the standard library at module level; rich and the runtime (`workers.scale`) inside
`main_with_args`. Invariants: every worker process and namespace is gone on every exit path; exit code 0 iff every
request of every N verified; with `--json` the last stdout line is the result object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of counts, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"counts must be >= 1, got {text!r}")
    return counts


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "scale",
        help="one D engine fed by 1, 4, 16 P engines: connections, descriptors, threads, memory and CPU per worker",
        description="For each count N of --peers, starts N P engines and one D engine (tp1 each, one worker "
        "process), moves --requests-per-peer requests from every P to D (each verified on D), then reads from "
        "/proc what the D worker and a P worker hold: established TCP connections, file descriptors, threads, "
        "resident memory, and the CPU time the load cost. --hosts netns puts every engine on its own network host "
        "(needs root).",
    )
    add_arguments(parser)
    parser.set_defaults(func=main_with_args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--peers", type=_counts, default=(1, 4, 16), help="comma list of P engine counts (default 1,4,16)")
    add("--requests-per-peer", type=int, default=16, help="requests each P engine sends (default 16)")
    add("--tokens", type=int, default=256, help="tokens per request (default 256: 8 MiB of KV)")
    add("--concurrency", type=int, default=16, help="receives in flight on D (default 16)")
    add("--hosts", choices=("netns", "local"), default="netns", help="netns (default): a network host per engine")
    add("--json", action="store_true", help="print one JSON object (the last stdout line) instead of the table")


def main_with_args(args: argparse.Namespace) -> int:
    """Run the scale measurement for parsed arguments; returns the exit code."""
    from rich.console import Console
    from rich.table import Table

    from workers.scale import ScaleOptions, ScaleRow, run_scale

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's INFO lines, one set per engine, drown the table
    err = Console(stderr=True)
    try:
        options = ScaleOptions(
            peers=args.peers,
            requests_per_peer=args.requests_per_peer,
            tokens=args.tokens,
            concurrency=args.concurrency,
            hosts=args.hosts,
        )
    except ValueError as exc:
        err.print(f"[red]kvsvc scale:[/] {exc}")
        return 2

    def progress(row: ScaleRow) -> None:
        if not args.json:
            err.print(f"N={row.peers}: {row.verified}/{row.requests} verified in {row.seconds:.1f} s")

    try:
        rows = run_scale(options, progress)
    except KeyboardInterrupt:
        err.print("interrupted: every worker process was stopped")
        return 130
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"
        if args.json:
            print(json.dumps({"ok": False, "error": message}))
        else:
            err.print(f"[red]kvsvc scale failed:[/] {message}")
        return 1
    ok = all(r.verified == r.requests and not r.errors for r in rows)
    if args.json:
        print(json.dumps({"ok": ok, "hosts": options.hosts, "rows": [r.to_json() for r in rows]}))
        return 0 if ok else 1
    table = Table(title=f"kvsvc scale ({options.hosts}): one D worker, N P workers", title_justify="left")
    for column in ("N", "verified", "GB/s", "D conns", "D fds", "D threads", "D RSS MiB", "D CPU s/GB"):
        table.add_column(column, justify="right")
    for column in ("P conns", "P fds", "P threads", "P RSS MiB"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            str(r.peers),
            f"{r.verified}/{r.requests}",
            f"{r.to_json()['goodput_gbps']:.3f}",
            str(r.d.connections),
            str(r.d.fds),
            str(r.d.threads),
            f"{r.d.rss_mib:.0f}",
            f"{r.d_cpu_s_per_gb:.2f}",
            str(r.p.connections),
            str(r.p.fds),
            str(r.p.threads),
            f"{r.p.rss_mib:.0f}",
        )
    table.caption = f"D's KV pool: {rows[0].d_pool_mib:.0f} MiB of its RSS" + ("" if ok else "; FAILED")
    Console().print(table)
    for row in rows:
        for error in row.errors:
            err.print(f"[red]N={row.peers}:[/] {error}")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`kvsvc scale` with `argv` (the arguments after `scale`)."""
    parser = argparse.ArgumentParser(prog="kvsvc scale")
    add_arguments(parser)
    return main_with_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
