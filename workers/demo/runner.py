"""The runtime of `kvsvc demo`: a prefill and a decode engine on this machine (worker processes, real Mooncake)
move requests' KV in waves, and every D worker checks every byte; `DemoOptions` says what to run, `DemoResult` what
it measured.

Imports the standard library and `workers.stats` at module level; `kvsvc` and the rest of the runtime
(`workers.executor`, `workers.engine`, `workers.commands.common`) only inside the functions that run, so the command
can build its parser from `DemoOptions` without slowing `kvsvc --help`. Invariants: every worker process
is reaped on every exit path, Ctrl-C included (workers ignore SIGINT; the parent shuts them down); `ok` means every
request finished and every D worker verified every byte of it; latencies and goodput are recorded, never asserted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from workers.stats import percentile

if TYPE_CHECKING:
    from workers.engine import DecodeEngine, DecodeRequest
    from workers.executor import EngineConfig, Executor

HOSTS: Final = ("local", "netns")
DEVICES: Final = ("cpu", "cuda")
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
    transport: str = "auto"  # ServiceConfig.transport: the same-host plane on one host, else Mooncake
    device: str = "cpu"  # where both engines keep their KV: "cpu", or "cuda" (each worker on the host's first GPU)

    def __post_init__(self) -> None:
        if self.hosts not in HOSTS:
            raise ValueError(f"hosts must be one of {HOSTS}, got {self.hosts!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")

    def describe(self) -> str:
        return (
            f"P pp{self.prefill_pp}×tp{self.prefill_tp} (block {self.prefill_block_size}) → "
            f"D pp{self.decode_pp}×tp{self.decode_tp} (block {self.decode_block_size}); "
            f"{self.layers} layers, {self.kv_heads} KV heads × {self.head_size}, {self.dtype}, {self.layout}"
            + ("" if self.device == "cpu" else f", KV on {self.device}")
        )

    def homogeneous(self) -> DemoOptions:
        """The same model, load and bytes with D laid out as P (its PP, TP and block size): the `--compare` run."""
        return dataclasses.replace(
            self, decode_pp=self.prefill_pp, decode_tp=self.prefill_tp, decode_block_size=self.prefill_block_size
        )

    def request_kv_bytes(self) -> int:
        """The KV of one request: what a decode engine must end up holding (K and V, every layer and head)."""
        from kvsvc.core.layout import dtype_size

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
    planes: list[str] = field(
        default_factory=list
    )  # the data planes P's workers chose ("samehost", "cuda_ipc", "mooncake")
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
        """What `--json` prints: the figures, p50 and p99 by nearest rank (`workers.stats.percentile`, as the bench),
        and with `options` the layouts described. Raises nothing."""
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
            "planes": self.planes,
        }
        if options is not None:
            payload["layout"] = options.describe()
        if self.homogeneous is not None:
            payload["homogeneous"] = self.homogeneous.to_json(options.homogeneous() if options else None)
            ratio = self.ratio_to_homogeneous
            payload["ratio_to_homogeneous"] = None if ratio is None else round(ratio, 3)
        return payload


# -- the run ----------------------------------------------------------------------------------------------------


def _engine_configs(options: DemoOptions) -> tuple[EngineConfig, EngineConfig]:
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
            service=ServiceConfig(recv_timeout_s=min(60.0, options.timeout_s), transport=options.transport),
            staging_bytes=options.staging_mib << 20,
            device=options.device,
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
        RuntimeError: `options.device` is "cuda" and torch here sees no CUDA GPU.
    """
    from workers.executor import Executor

    if options.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"device cuda: torch {torch.__version__} here sees no CUDA GPU")
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


def _on_netns_hosts(
    stack: contextlib.ExitStack, p_config: EngineConfig, d_config: EngineConfig
) -> tuple[EngineConfig, EngineConfig]:
    """Both engines on their own network hosts (namespaces removed when `stack` closes), with a control token,
    since their control ports now listen beyond loopback.

    Raises:
        HostsError: the namespaces could not be made (their reason; `skip_reason` when this machine cannot).
    """
    from kvsvc.engine.admin import random_token
    from kvsvc.engine.netns import HostsError, NetnsHosts, skip_reason

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
    here they would take the same two cores, and with 7-14 worker processes they did (docs/decisions.md, "The demo
    moves requests in waves and times only the transfers")."""
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
        result.planes = sorted(p_exec.planes())
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


__all__ = ["DEFAULT_REQUESTS", "DEFAULT_TOKENS", "HOSTS", "DemoOptions", "DemoResult", "run_demo"]
