"""`MooncakeTransport`: the `Transport` protocol on the Mooncake Transfer Engine (P2PHANDSHAKE, TCP or RDMA).

Imports: stdlib, `kvsvc.errors`, `kvsvc.transport.base`; `mooncake` only lazily, inside `MooncakeTransport`.
Invariants (MOONCAKE.md): every descriptor is its own one-descriptor batch (`transfer_submit_write`), because
`transfer_check_status` only looks at a batch's first descriptor; an id is polled until it reports 1 or -1 and never
again (that frees it); id 0 is a refusal, never polled; `get_batch_transfer_status` and the blocking calls are never
used. One poller task per transport, on the event loop: no thread per transfer, no busy spinning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvsvc.errors import TransportError
from kvsvc.transport.base import (
    ERR_FAILED,
    AddressRanges,
    Region,
    TransportClosed,
    TransportStatistics,
    WriteFailed,
    check_descriptors,
)

log = logging.getLogger(__name__)

# asyncio's epoll and uvloop's libuv timers both have a 1 ms floor; uvloop turns any shorter sleep into a zero
# timeout, i.e. a busy spin of the loop (measured). So the poller never sleeps less than this.
LOOP_TIMER_FLOOR_S: Final = 0.001
# Engines whose close gave up on in-flight descriptors: kept alive (never unregistered nor destroyed) so a late
# completion cannot touch freed memory or a dead engine.
_LEAKED_ENGINES: list[Any] = []


@dataclass(frozen=True)
class MooncakeConfig:
    """How a `MooncakeTransport` starts its engine and polls it.

    `progress_timeout_s`, `transfer_timeout_s` and `max_queued_per_peer` reach the engine through the MC_* environment
    variables, set by `MooncakeTransport()` just before the engine initialises: they are process-wide, and each engine
    reads them when it initialises (measured), so two transports in one process should share one config.
    `transfer_timeout_s` (MC_TRANSFER_TIMEOUT, >= 5) is off by default: it fails a call while its data keeps
    moving, which defeats the "finished means no longer moving" rule the service relies on.

    Raises:
        ValueError: a field is out of range.
    """

    host: str = "127.0.0.1"  # the address peers reach this engine at; also the session id's host
    protocol: str = "tcp"  # "tcp" or "rdma"
    device_name: str = ""  # RDMA device list ("" lets the engine discover them)
    progress_timeout_s: int = 30  # MC_TCP_PROGRESS_TIMEOUT_SEC: a connection without progress is dropped after it
    transfer_timeout_s: int | None = None  # MC_TRANSFER_TIMEOUT; None leaves the engine's default (off)
    max_queued_per_peer: int = 65535  # MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER, also our in-flight window per peer
    # After a descriptor of a write failed (or the write was cancelled and Mooncake's progress timeout passed), the
    # write stops waiting for its other descriptors once the peer completed none for this long.
    drain_timeout_s: float = 1.0
    poll_interval_min_s: float = LOOP_TIMER_FLOOR_S
    poll_interval_max_s: float = 0.05
    submit_chunk: int = 256  # descriptors submitted (about 2 us each) between yields to the event loop
    close_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if self.progress_timeout_s < 1:
            raise ValueError(f"progress_timeout_s must be >= 1, got {self.progress_timeout_s}")
        if self.transfer_timeout_s is not None and self.transfer_timeout_s < 5:
            raise ValueError(f"transfer_timeout_s must be >= 5 (Mooncake's floor), got {self.transfer_timeout_s}")
        if self.max_queued_per_peer < 1 or self.submit_chunk < 1:
            raise ValueError("max_queued_per_peer and submit_chunk must be >= 1")
        if not 0 < self.poll_interval_min_s <= self.poll_interval_max_s:
            raise ValueError("need 0 < poll_interval_min_s <= poll_interval_max_s")
        if self.drain_timeout_s <= 0 or self.close_timeout_s < 0:
            raise ValueError("drain_timeout_s must be > 0 and close_timeout_s >= 0")

    def environment(self) -> dict[str, str]:
        """The MC_* variables this config sets."""
        env = {
            "MC_TCP_PROGRESS_TIMEOUT_SEC": str(self.progress_timeout_s),
            "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": str(self.max_queued_per_peer),
        }
        if self.transfer_timeout_s is not None:
            env["MC_TRANSFER_TIMEOUT"] = str(self.transfer_timeout_s)
        return env


class _Write:
    """One `write` call: its submitted-but-unfinished descriptors and the two futures it resolves."""

    __slots__ = (
        "bytes_ok",
        "cancelled_at",
        "code",
        "drained",
        "error",
        "failed_at",
        "pending",
        "queue",
        "result",
        "submitting",
    )

    def __init__(self, queue: _PeerQueue, loop: asyncio.AbstractEventLoop) -> None:
        self.queue = queue
        self.pending = 0  # submitted, not finished
        self.submitting = True
        self.bytes_ok = 0
        self.error: str | None = None
        self.code = ERR_FAILED
        self.failed_at: float | None = None
        self.cancelled_at: float | None = None
        self.result: asyncio.Future[int] = loop.create_future()  # when `write` may return or raise
        self.drained: asyncio.Future[None] = loop.create_future()  # when nothing of it can move any more

    def fail(self, message: str, code: int, now: float) -> None:
        if self.error is None:
            self.error, self.code, self.failed_at = message, code, now

    def settle(self) -> None:
        """Resolve the futures that the current state allows."""
        if self.submitting or self.pending:
            return
        if not self.drained.done():
            self.drained.set_result(None)
            self.queue.stuck.discard(self)
        if self.result.done():
            return
        if self.error is None:
            self.result.set_result(self.bytes_ok)
        else:
            self.result.set_exception(self.failure())

    def give_up(self) -> None:
        """Resolve `result` with descriptors still in flight (the peer stopped progressing)."""
        if not self.result.done():
            self.queue.stuck.add(self)
            self.result.set_exception(self.failure(f"; {self.pending} descriptor(s) still in flight, await .drained"))

    def failure(self, suffix: str = "") -> WriteFailed:
        message = self.error or f"write to {self.queue.peer} cancelled"
        return WriteFailed(
            message + suffix, self.code, peer=self.queue.peer, undrained=self.pending, drained=self.drained
        )


class _PeerQueue:
    """The descriptors in flight to one peer, in submission order (the engine serves a peer roughly FIFO)."""

    def __init__(self, peer: str, now: float) -> None:
        self.peer = peer
        self.entries: deque[tuple[int, _Write, int]] = deque()  # (batch id, its write, length)
        self.writes: set[_Write] = set()
        self.stuck: set[_Write] = set()  # writes that gave up (result done) with descriptors still in flight
        self.last_success = now
        self.space = asyncio.Event()  # set when the window has room again


class MooncakeTransport:
    """The `Transport` protocol on one Mooncake `TransferEngine` (see `kvsvc.transport.base.Transport`).

    Construction initialises the engine (blocking, a few ms). The first `write` binds the transport to its running
    loop and starts the poller task there.

    Raises (constructor):
        ImportError: no `mooncake` package.
        TransportError: MC_TCP_PROTO=1 is set (writes would return before landing), or initialise failed (its code).
    """

    def __init__(self, config: MooncakeConfig | None = None, *, engine: Any = None) -> None:
        """`engine`: an initialised `mooncake.engine.TransferEngine` (or a stand-in for tests) to use instead of
        creating one; the config's environment is then not applied."""
        self.config = config or MooncakeConfig()
        if engine is None:
            engine = self._start_engine(self.config)
        self._engine: Any = engine
        self._session_id = f"{self.config.host}:{engine.get_rpc_port()}"
        self._local = AddressRanges()
        self._peers: dict[str, AddressRanges] = {}
        self._queues: dict[str, _PeerQueue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._connected: set[str] = set()  # peers a submission already reached (handshake done)
        self._connect_locks: dict[str, asyncio.Lock] = {}
        self._closed = False
        self._counts = dict.fromkeys(
            ("bytes", "descriptors", "completed", "failures", "refused", "writes", "in_flight", "polls"), 0
        )

    @staticmethod
    def _start_engine(config: MooncakeConfig) -> Any:
        if os.environ.get("MC_TCP_PROTO") == "1":
            raise TransportError("MC_TCP_PROTO=1 drops the write acknowledgement: unset it", ERR_FAILED)
        os.environ.update(config.environment())
        from mooncake.engine import TransferEngine  # lazy: `import kvsvc.transport` must work without mooncake

        engine = TransferEngine()
        rc = engine.initialize(config.host, "P2PHANDSHAKE", config.protocol, config.device_name)
        if rc != 0:
            raise TransportError(f"Mooncake initialize({config.host!r}, {config.protocol!r}) returned {rc}", rc)
        return engine

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def native_engine(self) -> Any:
        """The underlying `mooncake.engine.TransferEngine` (None after `close`), for benchmarks and diagnostics that
        measure the engine itself; nothing in kvsvc writes through it, and a caller must not while writes are in
        flight."""
        return self._engine

    # -- registration and peers -----------------------------------------------------------------------------------

    def register(self, regions: Sequence[Region]) -> None:
        """Register local memory in bulk (`batch_register_memory`, which releases the GIL).

        Raises:
            TransportError: a region is empty or overlaps one already registered (code -7, nothing registered),
                or the engine refused (its code).
            TransportClosed: after `close`.
        """
        if self._closed:
            raise TransportClosed("transport closed")
        staged = AddressRanges(self._local.regions())
        for addr, length in regions:
            staged.add(addr, length)
        if not regions:
            return
        rc = self._engine.batch_register_memory([a for a, _ in regions], [n for _, n in regions])
        if rc != 0:
            raise TransportError(f"batch_register_memory of {len(regions)} region(s) returned {rc}", rc)
        self._local = staged

    def add_peer(self, session_id: str, regions: Sequence[Region]) -> None:
        """Publish a peer's regions (replacing earlier ones). Raises `TransportError` on an empty/overlapping one."""
        self._peers[session_id] = AddressRanges(regions)

    def remove_peer(self, session_id: str) -> None:
        """Forget a peer; its writes in flight finish (or fail) on their own."""
        self._peers.pop(session_id, None)
        self._connected.discard(session_id)
        self._connect_locks.pop(session_id, None)

    # -- writes ---------------------------------------------------------------------------------------------------

    async def write(self, peer: str, descriptors: Sequence[tuple[int, int, int]]) -> int:
        """See `Transport.write`: raises InvalidDescriptor before submitting, WriteFailed, TransportClosed;
        cancellation waits for the submitted descriptors (bounded by the engine's progress timeout plus
        `drain_timeout_s`) before re-raising."""
        if self._closed:
            self._counts["refused"] += 1
            raise TransportClosed(f"transport closed; write to {peer} refused")
        try:
            check_descriptors(descriptors, self._local, self._peers.get(peer), peer)
        except TransportError:
            self._counts["refused"] += 1
            raise
        if not descriptors:
            return 0
        loop = self._bind_loop()
        queue = self._queues.get(peer)
        if queue is None:
            queue = self._queues[peer] = _PeerQueue(peer, loop.time())
        elif queue.stuck:
            # An earlier write gave up on this peer with descriptors stuck behind it: fail fast, submit nothing.
            self._counts["refused"] += 1
            raise WriteFailed(f"peer {peer} has descriptors stuck from a failed write", ERR_FAILED, peer=peer)
        op = _Write(queue, loop)
        queue.writes.add(op)
        self._counts["writes"] += 1
        try:
            await self._submit(op, descriptors)
            op.submitting = False
            op.settle()
            nbytes = await asyncio.shield(op.result)
        except asyncio.CancelledError:
            op.submitting = False
            if op.cancelled_at is None:
                op.cancelled_at = loop.time()
            op.settle()
            await _wait_uncancellable(op.result)
            raise
        except WriteFailed:
            self._counts["failures"] += 1
            raise
        finally:
            self._counts["writes"] -= 1
            if op.drained.done():
                queue.writes.discard(op)
            else:
                op.drained.add_done_callback(lambda _: queue.writes.discard(op))
            if op.result.done() and not op.result.cancelled():
                op.result.exception()  # mark retrieved: a cancelled write's failure is not news
        self._counts["completed"] += 1
        return nbytes

    def start_write(self, peer: str, descriptors: Sequence[tuple[int, int, int]]) -> asyncio.Future[int] | None:
        """Submit a small write at once, from the running loop, without a task: the many-small-requests path.

        Returns a future that resolves exactly as `write` returns or raises (bytes written, or `WriteFailed` whose
        `drained` may still be pending, or `TransportClosed`), or None, having submitted nothing, whenever `write`
        would do anything but submit at once: the first write to a peer (its handshake runs off the loop), a full
        window, stuck descriptors, more than `submit_chunk` descriptors, a refused descriptor, a closed transport.
        The caller then uses `write`, which raises what applies. Cancelling the future cancels nothing.
        """
        if (
            self._closed
            or not descriptors
            or peer not in self._connected
            or len(descriptors) > self.config.submit_chunk
        ):
            return None
        queue = self._queues.get(peer)
        if queue is not None and (
            queue.stuck or len(queue.entries) + len(descriptors) > self.config.max_queued_per_peer
        ):
            return None
        if self._loop is None or asyncio.get_running_loop() is not self._loop:
            return None
        try:
            check_descriptors(descriptors, self._local, self._peers.get(peer), peer)
        except TransportError:
            return None
        loop = self._bind_loop()
        if queue is None:
            queue = self._queues[peer] = _PeerQueue(peer, loop.time())
        op = _Write(queue, loop)
        queue.writes.add(op)
        self._counts["writes"] += 1
        submit = self._engine.transfer_submit_write
        for src, dst, length in descriptors:
            self._enqueue(op, submit(peer, src, dst, length), length)
            if op.error is not None:
                break
        op.submitting = False
        op.settle()
        op.result.add_done_callback(lambda _: self._started_write_done(op))
        return op.result

    def _started_write_done(self, op: _Write) -> None:
        """Bookkeeping of a `start_write` once its result is decided (what `write`'s epilogue does)."""
        self._counts["writes"] -= 1
        queue = op.queue
        if op.drained.done():
            queue.writes.discard(op)
        else:
            op.drained.add_done_callback(lambda _: queue.writes.discard(op))
        if op.result.cancelled():
            return
        exc = op.result.exception()
        if exc is None:
            self._counts["completed"] += 1
        elif isinstance(exc, WriteFailed):
            self._counts["failures"] += 1

    async def _submit(self, op: _Write, descriptors: Sequence[tuple[int, int, int]]) -> None:
        queue, engine, loop = op.queue, self._engine, self._loop
        assert loop is not None and self._wake is not None
        start = 0
        if queue.peer not in self._connected:
            async with self._connect_locks.setdefault(queue.peer, asyncio.Lock()):
                if queue.peer not in self._connected:
                    # The first write to a peer handshakes inside the submit call: keep a slow or black-holed
                    # peer from stalling the loop.
                    src, dst, length = descriptors[0]
                    fut = loop.run_in_executor(None, engine.transfer_submit_write, queue.peer, src, dst, length)
                    try:
                        await asyncio.shield(fut)
                    finally:  # also on cancel: the id exists and must be polled
                        await _wait_uncancellable(fut)
                        self._enqueue(op, fut.result(), length)
                    if op.error is None:
                        self._connected.add(queue.peer)
                    start = 1
        for i in range(start, len(descriptors)):
            if op.error is not None or op.cancelled_at is not None:
                return
            if self._closed:
                op.fail(f"transport closed while submitting a write to {queue.peer}", ERR_FAILED, loop.time())
                return
            src, dst, length = descriptors[i]
            while len(queue.entries) >= self.config.max_queued_per_peer:
                queue.space.clear()
                await queue.space.wait()
            self._enqueue(op, engine.transfer_submit_write(queue.peer, src, dst, length), length)
            if (i - start) % self.config.submit_chunk == self.config.submit_chunk - 1:
                await asyncio.sleep(0)  # let the poller and others run between chunks

    def _enqueue(self, op: _Write, batch_id: int, length: int) -> None:
        assert self._loop is not None and self._wake is not None
        if batch_id == 0:  # refused (unknown peer, queue full): never poll an id 0
            op.fail(
                f"Mooncake refused to submit a write to {op.queue.peer} (batch id 0)", ERR_FAILED, self._loop.time()
            )
            return
        op.queue.entries.append((batch_id, op, length))
        op.pending += 1
        self._counts["in_flight"] += 1
        self._wake.set()

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._wake = loop, asyncio.Event()
        elif self._loop is not loop:
            raise TransportError("MooncakeTransport used from a second event loop", ERR_FAILED)
        if self._poller is None or self._poller.done():
            self._poller = loop.create_task(self._poll_forever(), name=f"mooncake-poller-{self._session_id}")
        return loop

    # -- completion polling -------------------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        """Poll in-flight ids: per peer from the oldest, stopping at the first still running one. Sleeps in
        proportion to how long nothing finished (1/16 of it, between the configured bounds); parks when idle."""
        assert self._loop is not None and self._wake is not None
        cfg, loop = self.config, self._loop
        last_progress = loop.time()
        while True:
            if not any(q.entries for q in self._queues.values()):
                self._wake.clear()
                await self._wake.wait()
                last_progress = loop.time()
            now = loop.time()
            if self._poll_once(now):
                last_progress = now
            interval = min(cfg.poll_interval_max_s, max(cfg.poll_interval_min_s, (now - last_progress) / 16))
            await asyncio.sleep(max(interval, LOOP_TIMER_FLOOR_S))

    def _poll_once(self, now: float) -> int:
        finished = 0
        check = self._engine.transfer_check_status
        for peer, queue in list(self._queues.items()):
            entries = queue.entries
            while entries:
                batch_id, op, length = entries[0]
                status = check(batch_id)
                self._counts["polls"] += 1
                if status == 0:
                    break
                entries.popleft()  # 1 and -1 freed the id: never poll it again
                finished += 1
                self._counts["in_flight"] -= 1
                op.pending -= 1
                if status == 1:
                    op.bytes_ok += length
                    queue.last_success = now
                    self._counts["bytes"] += length
                    self._counts["descriptors"] += 1
                else:
                    op.fail(f"Mooncake failed a write to {peer} (status {status})", ERR_FAILED, now)
                op.settle()
            if finished:
                queue.space.set()
            self._check_stalls(queue, now)
            if not entries and not queue.writes:
                del self._queues[peer]
        return finished

    def _check_stalls(self, queue: _PeerQueue, now: float) -> None:
        """Give up waiting for a failed or cancelled write's descriptors when the peer stopped progressing."""
        cfg = self.config
        for op in queue.writes:
            if op.result.done() or not op.pending:
                continue
            if op.failed_at is not None:
                since = max(op.failed_at, queue.last_success)
                if now - since > cfg.drain_timeout_s:
                    op.give_up()
            elif op.cancelled_at is not None:
                # Mooncake fails a descriptor without byte progress after its progress timeout; wait for that.
                since = max(op.cancelled_at, queue.last_success)
                if now - since > cfg.progress_timeout_s + cfg.drain_timeout_s:
                    op.give_up()

    async def drained(self, peer: str | None = None) -> None:
        """Return once no descriptor to `peer` (any peer when None) is in flight. Cancellation-safe."""
        while True:
            queues = [q for p, q in self._queues.items() if peer is None or p == peer]
            waits = [op.drained for q in queues for op in q.writes if not op.drained.done()]
            if not waits:
                return
            await asyncio.wait(waits)

    def statistics(self) -> TransportStatistics:
        c = self._counts
        return TransportStatistics(
            bytes_written=c["bytes"],
            descriptors_written=c["descriptors"],
            writes_completed=c["completed"],
            failures=c["failures"],
            refused=c["refused"],
            writes_in_flight=c["writes"],
            descriptors_in_flight=c["in_flight"],
            peers=len(self._peers),
            registered_bytes=self._local.total_bytes,
            polls=c["polls"],
        )

    async def close(self) -> None:
        """Refuse new writes, wait up to `close_timeout_s` for in-flight descriptors, then unregister the memory
        and destroy the engine (off the loop: it takes ~0.7 s). Idempotent. If descriptors are still in flight at
        the bound, their writes raise `TransportClosed` and the engine is deliberately leaked (never unregistered
        nor destroyed) so nothing frees memory a late transfer could touch."""
        if self._closed:
            return
        self._closed = True
        if self._counts["in_flight"]:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.drained(), self.config.close_timeout_s)
        if self._poller is not None:
            self._poller.cancel()
            await _wait_uncancellable(self._poller)
        if self._counts["in_flight"]:
            log.warning(
                "closing Mooncake transport %s with %d descriptor(s) in flight: leaking its engine",
                self._session_id,
                self._counts["in_flight"],
            )
            _LEAKED_ENGINES.append(self._engine)
            for queue in self._queues.values():
                for op in queue.writes:
                    if not op.result.done():
                        op.result.set_exception(TransportClosed(f"transport closed during a write to {queue.peer}"))
            return
        box = [self._engine]
        self._engine = None
        regions = self._local.regions()

        def destroy() -> None:
            if regions:
                box[0].batch_unregister_memory([a for a, _ in regions])
            box.clear()  # the last reference: the engine's destructor runs here, off the loop

        await asyncio.to_thread(destroy)


async def _wait_uncancellable(fut: asyncio.Future[Any]) -> None:
    """Wait until `fut` is done, absorbing cancellations (the caller re-raises its own afterwards)."""
    while not fut.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait((fut,))
