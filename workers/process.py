"""One synthetic worker process: a KV pool, a Mooncake transport and a `KVTransferService` on the process's own uvloop.

Imports `workers.kv_pool`, `workers.synthetic` and `kvsvc`; started with the `spawn` context by `workers.executor`.
Protocol with the parent over a `multiprocessing` Pipe: the worker first sends `Ready(meta)` (or `StartFailed`), then
answers every `(seq, command)` with exactly one `Reply(seq, ...)`, errors included as a string, never a hang on its
side. The pipe is read from the event loop (`add_reader`), so the service keeps running between commands. The
parent closing the pipe is a shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import dataclasses
import gc
import logging
import os
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, Final

import uvloop

from kvsvc.core.auth import harness_secret
from kvsvc.core.messages import WorkerMetadata
from kvsvc.core.outputs import KVConnectorOutput
from kvsvc.engine import netns
from kvsvc.service import KVTransferService, ServiceConfig
from kvsvc.service.gather import TorchGather
from kvsvc.service.staging_area import StagingArea, build_staging
from kvsvc.transport.base import Transport
from kvsvc.transport.mooncake import MooncakeConfig
from kvsvc.transport.routed import worker_transport
from workers.bench.worker import BenchCommand, BenchState, handle_bench
from workers.kv_pool import KVPool, WorkerShape
from workers.synthetic import VerifyResult, fill, ready_after_fill, verify

log = logging.getLogger(__name__)

GC_THRESHOLDS: Final = (50_000, 20, 100)  # gc.set_threshold for worker processes, see `_serve`

_CLOSE_TIMEOUT_S: Final = 60.0
# A folder named here gets each worker's cProfile statistics at its exit (one file per process, named by engine,
# role and ranks): how the time of a bench or demo's workers splits, on a host where a profiler cannot attach.
PROFILE_ENV: Final = "KVSVC_PROFILE_DIR"


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """Everything a worker process needs to start; pickled to the child."""

    shape: WorkerShape
    incarnation: str
    role: str = "prefill"  # "prefill" or "decode": names the process; every worker can play both roles
    device: str = "cpu"
    service: ServiceConfig = field(default_factory=ServiceConfig)
    transport: MooncakeConfig = field(default_factory=MooncakeConfig)
    log_level: str = "WARNING"
    netns: str | None = None  # joined before anything binds: the worker runs on that namespace's network
    staging_bytes: int = 0  # a staging region of this size for staged writes (`kvsvc.service.staging_area`); 0: none
    torch_threads: int = 1  # torch intra-op threads (`EngineConfig.torch_threads`)


# -- commands (parent to worker) ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SetEngineMetadata:
    metas: dict[tuple[int, int], WorkerMetadata]


@dataclass(frozen=True, slots=True)
class Prefill:
    """Run the synthetic model for a request (fill its blocks) and hold its KV for D (`start_send`)."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    seed: int


@dataclass(frozen=True, slots=True)
class Recv:
    req_id: str
    transfer_id: str
    remote_engine_id: str
    remote_url: str
    block_ids: list[int]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class AbortRequest:
    req_id: str


@dataclass(frozen=True, slots=True)
class GetFinished:
    pass


@dataclass(frozen=True, slots=True)
class Verify:
    seed: int
    block_ids: list[int]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Batch:
    """Several commands in one round trip, carried out in order; the answer is the list of their answers. An engine
    core hands a step's requests to each worker in one call; with 7-14 worker processes on two cores a round trip
    per request cost the demo more than its transfers. A command that fails fails the batch, and the ones before it
    have taken effect (the parent undoes them: `workers.engine`)."""

    commands: list[Prefill | Recv | AbortRequest | Verify]


@dataclass(frozen=True, slots=True)
class Statistics:
    pass


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class Peers:
    """The service's `peers()` rows (admin endpoint)."""


@dataclass(frozen=True, slots=True)
class ForgetEngine:
    """`forget_engine(engine_id)` on the service: drop what it cached about a remote engine."""

    engine_id: str


@dataclass(frozen=True, slots=True)
class FailureReasons:
    """Why these receives failed, as this worker's service remembers it: `{req_id: reason}`."""

    req_ids: list[str]


@dataclass(frozen=True, slots=True)
class Transfers:
    """Rows of the requests this worker started (`Prefill`/`Recv`) and has not reported finished yet."""


Command = (
    SetEngineMetadata
    | Prefill
    | Recv
    | AbortRequest
    | GetFinished
    | Verify
    | Batch
    | Statistics
    | Shutdown
    | Peers
    | ForgetEngine
    | Transfers
    | FailureReasons
    | BenchCommand
)


# -- answers (worker to parent) -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    meta: WorkerMetadata
    pid: int


