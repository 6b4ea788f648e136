"""The trust boundary as an attacker of another user on the same host sees it (docs/operations.md, "Security").

Real engines (worker processes of the standalone runtime) on loopback without a control token, and an attacker in a
process of its own that drops to uid 65534 (nobody) before it does anything: it reads the engines' published
metadata, as anyone can, then
- points a Mooncake client of its own at every port the workers listen on and reads a registered pool address;
- opens a control connection to P and says hello as the real D worker (its identity is in the metadata and logs);
- serves a fake P engine that a client's params can send D to.
Each attack fails with a clear refusal, or finds no listener at all, and a real transfer beside it lands byte for
byte. The negative control runs the same Mooncake read against workers forced to Mooncake: there it reads P's KV,
which is what the docs say of Mooncake's port.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from kvsvc.core.layout import layer_bytes
from kvsvc.core.messages import FrameReader, HelloRefused, Message, WorkerMetadata, encode
from kvsvc.core.outputs import KVConnectorOutput
from kvsvc.service import ServiceConfig
from kvsvc.testing.hellos import start_of
from kvsvc.transport.samehost import listening_sockets
from workers.executor import EngineConfig, Executor, start_all
from workers.process import GetFinished, Prefill, Recv, Verify

pytest.importorskip("mooncake.engine")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NOBODY = 65534
GEOMETRY: dict[str, Any] = dict(num_layers=2, num_kv_heads=2, head_size=16, block_size=16, num_blocks=64)
TOKENS = 40
SETTLE_S = 30.0  # something that must happen, with no claim on how fast


def _engines(tag: str, transport: str = "auto") -> tuple[Executor, Executor]:
    service = ServiceConfig(transport=transport, handshake_timeout_s=3.0, recv_timeout_s=10.0, abort_grace_s=2.0)
    p = Executor(EngineConfig(engine_id=f"{tag}-p", role="prefill", service=service, **GEOMETRY))
    d = Executor(EngineConfig(engine_id=f"{tag}-d", role="decode", service=service, **GEOMETRY))
    start_all([p, d])
    return p, d


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Executor, Executor]]:
    p, d = _engines("trust")
    try:
        yield p, d
    finally:
        p.close()
        d.close()


def _ended(d: Executor, req_id: str) -> bool:
    """Wait until D reports `req_id`: True when it finished, False when it failed."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        (kv,) = d.broadcast(GetFinished())
        assert isinstance(kv, KVConnectorOutput)
        if req_id in (kv.finished_recving or ()) or req_id in (kv.failed_recving or ()):
            return req_id in (kv.finished_recving or ())
        time.sleep(0.02)
    pytest.fail(f"D never reported {req_id}")


def _transfer(p: Executor, d: Executor, tag: str, seed: int) -> None:
    """A real transfer from P to D, every byte checked on D."""
    blocks = [3 * seed % 60, 3 * seed % 60 + 1, 3 * seed % 60 + 2]
    p.broadcast(Prefill(f"p-{tag}", tag, blocks, TOKENS, seed))
    d.broadcast(Recv(f"d-{tag}", tag, p.engine_id, p.url, blocks, TOKENS))
    assert _ended(d, f"d-{tag}")
    (verified,) = d.broadcast(Verify(seed, blocks, TOKENS))
    assert getattr(verified, "ok", False), verified


# -- the attacker: a process of another user ---------------------------------------------------------------------


def _as_nobody(attack: Callable[..., Any], *args: Any) -> Any:
    """Run `attack(*args)` in a new process that drops to uid and gid 65534 once it has imported what it needs (the
    interpreter's own files may lie where nobody cannot read), and return what it returned."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_attacker_main, args=(child, attack, args), daemon=True)
    process.start()
    child.close()
    try:
        if not parent.poll(SETTLE_S * 2):
            pytest.fail("the attacker never answered")
        kind, value = parent.recv()
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
    if kind == "error":
        pytest.fail(f"the attacker failed: {value}")
    return value


def _attacker_main(conn: Connection, attack: Callable[..., Any], args: tuple[Any, ...]) -> None:
    # Everything the attacks use, before the interpreter's files are out of reach.
    import ctypes  # noqa: F401
    import encodings.idna  # noqa: F401
    import socket  # noqa: F401

    import aiohttp.web  # noqa: F401
    import mooncake.engine  # noqa: F401
    import msgspec  # noqa: F401

    import kvsvc.core.messages  # noqa: F401

    try:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        conn.send(("ok", attack(*args)))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def mooncake_read(sessions: list[str], addr: int, length: int) -> dict[str, tuple[int, bytes]]:
    """A Mooncake client of the attacker's own reads `length` bytes at `addr` from each session: (rc, bytes)."""
    import ctypes

    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("the attacker's Mooncake engine did not initialise")
    buffer = ctypes.create_string_buffer(length)
    engine.register_memory(ctypes.addressof(buffer), length)
    found = {}
    for session in sessions:
        ctypes.memset(buffer, 0, length)
        rc = engine.transfer_sync_read(session, ctypes.addressof(buffer), addr, length)
        found[session] = (rc, buffer.raw)
    return found


def squat(address: str, frames: bytes) -> list[Message]:
    """Open a control connection to `address`, send `frames`, and read every frame until the worker closes."""
    import socket

    host, _, port = address.rpartition(":")
    reader, answers = FrameReader(), []
    with socket.create_connection((host, int(port)), timeout=SETTLE_S) as sock:
        sock.sendall(frames)
        while data := sock.recv(65536):
            answers += reader.feed(data)
    return answers


# -- the attacks -------------------------------------------------------------------------------------------------


