"""What `kvsvc demo` and `kvsvc serve` share: launching worker processes that leave Ctrl-C to the parent.

Imports the standard library and `workers.executor` only. Invariant: workers are launched with SIGINT ignored, so
a Ctrl-C in the terminal (sent to the whole process group) reaches only the parent, which then shuts the workers
down in order and reaps them, instead of every worker dying mid-transfer with its own traceback.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence

from workers.executor import Executor, start_all


@contextlib.contextmanager
def sigint_ignored_by_children() -> Iterator[None]:
    """Ignore SIGINT while processes are spawned: an ignored signal stays ignored across exec, and Python (and
    asyncio's runner) install their SIGINT handler only where it was the default. Restores the handler after.
    A no-op outside the main thread (signal handlers can only be changed there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def start_engines(executors: Sequence[Executor]) -> None:
    """Spawn every engine's workers together (torch imports overlap), Ctrl-C left to the parent, then wait for all.

    Raises:
        WorkerError: an engine failed to start; every engine is closed (its processes reaped) then.
        OSError: a process could not be spawned; likewise.
    """
    try:
        with sigint_ignored_by_children():
            for executor in executors:
                executor.launch()
    except BaseException:
        for executor in executors:
            executor.close()
        raise
    start_all(executors)


__all__ = ["sigint_ignored_by_children", "start_engines"]
