"""`FineTimer`: sub-millisecond sleeps from a timerfd the loop watches, on asyncio's loop and on uvloop.

No test asserts how long a sleep took (the machines are noisy); they check that sleeps end, that a cancelled one is
disarmed, that misuse raises, and that `open` declines where there is no timerfd.
"""

from __future__ import annotations

import asyncio
import select
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from kvsvc.transport import finetimer
from kvsvc.transport.finetimer import FineTimer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux-only")

Runner = Callable[[Callable[[], Coroutine[Any, Any, None]]], None]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Runner:
    factory = uvloop.new_event_loop if request.param == "uvloop" else asyncio.new_event_loop

    def runner(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
        with asyncio.Runner(loop_factory=factory) as r:
            r.run(asyncio.wait_for(main(), 10))  # a deadline against hangs, not a timing assertion

    return runner


def _open() -> FineTimer:
    timer = FineTimer.open(asyncio.get_running_loop())
    assert timer is not None
    return timer


def test_sleeps_end_one_after_another(run: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    fired: list[FineTimer] = []
    fire = FineTimer._fired

    def counted(timer: FineTimer) -> None:
        fired.append(timer)
        fire(timer)

    monkeypatch.setattr(FineTimer, "_fired", counted)  # before `open` registers it with the loop

    async def main() -> None:
        timer = _open()
        for n, delay in enumerate((0.0, 1e-6, 100e-6, 300e-6, 2e-3), 1):
            start = time.monotonic()
            await timer.sleep(delay)
            # Each sleep ends on its own expiry of the timerfd (the loop saw it readable once), never before its
            # delay on the timer's clock, and leaves the fd unreadable for the next one.
            assert len(fired) == n and time.monotonic() - start >= delay
            assert select.select([timer._fd], [], [], 0)[0] == []
        timer.close()

    run(main)


def test_a_second_concurrent_sleep_is_refused(run: Runner) -> None:
    async def main() -> None:
        timer = _open()
        first = asyncio.ensure_future(timer.sleep(0.01))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="already pending"):
            await timer.sleep(0.01)
        await first
        timer.close()

    run(main)


def test_a_cancelled_sleep_disarms_the_timer_and_the_next_sleep_works(run: Runner) -> None:
    async def main() -> None:
        timer = _open()
        sleeper = asyncio.ensure_future(timer.sleep(0.02))
        await asyncio.sleep(0)
        sleeper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sleeper
        await asyncio.sleep(0.05)  # well past the cancelled expiry
        readable, _, _ = select.select([timer._fd], [], [], 0)
        assert readable == []  # disarmed: it never fired
        await timer.sleep(100e-6)
        timer.close()

    run(main)


def test_close_cancels_a_pending_sleep_and_later_sleeps_raise(run: Runner) -> None:
    async def main() -> None:
        timer = _open()
        sleeper = asyncio.ensure_future(timer.sleep(5))
        await asyncio.sleep(0)
        timer.close()
        with pytest.raises(asyncio.CancelledError):
            await sleeper
        with pytest.raises(RuntimeError, match="closed"):
            await timer.sleep(0.001)
        timer.close()  # idempotent

    run(main)


def test_open_declines_where_there_is_no_timerfd(monkeypatch: pytest.MonkeyPatch, run: Runner) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    finetimer._libc.cache_clear()  # looked up once a process: forget this host's libc, and the fake one after

    async def main() -> None:
        assert FineTimer.open(asyncio.get_running_loop()) is None

    try:
        run(main)
    finally:
        finetimer._libc.cache_clear()


def test_call_after_calls_the_latest_callback_once_and_refuses_beside_a_sleep(run: Runner) -> None:
    async def main() -> None:
        timer = _open()
        calls: list[str] = []
        done = asyncio.get_running_loop().create_future()
        timer.call_after(0.05, lambda: calls.append("replaced"))
        timer.call_after(200e-6, lambda: (calls.append("latest"), done.set_result(None)))  # re-armed sooner
        await done
        await asyncio.sleep(0.06)  # past the first delay: the replaced callback never runs
        assert calls == ["latest"]
        sleeping = asyncio.ensure_future(timer.sleep(0.001))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="pending"):
            timer.call_after(0.001, lambda: None)
        await sleeping
        timer.close()
        with pytest.raises(RuntimeError, match="closed"):
            timer.call_after(0.001, lambda: None)

    run(main)
