"""Authentication between real engines (docs/operations.md, Security): a real P and a real D engine sharing a control
token, and fakes played by this test: a fake P (its own bootstrap endpoint and control server) that D reaches
through params a client wrote, and a fake D that replays what the fake P captured to a real P worker.

Each test is the attack: the fake P never learns the token or D's pool, what it captures opens no real P, and a
P that answers done without writing fails the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from kvsvc.core.auth import HELLO_KEY, NONCE_BYTES, derive_key
from kvsvc.core.hello import HelloAccepted, HelloChallenged, accept_hello, challenge_hello
from kvsvc.core.messages import (
    PROTOCOL_VERSION,
    FrameReader,
    Hello,
    HelloChallenge,
    HelloOk,
    HelloStart,
    Message,
    TransferDone,
    TransferRequest,
    WorkerMetadata,
    encode,
)
from kvsvc.core.outputs import KVConnectorOutput
from kvsvc.engine.bootstrap import BootstrapServer
from kvsvc.service import ServiceConfig
from kvsvc.transport.mooncake import MooncakeConfig
from workers.executor import EngineConfig, Executor, start_all
from workers.process import ForgetEngine, GetFinished, Prefill, Recv

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TOKEN = "auth-test-" + uuid.uuid4().hex
GEOMETRY: dict[str, Any] = dict(num_layers=2, num_kv_heads=2, head_size=16, block_size=16, num_blocks=64)
SERVICE = ServiceConfig(control_token=TOKEN, handshake_timeout_s=3.0, recv_timeout_s=10.0, abort_grace_s=2.0)
TOKENS = 40
SETTLE_S = 30.0  # something that must happen, with no claim on how fast
IO_BOUND_S = 10.0


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Executor, Executor]]:
    # Mooncake from the start: D's session is one of the addresses a fake P must never learn, and a replayed hello
    # would have P write into D's pool over it.
    mooncake = MooncakeConfig(on_demand=False)
    p = Executor(EngineConfig(engine_id="auth-p", role="prefill", service=SERVICE, transport=mooncake, **GEOMETRY))
    d = Executor(EngineConfig(engine_id="auth-d", role="decode", service=SERVICE, transport=mooncake, **GEOMETRY))
    start_all([p, d])
    try:
        yield p, d
    finally:
        p.close()
        d.close()


class FakeP:
    """A P engine played by the test: its bootstrap endpoint publishes `published` (with the fake's control
    address), and `answer` decides what its control server says to each frame D sends. Records every byte."""

    def __init__(self, published: WorkerMetadata, answer: Callable[[FakeP, Message], list[Message]]) -> None:
        self.published = published
        self.answer = answer
        self.captured = bytearray()
        self.frames: list[Message] = []
        self.challenged: HelloChallenged | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)

    async def _start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.published = msgspec.structs.replace(self.published, control_addr=f"127.0.0.1:{port}")
        self._bootstrap = BootstrapServer({(0, 0): self.published})
        return await self._bootstrap.start()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = FrameReader()
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while data := await reader.read(65536):
                self.captured += data
                for message in frames.feed(data):
                    self.frames.append(message)
                    for reply in self.answer(self, message):
                        writer.write(encode(reply))
        except (ConnectionError, ValueError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._handlers.discard(task)

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for task in list(self._handlers):  # D may keep its connection open: end the handlers here
                task.cancel()
            await asyncio.gather(*self._handlers, return_exceptions=True)
            await self._bootstrap.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


def _fake_of(p: Executor, name: str) -> WorkerMetadata:
    """A P worker's metadata as a fake engine publishes it: a copy of `p`'s (so D's layout checks pass)."""
    return msgspec.structs.replace(p.metas[(0, 0)], engine_id=name, incarnation=uuid.uuid4().hex[:12])


def _ended(d: Executor, req_id: str) -> tuple[bool, set[int]]:
    """Wait until D reports `req_id`; (finished, invalid block ids)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        (kv,) = d.broadcast(GetFinished())
        assert isinstance(kv, KVConnectorOutput)
        if req_id in (kv.finished_recving or ()) or req_id in (kv.failed_recving or ()):
            return req_id in (kv.finished_recving or ()), set(kv.invalid_block_ids)
        time.sleep(0.02)
    pytest.fail(f"D never reported {req_id}")


def test_a_fake_p_without_the_key_learns_nothing_that_opens_a_real_p(engines: tuple[Executor, Executor]) -> None:
    """A client's params send D to a fake P, which answers D's hello as a P worker that accepts anything would.
    D fails the load, and everything it sent fits D's opening: no token, none of its pool. A fake D replaying
    that to a real P worker, aimed at it, gets no acceptance."""
    p, d = engines

    def answer(fake: FakeP, message: Message) -> list[Message]:
        if isinstance(message, HelloStart):  # a proof it cannot make: random bytes
            return [HelloChallenge(version=message.version, sender=fake.published, nonce=secrets.token_bytes(32),
                                   proof=secrets.token_bytes(32))]  # fmt: skip
        if isinstance(message, Hello):  # a D that sends its hello at once: accept it, as a P without a key would
            return [HelloOk(version=message.version, sender=fake.published)]
        return []

    fake = FakeP(_fake_of(p, "auth-fake-p"), answer)
    try:
        d.broadcast(Recv("d-fake", "fake-transfer", "auth-fake-p", fake.url, [1, 2, 3], TOKENS))
        finished, invalid = _ended(d, "d-fake")
    finally:
        fake.close()
    assert not finished and {1, 2, 3} <= invalid
    d_meta = d.metas[(0, 0)]
    assert TOKEN.encode() not in fake.captured
    assert d_meta.transport_addr.encode() not in fake.captured
    assert not any(isinstance(m, Hello | TransferRequest) for m in fake.frames), fake.frames
    assert fake.frames, "D never reached the fake P"

    # The fake D: the captured frames, aimed at the real P worker, then a hello with whatever proof it has.
    target = p.metas[(0, 0)]
    aim = dict(
        expect_engine_id=target.engine_id,
        expect_incarnation=target.incarnation,
        expect_pp_rank=target.pp_rank,
        expect_tp_rank=target.tp_rank,
    )
    answers = _replay(target.control_addr, [msgspec.structs.replace(m, **aim) for m in fake.frames], d_meta, aim)
    assert not any(isinstance(m, HelloOk) for m in answers), answers
    assert all(s["holds"] == 0 for s in p.statistics())


def _replay(address: str, frames: list[Any], d_meta: WorkerMetadata, aim: dict[str, Any]) -> list[Message]:
    """Send `frames` to a real P worker; to a challenge, answer a hello as D without the key would (D's published
    metadata, an empty proof, then a made-up one). Every frame P sent until it closed."""
    host, _, port = address.rpartition(":")
    reader = FrameReader()
    answers: list[Message] = []
    with socket.create_connection((host, int(port)), timeout=IO_BOUND_S) as sock:
        sock.sendall(b"".join(encode(m) for m in frames))
        deadline = time.monotonic() + IO_BOUND_S
        while time.monotonic() < deadline:
            try:
                data = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not data:
                break
            for message in reader.feed(data):
                answers.append(message)
                if isinstance(message, HelloChallenge):
                    stages = [(d_meta.start_layer, d_meta.end_layer)]
                    hello = Hello(version=PROTOCOL_VERSION, sender=d_meta, stage_layers=stages, **aim,
                                  proof=secrets.token_bytes(32))  # fmt: skip
                    sock.sendall(encode(hello))
    return answers


def test_a_p_that_answers_done_without_writing_fails_the_load(engines: tuple[Executor, Executor]) -> None:
    """A P worker that holds the key but answers `TransferDone` with 0 bytes for a transfer D planned to receive
    bytes from: D reports the load failed, its blocks invalid, instead of decoding over stale bytes."""
    p, d = engines
    key = derive_key(TOKEN, HELLO_KEY)

    def answer(fake: FakeP, message: Message) -> list[Message]:
        if isinstance(message, HelloStart):
            challenged = challenge_hello(fake.published, message, key, secrets.token_bytes(NONCE_BYTES))
            assert isinstance(challenged, HelloChallenged)
            fake.challenged = challenged
            return [challenged.reply]
        if isinstance(message, Hello) and fake.challenged is not None:
            accepted = accept_hello(fake.published, fake.challenged, message, key)
            assert isinstance(accepted, HelloAccepted), accepted
            return [accepted.seal("mooncake")]  # as P's service names its plane, with its proof
        if isinstance(message, TransferRequest):
            return [TransferDone(transfer_id=message.transfer_id, bytes=0, descriptors=0)]
        return []

    lazy = msgspec.structs.replace(_fake_of(p, "auth-lazy-p"), accepts_windows=False)
    fake = FakeP(lazy, answer)
    try:
        d.broadcast(Recv("d-lazy", "lazy-transfer", "auth-lazy-p", fake.url, [4, 5, 6], TOKENS))
        finished, invalid = _ended(d, "d-lazy")
    finally:
        fake.close()
    assert any(isinstance(m, TransferRequest) for m in fake.frames), "D never asked the fake P"
    assert not finished and {4, 5, 6} <= invalid


def test_engines_sharing_the_token_transfer(engines: tuple[Executor, Executor]) -> None:
    p, d = engines
    p.broadcast(Prefill("p-ok", "ok", [0, 1, 2], TOKENS, 5))
    d.broadcast(Recv("d-ok", "ok", p.engine_id, p.url, [7, 8, 9], TOKENS))
    finished, _ = _ended(d, "d-ok")
    assert finished


class Relay:
    """A relay without the token between a real D and a real P: it serves P's engine document with its own control
    address, forwards every frame both ways, and rewrites what lies between the proofs: P's metadata on its way to
    D (so that it matches the document D fetched), D's pool on its way to P (so that P would write where the relay
    chose). Records which frames went each way."""

    def __init__(self, p: Executor) -> None:
        self.p_meta = p.metas[(0, 0)]
        self.to_p: list[Message] = []
        self.to_d: list[Message] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)

    async def _start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        self._bootstrap = BootstrapServer({(0, 0): self._as_relayed(self.p_meta)})
        return await self._bootstrap.start()

    def _as_relayed(self, meta: WorkerMetadata) -> WorkerMetadata:
        return msgspec.structs.replace(meta, control_addr=self.address)

    async def _serve(self, d_reader: asyncio.StreamReader, d_writer: asyncio.StreamWriter) -> None:
        host, _, port = self.p_meta.control_addr.rpartition(":")
        p_reader, p_writer = await asyncio.open_connection(host, int(port))

        def to_p(message: Message) -> Message:
            if isinstance(message, Hello):  # D's pool, moved: P would write a block further on
                sender = message.sender
                moved = [addr + 4096 for addr in sender.base_addrs]
                message = msgspec.structs.replace(message, sender=msgspec.structs.replace(sender, base_addrs=moved))
            self.to_p.append(message)
            return message

        def to_d(message: Message) -> Message:
            if isinstance(message, HelloChallenge | HelloOk):
                message = msgspec.structs.replace(message, sender=self._as_relayed(message.sender))
            self.to_d.append(message)
            return message

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, change: Any) -> None:
            frames = FrameReader()
            with contextlib.suppress(ConnectionError, ValueError):
                while data := await reader.read(65536):
                    writer.write(b"".join(encode(change(m)) for m in frames.feed(data)))
            writer.close()

        await asyncio.gather(pump(d_reader, p_writer, to_p), pump(p_reader, d_writer, to_d))

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            await self._bootstrap.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


def test_a_relay_that_rewrites_the_metadata_between_the_proofs_is_refused(engines: tuple[Executor, Executor]) -> None:
    """The proofs bind the whole exchange: the relay's rewrite of P's metadata fails P's proof at D, which then sends
    P nothing of its pool, so P never sees a hello to write by; the transfer through the relay fails, and the same
    transfer asked of P directly lands."""
    p, d = engines
    d.broadcast(ForgetEngine(p.engine_id))  # D reaches P afresh, through the relay, not on the connection it holds
    relay = Relay(p)
    try:
        p.broadcast(Prefill("p-relayed", "relayed", [10, 11, 12], TOKENS, 7))
        d.broadcast(Recv("d-relayed", "relayed", p.engine_id, relay.url, [13, 14, 15], TOKENS))
        finished, invalid = _ended(d, "d-relayed")
    finally:
        relay.close()
    assert not finished and {13, 14, 15} <= invalid
    assert [type(m) for m in relay.to_d] == [HelloChallenge], relay.to_d  # D stopped at P's proof
    assert not any(isinstance(m, Hello) for m in relay.to_p), "D sent its pool through the relay"
    d.broadcast(ForgetEngine(p.engine_id))
    d.broadcast(Recv("d-direct", "relayed", p.engine_id, p.url, [13, 14, 15], TOKENS))
    assert _ended(d, "d-direct")[0]
