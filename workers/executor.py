"""`Executor`: one synthetic engine of `pp_size x tp_size` worker processes, its bootstrap endpoint and supervision.

Imports `workers.process` and `kvsvc` (engine side: handshake merge, bootstrap endpoint, output aggregation).
Rules: workers are indexed `pp_rank * tp_size + tp_rank`; every call to a worker has a deadline and
raises `WorkerError` (never hangs) when it errs, dies or stalls; replies are matched by sequence number, so a late
answer to a call that timed out is dropped, never taken for the next one; `close()` reaps every child, also after
errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any, Final, Self

from aiohttp import web

from kvsvc.core.connector import merge_handshake_metadata
from kvsvc.core.messages import WorkerMetadata
from kvsvc.core.outputs import AggregatorStatistics, KVConnectorOutput, KVOutputAggregator, ModelRunnerOutput
from kvsvc.engine.endpoint import BootstrapEndpoint
from kvsvc.service import ServiceConfig, new_incarnation
from kvsvc.transport.mooncake import MooncakeConfig
from workers.blocks import BlockAllocator, NoFreeBlocks
from workers.kv_pool import engine_shapes
from workers.process import (
    Command,
    GetFinished,
    Peers,
    Ready,
    Reply,
    SetEngineMetadata,
    Shutdown,
    StartFailed,
    Statistics,
    WorkerOptions,
    worker_main,
)

log = logging.getLogger(__name__)
_JOIN_TIMEOUT_S: Final = 10.0


class WorkerError(RuntimeError):
    """A worker answered a command with an error (the message carries the worker and its exception)."""


class WorkerDied(WorkerError):
    """A worker process exited, or closed its pipe, before it answered."""


class WorkerTimeout(WorkerError, TimeoutError):
    """A worker did not answer within the deadline (stopped, wedged, or very busy)."""


@dataclass(frozen=True)
class EngineConfig:
    """One synthetic engine: its geometry, parallelism and the settings its workers start with."""

    engine_id: str
    role: str = "prefill"  # "prefill" or "decode"; names processes and logs
    num_layers: int = 4
    num_kv_heads: int = 4
    head_size: int = 16
    block_size: int = 4
    num_blocks: int = 256
    pp_size: int = 1
    tp_size: int = 1
    layer_split: list[tuple[int, int]] | None = None  # None: `kvsvc.core.layout.even_layer_split`
    dtype: str = "bfloat16"
    layout: str = "HND"
    device: str = "cpu"
    service: ServiceConfig = field(default_factory=ServiceConfig)
    transport: MooncakeConfig = field(default_factory=MooncakeConfig)
    start_timeout_s: float = 120.0  # every worker must report its metadata within this (torch import is slow)
    call_timeout_s: float = 60.0
    log_level: str = "WARNING"
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 0  # 0: a free port, kept across `restart()`
    netns: str | None = None  # a network namespace the workers and the endpoint join (`kvsvc.engine.netns`)
    staging_bytes: int = 0  # each worker's staging region for staged writes (0: none, every plan goes direct)
    # torch intra-op threads per worker process. One, as a real engine binds one thread group per rank: several
    # worker processes with a thread per core each spin against each other (docs/performance.md).
    torch_threads: int = 1

    def __post_init__(self) -> None:
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")

    def on_host(self, address: str, netns: str | None = None) -> EngineConfig:
        """This engine with every listener (endpoint, control servers, Mooncake) bound to `address`, the one
        address its peers reach it at, and placed in `netns` when given.

        Raises:
            ValueError: `address` is a wildcard (the workers publish it: a peer could not use it), or it lies
                beyond loopback while the service has no control token.
        """
        try:
            unspecified = ipaddress.ip_address(address).is_unspecified
        except ValueError:
            unspecified = address == ""  # a host name is fine as it is
        if unspecified:
            raise ValueError(f"{address!r} binds every interface: give the address peers reach this host at")
        return dataclasses.replace(
            self,
            bootstrap_host=address,
            service=dataclasses.replace(self.service, control_host=address),
            transport=dataclasses.replace(self.transport, host=address),
            netns=netns,
        )


@dataclass
class WorkerHandle:
    """The parent's side of one worker process."""

    index: int
    worker: tuple[int, int]  # (pp_rank, tp_rank)
    process: BaseProcess
    conn: Connection
    meta: WorkerMetadata | None = None
    stopped: bool = False

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def __str__(self) -> str:
        return f"worker {self.index} (pp{self.worker[0]},tp{self.worker[1]}, pid {self.pid})"


