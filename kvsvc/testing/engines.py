"""Loopback P and D engines in one process, on the real Mooncake engine, for tests of an integration with kvsvc.

Rules: a `LoopbackEngine` is pp×tp `KVTransferService`s on the running event loop, each with its own Mooncake
transfer engine over TCP loopback and a numpy KV pool (`kvsvc.testing.sim.SimEngine` at real addresses), and one
bootstrap endpoint. P fills a transfer's blocks with `kv_pattern` bytes before holding them, so `check_received`
on D proves every byte. Reports are aggregated across workers with `KVOutputAggregator`, as an engine core would.
Mooncake is imported only when an engine starts; `transport="fake"` swaps in `LoopbackTransport` (no Mooncake).
With `staging_bytes`, each worker also has a staging region (numpy, registered like the pool) whose gathers and
scatters are `MemmoveCopies`, which a test can hold in flight.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Literal

import numpy as np

from kvsvc.core.auth import harness_secret
from kvsvc.core.layout import Int64Array, block_geometry
from kvsvc.core.messages import Worker
from kvsvc.core.outputs import KVConnectorOutput, KVOutputAggregator, ModelRunnerOutput
from kvsvc.engine.bootstrap import BootstrapServer
from kvsvc.service import KVTransferService, ServiceConfig, new_incarnation
from kvsvc.service.staging_area import StagingArea, build_staging
from kvsvc.testing.sim import ByteArray, EngineSpec, SimEngine, kv_pattern
from kvsvc.transport.base import Transport

Outcome = Literal["finished_sending", "finished", "failed"]


class MemmoveCopies:
    """A staging region's gather and scatter as `ctypes.memmove` of each piece on the loop, each once `gate` is set
    (it is at first): a test clears it to hold copies in flight. Addresses are trusted (test memory only)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.gathers = self.scatters = 0  # copies started

    async def __call__(self, src: Int64Array, dst: Int64Array, length: Int64Array) -> None:
        self.gathers += 1
        await self._copy(src, dst, length)

    async def scatter(self, src: Int64Array, dst: Int64Array, length: Int64Array) -> None:
        self.scatters += 1
        await self._copy(src, dst, length)

    async def _copy(self, src: Int64Array, dst: Int64Array, length: Int64Array) -> None:
        await self.gate.wait()
        for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
            ctypes.memmove(d, s, n)