@dataclass(frozen=True, slots=True)
class StartFailed:
    error: str


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to command `seq`: `value` when `error` is None, else `error` is `"ExceptionType: message"`."""

    seq: int
    value: object = None
    error: str | None = None


Result = (
    KVConnectorOutput
    | VerifyResult
    | dict[str, object]
    | list[dict[str, object]]
    | list[VerifyResult | None]
    | Coroutine[Any, Any, dict[str, Any]]  # answered once it completed on the worker's loop (bench commands)
    | None
)


class WorkerRuntime:
    """The command handler of one worker process; runs on the worker's event loop."""

    def __init__(self, options: WorkerOptions, pool: KVPool, service: KVTransferService) -> None:
        self.options = options
        self.pool = pool
        self.service = service
        self.stopping: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        # req_id -> (direction, transfer_id, started): what `Transfers` lists; dropped once `get_finished` reports it.
        self.in_flight: dict[str, tuple[str, str, float]] = {}
        self.transport: Transport | None = None  # the routed transport the service writes through (bench baselines)
        self.bench: BenchState | None = None

    def handle(self, command: Command) -> Result:
        """Carry out one command (except `Shutdown`, which the reader handles).

        Raises:
            TypeError: an unknown command. Anything the service or the synthetic model raises passes through.
        """
        service = self.service
        if isinstance(command, GetFinished):
            output = service.get_finished()
            for req_id in (output.finished_sending or set()) | (output.finished_recving or set()):
                self.in_flight.pop(req_id, None)
            return output
        if isinstance(command, Prefill):
            fill(self.pool.layers, self.pool.meta, command.seed, command.block_ids, command.num_tokens)
            ready = ready_after_fill(self.pool.device)
            secret = harness_secret(command.transfer_id)
            service.start_send(
                command.req_id, command.transfer_id, command.block_ids, command.num_tokens, ready, secret=secret
            )
            self.in_flight[command.req_id] = ("send", command.transfer_id, time.monotonic())
            return None
        if isinstance(command, Recv):
            service.start_recv(
                command.req_id,
                command.transfer_id,
                command.remote_engine_id,
                command.remote_url,
                command.block_ids,
                command.num_tokens,
                secret=harness_secret(command.transfer_id),
            )
            self.in_flight[command.req_id] = ("recv", command.transfer_id, time.monotonic())
            return None
        if isinstance(command, AbortRequest):
            service.abort(command.req_id)
            return None
        if isinstance(command, Verify):
            return verify(self.pool.layers, self.pool.meta, command.seed, command.block_ids, command.num_tokens)
        if isinstance(command, Batch):
            answers: list[VerifyResult | None] = []
            for position, each in enumerate(command.commands):
                if not isinstance(each, Prefill | Recv | AbortRequest | Verify):
                    raise TypeError(f"a batch carries Prefill, Recv, AbortRequest or Verify, not {type(each).__name__}")
                try:
                    answer = self.handle(each)
                except Exception as exc:
                    where = f"command {position} of the batch of {len(command.commands)} ({type(each).__name__})"
                    raise RuntimeError(f"{where}: {type(exc).__name__}: {exc}") from exc
                if answer is not None and not isinstance(answer, VerifyResult):
                    raise TypeError(f"batch command {position} answered {type(answer).__name__}")
                answers.append(answer)
            return answers
        if isinstance(command, Statistics):
            return self.statistics()
        if isinstance(command, SetEngineMetadata):
            service.set_engine_metadata(command.metas)
            return None
        if isinstance(command, Peers):
            return service.peers()
        if isinstance(command, ForgetEngine):
            service.forget_engine(command.engine_id)
            return None
        if isinstance(command, FailureReasons):
            reasons = {r: service.failure_reason(r) for r in command.req_ids}
            return {r: why for r, why in reasons.items() if why}
        if isinstance(command, Transfers):
            now = time.monotonic()
            return [
                {"req_id": req_id, "transfer_id": tid, "direction": direction, "age_s": round(now - started, 3)}
                for req_id, (direction, tid, started) in self.in_flight.items()
            ]
        if isinstance(command, BenchCommand):
            return handle_bench(self, command)
        raise TypeError(f"unknown worker command {type(command).__name__}")

    def statistics(self) -> dict[str, object]:
        stats = self.service.statistics()
        result = dataclasses.asdict(stats)
        result["holds"] = stats.holds
        result["pid"] = os.getpid()
        return result


def _staging_area(options: WorkerOptions, pool: KVPool, transport: Transport) -> StagingArea | None:
    """The worker's staging region, registered with the transport, when `options.staging_bytes` asks for one."""
    if not options.staging_bytes:
        return None
    sources = [pool.buffer] if pool.buffer is not None else pool.layers
    # The area's gather keeps the region alive for as long as the service holds the area.
    _, area = build_staging(
        options.staging_bytes, partial(TorchGather, sources), device=pool.device, register=transport.register
    )
    return area


