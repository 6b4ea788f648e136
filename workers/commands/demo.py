"""`kvsvc demo`: a prefill and a decode engine on this machine move requests' KV over real Mooncake, every byte checked.

The command only: parses arguments into `workers.demo.runner.DemoOptions`, calls `run_demo` and prints
`workers.demo.report`'s table (or, with `--json`, the result object as the last stdout line). Imports argparse, the
standard library, `kvsvc.core.layout` (pure) and `workers.demo.runner` (light at import: its runtime is imported when it
runs) at module level; rich and the report only inside `main_with_args`, so `kvsvc --help` stays fast. Invariants:
exit code 0 iff every request finished and every D worker verified every byte of it; the workers' log file is
removed after a run that passed unless `--worker-log` named it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvsvc.core.data_planes import SETTINGS
from kvsvc.core.layout import LAYOUTS  # pure core: no torch, keeps `kvsvc --help` fast
from workers.demo.runner import DEVICES, HOSTS, DemoOptions

if TYPE_CHECKING:
    from workers.demo.runner import DemoResult


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="a prefill and a decode engine on this machine, real transfers, every byte verified",
        description="Starts a P engine and a D engine (worker processes with synthetic KV), moves --requests "
        "requests from P to D on the data plane --transport picks (by default on one host the same-host plane, or "
        "the GPU plane for KV on a GPU), verifies every byte on every D worker and prints goodput and latency. "
        "Exit code 0 iff every request finished and verified.",
    )
    add_arguments(parser)
    parser.set_defaults(func=main_with_args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DemoOptions()
    add = parser.add_argument
    add("--prefill-pp", type=_positive, default=defaults.prefill_pp, help="P pipeline-parallel size (default 2)")
    add("--prefill-tp", type=_positive, default=defaults.prefill_tp, help="P tensor-parallel size (default 1)")
    add("--decode-pp", type=_positive, default=defaults.decode_pp, help="D pipeline-parallel size (default 1)")
    add("--decode-tp", type=_positive, default=defaults.decode_tp, help="D tensor-parallel size (default 2)")
    add("--requests", type=_positive, default=defaults.requests, help="requests to move (default 64)")
    add("--tokens", type=_positive, default=defaults.tokens, help="tokens per request (default 512)")
    add("--block-size", type=_positive, default=None, help="block size of both engines (default 16)")
    add("--prefill-block-size", type=_positive, default=None, help="P's block size (default: --block-size)")
    add("--decode-block-size", type=_positive, default=None, help="D's block size (default: --block-size)")
    add("--layers", type=_positive, default=defaults.layers, help="model layers (default 8)")
    add("--kv-heads", type=_positive, default=defaults.kv_heads, help="total KV heads (default 8)")
    add("--head-size", type=_positive, default=defaults.head_size, help="head size (default 128)")
    add("--dtype", default=defaults.dtype, choices=("bfloat16", "float16", "float32"), help="KV dtype")
    add(
        "--layout",
        default=defaults.layout,
        choices=LAYOUTS,
        help="KV layout of both engines (default HND); HND_CROSS_LAYER puts every local layer in each block",
    )
    add(
        "--hosts",
        default=defaults.hosts,
        choices=HOSTS,
        help="local (default): both engines on loopback; netns: P and D on two network hosts (namespaces on a "
        "private link, non-loopback addresses, a control token; needs root)",
    )
    add(
        "--staging-mib",
        type=int,
        default=defaults.staging_mib,
        help="each worker's staging region in MiB: P gathers writes of many small pieces there, D lends windows "
        "of it that P writes in one stream and D scatters (default 64; 0: every write direct)",
    )
    add(
        "--transport",
        default=defaults.transport,
        choices=SETTINGS,
        help="the data plane of P's writes: auto (default: where P and D share a host and user, the same-host plane, "
        "process_vm_writev, for KV in CPU memory, the GPU plane, CUDA IPC, for KV on GPUs; else Mooncake), mooncake, "
        "or samehost",
    )
    add(
        "--device",
        default=defaults.device,
        choices=DEVICES,
        help="where both engines keep their KV: cpu (default) or cuda (every worker on this host's first GPU; "
        "Mooncake's CUDA build moves it)",
    )
    add(
        "--concurrency",
        type=_positive,
        default=defaults.concurrency,
        help="requests per wave: P computes them, D receives them together, then checks them (default 8)",
    )
    add(
        "--compare",
        action="store_true",
        help="then run the same bytes with D laid out as P (homogeneous) and print the ratio of the goodputs",
    )
    add("--timeout", type=float, default=defaults.timeout_s, help="give up after this many seconds (default 120)")
    add("--json", action="store_true", help="print one JSON object (the last stdout line) instead of the table")
    add(
        "--worker-log",
        default=None,
        help="file for the workers' stderr, Mooncake's log included (default: a temporary file, kept only when the"
        " run fails); '-' leaves it on this terminal",
    )


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    block_size = args.block_size or 16
    return DemoOptions(
        prefill_pp=args.prefill_pp,
        prefill_tp=args.prefill_tp,
        decode_pp=args.decode_pp,
        decode_tp=args.decode_tp,
        requests=args.requests,
        tokens=args.tokens,
        prefill_block_size=args.prefill_block_size or block_size,
        decode_block_size=args.decode_block_size or block_size,
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_size=args.head_size,
        dtype=args.dtype,
        layout=args.layout,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        hosts=args.hosts,
        staging_mib=args.staging_mib,
        transport=args.transport,
        device=args.device,
    )


def main_with_args(args: argparse.Namespace) -> int:
    """Run the demo for parsed arguments; returns the exit code (0 iff every request finished and verified)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from workers.demo.report import summary_table
    from workers.demo.runner import run_demo

    options = options_from_args(args)
    err = Console(stderr=True)
    show_bar = not args.json and sys.stderr.isatty()
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("verified {task.fields[verified]}"),
        TimeElapsedColumn(),
        console=err,
        disable=not show_bar,
        transient=True,
    )
    task = progress.add_task("starting engines", total=options.requests, verified=0)

    def on_progress(result: DemoResult) -> None:
        done = result.finished + result.failed
        progress.update(task, description="transferring", completed=done, verified=result.verified)

    if args.worker_log == "-":
        worker_log = None
    elif args.worker_log:
        worker_log = args.worker_log
    else:
        handle, worker_log = tempfile.mkstemp(prefix="kvsvc-demo-", suffix=".log")
        os.close(handle)
    keep_log = args.worker_log is not None
    try:
        with progress:
            result = run_demo(options, on_progress, worker_log)
            if args.compare:
                progress.reset(task, description="homogeneous", total=options.requests, verified=0)
                result.homogeneous = run_demo(options.homogeneous(), on_progress, worker_log)
    except KeyboardInterrupt:
        if worker_log and not keep_log:
            os.unlink(worker_log)
        err.print("interrupted: every worker process was stopped")
        return 130
    except Exception as exc:  # a start failure or an impossible layout: one line for the operator, no trace
        message = f"{type(exc).__name__}: {exc}"
        where = f" (worker log: {worker_log})" if worker_log else ""
        if args.json:
            print(json.dumps({"ok": False, "requests": options.requests, "verified": 0, "error": message + where}))
        else:
            err.print(f"[red]kvsvc demo failed:[/] {message}{where}")
        return 1
    if worker_log and not keep_log and result.ok:
        os.unlink(worker_log)  # nothing to look into: don't leave a file per run behind
        worker_log = None
    if args.json:
        payload = result.to_json(options)
        payload["worker_log"] = worker_log
        print(json.dumps(payload))
    else:
        console = Console()
        console.print(options.describe())
        if result.homogeneous is not None:
            console.print(f"compared with {options.homogeneous().describe()}", style="dim")
        console.print(summary_table(result))
        if worker_log:
            console.print(f"worker log: {worker_log}", style="dim")
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`kvsvc demo` with `argv` (the arguments after `demo`); for tests and `python -m workers.commands.demo`."""
    parser = argparse.ArgumentParser(prog="kvsvc demo")
    add_arguments(parser)
    return main_with_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
