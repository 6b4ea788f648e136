"""`run_scale`: one D engine fed by 1, 4, 16, ... P engines; what each worker holds (connections, descriptors,
threads, memory) and spends (CPU) as the number of P engines grows.

Imports `workers.engine`, `workers.executor`, `workers.commands.common` and `kvsvc.engine.netns`. Every engine is
tp1 (one worker process), so the per-process figures are per worker. With `hosts="netns"` each engine runs on its own
network host; with "local" all share loopback. Figures are read from /proc after the load, when every connection
the load opened still stands: `connections` counts the worker's established TCP sockets (control and Mooncake),
`cpu_s` its user+system time during the load, byte verification on D included. Every request is verified on D;
nothing is asserted on time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from kvsvc.core.layout import dtype_size
from kvsvc.engine.admin import random_token
from kvsvc.service import ServiceConfig
from workers.engine import DecodeEngine, PrefillEngine
from workers.executor import EngineConfig, Executor

_TCP_ESTABLISHED: Final = "01"
_IDLE_SLEEP_S: Final = 0.0005


@dataclass(frozen=True)
class ScaleOptions:
    peers: tuple[int, ...] = (1, 4, 16)
    requests_per_peer: int = 16
    tokens: int = 256
    concurrency: int = 16
    hosts: str = "netns"  # "netns" or "local"
    layers: int = 8
    kv_heads: int = 8
    head_size: int = 128
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.peers or min(self.peers) < 1:
            raise ValueError(f"peers must be counts >= 1, got {self.peers}")
        if self.hosts not in ("netns", "local"):
            raise ValueError(f"hosts must be 'netns' or 'local', got {self.hosts!r}")
        if self.requests_per_peer < 1 or self.tokens < 1 or self.concurrency < 1:
            raise ValueError("requests_per_peer, tokens and concurrency must be >= 1")


@dataclass
class ProcessFigures:
    """One worker process, read from /proc."""

    connections: int = 0  # established TCP sockets
    fds: int = 0
    threads: int = 0
    rss_mib: float = 0.0
    cpu_s: float = 0.0  # user + system during the load


@dataclass
class ScaleRow:
    peers: int
    requests: int = 0
    verified: int = 0
    failed: int = 0
    kv_bytes: int = 0
    seconds: float = 0.0
    startup_s: float = 0.0
    d: ProcessFigures = field(default_factory=ProcessFigures)
    p: ProcessFigures = field(default_factory=ProcessFigures)  # the first P engine's worker
    d_pool_mib: float = 0.0  # D's KV pool, part of its RSS whatever N is
    errors: list[str] = field(default_factory=list)

    @property
    def d_cpu_s_per_gb(self) -> float:
        return self.d.cpu_s / (self.kv_bytes / 1e9) if self.kv_bytes else 0.0

    def to_json(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        row["d_cpu_s_per_gb"] = round(self.d_cpu_s_per_gb, 3)
        row["goodput_gbps"] = round(self.kv_bytes / self.seconds / 1e9, 4) if self.seconds else 0.0
        return row


# -- /proc ------------------------------------------------------------------------------------------------------


def _established_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/net/{table}", encoding="ascii") as handle:
            next(handle, None)
            for line in handle:
                cols = line.split()
                if len(cols) > 9 and cols[3] == _TCP_ESTABLISHED:
                    inodes.add(cols[9])
    return inodes


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def read_process(pid: int, cpu_since: float = 0.0) -> ProcessFigures:
    """A worker's figures now; `cpu_s` counts from `cpu_since` (an earlier `_cpu_s` reading).

    Raises:
        OSError: the process is gone.
    """
    sockets: set[str] = set()
    fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        fds += 1
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                sockets.add(target[8:-1])
    status: dict[str, str] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    return ProcessFigures(
        connections=len(sockets & _established_inodes(pid)),
        fds=fds,
        threads=int(status.get("Threads", "0")),
        rss_mib=int(status.get("VmRSS", "0 kB").split()[0]) / 1024,
        cpu_s=_cpu_s(pid) - cpu_since,
    )


# -- the run ----------------------------------------------------------------------------------------------------


def _configs(options: ScaleOptions, peers: int) -> tuple[list[EngineConfig], EngineConfig]:
    blocks = 2 * options.concurrency * -(-options.tokens // 16)
    service = ServiceConfig(control_token=random_token() if options.hosts == "netns" else None)
    common: dict[str, Any] = dict(
        num_layers=options.layers,
        num_kv_heads=options.kv_heads,
        head_size=options.head_size,
        block_size=16,
        service=service,
    )
    prefills = [
        EngineConfig(engine_id=f"scale-p{i}", role="prefill", num_blocks=blocks, **common) for i in range(peers)
    ]
    return prefills, EngineConfig(engine_id="scale-d", role="decode", num_blocks=blocks, **common)


def measure(options: ScaleOptions, peers: int, worker_log: str | None = None) -> ScaleRow:
    """One D engine and `peers` P engines; every request verified on D.

    Raises:
        WorkerError: an engine failed to start (every process is reaped first). HostsError: namespaces cannot be
            made (with hosts="netns": the reason). ValueError: more than 249 P engines on network hosts.
            OSError: a worker was gone when its figures were read.
    """
    from kvsvc.engine.netns import HostsError, NetnsHosts, skip_reason
    from workers.commands.common import start_engines

    if options.hosts == "netns" and (why := skip_reason()) is not None:
        raise HostsError(f"hosts netns: {why}")

    row = ScaleRow(peers)
    p_configs, d_config = _configs(options, peers)
    with contextlib.ExitStack() as stack:
        if options.hosts == "netns":
            net = stack.enter_context(NetnsHosts(["decode", *(c.engine_id for c in p_configs)]))
            p_configs = [c.on_host(net.address(c.engine_id), net.netns(c.engine_id)) for c in p_configs]
            d_config = d_config.on_host(net.address("decode"), net.netns("decode"))
        executors = [Executor(c) for c in (d_config, *p_configs)]
        started = time.monotonic()
        start_engines(executors, worker_log)
        try:
            row.startup_s = time.monotonic() - started
            _load(options, row, DecodeEngine(executors[0]), [PrefillEngine(e) for e in executors[1:]])
        finally:
            for executor in executors:
                executor.close()
    return row


def _load(options: ScaleOptions, row: ScaleRow, decode: DecodeEngine, prefills: list[PrefillEngine]) -> None:
    d_pid, p_pid = decode.executor.workers[0].pid, prefills[0].executor.workers[0].pid
    assert d_pid is not None and p_pid is not None
    config = decode.executor.config
    element = dtype_size(config.dtype)
    pool_bytes = config.num_blocks * config.num_layers * 2 * config.num_kv_heads * config.block_size * config.head_size
    row.d_pool_mib = pool_bytes * element / 2**20
    request_bytes = options.tokens * options.layers * 2 * options.kv_heads * options.head_size * element
    total = options.requests_per_peer * len(prefills)
    d_cpu0, p_cpu0 = _cpu_s(d_pid), _cpu_s(p_pid)
    begin = time.monotonic()
    deadline = begin + options.timeout_s
    in_flight = 0
    while row.requests < total or in_flight:
        while row.requests < total and in_flight < options.concurrency:
            prefill = prefills[row.requests % len(prefills)]
            transfer_id, seed = f"scale-{row.requests}", 100 + row.requests
            prefill.submit(transfer_id, options.tokens, seed)
            decode.submit(transfer_id, prefill.executor.engine_id, prefill.executor.url, options.tokens, seed)
            row.requests += 1
            in_flight += 1
        ended = decode.step(verify=True)
        for prefill in prefills:
            prefill.step()
        for req in ended:
            in_flight -= 1
            if req.verified_ok:
                row.verified += 1
                row.kv_bytes += request_bytes
            else:
                row.failed += 1
                if len(row.errors) < 5:
                    row.errors.append(f"{req.transfer_id}: {req.state} {req.reason}")
        if time.monotonic() > deadline:
            row.errors.append(f"{in_flight + total - row.requests} requests not done after {options.timeout_s} s")
            break
        if not ended:
            time.sleep(_IDLE_SLEEP_S)
    row.seconds = time.monotonic() - begin
    row.d, row.p = read_process(d_pid, d_cpu0), read_process(p_pid, p_cpu0)


def run_scale(
    options: ScaleOptions, on_row: Callable[[ScaleRow], None] | None = None, worker_log: str | None = None
) -> list[ScaleRow]:
    """`measure` for each count of `options.peers`, in order. Raises: as `measure`."""
    rows = []
    for peers in options.peers:
        rows.append(measure(options, peers, worker_log))
        if on_row is not None:
            on_row(rows[-1])
    return rows


__all__ = ["ProcessFigures", "ScaleOptions", "ScaleRow", "measure", "read_process", "run_scale"]
