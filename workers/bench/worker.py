"""The worker-process half of `kvsvc bench`: commands a worker runs for the benchmark, and their handlers.

Imports `kvsvc` (the service and the Mooncake transport), `workers.kv_pool` and `workers.synthetic`, never
`workers.process` (which dispatches to `handle_bench`). Invariants: baselines (raw Mooncake, the peers' way) run on
the worker's own Mooncake engine and registered pool, so they move the very bytes kvsvc moves, and only while
kvsvc has nothing in flight; every timing is taken inside the worker with `time.perf_counter` (span) or
`time.monotonic` (instants compared across processes: CLOCK_MONOTONIC is system-wide on Linux); CPU time is the
whole process's (`time.process_time`), Mooncake's threads included.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import numpy as np

from kvsvc.core.auth import harness_secret
from kvsvc.core.data_planes import SameHostAddress
from kvsvc.core.planner import Region
from kvsvc.service import KVTransferService
from kvsvc.transport.base import Transport, WriteFailed
from kvsvc.transport.mooncake import MooncakeTransport
from kvsvc.transport.ondemand import OnDemand
from kvsvc.transport.routed import RoutedTransport
from kvsvc.transport.samehost import copy_into
from workers.kv_pool import KVPool
from workers.synthetic import fill

Desc = tuple[int, int, int]
# (req_id, transfer_id, block ids, num_tokens, seed)
BenchRequest = tuple[str, str, list[int], int, int]
PEER_THREADS: Final = 10  # vLLM's MooncakeConnector sends from a pool of 10 threads
_RAW_POLL_SLEEP_S: Final = 20e-6  # the raw poller's nap between status checks of a still-running descriptor


class _Runtime(Protocol):
    pool: KVPool
    service: KVTransferService
    transport: Transport | None
    bench: BenchState | None


@dataclass
class BenchState:
    """What a worker remembers between bench commands: held requests' ready futures, receive start times."""

    layer_futures: dict[str, list[asyncio.Future[None]]] = field(default_factory=dict)
    recv_started: dict[str, float] = field(default_factory=dict)
    recv_ended: dict[str, float] = field(default_factory=dict)
    recv_failed: dict[str, str] = field(default_factory=dict)


# -- commands -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HoldMany:
    """P: `start_send` every request (after filling its KV when `fill`). `ready` is "none" (computed already),
    "layer" (one future per layer, resolved by `Compute`) or "whole" (one future, resolved by `Compute`)."""

    requests: list[BenchRequest]
    fill: bool = True
    ready: str = "none"


@dataclass(frozen=True, slots=True)
class Compute:
    """P: the synthetic prefill of held requests, one after another: `layer_time_s` per layer (a sleep: a GPU
    kernel leaves the CPU free), resolving each layer's future as it ends. Answers each request's end instant."""

    transfer_ids: list[str]
    layer_time_s: float
    layers: int


@dataclass(frozen=True, slots=True)
class RecvMany:
    """D: `start_recv` every request from engine `engine_id` at `url` at once; answers the CPU time before."""

    engine_id: str
    url: str
    requests: list[BenchRequest]


@dataclass(frozen=True, slots=True)
class Collect:
    """D: wait until every receive of `req_ids` ended (or `timeout_s`); answers their start and end instants."""

    req_ids: list[str]
    timeout_s: float = 60.0


@dataclass(frozen=True, slots=True)
class CpuTime:
    """Any worker: its process CPU seconds so far."""


RAW_SAMEHOST: Final = "samehost"  # RawWrite's method for the same-host plane's call alone on the same descriptors


@dataclass(frozen=True, slots=True)
class RawWrite:
    """P: write `descriptors[i]` to `peers[i]` straight on the engine, `method` being "submit_poll" (one-descriptor
    batches, polled from the oldest with a short nap) or "batch" (one async batch per peer, then
    `get_batch_transfer_status`), or "samehost" (`process_vm_writev` into the peers' processes, `peers` being their
    same-host sessions). Answers the span and the CPU it took."""

    peers: list[str]
    descriptors: list[list[Desc]]
    method: str = "submit_poll"


