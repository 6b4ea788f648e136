"""Both data planes against a real peer in another process: `MooncakeTransport` (a Mooncake engine, over loopback
TCP) and `SameHostTransport` (`process_vm_writev` into the peer's memory), one contract, every test run on each.

Each target is a subprocess that registers a zeroed buffer, holds a TCP connection to the test (the same-host plane
writes only into a process that passed the check against such a connection, as a hello's would be), prints
`session_id addr` and answers `sha`/`read` commands on stdin; the test process writes into it. Faults are real:
SIGKILL and SIGSTOP of the target. Nothing is timed: a write that should fail rather than hang is bounded by the
test's timeout. Where the planes differ, the test says how: a frozen peer stalls Mooncake's writes until its progress
timeout, while the kernel copies into a stopped process's memory as into a running one's.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from kvsvc.core.errors import TransportError
from kvsvc.transport import InvalidDescriptor, MooncakeConfig, MooncakeTransport, WriteFailed
from kvsvc.transport.base import Transport
from kvsvc.transport.samehost import SameHostTransport

pytest.importorskip("mooncake.engine")
pytestmark = pytest.mark.integration

SIZE = 64 << 20
REPO = Path(__file__).resolve().parents[2]
TARGET = """
import ctypes, hashlib, socket, sys
from kvsvc.transport.mooncake import MooncakeConfig, MooncakeTransport
from kvsvc.transport.samehost import SameHostTransport
size, kind = int(sys.argv[1]), sys.argv[2]
control = socket.create_connection(("127.0.0.1", int(sys.argv[3])))
transport = MooncakeTransport(MooncakeConfig()) if kind == "mooncake" else SameHostTransport()
buf = ctypes.create_string_buffer(size)
transport.register([(ctypes.addressof(buf), size)])
print(transport.session_id, ctypes.addressof(buf), flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "sha":
        print(hashlib.sha256(buf.raw).hexdigest(), flush=True)
    elif cmd == "read":
        off, n = map(int, args)
        print(buf.raw[off : off + n].hex(), flush=True)
"""


class Target:
    """A peer process with `SIZE` registered bytes at `addr`, reached through the plane `kind`."""

    def __init__(self, kind: str) -> None:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", TARGET, str(SIZE), kind, str(listener.getsockname()[1])],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
            listener.settimeout(60)
            self.control, _ = listener.accept()
        assert self.proc.stdout is not None
        session, addr = self.proc.stdout.readline().split()
        self.session_id, self.addr = session, int(addr)
        self.via = (self.control.getsockname()[:2], self.control.getpeername()[:2])

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def sha(self) -> str:
        return self.ask("sha")

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL also ends a SIGSTOPped process
        self.proc.wait(timeout=10)
        self.control.close()


@pytest.fixture(params=["mooncake", "samehost"])
def kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
def targets(kind: str) -> Iterator[Callable[[], Target]]:
    started: list[Target] = []

    def start() -> Target:
        started.append(Target(kind))
        return started[-1]

    yield start
    for target in started:
        target.stop()


@pytest.fixture
def source() -> ctypes.Array[ctypes.c_char]:
    return ctypes.create_string_buffer(random.Random(7).randbytes(SIZE), SIZE)


@pytest.fixture
async def writer(source: ctypes.Array[ctypes.c_char], kind: str) -> AsyncIterator[Transport]:
    transport: Transport
    if kind == "mooncake":
        transport = MooncakeTransport(MooncakeConfig(progress_timeout_s=3, close_timeout_s=15))
    else:
        transport = SameHostTransport()
    transport.register([(ctypes.addressof(source), SIZE)])
    yield transport
    await transport.close()


async def connect(writer: Transport, target: Target) -> None:
    regions = [(target.addr, SIZE)]
    if isinstance(writer, SameHostTransport):  # admitted only once its process passed the check
        assert await writer.reachable(target.session_id, regions, target.via) == ""
    writer.add_peer(target.session_id, regions)


def zeros_sha() -> str:
    return hashlib.sha256(bytes(SIZE)).hexdigest()


@pytest.mark.timeout(60)
async def test_multi_descriptor_writes_land_byte_exact(writer, source, targets) -> None:  # type: ignore[no-untyped-def]
    target = targets()
    await connect(writer, target)
    rng = random.Random(1)
    expected = bytearray(SIZE)
    plans: list[list[tuple[int, int, int]]] = [[], []]
    offset, raw = 0, source.raw  # `.raw` copies the whole buffer: once
    for i in range(300):  # disjoint destination runs of varied length, sources anywhere
        length = rng.choice([1, 7, 4096, 65536, 200_000])
        src_off = rng.randrange(0, SIZE - length)
        plans[i % 2].append((ctypes.addressof(source) + src_off, target.addr + offset, length))
        expected[offset : offset + length] = raw[src_off : src_off + length]
        offset += length + rng.randrange(0, 5000)
    sent = await asyncio.gather(*(writer.write(target.session_id, plan) for plan in plans))
    assert sum(sent) == sum(d[2] for plan in plans for d in plan)
    assert target.sha() == hashlib.sha256(expected).hexdigest()
    stats = writer.statistics()
    assert stats.descriptors_written == 300 and stats.descriptors_in_flight == 0 and stats.writes_in_flight == 0


@pytest.mark.timeout(60)
async def test_out_of_range_destination_is_refused_before_submission(writer, source, targets) -> None:  # type: ignore[no-untyped-def]
    target = targets()
    await connect(writer, target)
    src = ctypes.addressof(source)
    with pytest.raises(InvalidDescriptor):
        await writer.write(target.session_id, [(src, target.addr, 4096), (src, target.addr + SIZE - 100, 101)])
    with pytest.raises(InvalidDescriptor):
        await writer.write(target.session_id, [(src + SIZE, target.addr, 1)])
    assert target.sha() == zeros_sha()
    # The engine was not disturbed: a good write still lands.
    assert await writer.write(target.session_id, [(src, target.addr, 4096)]) == 4096
    assert target.ask("read 0 4096") == source.raw[:4096].hex()


@pytest.mark.timeout(60)
async def test_overlapping_registration_is_refused(writer, source) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TransportError) as info:
        writer.register([(ctypes.addressof(source) + 4096, 4096)])
    assert info.value.code == -7


@pytest.mark.timeout(60)
async def test_peer_killed_mid_write_fails_the_write(writer, source, targets, kind) -> None:  # type: ignore[no-untyped-def]
    target = targets()
    await connect(writer, target)
    chunk = SIZE // 256
    plan = [(ctypes.addressof(source) + i * chunk, target.addr + i * chunk, chunk) for i in range(256)]

    async def keep_writing() -> WriteFailed:
        while True:
            written = await writer.write(target.session_id, plan)
            if isinstance(written, WriteFailed):
                return written

    task = asyncio.create_task(keep_writing())
    for _ in range(10_000):  # kill it while data is moving
        if writer.statistics().bytes_written > 0 or task.done():
            break
        await asyncio.sleep(0.001)
    target.signal(signal.SIGKILL)
    failed = await task
    # Mooncake's engine fails the transfer; the kernel says the process is gone, and nothing was left moving.
    assert failed.code == (-1 if kind == "mooncake" else -102)
    assert kind == "mooncake" or (failed.drained is not None and failed.drained.done())
    await asyncio.wait_for(writer.drained(), 30)
    assert writer.statistics().descriptors_in_flight == 0


@pytest.mark.timeout(60)
async def test_frozen_peer_fails_the_write_after_the_progress_timeout(writer, source, targets, kind) -> None:  # type: ignore[no-untyped-def]
    target = targets()
    await connect(writer, target)
    src = ctypes.addressof(source)
    assert await writer.write(target.session_id, [(src, target.addr, 4096)]) == 4096  # connected
    target.signal(signal.SIGSTOP)
    chunk = SIZE // 16
    plan = [(src + i * chunk, target.addr + i * chunk, chunk) for i in range(16)]
    if kind == "samehost":  # the kernel copies into a stopped process's memory: nothing to time out
        assert await writer.write(target.session_id, plan) == SIZE
        target.signal(signal.SIGCONT)
        assert target.sha() == hashlib.sha256(source.raw).hexdigest()
        return
    error = await writer.write(target.session_id, plan)
    assert isinstance(error, WriteFailed) and error.drained is not None
    if error.undrained:  # Mooncake fails a frozen peer's queued descriptors a few at a time: they drain later
        stuck = await writer.write(target.session_id, plan[:1])  # refused at once while some are stuck
        assert isinstance(stuck, WriteFailed) and "stuck" in stuck.message
    target.stop()  # a dead peer fails what is left
    await asyncio.wait_for(error.drained, 30)
    assert writer.statistics().descriptors_in_flight == 0


@pytest.mark.timeout(60)
async def test_cancelled_write_returns_only_after_its_descriptors_drained(writer, source, targets) -> None:  # type: ignore[no-untyped-def]
    target = targets()
    await connect(writer, target)
    chunk = SIZE // 256
    plan = [(ctypes.addressof(source) + i * chunk, target.addr + i * chunk, chunk) for i in range(256)]
    task = asyncio.create_task(writer.write(target.session_id, plan))
    for _ in range(10_000):
        if writer.statistics().descriptors_in_flight > 0:
            break
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = writer.statistics()
    assert stats.descriptors_in_flight == 0 and stats.writes_in_flight == 0
    # Nothing still moves: the target's memory no longer changes.
    first = target.sha()
    await asyncio.sleep(0.05)
    assert target.sha() == first


async def test_peer_gone_tells_a_killed_peer_from_a_live_or_a_frozen_one(writer, targets) -> None:  # type: ignore[no-untyped-def]
    alive, killed, frozen = targets(), targets(), targets()
    killed.signal(signal.SIGKILL)
    killed.proc.wait(timeout=10)
    frozen.signal(signal.SIGSTOP)
    try:
        assert await writer.peer_gone(alive.session_id) is False
        assert await writer.peer_gone(killed.session_id) is True  # refused at once, or no such process
        # A stopped process's listener still accepts: the probe waits (about 5 s), so it is not proven gone.
        assert await writer.peer_gone(frozen.session_id) is False
    finally:
        frozen.signal(signal.SIGCONT)


def test_a_claimed_process_must_be_alive_this_user_and_hold_the_hello_connection() -> None:
    """What a hello claims of the same-host plane is checked against the kernel: the start time (a reused pid), and
    that the process holds the far end of the control connection the hello came on, so a hello cannot aim P's
    writes at another process of P's user (here: a child that holds no connection)."""
    import os
    import socket
    import subprocess
    import time

    from kvsvc.core.data_planes import SameHostAddress
    from kvsvc.transport.samehost import check_peer, own_address, start_time

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    via = (accepted.getsockname()[:2], accepted.getpeername()[:2])  # as P sees the hello's connection
    child = subprocess.Popen(["sleep", "30"])
    try:
        while start_time(child.pid) < 0:
            time.sleep(0.01)
        me = own_address()
        assert check_peer(me, via) == ""  # this process holds the client end
        other = SameHostAddress(me.host, os.getuid(), child.pid, start_time(child.pid))
        assert "does not hold the control connection" in check_peer(other, via)
        reused = SameHostAddress(me.host, os.getuid(), child.pid, start_time(child.pid) + 1)
        assert "not the process that published" in check_peer(reused, via)
        assert check_peer(me, None) == "no control connection to check the claimed process against"
    finally:
        child.kill()
        child.wait()
        for s in (client, accepted, server):
            s.close()