class LoopbackEngine:
    """One engine of `spec`'s layout whose workers are services in this process (see module docstring)."""

    def __init__(
        self,
        engine_id: str,
        spec: EngineSpec,
        *,
        config: ServiceConfig | None = None,
        transport: Literal["mooncake", "samehost", "fake"] = "mooncake",
        transport_factory: Callable[[], Transport] | None = None,
        clock: Callable[[], float] = time.monotonic,
        staging_bytes: int = 0,
    ) -> None:
        self.engine_id = engine_id
        self.spec = spec
        self.sim = SimEngine(engine_id, spec, None, incarnation=new_incarnation())
        self._config = config or ServiceConfig()
        self._factory = transport_factory or _transport_factory(transport)
        self._clock = clock
        self.services: dict[Worker, KVTransferService] = {}
        self._bootstrap: BootstrapServer | None = None
        self._aggregator = KVOutputAggregator(len(self.sim.metas))
        self.staging_bytes = staging_bytes
        self.copies = MemmoveCopies()  # every worker's gathers and scatters
        self.staging: dict[Worker, StagingArea] = {}
        self._regions: list[np.ndarray] = []  # kept alive while the services may use them
        self._outcomes: dict[str, Outcome] = {}
        self.url = ""

    @property
    def workers(self) -> list[Worker]:
        return sorted(self.sim.metas)

    async def start(self) -> LoopbackEngine:
        """Register each worker's pool, start its service, and serve the merged metadata.

        Raises:
            TransportError: Mooncake could not start or register a pool.
            OSError: a port could not be bound.
        """
        for worker in self.workers:
            transport = self._factory()
            arena = self.sim.arenas[worker]
            transport.register([(arena.ctypes.data, arena.nbytes)])
            staging = None
            if self.staging_bytes:
                region, staging = build_staging(self.staging_bytes, lambda _: self.copies, register=transport.register)
                self._regions.append(region)
                self.staging[worker] = staging
            service = KVTransferService(
                self.sim.metas[worker], transport, self._config, clock=self._clock, staging=staging
            )
            self.sim.metas[worker] = await service.start()
            self.services[worker] = service
        for service in self.services.values():
            service.set_engine_metadata(dict(self.sim.metas))
        self._bootstrap = BootstrapServer(dict(self.sim.metas))
        self.url = await self._bootstrap.start()
        return self

    async def close(self) -> None:
        """Close every service (draining writes) and the endpoint. Idempotent."""
        await asyncio.gather(*(s.close() for s in self.services.values()))
        if self._bootstrap is not None:
            await self._bootstrap.close()
            self._bootstrap = None

    # -- the engine's side of a transfer -----------------------------------------------------------------------

    def start_send(
        self,
        req_id: str,
        transfer_id: str,
        block_ids: list[int],
        num_tokens: int,
        ready: Mapping[Worker, Sequence[Awaitable[None]]] | None = None,
        *,
        secret: str | None = None,
    ) -> None:
        """Write `transfer_id`'s known KV into `block_ids` on every worker, then hold it for D; `ready`, when given,
        holds each worker's per-layer completions (a layer-wise send: each layer goes once its own resolved).
        `secret`: the hold's, `harness_secret` when None."""
        secret = harness_secret(transfer_id) if secret is None else secret
        for worker, service in self.services.items():
            for layer in range(self.sim.metas[worker].start_layer, self.sim.metas[worker].end_layer):
                self.sim.write_tokens(
                    worker, layer, block_ids, num_tokens, self._pattern(worker, transfer_id, layer, num_tokens)
                )
            layers = None if ready is None else ready[worker]
            service.start_send(req_id, transfer_id, block_ids, num_tokens, layers, secret=secret)

    def start_recv(
        self,
        req_id: str,
        transfer_id: str,
        source: LoopbackEngine,
        block_ids: list[int],
        num_tokens: int,
        first_token: int = 0,
        *,
        secret: str | None = None,
    ) -> None:
        """Receive tokens `[first_token, num_tokens)` of `transfer_id` from `source` into `block_ids` on every
        worker, presenting `secret` (`harness_secret` when None)."""
        secret = harness_secret(transfer_id) if secret is None else secret
        for service in self.services.values():
            service.start_recv(
                req_id, transfer_id, source.engine_id, source.url, block_ids, num_tokens, first_token, secret=secret
            )

    def abort(self, req_id: str) -> None:
        for service in self.services.values():
            service.abort(req_id)

    def collect(self) -> KVConnectorOutput:
        """One engine step: every worker's `get_finished`, aggregated; outcomes are remembered for `wait`."""
        outputs: list[ModelRunnerOutput | None] = [
            ModelRunnerOutput.with_kv_conn_output_only(self.services[w].get_finished()) for w in self.workers
        ]
        merged = self._aggregator.aggregate(outputs, output_rank=len(outputs) - 1)
        kv = merged.kv_connector_output if merged is not None else None
        if kv is None:
            return KVConnectorOutput()
        for req_id in kv.finished_sending or ():
            self._outcomes[req_id] = "finished_sending"
        failed = kv.failed_recving or set()
        for req_id in kv.finished_recving or ():
            self._outcomes[req_id] = "failed" if req_id in failed else "finished"
        for req_id in failed:
            self._outcomes[req_id] = "failed"
        return kv

    async def wait(self, req_id: str, *, timeout_s: float = 30.0) -> Outcome:
        """Step until every worker reported `req_id`; returns how it ended.

        Raises:
            TimeoutError: not reported by every worker within `timeout_s`.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while req_id not in self._outcomes:
            if loop.time() > deadline:
                raise TimeoutError(f"{self.engine_id}: {req_id!r} not reported by every worker in {timeout_s:g} s")
            self.collect()
            await asyncio.sleep(0.005)
        return self._outcomes[req_id]

    def check_received(self, transfer_id: str, block_ids: list[int], num_tokens: int, first_token: int = 0) -> None:
        """Every byte of tokens `[first_token, num_tokens)` of every layer and head this engine holds is
        `transfer_id`'s.

        Raises:
            AssertionError: naming the worker, layer and first wrong token.
        """
        for worker in self.workers:
            meta = self.sim.metas[worker]
            for layer in range(meta.start_layer, meta.end_layer):
                got = self.sim.tokens(worker, layer, block_ids, num_tokens)[first_token:]
                want = self._pattern(worker, transfer_id, layer, num_tokens)[first_token:]
                bad = (got != want).any(axis=(1, 2, 3)).nonzero()[0] + first_token
                if bad.size:
                    raise AssertionError(
                        f"{self.engine_id}{worker} layer {layer}: token {int(bad[0])} of {transfer_id!r} is wrong "
                        f"({bad.size} of {num_tokens} tokens)"
                    )

    def holds(self) -> int:
        """Holds and receives still open on all workers: 0 once everything was reported."""
        return sum(s.statistics().holds for s in self.services.values())

    def _pattern(self, worker: Worker, transfer_id: str, layer: int, num_tokens: int) -> ByteArray:
        geometry = block_geometry(self.sim.metas[worker])
        return kv_pattern(
            transfer_id, layer, self.sim.heads(worker), num_tokens, geometry.halves, geometry.element_bytes
        )


def _transport_factory(kind: Literal["mooncake", "samehost", "fake"]) -> Callable[[], Transport]:
    if kind == "fake":
        from kvsvc.testing.fakes import LoopbackTransport

        return LoopbackTransport
    from kvsvc.transport.mooncake import MooncakeTransport

    if kind == "samehost":
        from kvsvc.transport.routed import with_same_host

        return lambda: with_same_host(MooncakeTransport(), "cpu")
    return MooncakeTransport
