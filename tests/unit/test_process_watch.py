"""`ProcessWatch`: whether a process of this host has exited, from a pidfd (or /proc where pidfds are missing),
checked against real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvsvc.core.data_planes import SameHostAddress
from kvsvc.transport import samehost
from kvsvc.transport.samehost import ProcessWatch, own_address, start_time


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def address_of(pid: int, start: int | None = None) -> SameHostAddress:
    return SameHostAddress(own_address().host, os.getuid(), pid, start_time(pid) if start is None else start)


@pytest.mark.parametrize("pidfds", [True, False])
def test_a_watch_sees_its_process_exit(
    child: subprocess.Popen[bytes], pidfds: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not pidfds:  # a kernel before 5.3: every answer is a /proc read
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    watch = ProcessWatch(address_of(child.pid))
    assert not watch.gone()
    child.kill()
    child.wait()
    assert watch.gone()
    watch.close()
    watch.close()  # idempotent


def test_a_pid_that_names_a_later_process_is_gone_from_the_start(child: subprocess.Popen[bytes]) -> None:
    watch = ProcessWatch(address_of(child.pid, start=start_time(child.pid) - 1))  # as if its pid were reused
    assert watch.gone()


def test_a_closed_watch_answers_gone_and_holds_no_descriptor(
    child: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[int] = []
    real_open = os.pidfd_open

    def pidfd_open(pid: int, flags: int = 0) -> int:
        opened.append(real_open(pid, flags))
        return opened[-1]

    monkeypatch.setattr(samehost.os, "pidfd_open", pidfd_open)
    watch = ProcessWatch(address_of(child.pid))
    watch.close()
    assert watch.gone()
    with pytest.raises(OSError):
        os.fstat(opened[0])
