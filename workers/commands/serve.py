"""`kvsvc serve`: one synthetic engine whose handshake and admin endpoints share one aiohttp app and port.

Imports argparse and the standard library at module level; the runtime (`workers.executor`, torch, mooncake) and
`kvsvc.engine.admin` inside the functions. Invariants: `--host` is the one address every listener binds (the HTTP
endpoint, each worker's control server and Mooncake engine), loopback unless told otherwise, and never a wildcard,
because the workers publish it to their peers; POST endpoints need the bearer token (`--token-file` or
`KVSVC_ADMIN_TOKEN`) and are refused (403) without one; with a control token (`--control-token-file` or
`KVSVC_CONTROL_TOKEN`, the same on every engine of the deployment) the workers' control ports refuse hellos that do not
prove it, and a `--host` beyond loopback refuses to start without one; SIGINT and SIGTERM stop the engine and reap every
worker, their handler taking no lock (`StopSignal`); SIGUSR1 prints every thread's stack; `ServedEngine` is the code
path of both the command and the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Final, Self

from kvsvc.core.data_planes import SETTINGS

if TYPE_CHECKING:
    from aiohttp import web

    from workers.executor import Executor
    from workers.view import ExecutorView

TOKEN_ENV: Final = "KVSVC_ADMIN_TOKEN"
CONTROL_TOKEN_ENV: Final = "KVSVC_CONTROL_TOKEN"


@dataclass(frozen=True)
class ServeOptions:
    role: str = "prefill"
    engine_id: str = ""  # "" -> "<role>-<pid>"
    pp: int = 1
    tp: int = 1
    layers: int = 8
    kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    num_blocks: int = 1024
    dtype: str = "bfloat16"
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = field(default=None, repr=False)
    control_token: str | None = field(default=None, repr=False)  # ServiceConfig.control_token of every worker
    staging_mib: int = 64  # each worker's staging region for staged writes and windows (0: every write direct)
    transport: str = "auto"  # ServiceConfig.transport of every worker: auto, mooncake or samehost


class ServedEngine:
    """A started engine and its endpoint (`url`): the workers, an `ExecutorView`, and the admin app serving both
    the handshake route and the admin routes. A context manager; `close()` reaps every worker."""

    def __init__(self, executor: Executor, view: ExecutorView, app: web.Application) -> None:
        self.executor, self.view, self.app = executor, view, app

    @classmethod
    def start(cls, options: ServeOptions) -> Self:
        """Spawn the workers (they ignore SIGINT: the parent stops them), build the admin app on a view of them,
        serve it on `options.host:options.port` with the handshake metadata published.

        Raises:
            WorkerError: a worker failed to start (every process is reaped first). OSError: the port is taken.
            ValueError / TopologyError: impossible geometry, an empty token, a wildcard host, or a host beyond
                loopback without a control token.
        """
        check_host(options.host, options.control_token)
        from kvsvc.engine.admin import build_admin_app
        from kvsvc.service import ServiceConfig
        from kvsvc.transport.mooncake import MooncakeConfig
        from workers.commands.common import sigint_ignored_by_children
        from workers.executor import EngineConfig, Executor
        from workers.view import ExecutorView

        config = EngineConfig(
            engine_id=options.engine_id or f"{options.role}-{os.getpid()}",
            role=options.role,
            num_layers=options.layers,
            num_kv_heads=options.kv_heads,
            head_size=options.head_size,
            block_size=options.block_size,
            num_blocks=options.num_blocks,
            pp_size=options.pp,
            tp_size=options.tp,
            dtype=options.dtype,
            service=ServiceConfig(control_token=options.control_token, transport=options.transport),
            transport=MooncakeConfig(),
            bootstrap_port=options.port,
            staging_bytes=options.staging_mib << 20,
        ).on_host(options.host)
        executor = Executor(config)
        try:
            with sigint_ignored_by_children():
                executor.launch()
            # The view and app need the incarnation, which `launch` draws; the app must exist before `start` binds.
            view = ExecutorView(executor)
            app = build_admin_app(view, token=options.token)
            executor.serve_app(app)
            executor.start()
        except BaseException:
            executor.close()
            raise
        return cls(executor, view, app)

    @property
    def url(self) -> str:
        return self.executor.url

    def close(self) -> None:
        """Stop answering admin calls, then shut every worker down and reap it. Idempotent. Each step is said on
        stderr, so a stop that takes long names the step it waits in."""
        print("stopping: refusing admin calls", file=sys.stderr, flush=True)
        self.view.close()
        print("stopping: shutting the workers down", file=sys.stderr, flush=True)
        self.executor.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_host(host: str, control_token: str | None) -> None:
    """Refuse a host the workers cannot publish, and an open control port beyond loopback.

    Raises:
        ValueError: `host` is a wildcard or an IPv6 address (the published `host:port` forms take IPv4 or a name),
            or not loopback while `control_token` is None (the message names the flags).
    """
    import ipaddress

    from kvsvc.service.config import is_loopback

    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        ip = None  # a host name
    if host in ("", "0") or (ip is not None and ip.is_unspecified):  # "0" is what inet_aton reads as 0.0.0.0
        raise ValueError(
            f"--host {host!r} binds every interface, but the workers publish this address to their peers: pass the "
            "address the other engines reach this host at"
        )
    if ip is not None and ip.version == 6:
        raise ValueError(f"--host {host}: IPv6 addresses are not supported; give an IPv4 address or a host name")
    if control_token is None and not is_loopback(host):
        raise ValueError(
            f"--host {host} is reachable beyond loopback, so the workers' control ports need a token: pass "
            f"--control-token-file (or ${CONTROL_TOKEN_ENV}) with the secret every engine of the deployment shares"
        )


def read_token(token_file: str | None, env: str = TOKEN_ENV, what: str = "admin") -> str | None:
    """A token: the first line of `token_file`, else `$env`, else None (for the admin token: POSTs disabled; for
    the control token: any hello accepted).

    Raises:
        OSError: `token_file` cannot be read. ValueError: the token found is empty.
    """
    if token_file:
        with open(token_file, encoding="utf-8") as handle:
            token = handle.readline().strip()
        source = token_file
    elif env in os.environ:
        token, source = os.environ[env].strip(), f"${env}"
    else:
        return None
    if not token:
        raise ValueError(f"the {what} token from {source} is empty")
    return token


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    defaults = ServeOptions()
    parser = subparsers.add_parser(
        "serve",
        help="run one engine with synthetic workers and its handshake + admin endpoints",
        description="Runs one engine of pp × tp synthetic worker processes until SIGINT/SIGTERM. One HTTP port "
        "serves the handshake metadata (what a remote engine's start_recv fetches) and the admin endpoints "
        "(/healthz, /readyz, /metrics, /v1/topology, /v1/peers, /v1/transfers, /v1/statistics, POST /v1/drain, "
        f"POST /v1/peers/<engine>/forget). POSTs need the bearer token from --token-file or ${TOKEN_ENV}.",
    )
    add = parser.add_argument
    add("--role", choices=("prefill", "decode"), default=defaults.role)
    add("--engine-id", default="", help="engine id (default: <role>-<pid>)")
    add("--pp", type=int, default=defaults.pp, help="pipeline-parallel size (default 1)")
    add("--tp", type=int, default=defaults.tp, help="tensor-parallel size (default 1)")
    add("--layers", type=int, default=defaults.layers)
    add("--kv-heads", type=int, default=defaults.kv_heads)
    add("--head-size", type=int, default=defaults.head_size)
    add("--block-size", type=int, default=defaults.block_size)
    add("--num-blocks", type=int, default=defaults.num_blocks, help="KV blocks per worker (default 1024)")
    add("--dtype", default=defaults.dtype, choices=("bfloat16", "float16", "float32"))
    add(
        "--host",
        default=defaults.host,
        help="the address other engines reach this host at; the HTTP endpoint, the control servers and Mooncake "
        "all bind it (default 127.0.0.1: loopback only; beyond loopback a control token is required)",
    )
    add("--port", type=int, default=defaults.port, help="port of the HTTP endpoint (default 0: a free one)")
    add(
        "--staging-mib",
        type=int,
        default=defaults.staging_mib,
        help="each worker's staging region in MiB: a prefill worker gathers writes of many small pieces there, a "
        "decode worker lends windows of it that P writes in one stream (default 64; 0: every write direct)",
    )
    add(
        "--transport",
        choices=SETTINGS,
        default=defaults.transport,
        help="the data plane of this engine's writes, per decode worker: auto (default: the same-host plane, "
        "process_vm_writev, where both workers share a host and user; else Mooncake), mooncake, or samehost",
    )
    add("--token-file", default=None, help=f"file whose first line is the admin bearer token (else ${TOKEN_ENV})")
    add(
        "--control-token-file",
        default=None,
        help=f"file whose first line is the control token that every engine of the deployment shares; workers "
        f"refuse hellos that do not prove it (else ${CONTROL_TOKEN_ENV}; neither: any hello is accepted)",
    )
    parser.set_defaults(func=main_with_args)


def main_with_args(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit code (0 after a clean stop, 1 when the engine cannot start)."""
    from workers.executor import WorkerError

    try:
        token = read_token(args.token_file)
        control_token = read_token(args.control_token_file, CONTROL_TOKEN_ENV, "control")
        check_host(args.host, control_token)
    except (OSError, ValueError) as exc:
        print(f"kvsvc serve: {exc}", file=sys.stderr)
        return 2
    options = ServeOptions(
        role=args.role,
        engine_id=args.engine_id,
        pp=args.pp,
        tp=args.tp,
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_size=args.head_size,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        staging_mib=args.staging_mib,
        transport=args.transport,
        token=token,
        control_token=control_token,
    )
    # Mooncake's native INFO lines (one set per worker start) drown the URLs; an operator's own setting wins.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    stop = StopSignal()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # A stop that hangs anyway can be asked where it waits: SIGUSR1 prints every thread's stack on stderr.
        with contextlib.suppress(RuntimeError, ValueError):  # stderr closed: no dumps, the engine still serves
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        try:
            engine = ServedEngine.start(options)
        except (WorkerError, OSError, ValueError) as exc:
            print(f"kvsvc serve: the engine did not start: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        with engine:
            ex = engine.executor
            print(
                f"engine {ex.engine_id} ({options.role}, pp{options.pp}×tp{options.tp}, incarnation {ex.incarnation})"
            )
            print(f"bootstrap URL: {engine.url}   (what a decode engine's start_recv needs)")
            print(f"admin URL:     {engine.url}   (/healthz /readyz /metrics /v1/topology /v1/peers /v1/statistics)")
            if token is None:
                print(f"POST endpoints disabled: no admin token (--token-file or ${TOKEN_ENV})")
            if control_token is None:
                print(
                    "control ports accept hellos only from processes of this user: no token "
                    f"(--control-token-file or ${CONTROL_TOKEN_ENV})"
                )
            else:
                print("control ports accept only hellos that prove the control token")
            print("Ctrl-C or SIGTERM stops it.", flush=True)
            while not stop.received:
                if not all(engine.executor.alive()):
                    print("kvsvc serve: a worker process died; stopping", file=sys.stderr)
                    return 1
                time.sleep(0.5)  # a handler does not end the nap (PEP 475): the flag is read within half a second
        print("stopped; every worker reaped", file=sys.stderr)
        return 0
    finally:
        faulthandler.unregister(signal.SIGUSR1)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class StopSignal:
    """The SIGINT and SIGTERM handler of `kvsvc serve`: it records the signal in a plain attribute, which the main
    loop reads. A handler runs on the main thread between two bytecodes, possibly while that thread holds a lock (a
    `threading.Event.wait` holds its condition's lock around each nap); a handler that took the same lock, as
    `Event.set` does, would wait for itself for ever, so this one takes none."""

    def __init__(self) -> None:
        self.received = 0  # the signal's number once one arrived

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum


def main(argv: Sequence[str] | None = None) -> int:
    """`kvsvc serve` with `argv` (the arguments after `serve`)."""
    parser = argparse.ArgumentParser(prog="kvsvc")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(argv or [])])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
