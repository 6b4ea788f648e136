"""A thread-safe facade over `KVTransferService` for synchronous worker code.

Rules: the service lives on its own uvloop event loop in a daemon thread; every method here hands the call to that
loop, in order, and waits for its answer with a deadline (`call_timeout_s`), so a wedged loop surfaces as
`KVSvcTimeout`, never as a hang. Exceptions raised by the service are re-raised in the caller's thread unchanged. Two
calls let an engine's step go on past a busy loop: `post` does not wait, and `get_finished` waits `report_wait_s` at
most, then hands its report to a later call; only a loop silent for `call_timeout_s` fails it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kvsvc.core.errors import KVSvcTimeout, ServiceClosed
from kvsvc.core.messages import WorkerMetadata
from kvsvc.core.outputs import KVConnectorOutput
from kvsvc.service.config import ServiceConfig
from kvsvc.service.service import KVTransferService, ServiceStatistics
from kvsvc.service.staging_area import StagingArea
from kvsvc.transport.base import Transport

_T = TypeVar("_T")
# What a close may take past the writes' drain: the transport's own close (Mooncake waits up to 60 s for descriptors
# in flight), a peer probe it lets finish (up to about 5 s) and the engine's destruction (about 1 s), and slack.
CLOSE_SLACK_S = 90.0
# How long `get_finished` waits for the loop before the step goes on without its report: a drain takes microseconds,
# so only a loop busy with something else (a long copy, a stalled transport call) makes it wait this long.
REPORT_WAIT_S = 1.0


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
        close_timeout_s: float | None = None,
        staging: StagingArea | None = None,
        report_wait_s: float = REPORT_WAIT_S,
    ) -> None:
        """`staging`: a staging region the transport factory registers, for the writes its rule picks (P side)."""
        self._metadata = metadata
        self._staging = staging
        self._factory = transport_factory
        self._config = config
        self._timeout = call_timeout_s
        drain = (config or ServiceConfig()).close_drain_timeout_s
        self._close_timeout = close_timeout_s if close_timeout_s is not None else drain + CLOSE_SLACK_S
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvsvc-loop", daemon=True)
        self._service: KVTransferService | None = None
        self._report_wait = min(report_wait_s, call_timeout_s)
        # A report the loop has not handed back yet, and when it was asked for: the next calls deliver it.
        self._late_report: concurrent.futures.Future[KVConnectorOutput] | None = None
        self._late_since = 0.0
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
            self._service = KVTransferService(self._metadata, self._factory(), self._config, staging=self._staging)
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

    def post(self, fn: Callable[[KVTransferService], object]) -> concurrent.futures.Future[object]:
        """Hand `fn(service)` to the loop and return at once; it runs in order with every other call. What it
        raises lands in the returned future only, so `fn` must deliver its outcomes itself.

        Raises:
            ServiceClosed: the loop is not running.
        """

        async def run() -> object:
            return fn(self.service)

        return self._submit(run())

    def set_engine_metadata(self, metas: dict[tuple[int, int], WorkerMetadata]) -> None:
        self.call(lambda s: s.set_engine_metadata(metas))

    def start_send(
        self,
        req_id: str,
        transfer_id: str,
        block_ids: list[int],
        num_tokens: int,
        ready: concurrent.futures.Future[None] | Sequence[concurrent.futures.Future[None]] | None = None,
        *,
        secret: str | None = None,
    ) -> str:
        """As `KVTransferService.start_send` (returns the transfer's secret); `ready` may be thread futures
        (wrapped for the loop)."""

        def go(s: KVTransferService) -> str:
            wrapped: Any = ready
            if isinstance(ready, concurrent.futures.Future):
                wrapped = asyncio.wrap_future(ready)
            elif ready is not None:
                wrapped = [asyncio.wrap_future(r) for r in ready]
            return s.start_send(req_id, transfer_id, block_ids, num_tokens, wrapped, secret=secret)

        return self.call(go)

    def start_recv(
        self,
        req_id: str,
        transfer_id: str,
        remote_engine_id: str,
        remote_url: str,
        block_ids: list[int],
        num_tokens: int,
        first_token: int = 0,
        *,
        secret: str,
    ) -> None:
        self.call(
            lambda s: s.start_recv(
                req_id, transfer_id, remote_engine_id, remote_url, block_ids, num_tokens, first_token, secret=secret
            )
        )

    def abort(self, req_id: str) -> None:
        self.call(lambda s: s.abort(req_id))

    def get_finished(self, wait_s: float = 0.0, step_s: float = 0.0) -> KVConnectorOutput:
        """As `KVTransferService.get_finished(step_s)`, waiting `report_wait_s` at most (plus `wait_s`, which the
        loop first spends waiting for news, `KVTransferService.wait_for_reports`, so an idle caller need not poll).
        A report the loop has not handed back by then is kept, never cancelled (the loop may have drained already),
        and delivered by a later call, merged with that call's own: nothing reported is ever lost or repeated. While
        it is pending, calls return an empty report at once and ask the loop nothing more.

        Raises:
            KVSvcTimeout: the loop has not answered a report for `call_timeout_s` (it is wedged, not busy).
            ServiceClosed: after `close`.
        """
        now = time.monotonic()
        late, self._late_report = self._late_report, None
        if late is not None and not late.done():
            self._late_report = late
            if now - self._late_since >= self._timeout:
                raise KVSvcTimeout(
                    f"kvsvc loop of worker {self.metadata.worker} has not answered get_finished for "
                    f"{now - self._late_since:.1f} s (call_timeout_s {self._timeout:g})"
                )
            return KVConnectorOutput()
        future = self._submit(self._drain(wait_s, step_s))
        try:
            report = future.result(self._report_wait + wait_s)
        except concurrent.futures.TimeoutError:
            self._late_report, self._late_since = future, now
            report = KVConnectorOutput()
        return report if late is None else _merge(late.result(), report)

    async def _drain(self, wait_s: float, step_s: float) -> KVConnectorOutput:
        if wait_s > 0:
            await self.service.wait_for_reports(wait_s)
        return self.service.get_finished(step_s)

    def statistics(self) -> ServiceStatistics:
        return self.call(lambda s: s.statistics())

    def close(self) -> None:
        """Close the service (`KVTransferService.close`: writes drain, then the transport closes) and stop the loop
        thread. Idempotent.

        Waits at most `close_timeout_s`: the service's own bounds (`close_drain_timeout_s` for the writes, then
        the transport's close timeout, Mooncake's 60 s by default, plus a probe and the engine's destruction) and
        some slack; a close that takes longer means a wedged loop, which is then stopped where it stands.

        Raises:
            KVSvcTimeout: the close did not end within `close_timeout_s` (the loop thread is stopped anyway).
        """
        if not self._thread.is_alive():
            return
        try:
            if self._service is not None:
                self._run(self._service.close(), timeout=self._close_timeout)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=self._timeout)
        if not self._thread.is_alive():
            self._loop.close()

    def _submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        if self._loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise ServiceClosed(f"service thread of worker {self.metadata.worker} is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        future = self._submit(coro)
        try:
            return future.result(timeout if timeout is not None else self._timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise KVSvcTimeout(f"kvsvc loop did not answer within {timeout or self._timeout:g} s") from None


def _merge(a: KVConnectorOutput, b: KVConnectorOutput) -> KVConnectorOutput:
    """Two reports of one worker as one (their id sets are disjoint: each id is reported once)."""

    def union(x: set[str] | None, y: set[str] | None) -> set[str] | None:
        return (x or set()) | (y or set()) or None

    return KVConnectorOutput(
        finished_sending=union(a.finished_sending, b.finished_sending),
        finished_recving=union(a.finished_recving, b.finished_recving),
        failed_recving=union(a.failed_recving, b.failed_recving),
        invalid_block_ids=a.invalid_block_ids | b.invalid_block_ids,
        kv_connector_stats=_sum_stats(a.kv_connector_stats, b.kv_connector_stats),
    )


def _sum_stats(a: object, b: object) -> object:
    """The service's stats are counter deltas: two deltas add up."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}
    return b if a is None else a
