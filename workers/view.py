"""`ExecutorView`: the admin app's `EngineView` over a synthetic engine's `Executor` (worker processes).

Imports `workers.executor`, `workers.process` and `kvsvc.engine` (admin, metrics). Rules: the view's async methods
run on the admin app's event loop and never block it: every call into the executor runs in a thread, one at a time
(the executor's pipes are not thread-safe), and `close()` waits out the call in flight, so nothing talks to a worker
while the engine shuts down. Constant facts (`engine_id`, `incarnation`, `role`) are read once, at construction.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final, TypeVar

from kvsvc.core.messages import Worker, WorkerMetadata
from kvsvc.engine.admin import tag_worker
from kvsvc.engine.metrics import PeerRow, StatsDict
from workers.executor import Executor
from workers.process import ForgetEngine, Peers, Transfers

_T = TypeVar("_T")
_ROLES: Final = {"prefill": "P", "decode": "D"}
_DRAIN_POLL_S: Final = 0.05


class ViewClosed(LookupError):
    """The engine is shutting down; the admin call was not run (answered 404 by the admin app)."""


class ExecutorView:
    """An `EngineView` (kvsvc.engine.admin) of one `Executor`; build it after `launch()` (the incarnation is set)."""

    def __init__(self, executor: Executor, *, drain_timeout_s: float | None = None) -> None:
        """`drain_timeout_s` bounds `drain()`; default: the longest hold or receive deadline plus a call timeout,
        after which every transfer has ended by its own deadline anyway.

        Raises:
            ValueError: the executor was not launched (no incarnation yet).
        """
        if not executor.incarnation:
            raise ValueError(f"{executor.engine_id}: build the view after Executor.launch() (no incarnation yet)")
        self._executor = executor
        self._engine_id = executor.engine_id
        self._incarnation = executor.incarnation
        self._role = _ROLES.get(executor.config.role, "both")
        service = executor.config.service
        self._drain_timeout_s = drain_timeout_s or (
            max(service.hold_timeout_s, service.recv_timeout_s, service.abort_grace_s) + executor.config.call_timeout_s
        )
        self._lock = threading.Lock()
        self._closed = False
        self.draining = False

    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def incarnation(self) -> str:
        return self._incarnation

    @property
    def role(self) -> str:
        return self._role

    def workers(self) -> Mapping[Worker, WorkerMetadata]:
        return dict(self._executor.metas)

    def is_ready(self) -> bool:
        executor = self._executor
        return not self._closed and bool(executor.url) and len(executor.metas) == executor.num_workers

    async def statistics(self) -> Mapping[Worker, StatsDict]:
        stats = await self._run(lambda e: e.statistics())
        workers = [h.worker for h in self._executor.workers]
        return dict(zip(workers, stats, strict=False))

    async def peers(self) -> Sequence[PeerRow]:
        return await self._per_worker(Peers())

    async def transfers(self) -> Sequence[Mapping[str, object]]:
        return await self._per_worker(Transfers())

    async def drain(self) -> None:
        """Mark the engine draining and wait until no worker holds a send, awaits a receive or has a write in
        flight. The standalone engine takes new transfers only from its own driver (`kvsvc demo`, tests), which
        reads `draining`; workers keep serving the transfers they hold.

        Raises:
            ValueError: transfers were still in flight after the drain timeout (answered 409).
        """
        self.draining = True
        deadline = time.monotonic() + self._drain_timeout_s
        while True:
            stats = await self.statistics()
            busy = {w: s for w, s in stats.items() if s.get("holds") or s.get("writes_in_flight")}
            if not busy:
                return
            if time.monotonic() > deadline:
                raise ValueError(f"still in flight after {self._drain_timeout_s:.0f} s on workers {sorted(busy)}")
            await asyncio.sleep(_DRAIN_POLL_S)

    async def forget_peer(self, engine_id: str) -> None:
        await self._run(lambda e: e.broadcast(ForgetEngine(engine_id)))

    def close(self) -> None:
        """Refuse further calls and wait for the one in flight (call before `Executor.close`). Idempotent."""
        self._closed = True
        with self._lock:
            pass

    async def _per_worker(self, command: Peers | Transfers) -> list[dict[str, object]]:
        def gather(executor: Executor) -> list[dict[str, object]]:
            answers = executor.broadcast(command)
            rows: list[dict[str, object]] = []
            for handle, answer in zip(executor.workers, answers, strict=True):
                rows.extend(tag_worker(handle.worker, answer if isinstance(answer, list) else []))
            return rows

        return await self._run(gather)

    async def _run(self, call: Callable[[Executor], _T]) -> _T:
        def locked() -> _T:
            with self._lock:
                if self._closed:
                    raise ViewClosed(f"engine {self._engine_id} is shutting down")
                return call(self._executor)

        return await asyncio.to_thread(locked)


__all__ = ["ExecutorView", "ViewClosed"]