def _listeners(executor: Executor) -> set[tuple[str, int]]:
    return {each for handle in executor.workers for each in listening_sockets(handle.pid or 0)}


def _control_ports(executor: Executor) -> set[tuple[str, int]]:
    return {
        (m.control_addr.rpartition(":")[0], int(m.control_addr.rpartition(":")[2])) for m in executor.metas.values()
    }


@pytest.mark.parametrize("transport", ["auto", "mooncake"], ids=["same-host plane", "negative control: Mooncake"])
def test_a_mooncake_client_of_another_user_reads_no_pool_where_every_pair_takes_the_same_host_plane(
    transport: str,
) -> None:
    p, d = _engines(f"moon-{transport}", transport)
    try:
        _transfer(p, d, "first", 1)
        listening = _listeners(p) | _listeners(d)
        meta: WorkerMetadata = p.metas[(0, 0)]
        # Every port the workers listen on, and whatever Mooncake session they published, is tried.
        sessions = sorted(
            {f"127.0.0.1:{port}" for _, port in listening} | {m.transport_addr for m in p.metas.values()} - {""}
        )
        read = _as_nobody(mooncake_read, sessions, meta.base_addrs[0], layer_bytes(meta))
        landed = {session: data for session, (rc, data) in read.items() if rc == 0 and any(data)}
        if transport == "auto":
            assert listening == _control_ports(p) | _control_ports(d), "a worker listens beyond its control port"
            assert all(m.transport_addr == "" for m in [*p.metas.values(), *d.metas.values()])
            assert not landed, f"a Mooncake client read P's pool through {sorted(landed)}"
        else:  # the attack is real: a worker that runs Mooncake serves its pool to anyone who reaches the port
            assert meta.transport_addr in landed, read.keys()
        _transfer(p, d, "beside", 2)
    finally:
        p.close()
        d.close()


def test_a_process_of_another_user_cannot_take_the_place_of_a_d_worker(engines: tuple[Executor, Executor]) -> None:
    """Without a token the hello proves nothing, so the kernel's word on who holds the connection decides: a hello
    that names the live D worker's identity, from another user, is refused before P reads it, and the live
    connection (and its receives) go on."""
    p, d = engines
    _transfer(p, d, "before-squat", 3)
    p_meta, d_meta = p.metas[(0, 0)], d.metas[(0, 0)]
    from kvsvc.core.hello import make_hello

    hello = make_hello(d_meta, d.metas, p_meta, b"")
    answers = _as_nobody(squat, p_meta.control_addr, encode(start_of(hello)) + encode(hello))
    assert len(answers) == 1 and isinstance(answers[0], HelloRefused), answers
    assert f"the far end runs as uid {NOBODY}, this worker as uid {os.getuid()}" in answers[0].reason
    for seed in (4, 5):  # D's connection was never replaced: its receives land
        _transfer(p, d, f"after-squat-{seed}", seed)


def fake_p(published: bytes, stop_after_s: float, conn: Connection) -> int:
    """A P engine of the attacker's: its handshake endpoint serves `published` (a real P's document with the
    fake's control address), and its control server counts every byte D sends it, until `stop_after_s` passed."""
    import msgspec
    from aiohttp import web

    from kvsvc.core.messages import METADATA_CONTENT_TYPE, METADATA_PATH, decode_engine_metadata, encode_engine_metadata

    captured = 0

    async def serve() -> None:
        nonlocal captured

        async def control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal captured
            while data := await reader.read(65536):
                captured += len(data)
            writer.close()

        server = await asyncio.start_server(control, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        metas = {
            w: msgspec.structs.replace(m, control_addr=f"127.0.0.1:{port}")
            for w, m in decode_engine_metadata(published).items()
        }
        body = encode_engine_metadata(metas)

        async def document(_: web.Request) -> web.Response:
            return web.Response(body=body, content_type=METADATA_CONTENT_TYPE)

        app = web.Application()
        app.router.add_get(METADATA_PATH, document)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        conn.send(f"http://127.0.0.1:{runner.addresses[0][1]}")
        await asyncio.sleep(stop_after_s)
        await runner.cleanup()
        server.close()

    asyncio.run(serve())
    return captured


def test_without_a_token_d_tells_a_p_of_another_user_nothing(engines: tuple[Executor, Executor]) -> None:
    """A client's unsigned params may name any P on loopback. A fake P run by another user copies a real P's
    document; D connects, asks the kernel who holds the far end, and closes before it sends a byte: not its
    identity, not its pool addresses, and no block it holds is reported loaded."""
    from kvsvc.core.messages import encode_engine_metadata

    p, d = engines
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    fake = uuid.uuid4().hex[:8]
    published = encode_engine_metadata(p.metas)
    result_parent, result_child = ctx.Pipe()
    process = ctx.Process(target=_attacker_main, args=(result_child, fake_p, (published, 8.0, child)), daemon=True)
    process.start()
    try:
        assert parent.poll(SETTLE_S), "the fake P never started"
        url = parent.recv()
        d.broadcast(Recv("d-fake", f"fake-{fake}", p.engine_id, url, [50, 51, 52], TOKENS))
        assert not _ended(d, "d-fake")
        assert result_parent.poll(SETTLE_S), "the fake P never reported"
        kind, captured = result_parent.recv()
        assert kind == "ok", captured
        assert captured == 0, f"D sent a P of another user {captured} bytes"
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
    _transfer(p, d, "after-fake", 6)


def _fake_p_entry(published: bytes, stop_after_s: float, conn: Connection) -> int:
    return fake_p(published, stop_after_s, conn)
