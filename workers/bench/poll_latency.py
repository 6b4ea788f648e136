"""`kvsvc bench --poll-latency`: how late a completion future sees a CUDA event that completed, kvsvc's poller
(`kvsvc.transport.streams.completion_future`: a loop's pending events polled together from a timerfd) against the loop's
own timers (the baseline: `call_later` naps doubling from 20 us to 1 ms, which uvloop rounds to whole milliseconds), in
one run on uvloop.

No GPU needed: the event is a stand-in whose `query()` turns True at a set time after it was made (the copy's
duration), so the figure is the poller's alone. Reports per copy duration the median and p90 delay between that
time and the future's resolution, and the loop's CPU share while it waited.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import uvloop

from kvsvc.transport.streams import completion_future

DURATIONS_S: Final = (30e-6, 100e-6, 300e-6, 1e-3)
_BASELINE_MIN_S: Final = 20e-6
_BASELINE_MAX_S: Final = 1e-3


class _CopyEvent:
    """Completes `duration` seconds after it was made, as a device copy of that length would."""

    def __init__(self, duration: float) -> None:
        self.at = time.perf_counter() + duration

    def query(self) -> bool:
        return time.perf_counter() >= self.at


def _timer_future(event: _CopyEvent) -> asyncio.Future[None]:
    """The baseline: the event polled on the loop's timers, naps doubling to 1 ms."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def poll(delay: float) -> None:
        if event.query():
            fut.set_result(None)
        else:
            loop.call_later(delay, poll, min(delay * 2, _BASELINE_MAX_S))

    poll(_BASELINE_MIN_S)
    return fut


@dataclass(frozen=True)
class PollResult:
    way: str  # "kvsvc" or "loop_timers"
    copy_us: float
    late_us_p50: float
    late_us_p90: float
    loop_cpu_share: float


async def _measure(way: str, make: Callable[[_CopyEvent], asyncio.Future[None]], duration: float, n: int) -> PollResult:
    late: list[float] = []
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        event = _CopyEvent(duration)
        await make(event)
        late.append((time.perf_counter() - event.at) * 1e6)
    share = (time.process_time() - cpu) / (time.perf_counter() - wall)
    late.sort()
    return PollResult(way, duration * 1e6, statistics.median(late), late[int(0.9 * (n - 1))], share)


def run_poll_latency(samples: int = 200) -> list[PollResult]:
    """Both ways at every duration of `DURATIONS_S`, `samples` events each, alternating, on one uvloop."""

    async def main() -> list[PollResult]:
        results = []
        for duration in DURATIONS_S:
            results.append(await _measure("loop_timers", _timer_future, duration, samples))
            results.append(await _measure("kvsvc", lambda e: completion_future(e), duration, samples))
        return results

    return uvloop.run(main())


__all__ = ["DURATIONS_S", "PollResult", "run_poll_latency"]
