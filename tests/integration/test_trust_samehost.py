"""The same-host plane as an attacker sees it: a crafted hello must not aim P's writes at another process.

A P engine of this process serves on loopback with the same-host plane; a victim is another process of the same user
with a buffer of known bytes (what an unrelated process's memory is to P). The attacker opens a control connection
and sends a hello whose metadata names the victim, then asks for a held transfer: once with the victim in
`transport_addr` (the Mooncake address, which must never reach the same-host plane), once in `samehost_addr` (which
P checks against the process holding the connection). Each is refused, the victim's bytes stay as they were, and a
real D engine beside the attacker still receives its transfer byte for byte.
"""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from msgspec.structs import replace

from kvsvc.core.data_planes import SameHostAddress
from kvsvc.core.layout import layer_bytes
from kvsvc.core.messages import (
    PROTOCOL_VERSION,
    FrameReader,
    Hello,
    HelloChallenge,
    HelloOk,
    HelloRefused,
    Message,
    TransferDone,
    TransferRequest,
    WorkerMetadata,
    encode,
)
from kvsvc.testing.engines import LoopbackEngine
from kvsvc.testing.hellos import unkeyed_frames
from kvsvc.testing.plugin import LoopbackFactory
from kvsvc.transport.samehost import host_identity, start_time

pytest.importorskip("mooncake.engine")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
VICTIM_BYTES = 1 << 20
VICTIM = """
import ctypes, hashlib, sys
buf = ctypes.create_string_buffer(bytes(range(256)) * (int(sys.argv[1]) // 256), int(sys.argv[1]))
print(ctypes.addressof(buf), flush=True)
for line in sys.stdin:
    print(hashlib.sha256(buf.raw).hexdigest(), flush=True)
"""


class Victim:
    """A process of this user that never talked to P: its buffer is at `addr`."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", VICTIM, str(VICTIM_BYTES)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.addr = int(self.proc.stdout.readline())
        self.untouched = hashlib.sha256(bytes(range(256)) * (VICTIM_BYTES // 256)).hexdigest()

    @property
    def address(self) -> str:
        import os

        return str(SameHostAddress(host_identity(), os.getuid(), self.proc.pid, start_time(self.proc.pid)))

    def sha(self) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("sha\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()


@pytest.fixture
def victim() -> Iterator[Victim]:
    target = Victim()
    yield target
    target.proc.kill()
    target.proc.wait(timeout=10)


def _aimed_at(d: WorkerMetadata, victim: Victim, **addresses: str) -> WorkerMetadata:
    """The real D worker's metadata as an attacker rewrites it: another engine whose KV pool is the victim's buffer."""
    size = layer_bytes(d)
    assert size * len(d.base_addrs) <= VICTIM_BYTES
    bases = [victim.addr + i * size for i in range(len(d.base_addrs))]
    return replace(d, engine_id="attacker", incarnation="a1", base_addrs=bases, **addresses)


async def _attack(p: LoopbackEngine, sender: WorkerMetadata, transfer_id: str, blocks: list[int]) -> list[Message]:
    """Hello P worker (0, 0) as `sender`, ask for `transfer_id` if the hello is accepted; every frame P answered."""
    meta = p.sim.metas[(0, 0)]
    host, port = meta.control_addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    frames = FrameReader()
    answers: list[Message] = []
    try:
        hello = Hello(
            version=PROTOCOL_VERSION,
            sender=sender,
            stage_layers=[(sender.start_layer, sender.end_layer)],
            expect_engine_id=meta.engine_id,
            expect_incarnation=meta.incarnation,
            expect_pp_rank=0,
            expect_tp_rank=0,
        )
        writer.write(unkeyed_frames(hello))  # no control token here: P's challenge asks nothing of the client
        while not [a for a in answers if not isinstance(a, HelloChallenge)]:
            answers += frames.feed(await asyncio.wait_for(reader.read(65536), 30))
        answers = [a for a in answers if not isinstance(a, HelloChallenge)]
        if isinstance(answers[0], HelloOk):
            writer.write(encode(TransferRequest(transfer_id=transfer_id, block_ids=blocks, num_tokens=8)))
            while len(answers) < 2:
                chunk = await asyncio.wait_for(reader.read(65536), 30)
                if not chunk:
                    break
                answers += frames.feed(chunk)
    finally:
        writer.close()
    return answers


@pytest.mark.parametrize("field", ["transport_addr", "samehost_addr"])
async def test_a_hello_cannot_aim_p_writes_at_another_process(
    loopback_engines: LoopbackFactory, victim: Victim, field: str
) -> None:
    p, d = await loopback_engines(transport="samehost")
    blocks, mine = [0, 1], [2, 3]
    p.start_send("r1", "t1", blocks, 8)
    p.start_send("r2", "t2", mine, 8)
    # The other address field gets a Mooncake address nobody serves, so no write can land anywhere through it.
    other = "samehost_addr" if field == "transport_addr" else "transport_addr"
    sender = _aimed_at(d.sim.metas[(0, 0)], victim, **{field: victim.address, other: ""})
    if field == "samehost_addr":
        sender = replace(sender, transport_addr="127.0.0.1:9")
    answers = await _attack(p, sender, "t1", blocks)

    if field == "transport_addr":  # refused at the hello, naming the field
        assert isinstance(answers[0], HelloRefused) and "transport_addr" in answers[0].reason, answers
    else:  # the check of the claimed process refuses the plane; the write, on Mooncake to nowhere, cannot land
        assert not any(isinstance(a, TransferDone) for a in answers), answers
    assert victim.sha() == victim.untouched, "P wrote into a process that never talked to it"
    # The legitimate D beside the attacker gets every byte of its transfer.
    d.start_recv("r2", "t2", p, mine, 8)
    assert await d.wait("r2") == "finished"
    d.check_received("t2", mine, 8)


async def test_a_worker_forced_to_mooncake_offers_no_same_host_plane(loopback_engines: LoopbackFactory) -> None:
    from kvsvc.service import ServiceConfig
    from kvsvc.transport.mooncake import MooncakeTransport
    from kvsvc.transport.routed import RoutedTransport, with_same_host

    p, _ = await loopback_engines(config=ServiceConfig(transport="mooncake"), transport="samehost")
    assert all(meta.samehost_addr == "" for meta in p.sim.metas.values())
    forced = with_same_host(MooncakeTransport(), "cpu", "mooncake")
    try:
        assert not isinstance(forced, RoutedTransport) and forced.local_session_id == ""
    finally:
        await forced.close()