class Executor:
    """Starts and supervises one engine's worker processes (see module docstring). A context manager."""

    def __init__(self, config: EngineConfig) -> None:
        """Validates the geometry; nothing starts before `start()`.

        Raises:
            ValueError / TopologyError: the layer split or the head split is impossible.
        """
        self.config = config
        self._shapes = engine_shapes(
            engine_id=config.engine_id,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_size=config.head_size,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            pp_size=config.pp_size,
            tp_size=config.tp_size,
            layer_split=config.layer_split,
            dtype=config.dtype,
            layout=config.layout,
        )
        self._ctx = multiprocessing.get_context("spawn")
        self.workers: list[WorkerHandle] = []
        self.metas: dict[tuple[int, int], WorkerMetadata] = {}
        self.incarnation = ""
        self._seq = 0
        self._bootstrap: BootstrapEndpoint | None = None
        self._app: web.Application | None = None
        self._aggregator = KVOutputAggregator(self.num_workers)
        self._output_rank = self.index_of(config.pp_size - 1, 0)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        return self.config.pp_size * self.config.tp_size

    @property
    def engine_id(self) -> str:
        return self.config.engine_id

    @property
    def url(self) -> str:
        """The bootstrap endpoint remote engines fetch this engine's metadata from (empty before `start`)."""
        return self._bootstrap.url if self._bootstrap is not None else ""

    def serve_app(self, app: web.Application) -> None:
        """Serve `app` on the bootstrap address instead of a bare handshake server: one port for the handshake
        endpoint and whatever else `app` routes (the admin endpoints of `kvsvc.engine.admin.build_admin_app`).
        `app` must carry the handshake route (`bootstrap.add_metadata_route`); it is bound once, the metadata is
        published into it, and its handlers run on the bootstrap thread's event loop. Call before `start`.

        Raises:
            RuntimeError: the engine serves its endpoint already.
        """
        if self._bootstrap is not None:
            raise RuntimeError(f"{self.engine_id}: serve_app must come before start (the endpoint is serving)")
        self._app = app

    def index_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.config.tp_size + tp_rank

    def launch(self) -> None:
        """Spawn the worker processes without waiting for them (`start` finishes the job); lets several engines
        import torch at the same time.

        Raises:
            OSError: a process could not be spawned (those already spawned are reaped).
        """
        if self.workers:
            return
        self.incarnation = new_incarnation()
        self._aggregator = KVOutputAggregator(self.num_workers)
        try:
            for index, shape in enumerate(self._shapes):
                options = WorkerOptions(
                    shape=shape,
                    incarnation=self.incarnation,
                    role=self.config.role,
                    device=self.config.device,
                    service=self.config.service,
                    transport=self.config.transport,
                    log_level=self.config.log_level,
                    netns=self.config.netns,
                    staging_bytes=self.config.staging_bytes,
                    torch_threads=self.config.torch_threads,
                )
                parent, child = self._ctx.Pipe(duplex=True)
                process = self._ctx.Process(
                    target=worker_main,
                    args=(options, child),
                    name=f"{self.config.role}-{self.engine_id}-pp{shape.pp_rank}-tp{shape.tp_rank}",
                    daemon=True,
                )
                try:
                    process.start()
                finally:
                    child.close()  # the child has its own end; ours must go, or a dead child's EOF never shows
                self.workers.append(WorkerHandle(index, (shape.pp_rank, shape.tp_rank), process, parent))
        except BaseException:
            self._stop_workers()
            raise

    def start(self) -> Self:
        """Start every worker (unless `launch` did), wait for their metadata, hand each the merged engine view,
        serve it.

        Raises:
            WorkerError: a worker failed to start (its error), died, or missed `start_timeout_s`; every started
                child is reaped before it propagates.
        """
        if self.workers and self.url and all(h.meta is not None for h in self.workers):
            return self  # started already
        try:
            self.launch()
            self._await_ready()
            self.metas = merge_handshake_metadata({h.worker: h.meta} for h in self.workers if h.meta is not None)
            self.broadcast(SetEngineMetadata(self.metas))
            if self._bootstrap is None:
                self._bootstrap = BootstrapEndpoint(
                    self.config.bootstrap_host, self.config.bootstrap_port, self._app, netns=self.config.netns
                )
            self._bootstrap.serve(self.metas, self.config.call_timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        waiting = {h.conn: h for h in self.workers if h.meta is None}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                names = ", ".join(str(h) for h in waiting.values())
                raise WorkerTimeout(f"{self.engine_id}: {names} did not start within {self.config.start_timeout_s} s")
            for conn in wait(list(waiting), timeout=min(remaining, 1.0)):
                assert isinstance(conn, Connection)
                handle = waiting.pop(conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    raise WorkerDied(
                        f"{self.engine_id}: {handle} exited during start (exit code {handle.process.exitcode})"
                    ) from None
                if isinstance(message, StartFailed):
                    raise WorkerError(f"{self.engine_id}: {handle} failed to start: {message.error}")
                if not isinstance(message, Ready):
                    raise WorkerError(f"{self.engine_id}: {handle} sent {type(message).__name__} instead of Ready")
                handle.meta = message.meta

    def restart(self) -> None:
        """A new incarnation of the whole engine: every worker is stopped (killed if it does not stop), new ones
        start with fresh, empty pools; the bootstrap URL stays the same. Blocks the caller frees are its own job.

        Raises:
            WorkerError: as `start`; the engine is then closed.
        """
        if self._bootstrap is not None:
            self._bootstrap.withdraw(self.config.call_timeout_s)
        self._stop_workers()
        self.start()

    def close(self) -> None:
        """Shut every worker down (killing those that do not stop in time), reap them, stop the endpoint.
        Idempotent; never raises for a worker that misbehaves."""
        try:
            self._stop_workers()
        finally:
            if self._bootstrap is not None:
                self._bootstrap.close(_JOIN_TIMEOUT_S)
                self._bootstrap = None

    def _stop_workers(self) -> None:
        try:
            for handle in self.workers:
                if handle.stopped:
                    self.cont(handle.index)
            live = [h for h in self.workers if h.process.is_alive()]
            seqs: dict[int, int] = {}
            for handle in live:
                with contextlib.suppress(WorkerError):
                    seqs[handle.index] = self._send(handle, Shutdown())
            deadline = time.monotonic() + _JOIN_TIMEOUT_S
            for handle in live:
                if handle.index in seqs:
                    try:
                        self._receive(handle, seqs[handle.index], deadline)
                    except WorkerError as exc:  # an operator's clue when a stop takes its full bound
                        log.warning("%s did not confirm its shutdown: %s", handle, exc)
        finally:
            for handle in self.workers:
                handle.process.join(max(0.0, min(_JOIN_TIMEOUT_S, 2.0)))
                if handle.process.is_alive():
                    log.warning("%s still runs after its shutdown; killing it", handle)
                    handle.process.kill()
                    handle.process.join(_JOIN_TIMEOUT_S)
                handle.conn.close()
            self.workers = []

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- commands ----------------------------------------------------------------------------------------------

    def call(self, index: int, command: Command, timeout_s: float | None = None) -> object:
        """Run `command` on worker `index` and return its answer.

        Raises:
            WorkerError: the worker answered with an error. WorkerDied: it is gone. WorkerTimeout: no answer in time.
        """
        handle = self.workers[index]
        seq = self._send(handle, command)
        return self._receive(handle, seq, time.monotonic() + (timeout_s or self.config.call_timeout_s))

    def broadcast(
        self,
        command: Command | Callable[[WorkerHandle], Command],
        timeout_s: float | None = None,
        workers: Sequence[int] | None = None,
    ) -> list[object]:
        """Send a command (or one built per worker) to every worker (or to `workers`), then collect the answers in
        that order; the workers run it concurrently.

        Raises:
            WorkerError / WorkerDied / WorkerTimeout: the first worker, in order, that failed (after every answer
                that could be collected was collected, so no answer is left behind for a later call).
        """
        targets = [self.workers[i] for i in (workers if workers is not None else range(len(self.workers)))]
        deadline = time.monotonic() + (timeout_s or self.config.call_timeout_s)
        sent: list[tuple[WorkerHandle, int | WorkerError]] = []
        for handle in targets:
            try:
                sent.append((handle, self._send(handle, command(handle) if callable(command) else command)))
            except WorkerError as exc:
                sent.append((handle, exc))
        results: list[object] = []
        first_error: WorkerError | None = None
        for handle, seq in sent:
            try:
                if isinstance(seq, WorkerError):
                    raise seq
                results.append(self._receive(handle, seq, deadline))
            except WorkerError as exc:
                first_error = first_error or exc
                results.append(exc)
        if first_error is not None:
            raise first_error
        return results

    def _send(self, handle: WorkerHandle, command: Command) -> int:
        self._seq += 1
        try:
            handle.conn.send((self._seq, command))
        except (OSError, ValueError) as exc:
            raise WorkerDied(f"{self.engine_id}: {handle} cannot take commands: {exc}") from None
        return self._seq

    def _receive(self, handle: WorkerHandle, seq: int, deadline: float) -> object:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerTimeout(f"{self.engine_id}: {handle} did not answer command {seq} in time")
            try:
                if not handle.conn.poll(min(remaining, 0.5)):
                    continue
                reply = handle.conn.recv()
            except (EOFError, OSError):
                handle.process.join(1.0)
                raise WorkerDied(f"{self.engine_id}: {handle} is gone (exit code {handle.process.exitcode})") from None
            if not isinstance(reply, Reply) or reply.seq != seq:
                continue  # the late answer to a call that timed out
            if reply.error is not None:
                raise WorkerError(f"{self.engine_id}: {handle}: {reply.error}")
            return reply.value

    # -- engine core -------------------------------------------------------------------------------------------

    def step(self, timeout_s: float | None = None) -> KVConnectorOutput:
        """Drain every worker's `get_finished` and aggregate them as the engine core does: an id is reported once
        every worker reported it. Non-last PP stages report through `with_kv_conn_output_only`.

        Raises:
            WorkerError / WorkerDied / WorkerTimeout: as `broadcast` (nothing is aggregated then).
        """
        outputs: list[ModelRunnerOutput | None] = []
        for handle, kv in zip(self.workers, self.broadcast(GetFinished(), timeout_s), strict=True):
            assert isinstance(kv, KVConnectorOutput)
            if handle.worker[0] < self.config.pp_size - 1:
                outputs.append(ModelRunnerOutput.with_kv_conn_output_only(kv))
            else:
                outputs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=kv))
        aggregate = self._aggregator.aggregate(outputs, self._output_rank)
        assert aggregate is not None and aggregate.kv_connector_output is not None
        return aggregate.kv_connector_output

    def statistics(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Each worker's service statistics (`dataclasses.asdict` of `ServiceStatistics` plus `holds` and `pid`).

        Raises:
            WorkerError / WorkerDied / WorkerTimeout: as `broadcast`.
        """
        return [dict(s) for s in self.broadcast(Statistics(), timeout_s) if isinstance(s, dict)]

    def planes(self) -> set[str]:
        """The data planes this engine's workers chose for the D workers they write to ("samehost", "mooncake"),
        from their peer tables; empty before any hello.

        Raises:
            WorkerError / WorkerDied / WorkerTimeout: as `broadcast`.
        """
        rows = [row for rows in self.broadcast(Peers()) if isinstance(rows, list) for row in rows]
        return {row["transport"] for row in rows if row["direction"] == "from_d"}

    def aggregator_statistics(self) -> AggregatorStatistics:
        """The engine core's output aggregator counters (this incarnation): `late_reports_ignored` > 0 means a
        worker reported an id again after it completed."""
        return self._aggregator.statistics()

    # -- supervision -------------------------------------------------------------------------------------------

    def alive(self) -> list[bool]:
        """Whether each worker process is running (a stopped one counts as alive)."""
        return [h.process.is_alive() for h in self.workers]

    def kill(self, index: int) -> None:
        """SIGKILL worker `index` and reap it (its peers see the connection drop)."""
        handle = self.workers[index]
        handle.process.kill()
        handle.process.join(_JOIN_TIMEOUT_S)
        handle.stopped = False

    def stop(self, index: int) -> None:
        """SIGSTOP worker `index`: it freezes, its sockets stay open (a stalled peer)."""
        handle = self.workers[index]
        if handle.pid is not None and handle.process.is_alive():
            os.kill(handle.pid, signal.SIGSTOP)
            handle.stopped = True

    def cont(self, index: int) -> None:
        """SIGCONT worker `index`."""
        handle = self.workers[index]
        if handle.pid is not None and handle.process.is_alive():
            os.kill(handle.pid, signal.SIGCONT)
        handle.stopped = False


def start_all(executors: Sequence[Executor]) -> None:
    """Start several engines, their processes spawned together (torch imports overlap).

    Raises:
        WorkerError: an engine failed to start; every engine of `executors` is closed then.
    """
    try:
        for executor in executors:
            executor.launch()
        for executor in executors:
            executor.start()
    except BaseException:
        for executor in executors:
            executor.close()
        raise


__all__ = [
    "BlockAllocator",
    "EngineConfig",
    "Executor",
    "NoFreeBlocks",
    "WorkerDied",
    "WorkerError",
    "WorkerHandle",
    "WorkerTimeout",
    "start_all",
]
