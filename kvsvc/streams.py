"""Completion futures from CUDA events (docs/design.md, "Completion futures"): the send job awaits the compute
that wrote a request's KV.

Imports: stdlib only at module level; torch lazily inside `record_event` (no mooncake, never its *_on_cuda calls).
Invariants: the event loop is never blocked (events are polled with `query()` from `call_later`, backing off from
20 us to 1 ms); a future made from `None` is already resolved (the CPU path); cancelling a future stops its polling
and never affects the GPU work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Final, Protocol

MIN_POLL_S: Final = 20e-6
MAX_POLL_S: Final = 1e-3


class EventLike(Protocol):
    """What `completion_future` needs of an event: `torch.cuda.Event` fits."""

    def query(self) -> bool: ...


def completion_future(
    event: EventLike | None,
    *,
    loop: asyncio.AbstractEventLoop | None = None,
    min_poll_s: float = MIN_POLL_S,
    max_poll_s: float = MAX_POLL_S,
) -> asyncio.Future[None]:
    """A future that resolves once `event.query()` returns True; already resolved when `event` is None.

    `loop` defaults to the running loop (so call it from a coroutine or pass one). The event is queried at once,
    then from `call_later` with intervals doubling from `min_poll_s` to `max_poll_s` (the loop's timers round
    sub-millisecond delays, so in practice it settles at about 1 ms).

    Raises:
        RuntimeError: no running loop and none given.
    The future carries the exception if `query()` raises (a CUDA error). Cancelling it stops the polling.
    """
    loop = loop or asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    if event is None:
        fut.set_result(None)
        return fut
    handle: list[asyncio.TimerHandle] = []

    def poll(delay: float) -> None:
        handle.clear()
        if fut.done():  # cancelled by its owner: stop querying
            return
        try:
            ready = event.query()
        except Exception as exc:
            fut.set_exception(exc)
            return
        if ready:
            fut.set_result(None)
        else:
            handle.append(loop.call_later(delay, poll, min(delay * 2, max_poll_s)))

    def stop(_: asyncio.Future[None]) -> None:
        for h in handle:
            h.cancel()

    fut.add_done_callback(stop)
    poll(min_poll_s)
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
