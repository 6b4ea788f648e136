"""What `kvsvc demo` and `kvsvc serve` share: launching worker processes that leave Ctrl-C to the parent.

Imports the standard library and `workers.executor` only. Invariant: workers are launched with SIGINT ignored, so
a Ctrl-C in the terminal (sent to the whole process group) reaches only the parent, which then shuts the workers
down in order and reaps them, instead of every worker dying mid-transfer with its own traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
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


@contextlib.contextmanager
def children_stderr_to(path: str | None) -> Iterator[None]:
    """Point file descriptor 2 at `path` (appended) while processes are spawned, so they inherit it: Mooncake's
    native logging writes to fd 2 whatever Python does. None leaves stderr alone. Restores fd 2 after.

    Raises:
        OSError: `path` cannot be opened for appending.
    """
    if path is None:
        yield
        return
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        os.dup2(target, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


def start_engines(executors: Sequence[Executor], worker_log: str | None = None) -> None:
    """Spawn every engine's workers together (torch imports overlap), Ctrl-C left to the parent, their stderr
    in `worker_log` when given, then wait for all.

    Raises:
        WorkerError: an engine failed to start; every engine is closed (its processes reaped) then.
        OSError: a process could not be spawned, or `worker_log` cannot be opened; likewise.
    """
    try:
        with sigint_ignored_by_children(), children_stderr_to(worker_log):
            for executor in executors:
                executor.launch()
    except BaseException:
        for executor in executors:
            executor.close()
        raise
    start_all(executors)


__all__ = ["children_stderr_to", "sigint_ignored_by_children", "start_engines"]
