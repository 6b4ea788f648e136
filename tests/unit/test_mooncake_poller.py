"""MooncakeTransport's submission and completion polling, against a scripted stand-in engine (no mooncake needed).

The stand-in enforces the crash rules of docs/mooncake.md: polling id 0, or an id after it reported 1/-1, fails
the test.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import Callable
from typing import Any

import pytest

from kvsvc.core.errors import TransportError
from kvsvc.transport import InvalidDescriptor, MooncakeConfig, MooncakeTransport, WriteFailed
from kvsvc.transport.finetimer import FineTimer

LOCAL, REMOTE, SIZE = 1 << 20, 1 << 30, 1 << 16


class ScriptedEngine:
    """Every submitted id runs until the test sets its status with `finish`."""

    def __init__(self) -> None:
        self._ids = itertools.count(1000)
        self.status: dict[int, int] = {}
        self.freed: set[int] = set()
        self.submitted: list[tuple[int, int, int, int]] = []  # (id, src, dst, length)
        self.polled: list[int] = []
        self.refuse_after: int | None = None

    def get_rpc_port(self) -> int:
        return 15999

    def batch_register_memory(self, addrs: list[int], lengths: list[int]) -> int:
        return 0

    def batch_unregister_memory(self, addrs: list[int]) -> int:
        return 0

    def transfer_submit_write(self, peer: str, src: int, dst: int, length: int) -> int:
        if self.refuse_after is not None and len(self.submitted) >= self.refuse_after:
            return 0
        batch_id = next(self._ids)
        self.status[batch_id] = 0
        self.submitted.append((batch_id, src, dst, length))
        return batch_id

    def transfer_check_status(self, batch_id: int) -> int:
        assert batch_id != 0, "polled id 0"
        assert batch_id not in self.freed, f"polled freed id {batch_id}"
        self.polled.append(batch_id)
        status = self.status[batch_id]
        if status != 0:
            self.freed.add(batch_id)
        return status

    def finish(self, index: int | slice, status: int = 1) -> None:
        entries = self.submitted[index]
        for batch_id, *_ in entries if isinstance(entries, list) else [entries]:
            self.status[batch_id] = status


def make(**overrides: Any) -> tuple[MooncakeTransport, ScriptedEngine]:
    engine = ScriptedEngine()
    settings: dict[str, Any] = {"drain_timeout_s": 0.05, "progress_timeout_s": 1, **overrides}
    config = MooncakeConfig(**settings)
    transport = MooncakeTransport(config, engine=engine)
    transport.register([(LOCAL, SIZE)])
    transport.add_peer("peer:1", [(REMOTE, SIZE)])
    return transport, engine


def descs(n: int, length: int = 256) -> list[tuple[int, int, int]]:
    return [(LOCAL + i * length, REMOTE + i * length, length) for i in range(n)]


async def until(predicate: Callable[[], bool]) -> None:
    """Yield to the loop until `predicate()` holds (at most about 5 s)."""
    for _ in range(5000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


async def test_write_returns_bytes_once_every_descriptor_reported_done() -> None:
    transport, engine = make()
    task = asyncio.create_task(transport.write("peer:1", descs(3)))
    await until(lambda: len(engine.submitted) == 3)
    engine.finish(slice(0, 2))
    await asyncio.sleep(0.01)
    assert not task.done()
    engine.finish(2)
    assert await task == 768
    stats = transport.statistics()
    assert (stats.bytes_written, stats.descriptors_written, stats.descriptors_in_flight) == (768, 3, 0)
    assert [(s, d, n) for _, s, d, n in engine.submitted] == descs(3)
    await transport.close()


async def test_poller_stops_at_the_first_running_descriptor_of_a_peer() -> None:
    transport, engine = make()
    task = asyncio.create_task(transport.write("peer:1", descs(4)))
    await until(lambda: len(engine.submitted) == 4)
    engine.finish(slice(1, 4))  # the head still runs
    await asyncio.sleep(0.02)
    head = engine.submitted[0][0]
    assert set(engine.polled) == {head}
    engine.finish(0)
    assert await task == 1024
    await transport.close()


async def test_out_of_range_write_submits_nothing() -> None:
    transport, engine = make()
    with pytest.raises(InvalidDescriptor):
        await transport.write("peer:1", [*descs(2), (LOCAL, REMOTE + SIZE - 1, 2)])
    assert engine.submitted == []
    assert transport.statistics().refused == 1
    await transport.close()


async def test_failed_descriptor_fails_the_write_after_the_others_finished() -> None:
    transport, engine = make(drain_timeout_s=5.0)
    task = asyncio.create_task(transport.write("peer:1", descs(3)))
    await until(lambda: len(engine.submitted) == 3)
    engine.finish(0, -1)
    await asyncio.sleep(0.02)
    assert not task.done()  # the other two may still be moving
    engine.finish(slice(1, 3))
    failed = await task
    assert isinstance(failed, WriteFailed) and failed.code == -1 and failed.undrained == 0
    assert failed.drained is not None and failed.drained.done()
    assert transport.statistics().failures == 1
    await transport.close()


async def test_refused_submission_never_polls_id_zero_and_waits_for_the_submitted() -> None:
    transport, engine = make()
    engine.refuse_after = 2
    task = asyncio.create_task(transport.write("peer:1", descs(5)))
    await until(lambda: len(engine.submitted) == 2)
    await asyncio.sleep(0.01)
    assert not task.done()
    engine.finish(slice(0, 2))
    refused = await task
    assert isinstance(refused, WriteFailed) and "batch id 0" in refused.message
    assert len(engine.submitted) == 2
    await transport.close()


async def test_cancelled_write_returns_only_after_its_descriptors_drained() -> None:
    transport, engine = make(progress_timeout_s=30)
    task = asyncio.create_task(transport.write("peer:1", descs(3)))
    await until(lambda: len(engine.submitted) == 3)
    task.cancel()
    await asyncio.sleep(0.02)
    assert not task.done()
    task.cancel()  # a second cancel does not cut the drain short
    await asyncio.sleep(0.02)
    assert not task.done()
    engine.finish(slice(0, 3))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert transport.statistics().descriptors_in_flight == 0
    await transport.close()


async def test_stuck_peer_fails_the_write_with_a_drained_future_and_fails_later_writes_fast() -> None:
    transport, engine = make()
    task = asyncio.create_task(transport.write("peer:1", descs(4)))
    await until(lambda: len(engine.submitted) == 4)
    engine.finish(0, -1)  # the engine failed one lane; the rest stay stuck
    error = await asyncio.wait_for(task, 5)
    assert isinstance(error, WriteFailed)
    assert error.undrained == 3 and error.drained is not None and not error.drained.done()
    refused = await transport.write("peer:1", descs(1))
    assert isinstance(refused, WriteFailed) and "stuck" in refused.message
    assert len(engine.submitted) == 4
    engine.finish(slice(1, 4), -1)
    await asyncio.wait_for(error.drained, 5)
    await asyncio.wait_for(transport.drained("peer:1"), 5)
    assert transport.statistics().descriptors_in_flight == 0
    await transport.close()


async def test_in_flight_window_per_peer_is_respected() -> None:
    transport, engine = make(max_queued_per_peer=2)
    task = asyncio.create_task(transport.write("peer:1", descs(5)))
    await until(lambda: len(engine.submitted) == 2)
    await asyncio.sleep(0.01)
    assert len(engine.submitted) == 2
    for i in range(5):
        await until(lambda i=i: len(engine.submitted) > i)  # type: ignore[misc]
        engine.finish(i)
    assert await task == 5 * 256
    await transport.close()


async def test_closed_transport_refuses_writes() -> None:
    transport, _ = make()
    await transport.close()
    await transport.close()
    with pytest.raises(TransportError):
        await transport.write("peer:1", descs(1))


# -- start_write: submitting small writes without a task --------------------------------------------------------


async def connected() -> tuple[MooncakeTransport, ScriptedEngine]:
    """A transport whose first write to peer:1 (the handshake one, off the loop) has landed."""
    transport, engine = make()
    first = asyncio.create_task(transport.write("peer:1", descs(1)))
    await until(lambda: len(engine.submitted) == 1)
    engine.finish(0)
    await first
    return transport, engine


async def test_start_write_declines_before_the_first_write_to_a_peer_and_submits_nothing() -> None:
    transport, engine = make()
    assert transport.start_write("peer:1", descs(1)) is None
    assert engine.submitted == []
    await transport.close()


async def test_start_write_submits_at_once_and_resolves_like_write() -> None:
    transport, engine = await connected()
    result = transport.start_write("peer:1", descs(2))
    assert result is not None
    assert len(engine.submitted) == 3  # submitted synchronously, no task
    assert transport.statistics().writes_in_flight == 1
    engine.finish(slice(1, 3))
    assert await result == 512
    await asyncio.sleep(0)
    stats = transport.statistics()
    assert (stats.writes_in_flight, stats.writes_completed, stats.descriptors_in_flight) == (0, 2, 0)
    await transport.close()


async def test_start_write_failure_is_its_own_and_the_next_write_still_lands() -> None:
    transport, engine = await connected()
    writes = [transport.start_write("peer:1", [d]) for d in descs(3)]
    assert all(w is not None for w in writes)
    engine.finish(1)
    engine.finish(2, -1)
    engine.finish(3)
    first, failed, last = await asyncio.gather(*writes)  # type: ignore[arg-type]
    assert first == 256 and last == 256
    assert isinstance(failed, WriteFailed) and failed.drained is not None and failed.drained.done()
    await asyncio.sleep(0)
    assert transport.statistics().failures == 1
    await transport.close()


async def test_start_write_declines_what_write_must_handle() -> None:
    transport, engine = await connected()
    assert transport.start_write("peer:1", [(LOCAL, REMOTE + SIZE - 1, 2)]) is None  # refused descriptor
    assert transport.start_write("peer:2", descs(1)) is None  # unknown peer
    assert transport.start_write("peer:1", descs(transport.config.submit_chunk + 1)) is None  # large
    assert transport.start_write("peer:1", []) is None
    assert len(engine.submitted) == 1
    await transport.close()
    assert transport.start_write("peer:1", descs(1)) is None  # closed


# -- short naps from a timerfd while descriptors finish --------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux-only")
async def test_a_write_is_polled_with_short_naps_while_it_moves() -> None:
    transport, engine = make()  # by default whatever the bytes in flight
    task = asyncio.create_task(transport.write("peer:1", descs(2)))
    await until(lambda: len(engine.submitted) == 2)
    await until(lambda: transport.statistics().fine_polls > 0)
    engine.finish(slice(0, 2))
    assert await task == 512
    await transport.close()


@pytest.mark.parametrize("overrides", [{"fine_poll_bytes": 256}, {"fine_poll_interval_s": None}])
async def test_no_short_naps_with_many_bytes_in_flight_or_when_turned_off(overrides: dict[str, Any]) -> None:
    transport, engine = make(**overrides)
    task = asyncio.create_task(transport.write("peer:1", descs(2)))  # 512 bytes in flight
    await until(lambda: len(engine.submitted) == 2)
    await asyncio.sleep(0.02)
    engine.finish(slice(0, 2))
    assert await task == 512
    assert transport.statistics().fine_polls == 0
    await transport.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux-only")
async def test_short_naps_stop_when_the_writes_stop_moving() -> None:
    transport, engine = make()
    task = asyncio.create_task(transport.write("peer:1", descs(1)))
    await until(lambda: len(engine.submitted) == 1)
    await asyncio.sleep(0.05)  # far past PROGRESS_WINDOW_S without progress
    naps = transport.statistics().fine_polls
    await asyncio.sleep(0.05)
    assert transport.statistics().fine_polls == naps  # back on the loop's timers
    engine.finish(0)
    assert await task == 256
    await transport.close()


def test_fine_poll_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="fine_poll_interval_s"):
        MooncakeConfig(fine_poll_interval_s=0.001)
    with pytest.raises(ValueError, match="fine_poll_bytes"):
        MooncakeConfig(fine_poll_bytes=-1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux-only")
async def test_a_timer_that_fails_leaves_the_poller_on_the_loop_timers(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(self: FineTimer, delay: float) -> None:
        raise RuntimeError("timerfd_settime failed: errno 9")

    monkeypatch.setattr(FineTimer, "sleep", broken)
    transport, engine = make()
    task = asyncio.create_task(transport.write("peer:1", descs(1)))  # short naps from its first poll
    await until(lambda: transport.statistics().fine_polls > 0)
    assert transport._completions._fine is None  # the broken timer was dropped, not retried
    engine.finish(0)
    assert await task == 256  # still polled to completion
    await transport.close()
