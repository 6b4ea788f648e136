"""Completion futures from CUDA events (docs/design.md, "Completion futures"): the send job awaits the compute
that wrote a request's KV.

Imports: stdlib and `kvsvc.transport.finetimer` at module level; torch lazily inside `record_event` (no mooncake,
never its *_on_cuda calls).
Invariants: the event loop is never blocked (a loop's pending events are polled together from one timer, each
`query()`d once a poll however many futures wait on it, naps growing from 20 us to 200 us, then 1 ms for an event
pending over 5 ms); a future made from `None` is already resolved (the CPU path); cancelling a future stops its
polling and never affects the GPU work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Final, Protocol

from kvsvc.transport.finetimer import FineTimer

MIN_POLL_S: Final = 20e-6
FINE_POLL_MAX_S: Final = 200e-6  # the longest nap while an event is young: a device copy ends in microseconds
FINE_WINDOW_S: Final = 5e-3  # an event pending longer (a layer still computing) is polled on MAX_POLL_S
MAX_POLL_S: Final = 1e-3


class EventLike(Protocol):
    """What `completion_future` needs of an event: `torch.cuda.Event` fits."""

    def query(self) -> bool: ...


class _Poller:
    """Every pending event of one loop, queried together: one timer for all of them, never one per event.

    Naps double from `MIN_POLL_S` while nothing completes (back to it when something did) up to `FINE_POLL_MAX_S`
    while the youngest event is under `FINE_WINDOW_S` old, else up to `MAX_POLL_S`. Sub-millisecond naps come from
    a `FineTimer` (uvloop's timers count whole milliseconds and spin the loop on anything shorter, so a copy of
    tens of microseconds was seen a millisecond late), every nap from it; where there is none, the loop's timers.
    It exists while events are pending: the last one resolved or cancelled, it closes its timer and leaves
    `_POLLERS`.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._timer = FineTimer.open(loop)
        self._handle: asyncio.TimerHandle | None = None
        self._pending: list[tuple[EventLike, asyncio.Future[None], float]] = []
        self._delay = self._min_delay = MIN_POLL_S

    def add(self, event: EventLike, fut: asyncio.Future[None], min_poll_s: float) -> None:
        self._pending.append((event, fut, self._loop.time()))
        self._min_delay = self._delay = min_poll_s  # a new event: poll soon again
        self._schedule()

    def _schedule(self) -> None:
        """The next poll after the current nap, replacing one not yet run: one chain of polls per loop."""
        if self._timer is not None:
            self._timer.call_after(self._delay, self._poll)
            return
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._loop.call_later(self._delay, self._poll)

    def _poll(self) -> None:
        self._handle = None
        still: list[tuple[EventLike, asyncio.Future[None], float]] = []
        resolved = False
        # Many futures may wait on one event (each send of a step on each layer's event): one query each per poll.
        answers: dict[int, bool | Exception] = {}
        for event, fut, born in self._pending:
            if fut.done():  # cancelled by its owner: no more queries
                continue
            ready = answers.get(id(event))
            if ready is None:
                try:
                    ready = event.query()
                except Exception as exc:
                    ready = exc
                answers[id(event)] = ready
            if isinstance(ready, Exception):
                fut.set_exception(ready)
                resolved = True
                continue
            if ready:
                fut.set_result(None)
                resolved = True
            else:
                still.append((event, fut, born))
        self._pending = still
        if not still:
            self._close()
            return
        young = self._loop.time() - max(born for _, _, born in still) < FINE_WINDOW_S
        cap = FINE_POLL_MAX_S if young else MAX_POLL_S
        self._delay = self._min_delay if resolved else min(self._delay * 2, cap)
        self._schedule()

    def _close(self) -> None:
        if _POLLERS.get(self._loop) is self:
            del _POLLERS[self._loop]
        if self._timer is not None:
            self._timer.close()
        if self._handle is not None:
            self._handle.cancel()


_POLLERS: dict[asyncio.AbstractEventLoop, _Poller] = {}


def completion_future(
    event: EventLike | None,
    *,
    loop: asyncio.AbstractEventLoop | None = None,
    min_poll_s: float = MIN_POLL_S,
) -> asyncio.Future[None]:
    """A future that resolves once `event.query()` returns True; already resolved when `event` is None.

    `loop` defaults to the running loop (so call it from a coroutine or pass one; only from its thread). The event
    is queried at once, then with every other pending event of the loop, after naps from `min_poll_s` up to 200 us
    while it is young and 1 ms later (`_Poller`): a copy is seen within a nap of its end, and each nap takes the GIL
    of the process once, whatever the number of events.

    Raises:
        RuntimeError: no running loop and none given.
    The future carries the exception if `query()` raises (a CUDA error). Cancelling it stops its queries.
    """
    loop = loop or asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    if event is None:
        fut.set_result(None)
        return fut
    try:
        ready = event.query()
    except Exception as exc:
        fut.set_exception(exc)
        return fut
    if ready:
        fut.set_result(None)
        return fut
    poller = _POLLERS.get(loop)
    if poller is None:
        poller = _POLLERS[loop] = _Poller(loop)
    poller.add(event, fut, min_poll_s)
    return fut


class LayerReadiness:
    """One completion future per layer, for layer-wise sends: layer i may go once its event fired.

    Awaiting `wait(i)` is cancellation-safe (shielded): one waiter's cancellation leaves the shared future alone.
    `cancel()` stops every layer's polling (the futures end cancelled).
    """

    def __init__(self, events: Sequence[EventLike | None], *, loop: asyncio.AbstractEventLoop | None = None) -> None:
        loop = loop or asyncio.get_running_loop()
        self._futures = [completion_future(e, loop=loop) for e in events]

    @classmethod
    def ready(cls, num_layers: int, *, loop: asyncio.AbstractEventLoop | None = None) -> LayerReadiness:
        """All layers already complete (the CPU path)."""
        return cls([None] * num_layers, loop=loop)

    def __len__(self) -> int:
        return len(self._futures)

    def future(self, layer: int) -> asyncio.Future[None]:
        """The shared future of `layer` (IndexError if out of range). Do not cancel it to stop waiting: use
        `wait`."""
        return self._futures[layer]

    @property
    def futures(self) -> list[asyncio.Future[None]]:
        return list(self._futures)

    def done_layers(self) -> int:
        """How many layers are complete, counted from layer 0 (the prefix that may be sent)."""
        n = 0
        for fut in self._futures:
            if not fut.done() or fut.cancelled() or fut.exception() is not None:
                break
            n += 1
        return n

    async def wait(self, layer: int) -> None:
        """Return once `layer` is complete; raises what its event's `query()` raised."""
        await asyncio.shield(self._futures[layer])

    async def wait_all(self) -> None:
        """Return once every layer is complete; raises the first layer's error."""
        for fut in self._futures:
            await asyncio.shield(fut)

    def cancel(self) -> None:
        for fut in self._futures:
            fut.cancel()


def record_event(stream: Any = None) -> EventLike | None:
    """Create and record a `torch.cuda.Event` on `stream` (the current stream when None); None without CUDA.

    torch is imported here, lazily. Raises whatever torch raises when recording fails.
    """
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    event: EventLike = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)  # type: ignore[attr-defined]
    return event