async def _serve(options: WorkerOptions, conn: Connection) -> int:
    try:
        pool = KVPool(options.shape, options.incarnation, options.device)
        transport = worker_transport(options.transport, str(options.device), options.service.transport)
        transport.register(pool.regions())
        staging = _staging_area(options, pool, transport)
        service = KVTransferService(pool.meta, transport, options.service, staging=staging)
        meta = await service.start()
    except Exception as exc:
        log.exception("worker failed to start")
        conn.send(StartFailed(f"{type(exc).__name__}: {exc}"))
        return 1
    runtime = WorkerRuntime(options, pool, service)
    runtime.transport = transport
    loop = asyncio.get_running_loop()
    shutdown_seq: list[int] = []
    later: set[asyncio.Task[None]] = set()

    async def answer_later(seq: int, work: Coroutine[Any, Any, dict[str, Any]]) -> None:
        try:
            reply = Reply(seq, await work)
        except Exception as exc:
            reply = Reply(seq, error=f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(OSError, EOFError):
            conn.send(reply)

    def on_readable() -> None:
        try:
            while not runtime.stopping.done() and conn.poll():
                seq, command = conn.recv()
                if isinstance(command, Shutdown):
                    shutdown_seq.append(seq)
                    runtime.stopping.set_result(0)
                    return
                try:
                    value = runtime.handle(command)
                    if asyncio.iscoroutine(value):
                        task = loop.create_task(answer_later(seq, value))
                        later.add(task)
                        task.add_done_callback(later.discard)
                        continue
                    reply = Reply(seq, value)
                except Exception as exc:  # every command is answered: the parent decides what an error means
                    reply = Reply(seq, error=f"{type(exc).__name__}: {exc}")
                try:
                    conn.send(reply)
                except (OSError, EOFError):
                    raise
                except Exception as exc:  # the value did not pickle: still answer, with why
                    conn.send(Reply(seq, error=f"{type(exc).__name__}: {exc}"))
        except (EOFError, OSError):
            # The parent is gone (or closed the pipe): nobody will read our answers, so stop.
            if not runtime.stopping.done():
                runtime.stopping.set_result(0)

    # What exists now (torch's modules, the pool, the engine) lives as long as the worker: freezing it keeps the
    # collector's full passes to what requests allocate (50 ms passes on a busy P without it: docs/decisions.md,
    # "Worker processes freeze and tune the collector").
    gc.collect()
    gc.freeze()
    # A burst of requests keeps tens of thousands of young objects alive at once (holds, jobs, futures), which
    # the default first-generation threshold (700) scans again and again: 10,000 one-block requests ran 12 %
    # faster with these thresholds (docs/decisions.md, "Worker processes freeze and tune the collector").
    gc.set_threshold(*GC_THRESHOLDS)
    conn.send(Ready(meta, os.getpid()))
    loop.add_reader(conn.fileno(), on_readable)
    # uvloop's add_reader makes the fd non-blocking; a command or answer larger than the socket buffer would then
    # fail half-read (BlockingIOError). Readiness polling works the same on a blocking fd.
    os.set_blocking(conn.fileno(), True)
    code = await runtime.stopping
    loop.remove_reader(conn.fileno())
    error: str | None = None
    try:
        await asyncio.wait_for(service.close(), _CLOSE_TIMEOUT_S)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        code = 1
    if shutdown_seq:
        with contextlib.suppress(OSError):
            conn.send(Reply(shutdown_seq[0], error=error))
    return code


def worker_main(options: WorkerOptions, conn: Connection) -> None:
    """The target of a worker process; never returns (exits with 0 after a clean shutdown)."""
    logging.basicConfig(
        level=options.log_level,
        format=f"%(asctime)s {options.role}[pp{options.shape.pp_rank},tp{options.shape.tp_rank}] %(name)s: %(message)s",
    )
    code = 1
    profile_dir = os.environ.get(PROFILE_ENV)
    profiler = cProfile.Profile() if profile_dir else None
    if profiler is not None:
        profiler.enable()
    try:
        import torch

        torch.set_num_threads(options.torch_threads)
        if options.netns is not None:
            netns.join(options.netns)  # before Mooncake and the loop start threads: they inherit it
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            code = runner.run(_serve(options, conn))
    except BaseException:
        log.exception("worker crashed")
    finally:
        with contextlib.suppress(OSError):
            conn.close()
        if profiler is not None and profile_dir:
            profiler.disable()
            shape = options.shape
            name = f"{shape.engine_id}-{options.role}-pp{shape.pp_rank}-tp{shape.tp_rank}-{os.getpid()}.prof"
            with contextlib.suppress(OSError):
                profiler.dump_stats(os.path.join(profile_dir, name))
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown: Mooncake's native threads and static destructors can stall a normal exit.
        os._exit(code)
