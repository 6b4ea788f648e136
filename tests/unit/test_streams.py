"""Completion futures on CPU: a fake event resolves them only once query() turns True, without blocking the loop."""

from __future__ import annotations

import asyncio

import pytest

from kvsvc.transport.streams import LayerReadiness, completion_future, record_event


class FakeEvent:
    """An event that completes after `polls` queries (or when `fire()` is called)."""

    def __init__(self, polls: int | None = None) -> None:
        self.queries = 0
        self.polls = polls
        self.fired = False

    def fire(self) -> None:
        self.fired = True

    def query(self) -> bool:
        self.queries += 1
        return self.fired or (self.polls is not None and self.queries >= self.polls)


class BrokenEvent:
    def query(self) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


async def test_none_event_gives_an_already_resolved_future() -> None:
    fut = completion_future(None)
    assert fut.done() and fut.result() is None


async def test_completed_event_resolves_without_waiting() -> None:
    event = FakeEvent(polls=1)
    fut = completion_future(event)
    assert fut.done()
    assert event.queries == 1


async def test_future_resolves_only_after_query_turns_true() -> None:
    event = FakeEvent()
    fut = completion_future(event)
    for _ in range(5):
        await asyncio.sleep(0.002)
        assert not fut.done()
    assert event.queries > 1
    event.fire()
    await asyncio.wait_for(fut, 5)
    assert fut.done()


async def test_polling_does_not_block_the_loop() -> None:
    event = FakeEvent()
    fut = completion_future(event)
    ticks = 0
    for _ in range(20):
        await asyncio.sleep(0)
        ticks += 1
    assert ticks == 20 and not fut.done()
    event.fire()
    await asyncio.wait_for(fut, 5)


async def test_cancelling_the_future_stops_polling() -> None:
    event = FakeEvent()
    fut = completion_future(event)
    await asyncio.sleep(0.005)
    fut.cancel()
    seen = event.queries
    await asyncio.sleep(0.01)
    assert event.queries == seen


async def test_cancelled_waiter_leaves_polling_running_when_shielded() -> None:
    event = FakeEvent()
    readiness = LayerReadiness([event])
    waiter = asyncio.create_task(readiness.wait(0))
    await asyncio.sleep(0.002)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not readiness.future(0).done()
    event.fire()
    await asyncio.wait_for(readiness.wait(0), 5)


async def test_query_error_lands_in_the_future() -> None:
    fut = completion_future(BrokenEvent())
    with pytest.raises(RuntimeError, match="illegal memory access"):
        await fut


async def test_layers_resolve_independently_and_in_any_order() -> None:
    events = [FakeEvent(), FakeEvent(), None]
    readiness = LayerReadiness(events)
    assert len(readiness) == 3
    assert readiness.future(2).done()
    assert readiness.done_layers() == 0
    events[1].fire()
    await asyncio.wait_for(readiness.wait(1), 5)
    assert readiness.done_layers() == 0  # layer 0 still computing
    assert not readiness.future(0).done()
    events[0].fire()
    await asyncio.wait_for(readiness.wait_all(), 5)
    assert readiness.done_layers() == 3


async def test_ready_readiness_has_every_layer_complete() -> None:
    readiness = LayerReadiness.ready(4)
    await readiness.wait_all()
    assert readiness.done_layers() == 4


async def test_cancel_stops_every_layer() -> None:
    events = [FakeEvent(), FakeEvent()]
    readiness = LayerReadiness(events)
    readiness.cancel()
    assert all(f.cancelled() for f in readiness.futures)
    seen = [e.queries for e in events]
    await asyncio.sleep(0.005)
    assert [e.queries for e in events] == seen


def test_record_event_is_none_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by test_streams_cuda")
    assert record_event() is None


async def test_pending_events_of_a_loop_share_one_poller_that_leaves_with_the_last() -> None:
    from kvsvc.transport import streams

    loop = asyncio.get_running_loop()
    events = [FakeEvent() for _ in range(3)]
    futures = [completion_future(e) for e in events]
    poller = streams._POLLERS[loop]
    assert len(streams._POLLERS) == 1 and len(poller._pending) == 3
    timer = poller._timer
    events[1].fire()
    await asyncio.wait_for(futures[1], 5)
    assert streams._POLLERS.get(loop) is poller and not futures[0].done()
    futures[0].cancel()  # its owner gave up: dropped at the next poll, never queried again
    seen = events[0].queries
    events[2].fire()
    await asyncio.wait_for(futures[2], 5)
    await asyncio.sleep(0.002)
    assert events[0].queries == seen
    assert loop not in streams._POLLERS
    assert timer is None or timer._fd == -1  # the timerfd went with it


@pytest.mark.parametrize("factory", ["asyncio", "uvloop"])
def test_events_resolve_on_either_loop_whatever_their_order(factory: str) -> None:
    import uvloop

    from kvsvc.transport import streams

    async def main() -> None:
        events = [FakeEvent() for _ in range(4)]
        futures = [completion_future(e) for e in events]
        for i in (2, 0, 3, 1):
            events[i].fire()
            await asyncio.wait_for(futures[i], 5)
        assert all(f.done() for f in futures) and not streams._POLLERS
        late = FakeEvent(polls=3)  # a new poller for a new burst
        await asyncio.wait_for(completion_future(late), 5)
        assert late.queries == 3

    loop_factory = uvloop.new_event_loop if factory == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())


async def test_an_event_pending_long_backs_off_to_the_loops_timers() -> None:
    from kvsvc.transport import streams

    event = FakeEvent()
    fut = completion_future(event)
    poller = streams._POLLERS[asyncio.get_running_loop()]
    await asyncio.sleep(streams.FINE_WINDOW_S)
    async with asyncio.timeout(5):  # a bound on a busy machine's timers, not a measure of speed
        while poller._delay != streams.MAX_POLL_S:  # a layer still computing is not polled every 200 us
            await asyncio.sleep(0.001)
    assert not fut.done()
    event.fire()
    await asyncio.wait_for(fut, 5)


async def test_futures_sharing_an_event_query_it_once_a_poll() -> None:
    # Each send of a step waits on the same per-layer events: a poll must not query an event once per send.
    shared, alone = FakeEvent(), FakeEvent()
    futures = [completion_future(shared) for _ in range(8)]
    lone = completion_future(alone)
    assert shared.queries == 8 and alone.queries == 1  # the query at creation, one per future
    await asyncio.sleep(0.005)
    polls = alone.queries - 1
    assert polls >= 1 and shared.queries - 8 == polls
    shared.fire()
    await asyncio.wait_for(asyncio.gather(*futures), 5)
    assert not lone.done()
    lone.cancel()


async def test_an_event_that_fails_fails_every_future_waiting_on_it() -> None:
    event = FakeEvent()
    futures = [completion_future(event) for _ in range(3)]

    def broken() -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    event.query = broken  # type: ignore[method-assign]
    for fut in futures:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            await asyncio.wait_for(fut, 5)
