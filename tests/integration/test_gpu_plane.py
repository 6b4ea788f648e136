"""The GPU plane on a real GPU: P (this process) writes into a D process's GPU memory through CUDA IPC, with the
host's CUDA driver (`LibCuda`). Skipped without a GPU; `make gpu-check` runs them on a GPU host."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvsvc.core.messages import IpcHandle
from kvsvc.transport import WriteFailed

pytestmark = pytest.mark.cuda

NBYTES = 64 << 20


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


if not _has_cuda():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import torch  # noqa: E402

from kvsvc.transport.cuda_driver import LibCuda  # noqa: E402
from kvsvc.transport.cuda_ipc import CudaIpcTransport  # noqa: E402


@dataclass
class Peer:
    process: subprocess.Popen[str]
    offer: dict[str, object]
    via: tuple[tuple[str, int], tuple[str, int]]
    connection: socket.socket

    def sha(self, start: int, length: int) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"sha {start} {length}\n")
        self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    @property
    def handles(self) -> list[IpcHandle]:
        rows = self.offer["handles"]
        assert isinstance(rows, list)
        return [IpcHandle(handle=bytes.fromhex(h), base=b, size=s) for h, b, s in rows]

    @property
    def regions(self) -> list[tuple[int, int]]:
        addr, size = self.offer["region"]  # type: ignore[misc]
        return [(addr, size)]


def start_peer(extra_env: dict[str, str] | None = None) -> Peer:
    server = socket.create_server(("127.0.0.1", 0))
    host, port = server.getsockname()[:2]
    env = dict(os.environ, **(extra_env or {}))
    process = subprocess.Popen(
        [sys.executable, "-m", "kvsvc.testing.gpu_peer", host, str(port), str(NBYTES)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    # Accepted in one-second slices: a peer that dies before connecting (its CUDA start failed) fails the test at
    # once, its stderr in pytest's capture, rather than holding it for the whole bound.
    server.settimeout(1)
    with server:
        for _ in range(120):
            try:
                connection, _ = server.accept()
                break
            except TimeoutError:
                if process.poll() is not None:
                    _reap(process)
                    pytest.fail(f"the GPU peer exited with {process.returncode} before connecting")
        else:
            _reap(process)
            pytest.fail("the GPU peer did not connect within 120 s")
    assert process.stdout is not None
    offer = json.loads(process.stdout.readline())
    via = (connection.getsockname()[:2], connection.getpeername()[:2])
    return Peer(process, offer, via, connection)


def _reap(process: subprocess.Popen[str]) -> None:
    process.kill()
    process.wait(10)
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            pipe.close()


@pytest.fixture
def peer() -> Iterator[Peer]:
    made = start_peer()
    yield made
    made.connection.close()
    made.process.kill()
    made.process.wait(30)


async def test_p_writes_d_s_gpu_memory_large_and_in_many_pieces(peer: Peer) -> None:
    assert str(peer.offer["session"]).startswith("cudaipc:"), peer.offer
    src = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    plane = CudaIpcTransport()
    plane.register([(src.data_ptr(), NBYTES)])
    session = str(peer.offer["session"])
    try:
        assert await plane.reachable(session, peer.regions, peer.via, peer.handles) == ""
        plane.add_peer(session, peer.regions)
        d = peer.regions[0][0]
        half = NBYTES // 2
        assert await plane.write(session, [(src.data_ptr(), d, half)]) == half
        # The other half as 4 KiB pieces in a shuffled order: one batched call where the driver has it.
        piece = 4096
        order = list(range(half // piece))
        random.Random(7).shuffle(order)
        pieces = [(src.data_ptr() + half + i * piece, d + half + j * piece, piece) for j, i in enumerate(order)]
        assert await plane.write(session, pieces) == half
        want = src.cpu().numpy().tobytes()
        assert peer.sha(0, half) == hashlib.sha256(want[:half]).hexdigest()
        moved = b"".join(want[half + i * piece : half + (i + 1) * piece] for i in order)
        assert peer.sha(half, half) == hashlib.sha256(moved).hexdigest()
        stats = plane.statistics()
        assert stats.bytes_written == NBYTES and stats.failures == 0
    finally:
        await plane.close()


async def test_rows_at_constant_pitches_land_where_each_row_says(peer: Peer) -> None:
    # A split layout's plan: contiguous rows of P into every other row of D (a head share of each block). The plane
    # moves them as 2D copies; each row must land at its own place and the gaps keep what D held.
    src = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device="cuda")
    zeros = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    plane = CudaIpcTransport()
    plane.register([(src.data_ptr(), NBYTES), (zeros.data_ptr(), NBYTES)])
    session = str(peer.offer["session"])
    try:
        assert await plane.reachable(session, peer.regions, peer.via, peer.handles) == ""
        plane.add_peer(session, peer.regions)
        d = peer.regions[0][0]
        assert await plane.write(session, [(zeros.data_ptr(), d, NBYTES)]) == NBYTES
        row = 8192
        rows = [(src.data_ptr() + i * row, d + 2 * i * row, row) for i in range(NBYTES // (2 * row))]
        rows.append((src.data_ptr() + NBYTES - row, d + NBYTES - 3 * row, row))  # breaks the pitch at the end
        assert await plane.write(session, rows) == NBYTES // 2 + row
        data = src.cpu().numpy().tobytes()
        want = bytearray(NBYTES)
        for s, t, n in rows:
            want[t - d : t - d + n] = data[s - src.data_ptr() : s - src.data_ptr() + n]
        assert peer.sha(0, NBYTES) == hashlib.sha256(bytes(want)).hexdigest()
        assert isinstance(plane._driver, LibCuda) and plane._driver.pitched  # as 2D copies, not the batch
    finally:
        await plane.close()


async def test_a_dead_d_fails_the_next_write_at_once(peer: Peer) -> None:
    src = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    plane = CudaIpcTransport()
    plane.register([(src.data_ptr(), 4096)])
    session = str(peer.offer["session"])
    try:
        assert await plane.reachable(session, peer.regions, peer.via, peer.handles) == ""
        plane.add_peer(session, peer.regions)
        peer.process.kill()
        await asyncio.to_thread(peer.process.wait, 30)
        failed = await plane.write(session, [(src.data_ptr(), peer.regions[0][0], 4096)])
        assert isinstance(failed, WriteFailed) and "is gone" in failed.message
        assert await plane.peer_gone(session)
    finally:
        await plane.close()


def test_memory_from_expandable_segments_offers_no_gpu_plane() -> None:
    made = start_peer({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    try:
        assert made.offer["session"] == ""
        assert "CUDA IPC cannot export" in str(made.offer["unexportable"])
    finally:
        made.connection.close()
        made.process.kill()
        made.process.wait(30)