@dataclass(frozen=True, slots=True)
class PeerStyleWrite:
    """P: the peers' way: each batch (one request for one D worker) is one blocking `batch_transfer_sync_write`,
    run from a pool of `threads` threads. `batches[i]` goes to `peers[i]`."""

    peers: list[str]
    batches: list[list[Desc]]
    threads: int = PEER_THREADS


@dataclass(frozen=True, slots=True)
class PlaneWrite:
    """P: write `descriptors[i]` to `peers[i]` through one plane of the worker's routed transport, all peers at once
    (the service's own call, without the service): `plane` "local" (the pair's own plane: CUDA IPC for KV on a GPU)
    or "primary" (Mooncake; `regions[i]`, D's published KV, are added as `peers[i]`'s first, since a pair that took
    the local plane never told Mooncake about D). Answers the span and the CPU it took."""

    plane: str
    peers: list[str]
    descriptors: list[list[Desc]]
    regions: list[list[Region]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TorchCopy:
    """P, KV on a GPU: copy `descriptors[i]` with torch into `peers[i]`'s memory as mapped in this process (the CUDA
    IPC plane's `peer_pointer`), one `copy_` per contiguous run, then wait for the device. What a program that
    opened the same mapping would do with torch alone."""

    peers: list[str]
    descriptors: list[list[Desc]]


BenchCommand = HoldMany | Compute | RecvMany | Collect | CpuTime | RawWrite | PeerStyleWrite | PlaneWrite | TorchCopy
BenchResult = dict[str, Any]


def handle_bench(runtime: _Runtime, command: BenchCommand) -> BenchResult | Coroutine[Any, Any, BenchResult]:
    """Run one bench command: a value, or a coroutine the worker awaits on its loop before answering.

    Raises:
        ValueError / TransportError: what the service or the engine refused; TypeError for an unknown command.
    """
    if runtime.bench is None:
        runtime.bench = BenchState()
    state = runtime.bench
    if isinstance(command, HoldMany):
        return _hold_many(runtime, state, command)
    if isinstance(command, Compute):
        return _compute(state, command)
    if isinstance(command, RecvMany):
        cpu = time.process_time()
        for req_id, transfer_id, block_ids, num_tokens, _ in command.requests:
            state.recv_started[req_id] = time.monotonic()
            secret = harness_secret(transfer_id)
            runtime.service.start_recv(
                req_id, transfer_id, command.engine_id, command.url, block_ids, num_tokens, secret=secret
            )
        return {"cpu": cpu}
    if isinstance(command, Collect):
        return _collect(runtime.service, state, command)
    if isinstance(command, CpuTime):
        return {"cpu": time.process_time()}
    if isinstance(command, PlaneWrite):
        return _plane_write(_plane_named(runtime, command.plane), command)
    if isinstance(command, TorchCopy):
        return _torch_copy(_routed(runtime).local, command)
    if isinstance(command, RawWrite) and command.method == RAW_SAMEHOST:
        return _timed(lambda: _raw_samehost_write(command))
    if isinstance(command, RawWrite | PeerStyleWrite):
        engine = _native_mooncake(runtime)
        if isinstance(command, RawWrite):
            return _timed(lambda: _raw_write(engine, command))
        return _timed(lambda: _peer_style_write(engine, command))
    raise TypeError(f"unknown bench command {type(command).__name__}")


def _native_mooncake(runtime: _Runtime) -> Any:
    """The Mooncake engine the worker's transport runs (started with the worker: the bench's engines ask for it).

    Raises:
        ValueError: the worker runs no Mooncake engine.
    """
    transport = runtime.transport
    primary: Transport | None = transport.primary if isinstance(transport, RoutedTransport) else transport
    if isinstance(primary, OnDemand):
        primary = primary.engine
    if not isinstance(primary, MooncakeTransport) or primary.native_engine is None:
        raise ValueError("this worker runs no Mooncake engine to benchmark (its config starts one on demand)")
    return primary.native_engine


def _hold_many(runtime: _Runtime, state: BenchState, command: HoldMany) -> BenchResult:
    pool, service = runtime.pool, runtime.service
    loop = asyncio.get_running_loop()
    for _, _, block_ids, num_tokens, seed in command.requests if command.fill else ():
        fill(pool.layers, pool.meta, seed, block_ids, num_tokens)
    if command.fill and pool.device.type == "cuda":
        import torch

        # The fills are kernels on this stream; the plane copies on its own: wait here, untimed, rather than hand
        # every request a ready future the timed run would then wait on.
        torch.cuda.synchronize()
    for req_id, transfer_id, block_ids, num_tokens, _ in command.requests:
        if command.ready == "none":
            service.start_send(req_id, transfer_id, block_ids, num_tokens, None, secret=harness_secret(transfer_id))
            continue
        count = pool.meta.num_layers if command.ready == "layer" else 1
        futures = [loop.create_future() for _ in range(count)]
        state.layer_futures[transfer_id] = futures
        ready = futures if count > 1 else futures[0]
        service.start_send(req_id, transfer_id, block_ids, num_tokens, ready, secret=harness_secret(transfer_id))
    return {}


async def _compute(state: BenchState, command: Compute) -> BenchResult:
    ends: dict[str, float] = {}
    for transfer_id in command.transfer_ids:
        futures = state.layer_futures.pop(transfer_id)
        for layer in range(command.layers):
            await asyncio.sleep(command.layer_time_s)
            if len(futures) > 1:
                futures[layer].set_result(None)
        ends[transfer_id] = time.monotonic()
        if len(futures) == 1:  # whole-request ready: resolved once the last layer's compute ended
            futures[0].set_result(None)
    return {"ends": ends}


async def _collect(service: KVTransferService, state: BenchState, command: Collect) -> BenchResult:
    wanted = set(command.req_ids)
    deadline = time.monotonic() + command.timeout_s
    while True:
        output = service.get_finished()
        now = time.monotonic()
        failed = output.failed_recving or set()
        for req_id in output.finished_recving or ():
            if req_id in failed:
                state.recv_failed[req_id] = "failed"
            state.recv_ended[req_id] = now
        for req_id in failed:
            state.recv_failed.setdefault(req_id, "failed")
            state.recv_ended.setdefault(req_id, now)
        if wanted.issubset(state.recv_ended) or now > deadline:
            break
        await service.wait_for_reports(max(0.0, deadline - now))
    result = {
        "cpu": time.process_time(),
        "started": {r: state.recv_started.pop(r, 0.0) for r in command.req_ids},
        "ended": {r: state.recv_ended.pop(r) for r in command.req_ids if r in state.recv_ended},
        "failed": {r: state.recv_failed.pop(r) for r in command.req_ids if r in state.recv_failed},
    }
    return result


# -- baselines ------------------------------------------------------------------------------------------------


def _timed(run: Any) -> BenchResult:
    cpu, start = time.process_time(), time.perf_counter()
    failures = run()
    return {"span": time.perf_counter() - start, "cpu_start": cpu, "cpu": time.process_time(), "failures": failures}


def _raw_write(engine: Any, command: RawWrite) -> int:
    """The best way docs/mooncake.md allows to move a descriptor list: returns how many descriptors failed."""
    failures = 0
    if command.method == "batch":
        ids = []
        for peer, descs in zip(command.peers, command.descriptors, strict=True):
            if not descs:
                continue
            batch = engine.batch_transfer_async_write(
                peer, [d[0] for d in descs], [d[1] for d in descs], [d[2] for d in descs]
            )
            if batch == 0:  # refused: never poll an id 0
                failures += len(descs)
            else:
                ids.append(batch)
        if ids and engine.get_batch_transfer_status(ids) != 0:
            failures += 1
        return failures
    if command.method != "submit_poll":
        raise ValueError(f"unknown raw method {command.method!r}")
    submit, check = engine.transfer_submit_write, engine.transfer_check_status
    queues: list[deque[int]] = []
    for peer, descs in zip(command.peers, command.descriptors, strict=True):
        queue: deque[int] = deque()
        for src, dst, length in descs:
            batch = submit(peer, src, dst, length)
            if batch == 0:
                failures += 1
            else:
                queue.append(batch)
        queues.append(queue)
    sleep = time.sleep
    while any(queues):
        progressed = False
        for queue in queues:
            while queue:
                status = check(queue[0])
                if status == 0:
                    break
                queue.popleft()  # 1 or -1 freed the id
                progressed = True
                if status != 1:
                    failures += 1
        if not progressed:
            sleep(_RAW_POLL_SLEEP_S)
    return failures


def _raw_samehost_write(command: RawWrite) -> int:
    """The same-host plane's kernel call alone: each peer's descriptors in `IOV_MAX`-row calls, one peer after the
    other, from this thread; `peers` are same-host sessions. Returns how many peers' writes failed."""
    failures = 0
    for peer, descs in zip(command.peers, command.descriptors, strict=True):
        if not descs:
            continue
        try:
            copy_into(SameHostAddress.parse(peer).pid, np.asarray(descs, dtype=np.int64).reshape(-1, 3))
        except OSError:
            failures += 1
    return failures


def _routed(runtime: _Runtime) -> Any:
    """The worker's routed transport (`primary` and `local` planes). Raises ValueError when it has only one plane."""
    transport = runtime.transport
    if transport is None or not hasattr(transport, "local") or not hasattr(transport, "primary"):
        raise ValueError("this worker has one data plane only (KV plane off or forced to Mooncake)")
    return transport


def _plane_named(runtime: _Runtime, name: str) -> Transport:
    """The worker's plane `name`: "local" (only a routed transport has it) or "primary" (Mooncake, the transport
    itself where it is not routed). Raises ValueError for an unknown name or a missing plane."""
    if name == "primary" and runtime.transport is not None and not hasattr(runtime.transport, "primary"):
        return runtime.transport
    if name not in ("local", "primary"):
        raise ValueError(f"unknown plane {name!r}: local or primary")
    plane: Transport = getattr(_routed(runtime), name)
    return plane


async def _plane_write(plane: Transport, command: PlaneWrite) -> BenchResult:
    for peer, regions in zip(command.peers, command.regions, strict=False):
        plane.add_peer(peer, regions)
    cpu, start = time.process_time(), time.perf_counter()
    writes = [plane.write(peer, descs) for peer, descs in zip(command.peers, command.descriptors, strict=True) if descs]
    results = await asyncio.gather(*writes, return_exceptions=True)
    span = time.perf_counter() - start
    return {
        "span": span,
        "cpu_start": cpu,
        "cpu": time.process_time(),
        "failures": sum(1 for r in results if isinstance(r, BaseException | WriteFailed)),
    }


def contiguous_runs(descs: Sequence[Desc]) -> list[Desc]:
    """`descs` with each descriptor that continues the one before it on both sides merged into it: the copies a
    program would issue for the same bytes."""
    runs: list[Desc] = []
    for src, dst, length in descs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + length)
        else:
            runs.append((src, dst, length))
    return runs


