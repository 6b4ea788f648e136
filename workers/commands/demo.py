"""`kvsvc demo`: a prefill and a decode engine on this machine move requests' KV over real Mooncake, every byte checked.

Imports: argparse and the standard library at module level; torch, rich and the runtime (`workers.executor`,
`workers.engine`) only inside `main`, so `kvsvc --help` stays fast. Invariants: every worker process is reaped on
every exit path, Ctrl-C included (workers ignore SIGINT; the parent shuts them down); `ok` means every request
finished and every D worker verified every byte of it; with `--json` the last stdout line is the result object.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from kvsvc.layout import LAYOUTS  # pure core: no torch, keeps `kvsvc --help` fast

if TYPE_CHECKING:
    from rich.table import Table

    from workers.engine import DecodeEngine, DecodeRequest
    from workers.executor import EngineConfig, Executor

HOSTS: Final = ("local", "netns")
DEFAULT_REQUESTS: Final = 64
DEFAULT_TOKENS: Final = 512
_IDLE_SLEEP_S: Final = 0.0005  # between polls when nothing finished: short, so latency is not the poll period


@dataclass(frozen=True)
class DemoOptions:
    """One demo run: the two engines' layouts, the model geometry and the load."""

    prefill_pp: int = 2
    prefill_tp: int = 1
    decode_pp: int = 1
    decode_tp: int = 2
    requests: int = DEFAULT_REQUESTS
    tokens: int = DEFAULT_TOKENS
    prefill_block_size: int = 16
    decode_block_size: int = 16
    layers: int = 8
    kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"
    layout: str = "HND"
    concurrency: int = 8
    timeout_s: float = 120.0
    hosts: str = "local"  # "local": both engines on this host's loopback; "netns": each on its own network host
    staging_mib: int = 64  # each worker's staging region for staged writes and windows (0: every write direct)

    def __post_init__(self) -> None:
        if self.hosts not in HOSTS:
            raise ValueError(f"hosts must be one of {HOSTS}, got {self.hosts!r}")

    def describe(self) -> str:
        return (
            f"P pp{self.prefill_pp}×tp{self.prefill_tp} (block {self.prefill_block_size}) → "
            f"D pp{self.decode_pp}×tp{self.decode_tp} (block {self.decode_block_size}); "
            f"{self.layers} layers, {self.kv_heads} KV heads × {self.head_size}, {self.dtype}, {self.layout}"
        )

    def homogeneous(self) -> DemoOptions:
        """The same model, load and bytes with D laid out as P (its PP, TP and block size): the `--compare` run."""
        return dataclasses.replace(
            self, decode_pp=self.prefill_pp, decode_tp=self.prefill_tp, decode_block_size=self.prefill_block_size
        )

    def request_kv_bytes(self) -> int:
        """The KV of one request: what a decode engine must end up holding (K and V, every layer and head)."""
        from kvsvc.layout import dtype_size

        return self.tokens * self.layers * 2 * self.kv_heads * self.head_size * dtype_size(self.dtype)


@dataclass
class DemoResult:
    """What a run measured. `bytes` and `descriptors` are what P's services wrote (their counters)."""

    requests: int
    finished: int = 0
    failed: int = 0
    verified: int = 0
    bytes: int = 0
    kv_bytes: int = 0  # KV of the verified requests (the goodput numerator)
    descriptors: int = 0
    seconds: float = 0.0  # the whole run: P's fill, the transfers and D's checks
    transfer_seconds: float = 0.0  # the transfer phases: from each wave's receives started to its last one ended
    startup_seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    failure_reasons: dict[str, int] = field(default_factory=dict)  # why receives failed, counted, first seen first
    hosts: dict[str, str] = field(default_factory=dict)  # role -> the address its engine listened on
    homogeneous: DemoResult | None = None  # `--compare`: the same bytes with D laid out as P, run after this one

    def add_failure(self, transfer_id: str, reason: str) -> None:
        self.failed += 1
        self.errors.append(f"{transfer_id}: receive failed: {reason}")
        self.failure_reasons[reason] = self.failure_reasons.get(reason, 0) + 1

    @property
    def ok(self) -> bool:
        mine = self.requests > 0 and self.finished == self.requests == self.verified and not self.errors
        return mine and (self.homogeneous is None or self.homogeneous.ok)

    @property
    def goodput_gbps(self) -> float:
        """Verified KV bytes over the transfer phases' seconds, in 10^9 B/s."""
        return self.kv_bytes / self.transfer_seconds / 1e9 if self.transfer_seconds > 0 else 0.0

    @property
    def ratio_to_homogeneous(self) -> float | None:
        """This run's goodput over the homogeneous run's (`--compare`); None without one or when it moved nothing."""
        base = self.homogeneous.goodput_gbps if self.homogeneous is not None else 0.0
        return self.goodput_gbps / base if base > 0 else None

    def to_json(self, options: DemoOptions | None = None) -> dict[str, Any]:
        p50, p99 = (percentile(self.latencies_ms, q) if self.latencies_ms else None for q in (50, 99))
        payload: dict[str, Any] = {
            "ok": self.ok,
            "requests": self.requests,
            "finished": self.finished,
            "failed": self.failed,
            "verified": self.verified,
            "bytes": self.bytes,
            "kv_bytes": self.kv_bytes,
            "seconds": round(self.seconds, 4),
            "transfer_seconds": round(self.transfer_seconds, 4),
            "startup_seconds": round(self.startup_seconds, 3),
            "goodput_gbps": round(self.goodput_gbps, 4),
            "p50_ms": None if p50 is None else round(p50, 3),
            "p99_ms": None if p99 is None else round(p99, 3),
            "descriptors": self.descriptors,
            "errors": self.errors[:10],
            "failure_reasons": dict(list(self.failure_reasons.items())[:10]),
            "hosts": self.hosts,
        }
        if options is not None:
            payload["layout"] = options.describe()
        if self.homogeneous is not None:
            payload["homogeneous"] = self.homogeneous.to_json(options.homogeneous() if options else None)
            ratio = self.ratio_to_homogeneous
            payload["ratio_to_homogeneous"] = None if ratio is None else round(ratio, 3)
        return payload


