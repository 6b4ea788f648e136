"""A thread-safe facade over `KVTransferService` for synchronous worker code.

Rules: the service lives on its own uvloop event loop in a daemon thread; every method here hands the call to that
loop and waits for its answer with a deadline (`call_timeout_s`), so a wedged loop surfaces as `KVSvcTimeout`, never
as a hang. Exceptions raised by the service are re-raised in the caller's thread unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kvsvc.errors import KVSvcTimeout, ServiceClosed
from kvsvc.messages import WorkerMetadata
from kvsvc.outputs import KVConnectorOutput
from kvsvc.service.config import ServiceConfig
from kvsvc.service.service import KVTransferService, ServiceStatistics
from kvsvc.transport.base import Transport

_T = TypeVar("_T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (it is a dependency), asyncio's default loop otherwise."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class ServiceThread:
    """Runs one `KVTransferService` on a private event loop thread.

    `transport_factory` is called on the loop thread (Mooncake's engine is created there); the transport must have
    its KV pool registered before `start` returns, since the published metadata points into it.
    """

    def __init__(
        self,
        metadata: WorkerMetadata,
        transport_factory: Callable[[], Transport],
        config: ServiceConfig | None = None,
        *,
        call_timeout_s: float = 30.0,
    ) -> None:
        self._metadata = metadata
        self._factory = transport_factory
        self._config = config
        self._timeout = call_timeout_s
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvsvc-loop", daemon=True)
        self._service: KVTransferService | None = None
        self.metadata: WorkerMetadata = metadata

    def start(self) -> WorkerMetadata:
        """Start the loop thread and the service; returns the metadata to publish.

        Raises:
            KVSvcTimeout: the service did not start within the call timeout.
            ServiceClosed: on any call after `close` (every method).
            OSError, TransportError: from the transport or the control server.
        """
        self._thread.start()

        async def boot() -> WorkerMetadata:
            self._service = KVTransferService(self._metadata, self._factory(), self._config)
            return await self._service.start()

        self.metadata = self._run(boot())
        return self.metadata

    @property
    def service(self) -> KVTransferService:
        """The service itself, to be touched only from its loop (`call` hands work there)."""
        if self._service is None:
            raise ServiceClosed("service thread not started")
        return self._service

    def call(self, fn: Callable[[KVTransferService], _T]) -> _T:
        """Run `fn(service)` on the loop and return its result (or raise its exception)."""

        async def run() -> _T:
            return fn(self.service)

        return self._run(run())

    def set_engine_metadata(self, metas: dict[tuple[int, int], WorkerMetadata]) -> None:
        self.call(lambda s: s.set_engine_metadata(metas))

    def start_send(
        self,
        req_id: str,
        transfer_id: str,
        block_ids: list[int],
        num_tokens: int,
        ready: concurrent.futures.Future[None] | Sequence[concurrent.futures.Future[None]] | None = None,
    ) -> None:
        """As `KVTransferService.start_send`; `ready` may be thread futures (wrapped for the loop)."""

        def go(s: KVTransferService) -> None:
            wrapped: Any = ready
            if isinstance(ready, concurrent.futures.Future):
                wrapped = asyncio.wrap_future(ready)
            elif ready is not None:
                wrapped = [asyncio.wrap_future(r) for r in ready]
            s.start_send(req_id, transfer_id, block_ids, num_tokens, wrapped)

        self.call(go)

    def start_recv(
        self,
        req_id: str,
        transfer_id: str,
        remote_engine_id: str,
        remote_url: str,
        block_ids: list[int],
        num_tokens: int,
    ) -> None:
        self.call(lambda s: s.start_recv(req_id, transfer_id, remote_engine_id, remote_url, block_ids, num_tokens))

    def abort(self, req_id: str) -> None:
        self.call(lambda s: s.abort(req_id))

    def get_finished(self) -> KVConnectorOutput:
        return self.call(lambda s: s.get_finished())

    def statistics(self) -> ServiceStatistics:
        return self.call(lambda s: s.statistics())

    def close(self) -> None:
        """Close the service (draining in-flight writes) and stop the loop thread. Idempotent."""
        if not self._thread.is_alive():
            return
        if self._service is not None:
            drain = self._config.close_drain_timeout_s if self._config else ServiceConfig().close_drain_timeout_s
            self._run(self._service.close(), timeout=drain + self._timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=self._timeout)
        if not self._thread.is_alive():
            self._loop.close()

    def _run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        if self._loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise ServiceClosed(f"service thread of worker {self.metadata.worker} is not running")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout if timeout is not None else self._timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise KVSvcTimeout(f"kvsvc loop did not answer within {timeout or self._timeout:g} s") from None
