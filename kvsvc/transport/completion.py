"""Completion of Mooncake writes: the descriptors in flight per peer, the `Write` each belongs to, and their poller.

Imports: stdlib, `kvsvc.core.errors` and `kvsvc.transport.base` only; the engine is reached through the `check_status`
callable it is given (`transfer_check_status`). Invariants (docs/mooncake.md): an id is polled until it reports 1 or -1
and never again (that frees it); id 0 is a refusal, never enqueued nor polled; per peer, ids are polled from the oldest,
stopping at the first still running one. One poll task, on the event loop, that parks when idle and never sleeps less
than `LOOP_TIMER_FLOOR_S` on the loop's timers; only while descriptors keep finishing (one within the last
`PROGRESS_WINDOW_S`, and at most the configured bytes in flight) does it take shorter naps, from a `FineTimer`, when the
platform has one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from kvsvc.core.errors import ERR_FAILED
from kvsvc.transport.base import WriteFailed, Written
from kvsvc.transport.finetimer import FineTimer

# asyncio's epoll and uvloop's libuv timers both have a 1 ms floor; uvloop turns any shorter sleep into a zero
# timeout, i.e. a busy spin of the loop (measured). So the poller never sleeps less than this.
LOOP_TIMER_FLOOR_S: Final = 0.001
# Short naps only while descriptors keep finishing: a peer that finished nothing for this long is not about to, and
# fine polls of a stalled peer would only burn CPU until its progress timeout.
PROGRESS_WINDOW_S: Final = 0.002


class Write:
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

    def __init__(self, queue: PeerQueue, loop: asyncio.AbstractEventLoop) -> None:
        self.queue = queue
        self.pending = 0  # submitted, not finished
        self.submitting = True
        self.bytes_ok = 0
        self.error: str | None = None
        self.code = ERR_FAILED
        self.failed_at: float | None = None
        self.cancelled_at: float | None = None
        self.result: asyncio.Future[Written] = loop.create_future()  # when `write` may end, and how
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
        self.result.set_result(self.bytes_ok if self.error is None else self.failure())

    def give_up(self) -> None:
        """Resolve `result` with descriptors still in flight (the peer stopped progressing)."""
        if not self.result.done():
            self.queue.stuck.add(self)
            self.result.set_result(self.failure(f"; {self.pending} descriptor(s) still in flight, await .drained"))

    def failure(self, suffix: str = "") -> WriteFailed:
        message = self.error or f"write to {self.queue.peer} cancelled"
        return WriteFailed(
            message + suffix, self.code, peer=self.queue.peer, undrained=self.pending, drained=self.drained
        )


class PeerQueue:
    """The descriptors in flight to one peer, in submission order (the engine serves a peer roughly FIFO)."""

    def __init__(self, peer: str, now: float) -> None:
        self.peer = peer
        self.entries: deque[tuple[int, Write, int]] = deque()  # (batch id, its write, length)
        self.writes: set[Write] = set()
        self.stuck: set[Write] = set()  # writes that gave up (result done) with descriptors still in flight
        self.last_success = now
        self.space = asyncio.Event()  # set when the window has room again


class CompletionPoller:
    """The in-flight descriptors of one transport, per peer, and the task that polls them to completion.

    `check_status` is the engine's `transfer_check_status`; `stop` drops it, so that the transport's reference to
    the engine is the last one when it destroys the engine.
    """

    def __init__(
        self,
        check_status: Callable[[int], int],
        *,
        drain_timeout_s: float,
        progress_timeout_s: float,
        poll_interval_min_s: float,
        poll_interval_max_s: float,
        fine_interval_s: float | None = None,
        fine_bytes: int | None = None,
    ) -> None:
        self.queues: dict[str, PeerQueue] = {}
        self._check_status: Callable[[int], int] | None = check_status
        self._drain_timeout_s = drain_timeout_s
        self._progress_timeout_s = progress_timeout_s
        self._interval_min_s = poll_interval_min_s
        self._interval_max_s = poll_interval_max_s
        self._fine_interval_s = fine_interval_s
        self._fine_bytes = fine_bytes
        self._fine: FineTimer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.in_flight = 0  # descriptors submitted, not finished
        self.in_flight_bytes = 0
        self.fine_polls = 0  # polls after a short nap
        self.bytes = 0  # written by descriptors that finished
        self.descriptors = 0  # finished successfully
        self.polls = 0  # `check_status` calls

    def start(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        """Run the poll task on `loop` unless it runs already (or start it again if it ended)."""
        if self._loop is None:
            self._loop, self._wake = loop, asyncio.Event()
            if self._fine_interval_s is not None:
                self._fine = FineTimer.open(loop)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._poll_forever(), name=name)

    async def stop(self) -> None:
        """Cancel the poll task, wait for it to end, and drop `check_status`; nothing is polled afterwards."""
        if self._task is not None:
            self._task.cancel()
            await wait_uncancellable(self._task)
        if self._fine is not None:
            self._fine.close()
            self._fine = None
        self._check_status = None

    def queue(self, peer: str, now: float) -> PeerQueue:
        """`peer`'s queue, opened (its last success `now`) if it has none."""
        queue = self.queues.get(peer)
        if queue is None:
            queue = self.queues[peer] = PeerQueue(peer, now)
        return queue

    def enqueue(self, op: Write, batch_id: int, length: int) -> None:
        """Track a descriptor that `op` submitted; batch id 0 (a refusal) fails `op` instead. Call after `start`."""
        assert self._loop is not None and self._wake is not None
        if batch_id == 0:  # refused (unknown peer, queue full): never poll an id 0
            op.fail(
                f"Mooncake refused to submit a write to {op.queue.peer} (batch id 0)", ERR_FAILED, self._loop.time()
            )
            return
        op.queue.entries.append((batch_id, op, length))
        op.pending += 1
        self.in_flight += 1
        self.in_flight_bytes += length
        self._wake.set()

    async def drained(self, peer: str | None = None) -> None:
        """Return once no descriptor to `peer` (any peer when None) is in flight. Cancellation-safe."""
        while True:
            queues = [q for p, q in self.queues.items() if peer is None or p == peer]
            waits = [op.drained for q in queues for op in q.writes if not op.drained.done()]
            if not waits:
                return
            await asyncio.wait(waits)

    async def _poll_forever(self) -> None:
        """Poll in-flight ids: per peer from the oldest, stopping at the first still running one. Sleeps in
        proportion to how long nothing finished (1/16 of it, between the configured bounds); parks when idle."""
        assert self._loop is not None and self._wake is not None
        loop = self._loop
        last_progress = loop.time()
        while True:
            if not any(q.entries for q in self.queues.values()):
                self._wake.clear()
                await self._wake.wait()
                last_progress = loop.time()
            now = loop.time()
            if self._poll_once(now):
                last_progress = now
            fine = self._fine
            if (
                fine is not None
                and self._fine_interval_s is not None
                and self.in_flight_bytes > 0
                and (self._fine_bytes is None or self.in_flight_bytes <= self._fine_bytes)
                and now - last_progress < PROGRESS_WINDOW_S
            ):
                self.fine_polls += 1
                try:
                    await fine.sleep(self._fine_interval_s)
                    continue
                except RuntimeError:  # the timerfd refused to arm: keep polling, on the loop's timers from now on
                    fine.close()
                    self._fine = None
            interval = min(self._interval_max_s, max(self._interval_min_s, (now - last_progress) / 16))
            await asyncio.sleep(max(interval, LOOP_TIMER_FLOOR_S))

    def _poll_once(self, now: float) -> int:
        finished = 0
        check = self._check_status
        assert check is not None, "polled after stop"
        for peer, queue in list(self.queues.items()):
            entries = queue.entries
            while entries:
                batch_id, op, length = entries[0]
                status = check(batch_id)
                self.polls += 1
                if status == 0:
                    break
                entries.popleft()  # 1 and -1 freed the id: never poll it again
                finished += 1
                self.in_flight -= 1
                self.in_flight_bytes -= length
                op.pending -= 1
                if status == 1:
                    op.bytes_ok += length
                    queue.last_success = now
                    self.bytes += length
                    self.descriptors += 1
                else:
                    op.fail(f"Mooncake failed a write to {peer} (status {status})", ERR_FAILED, now)
                op.settle()
            if finished:
                queue.space.set()
            self._check_stalls(queue, now)
            if not entries and not queue.writes:
                del self.queues[peer]
        return finished

    def _check_stalls(self, queue: PeerQueue, now: float) -> None:
        """Give up waiting for a failed or cancelled write's descriptors when the peer stopped progressing."""
        for op in queue.writes:
            if op.result.done() or not op.pending:
                continue
            if op.failed_at is not None:
                since = max(op.failed_at, queue.last_success)
                if now - since > self._drain_timeout_s:
                    op.give_up()
            elif op.cancelled_at is not None:
                # Mooncake fails a descriptor without byte progress after its progress timeout; wait for that.
                since = max(op.cancelled_at, queue.last_success)
                if now - since > self._progress_timeout_s + self._drain_timeout_s:
                    op.give_up()


async def wait_uncancellable(fut: asyncio.Future[Any]) -> None:
    """Wait until `fut` is done, absorbing cancellations (the caller re-raises its own afterwards)."""
    while not fut.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait((fut,))