# -- pure helpers -----------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile of `values`, linearly interpolated between closest ranks (numpy's default method).

    Raises:
        ValueError: `values` is empty, or `q` is outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def format_bytes(count: int) -> str:
    """`count` bytes in binary units with three significant figures ("1.00 GiB", "512 B"). Raises nothing."""
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


# -- the run ----------------------------------------------------------------------------------------------------


def _engine_configs(options: DemoOptions) -> tuple[Any, Any]:
    from kvsvc.service import ServiceConfig
    from workers.executor import EngineConfig

    def config(role: str, pp: int, tp: int, block_size: int) -> EngineConfig:
        blocks_per_request = max(1, -(-options.tokens // block_size))
        return EngineConfig(
            engine_id=f"demo-{role}",
            role=role,
            num_layers=options.layers,
            num_kv_heads=options.kv_heads,
            head_size=options.head_size,
            block_size=block_size,
            # P may report a send finished a step after D saw the receive: room for two windows of requests.
            num_blocks=2 * options.concurrency * blocks_per_request,
            pp_size=pp,
            tp_size=tp,
            dtype=options.dtype,
            layout=options.layout,
            service=ServiceConfig(recv_timeout_s=min(60.0, options.timeout_s)),
            staging_bytes=options.staging_mib << 20,
        )

    return (
        config("prefill", options.prefill_pp, options.prefill_tp, options.prefill_block_size),
        config("decode", options.decode_pp, options.decode_tp, options.decode_block_size),
    )


def _counters(executor: Executor) -> tuple[int, int]:
    stats = executor.statistics()
    return sum(int(s["bytes_sent"]) for s in stats), sum(int(s["descriptors_sent"]) for s in stats)


def run_demo(
    options: DemoOptions, on_progress: Callable[[DemoResult], None] | None = None, worker_log: str | None = None
) -> DemoResult:
    """Start both engines, push `options.requests` requests through, verify each on every D worker, stop them.
    The workers' stderr (Mooncake's native log included) goes to `worker_log` when given.

    Raises:
        WorkerError: an engine failed to start or a worker failed a command (every process is reaped first).
        ValueError / TopologyError: the layouts cannot work together.
        HostsError: `options.hosts` is "netns" and the namespaces cannot be made here (the reason).
    """
    from workers.executor import Executor

    p_config, d_config = _engine_configs(options)
    Executor(p_config), Executor(d_config)  # validates the geometry before anything starts
    result = DemoResult(requests=options.requests)
    with contextlib.ExitStack() as stack:
        if options.hosts == "netns":
            p_config, d_config = _on_netns_hosts(stack, p_config, d_config)
        p_exec, d_exec = Executor(p_config), Executor(d_config)
        result.hosts = {"prefill": p_config.bootstrap_host, "decode": d_config.bootstrap_host}
        _run_engines(options, p_exec, d_exec, result, on_progress, worker_log)
    return result


def _on_netns_hosts(stack: contextlib.ExitStack, p_config: EngineConfig, d_config: EngineConfig) -> tuple[Any, Any]:
    """Both engines on their own network hosts (namespaces removed when `stack` closes), with a control token,
    since their control ports now listen beyond loopback.

    Raises:
        HostsError: the namespaces could not be made (their reason; `skip_reason` when this machine cannot).
    """
    from kvsvc.engine.admin import random_token
    from kvsvc.testing.hosts import HostsError, NetnsHosts, skip_reason

    why = skip_reason()
    if why is not None:
        raise HostsError(f"--hosts netns: {why}")
    net = stack.enter_context(NetnsHosts(["prefill", "decode"]))
    token = random_token()

    def place(config: EngineConfig, role: str) -> EngineConfig:
        tokened = dataclasses.replace(config, service=dataclasses.replace(config.service, control_token=token))
        return tokened.on_host(net.address(role), net.netns(role))

    return place(p_config, "prefill"), place(d_config, "decode")


def _run_engines(
    options: DemoOptions,
    p_exec: Executor,
    d_exec: Executor,
    result: DemoResult,
    on_progress: Callable[[DemoResult], None] | None,
    worker_log: str | None,
) -> None:
    """Move the requests in waves of `options.concurrency`: P computes a wave's KV and holds it, D receives the
    wave (timed: `transfer_seconds`), then every D worker checks it. The synthetic model's fill and check run
    between transfers, not beside them: on a GPU they would be kernels that leave the CPU to the transfers, while
    here they would take the same two cores, and with 7-14 worker processes they did (docs/decisions.md 84)."""
    from workers.commands.common import start_engines
    from workers.engine import DecodeEngine, PrefillEngine

    started = time.monotonic()
    start_engines([p_exec, d_exec], worker_log)
    try:
        result.startup_seconds = time.monotonic() - started
        prefill, decode = PrefillEngine(p_exec), DecodeEngine(d_exec)
        bytes0, descriptors0 = _counters(p_exec)
        begin = time.monotonic()
        deadline = begin + options.timeout_s
        for first in range(0, options.requests, options.concurrency):
            if time.monotonic() > deadline:
                result.errors.append(f"{options.requests - first} requests not started after {options.timeout_s} s")
                break
            wave = range(first, min(first + options.concurrency, options.requests))
            specs = [(f"demo-{index}", options.tokens, 1000 + index) for index in wave]
            prefill.submit_many(specs)
            if not _transfer_wave(options, decode, p_exec, specs, result, deadline):
                if options.requests > first + len(wave):
                    result.errors.append(f"{options.requests - first - len(wave)} requests not started")
                break
            while prefill.requests and time.monotonic() < deadline:  # sends end a step after the receives
                prefill.step()
                time.sleep(_IDLE_SLEEP_S)
            if prefill.requests:
                result.errors.append(f"P still held {len(prefill.requests)} sends after {options.timeout_s} s")
                break
            if on_progress is not None:
                on_progress(result)
        result.seconds = time.monotonic() - begin
        bytes1, descriptors1 = _counters(p_exec)
        result.bytes, result.descriptors = bytes1 - bytes0, descriptors1 - descriptors0
    finally:
        d_exec.close()
        p_exec.close()


def _transfer_wave(
    options: DemoOptions,
    decode: DecodeEngine,
    p_exec: Executor,
    specs: list[tuple[str, int, int]],
    result: DemoResult,
    deadline: float,
) -> bool:
    """Receive one wave on D, timed from submitting its receives to the step that saw the last one end, then check
    every byte of the finished ones on every D worker. False when the run is past its deadline."""
    began = time.monotonic()
    pending = {req.req_id for req in decode.submit_many(p_exec.engine_id, p_exec.url, specs)}
    ended: list[DecodeRequest] = []
    while pending:
        got = decode.step(verify=False)
        now = time.monotonic()
        for req in got:
            pending.discard(req.req_id)
            result.latencies_ms.append((now - began) * 1e3)
        ended += got
        if now > deadline:
            result.errors.append(f"{len(pending)} requests of a wave not done after {options.timeout_s} s")
            break
        if not got:
            time.sleep(_IDLE_SLEEP_S)
    result.transfer_seconds += time.monotonic() - began
    finished = [req for req in ended if req.state == "finished"]
    for req in ended:
        if req.state != "finished":
            result.add_failure(req.transfer_id, req.reason)
    result.finished += len(finished)
    # Their blocks were freed in the step, but nothing is allocated before this check: still ours.
    decode.verify(finished)
    kv_bytes = options.request_kv_bytes()
    for req in finished:
        if len(req.verified) == decode.executor.num_workers and all(v.ok and v.checked > 0 for v in req.verified):
            result.verified += 1
            result.kv_bytes += kv_bytes
        else:
            bad = next((v for v in req.verified if not v.ok), None)
            result.errors.append(f"{req.transfer_id}: {bad.mismatches if bad else '?'} bytes differ: {bad}")
    return not pending


# -- the command ------------------------------------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="a prefill and a decode engine on this machine, real Mooncake transfers, every byte verified",
        description="Starts a P engine and a D engine (worker processes with synthetic KV), moves --requests "
        "requests from P to D over Mooncake (TCP loopback), verifies every byte on every D worker and prints "
        "goodput and latency. Exit code 0 iff every request finished and verified.",
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
    )


def main_with_args(args: argparse.Namespace) -> int:
    """Run the demo for parsed arguments; returns the exit code (0 iff every request finished and verified)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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
