"""`TaskGroup`: the one owner of every task a worker's service starts, so `close` leaves nothing running.

Rules: a task is started through `spawn` (or, when asyncio made it for us, such as a connection handler, registered
with `adopt`) and leaves the group when it ends; a task that fails is logged, never lost; `cancel` cancels every
task at once and `wait` returns when all have ended. Unlike `asyncio.TaskGroup`, one task's failure cancels nothing
else: one broken connection must not take the worker's other transfers down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class TaskGroup:
    """The tasks of one service (see module docstring)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, _T], name: str | None = None) -> asyncio.Task[_T]:
        """Run `coro` as a task of this group (on the running loop)."""
        task = asyncio.create_task(coro, name=name)
        self.adopt(task)
        return task

    def adopt(self, task: asyncio.Task[Any]) -> None:
        """Make a task asyncio started for us (a connection handler) a member: `cancel` reaches it too."""
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def cancel(self) -> None:
        """Cancel every member (the current task excepted: a member may be the one closing the service)."""
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    async def wait(self) -> None:
        """Return once every member but the current task has ended. Cancelling this wait leaves the members alone."""
        current = asyncio.current_task()
        while pending := [t for t in self._tasks if t is not current and not t.done()]:
            await asyncio.wait(pending)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("kvsvc task %s failed", task.get_name(), exc_info=exc)