class _CudaBytes:
    """`length` bytes of device memory at `ptr`, as `__cuda_array_interface__` describes them to torch."""

    def __init__(self, ptr: int, length: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


def _torch_copy(plane: Any, command: TorchCopy) -> BenchResult:
    """The copies timed from the first `copy_` to the device done; wrapping the addresses as tensors, which a
    program does once, is not.

    Raises:
        InvalidDescriptor: from `peer_pointer`, for a session or an address D did not publish.
    """
    import torch

    copies = []
    for peer, descs in zip(command.peers, command.descriptors, strict=True):
        for src, dst, length in contiguous_runs(descs):
            mapped = plane.peer_pointer(peer, dst)
            copies.append((torch.as_tensor(_CudaBytes(src, length), device="cuda"),
                           torch.as_tensor(_CudaBytes(mapped, length), device="cuda")))  # fmt: skip
    torch.cuda.synchronize()  # what came before (the fill, kvsvc's writes) is not timed as the copies' own
    cpu, start = time.process_time(), time.perf_counter()
    for src_t, dst_t in copies:
        dst_t.copy_(src_t)
    torch.cuda.synchronize()
    return {"span": time.perf_counter() - start, "cpu_start": cpu, "cpu": time.process_time(), "failures": 0}


def _peer_style_write(engine: Any, command: PeerStyleWrite) -> int:
    def one(peer: str, descs: Sequence[Desc]) -> int:
        rc = engine.batch_transfer_sync_write(peer, [d[0] for d in descs], [d[1] for d in descs], [d[2] for d in descs])
        return 0 if rc == 0 else 1

    with ThreadPoolExecutor(command.threads) as pool:
        futures = [pool.submit(one, p, b) for p, b in zip(command.peers, command.batches, strict=True) if b]
        return sum(f.result() for f in futures)
