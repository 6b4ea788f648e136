"""`MooncakeTransport`: the `Transport` protocol on the Mooncake Transfer Engine (P2PHANDSHAKE, TCP or RDMA).

Imports: stdlib, `kvsvc.core.errors`, `kvsvc.core.planner` (the address rule), `kvsvc.transport.base` and `.completion`
(which polls what this submits); `mooncake` only lazily, inside `MooncakeTransport`. Invariants (docs/mooncake.md):
every descriptor is its own one-descriptor batch (`transfer_submit_write`), because `transfer_check_status` only looks
at a batch's first descriptor; every id the engine returns goes to the `CompletionPoller`, the only caller of
`transfer_check_status`; `get_batch_transfer_status` and the blocking calls are never used. One poller task per
transport: no thread per transfer, no busy spinning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvsvc.core.errors import ERR_FAILED, TransportError
from kvsvc.core.messages import IpcHandle
from kvsvc.core.planner import AddressRanges, Descriptors, Region, as_rows, check_descriptors
from kvsvc.transport.base import OwnLoop, TransportClosed, TransportStatistics, WriteFailed, Written
from kvsvc.transport.completion import LOOP_TIMER_FLOOR_S, CompletionPoller, Write, wait_uncancellable

log = logging.getLogger(__name__)

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
    # While descriptors keep finishing, poll every `fine_poll_interval_s` through a timerfd instead of the loop's
    # 1 ms timers (None turns it off); `fine_poll_bytes` limits that to the tail of a burst (at most this many bytes
    # in flight; None: any amount). Why a whole burst: docs/decisions.md, "Completion polling naps short while
    # bytes move".
    fine_poll_interval_s: float | None = 0.0001
    fine_poll_bytes: int | None = None
    submit_chunk: int = 256  # descriptors submitted (12-16 us each, docs/mooncake.md) between yields to the loop
    close_timeout_s: float = 60.0
    # A worker on loopback starts its engine only when a pair of workers needs it (`kvsvc.transport.ondemand`);
    # False starts it with the worker (a benchmark of Mooncake itself).
    on_demand: bool = True

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
        if self.fine_poll_interval_s is not None and not 0 < self.fine_poll_interval_s < LOOP_TIMER_FLOOR_S:
            raise ValueError(
                f"fine_poll_interval_s must be in (0, {LOOP_TIMER_FLOOR_S}) or None, got {self.fine_poll_interval_s}"
            )
        if self.fine_poll_bytes is not None and self.fine_poll_bytes < 0:
            raise ValueError(f"fine_poll_bytes must be >= 0 or None, got {self.fine_poll_bytes}")
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
        self._completions = CompletionPoller(
            engine.transfer_check_status,
            drain_timeout_s=self.config.drain_timeout_s,
            progress_timeout_s=self.config.progress_timeout_s,
            poll_interval_min_s=self.config.poll_interval_min_s,
            poll_interval_max_s=self.config.poll_interval_max_s,
            fine_interval_s=self.config.fine_poll_interval_s,
            fine_bytes=self.config.fine_poll_bytes,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._own = OwnLoop()
        self._connected: set[str] = set()  # peers a submission already reached (handshake done)
        self._connect_locks: dict[str, asyncio.Lock] = {}
        self._closed = False  # writes refused from the first `close` on
        self._closing: asyncio.Future[None] | None = None
        self._counts = dict.fromkeys(("completed", "failures", "refused", "writes"), 0)
        self._probes: ThreadPoolExecutor | None = None  # one thread: a probe of a frozen peer blocks ~5 s

    @staticmethod
    def _start_engine(config: MooncakeConfig) -> Any:
        if os.environ.get("MC_TCP_PROTO") == "1":
            raise TransportError("MC_TCP_PROTO=1 drops the write acknowledgement: unset it", ERR_FAILED)
        if any(os.environ.get(k) != v for k, v in config.environment().items()):
            os.environ.update(config.environment())  # `worker_transport` sets them on its own thread first
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
    def local_session_id(self) -> str:
        return ""  # no same-host plane (`kvsvc.transport.routed.RoutedTransport` adds one)

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

    async def write(self, peer: str, descriptors: Descriptors) -> Written:
        """See `Transport.write`: the bytes or a `WriteFailed`; raises InvalidDescriptor before submitting and
        TransportClosed; cancellation waits for the submitted descriptors (bounded by the engine's progress timeout
        plus `drain_timeout_s`) before re-raising. A table is taken as tuples: the engine submits one at a time."""
        descriptors = as_rows(descriptors)
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
        queue = self._completions.queue(peer, loop.time())
        if queue.stuck:
            # An earlier write gave up on this peer with descriptors stuck behind it: fail fast, submit nothing.
            self._counts["refused"] += 1
            return WriteFailed(f"peer {peer} has descriptors stuck from a failed write", ERR_FAILED, peer=peer)
        op = self._start_op(queue, loop)
        cancelled = False
        try:
            await self._submit(op, descriptors)
            op.submitting = False
            op.settle()
            return await asyncio.shield(op.result)
        except asyncio.CancelledError:
            cancelled = True
            op.submitting = False
            if op.cancelled_at is None:
                op.cancelled_at = loop.time()
            op.settle()
            await wait_uncancellable(op.result)
            raise
        finally:
            self._end_op(op, counted=not cancelled)

    def start_write(self, peer: str, descriptors: Descriptors) -> asyncio.Future[Written] | None:
        """Submit a small write at once, from the running loop, without a task: the many-small-requests path.

        Returns a future that resolves exactly as `write` returns or raises (bytes written, or a `WriteFailed` whose
        `drained` may still be pending, or raising `TransportClosed`), or None, having submitted nothing, whenever
        `write` would do anything but submit at once: the first write to a peer (its handshake runs off the loop), a
        full window, stuck descriptors, more than `submit_chunk` descriptors, a refused descriptor, a closed
        transport. The caller then uses `write`, which raises what applies. Cancelling the future cancels nothing.
        """
        descriptors = as_rows(descriptors)
        if (
            self._closed
            or not descriptors
            or peer not in self._connected
            or len(descriptors) > self.config.submit_chunk
        ):
            return None
        queue = self._completions.queues.get(peer)
        if queue is not None and (
            queue.stuck or len(queue.entries) + len(descriptors) > self.config.max_queued_per_peer
        ):
            return None
        if self._loop is None or self._own.current() is not self._loop:
            return None
        try:
            check_descriptors(descriptors, self._local, self._peers.get(peer), peer)
        except TransportError:
            return None
        loop = self._bind_loop()
        op = self._start_op(self._completions.queue(peer, loop.time()), loop)
        submit = self._engine.transfer_submit_write
        for src, dst, length in descriptors:
            self._completions.enqueue(op, submit(peer, src, dst, length), length)
            if op.error is not None:
                break
        op.submitting = False
        op.settle()
        op.result.add_done_callback(lambda _: self._end_op(op))
        return op.result

    def _start_op(self, queue: Any, loop: asyncio.AbstractEventLoop) -> Write:
        """A write's bookkeeping from its first submission (`write` and `start_write` alike)."""
        op = Write(queue, loop)
        queue.writes.add(op)
        self._counts["writes"] += 1
        return op

    def _end_op(self, op: Write, *, counted: bool = True) -> None:
        """A write's bookkeeping once its caller has its outcome: it stays in its queue until its descriptors
        drained; `counted` False for a cancelled `write`, whose outcome is nobody's news."""
        self._counts["writes"] -= 1
        queue = op.queue
        if op.drained.done():
            queue.writes.discard(op)
        else:
            op.drained.add_done_callback(lambda _: queue.writes.discard(op))
        if not op.result.done() or op.result.cancelled():
            return
        if op.result.exception() is not None or not counted:  # (also marks it retrieved) closed mid-write
            return
        self._counts["failures" if isinstance(op.result.result(), WriteFailed) else "completed"] += 1

    async def _submit(self, op: Write, descriptors: Sequence[tuple[int, int, int]]) -> None:
        queue, engine, loop = op.queue, self._engine, self._loop
        assert loop is not None
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
                        await wait_uncancellable(fut)
                        self._completions.enqueue(op, fut.result(), length)
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
            self._completions.enqueue(op, engine.transfer_submit_write(queue.peer, src, dst, length), length)
            if (i - start) % self.config.submit_chunk == self.config.submit_chunk - 1:
                await asyncio.sleep(0)  # let the poller and others run between chunks

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._own.current()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise TransportError("MooncakeTransport used from a second event loop", ERR_FAILED)
        self._completions.start(loop, name=f"mooncake-poller-{self._session_id}")
        return loop

    # -- completion and statistics --------------------------------------------------------------------------------

    async def drained(self, peer: str | None = None) -> None:
        """Return once no descriptor to `peer` (any peer when None) is in flight. Cancellation-safe."""
        await self._completions.drained(peer)

    def statistics(self) -> TransportStatistics:
        c, done = self._counts, self._completions
        return TransportStatistics(
            bytes_written=done.bytes,
            descriptors_written=done.descriptors,
            writes_completed=c["completed"],
            failures=c["failures"],
            refused=c["refused"],
            writes_in_flight=c["writes"],
            descriptors_in_flight=done.in_flight,
            peers=len(self._peers),
            registered_bytes=self._local.total_bytes,
            polls=done.polls,
            fine_polls=done.fine_polls,
        )

    async def reachable(
        self,
        session: str,
        regions: Sequence[Region],
        via: tuple[tuple[str, int], tuple[str, int]] | None = None,
        handles: Sequence[IpcHandle] = (),
    ) -> str:
        """Writes to any added peer can go as far as this transport knows: "" always."""
        return ""

    async def peer_gone(self, session: str, within_s: float = 0.5) -> bool:
        """True when `session`'s transfer engine refuses a probe (`send_probe`) within `within_s`: its process is
        gone. A live engine answers (False); a frozen one keeps the probe waiting about 5 s before it fails, which
        is past `within_s`, so it counts as not gone. False too once this transport is closed. Never raises.
        """
        if self._closed or self._engine is None or session.startswith(("samehost:", "cudaipc:")):
            return False  # a same-host session is no engine's: a refused probe would read as a death
        if self._probes is None:
            self._probes = ThreadPoolExecutor(1, thread_name_prefix="kvsvc-probe")
        loop = asyncio.get_running_loop()
        started = loop.time()
        probe = loop.run_in_executor(self._probes, self._engine.send_probe, session)
        try:
            rc = await asyncio.wait_for(asyncio.shield(probe), within_s)
        except Exception:  # slow (a frozen peer) or failed: not proven gone
            return False
        return rc != 0 and loop.time() - started <= within_s

    async def close(self) -> None:
        """Refuse new writes, wait up to `close_timeout_s` for in-flight descriptors, then unregister the memory
        and destroy the engine (off the loop: it takes ~0.7 s). If descriptors are still in flight at the bound,
        their writes raise `TransportClosed` and the engine is deliberately leaked (never unregistered nor
        destroyed) so nothing frees memory a late transfer could touch.

        Idempotent: every call waits for the one close. Cancelling a caller leaves the close running to its end
        (bounded as above); writes are refused from the first call on.
        """
        if self._closing is None:
            self._closed = True
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        if self._completions.in_flight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.drained(), self.config.close_timeout_s)
        await self._completions.stop()
        if self._probes is not None:  # a probe uses the engine: let it return (at most ~5 s) before destroying it
            await _off_loop(self._probes.shutdown)
        if self._completions.in_flight:
            log.warning(
                "closing Mooncake transport %s with %d descriptor(s) in flight: leaking its engine",
                self._session_id,
                self._completions.in_flight,
            )
            _LEAKED_ENGINES.append(self._engine)
            for queue in self._completions.queues.values():
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

        await _off_loop(destroy)


async def _off_loop(fn: Callable[[], None]) -> None:
    """Run `fn` in a thread; in this thread when the interpreter is exiting and refuses new ones (an engine that
    closes its transport from an `atexit` hook, as vLLM does)."""
    try:
        done = asyncio.get_running_loop().run_in_executor(None, fn)
    except RuntimeError:  # the executor refused the job (it never ran): run it here
        fn()
        return
    await done
