"""Faults injected for real into worker processes moving KV over each data plane (Mooncake over TCP loopback, and the
same-host plane): nothing lost, nothing leaked.

Proven here, each failure within a bound named in the test (a polling deadline; durations are never asserted):
- repeated `start_send` / `start_recv` and repeated wire messages write once and report once per worker;
- a hold nobody asks for expires (`hold_timeout_s`) and is reported once, within `HOLD_EXPIRY_BOUND_S`;
- a receive from a SIGKILLed P worker fails within `DEAD_P_BOUND_S` (below D's receive timeout, so the dead
  connection decides it, not the timer), mid-write too, with every block of the request invalid;
- a SIGSTOPped P worker fails the receive within `FROZEN_P_BOUND_S` (D's receive timeout plus abort grace) and,
  once it resumes, its hold ends and is reported once;
- a restarted P engine (new incarnation) serves new requests byte-exact and fails the old ones;
- malformed input on a control port gets an error frame and breaks neither the worker nor later transfers.
After every test a finalizer polls every worker of every engine until none holds a request, writes or has
descriptors in flight (within `LEAK_BOUND_S`). Engines start once per module; faulted ones restart themselves.
Reports are read per worker (`GetFinished` on each), below the engine core's aggregation, so a worker that
reported an id twice is seen. Bugs found are strict xfails, their reasons naming file and cause.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import socket
import struct
import time
import uuid
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import pytest

from kvsvc.core.auth import harness_secret
from kvsvc.core.messages import (
    PROTOCOL_VERSION,
    Abort,
    ErrorMessage,
    FrameReader,
    Hello,
    HelloChallenge,
    HelloOk,
    HelloRefused,
    Message,
    Ping,
    Pong,
    Release,
    TransferDone,
    TransferFailed,
    TransferRequest,
    WorkerMetadata,
    encode,
)
from kvsvc.core.outputs import KVConnectorOutput
from kvsvc.engine.admin import AdminServer
from kvsvc.service import ServiceConfig
from kvsvc.testing.hellos import start_of, unkeyed_frames
from kvsvc.transport.mooncake import MooncakeConfig
from workers.executor import EngineConfig, Executor, start_all
from workers.process import Batch, ForgetEngine, GetFinished, Peers, Prefill, Recv, Verify
from workers.synthetic import VerifyResult
from workers.view import ExecutorView

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

# -- configuration: short timeouts, so every fault resolves in seconds ---------------------------------------

BLOCK_SIZE = 16
NUM_BLOCKS = 2048  # 128 MiB per tp1 worker: a whole-pool write stays in flight for a few hundred ms
GEOMETRY: dict[str, Any] = dict(
    num_layers=4, num_kv_heads=4, head_size=64, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS
)
HOLD_TIMEOUT_S = 1.0  # P engine "expiring" only
EARLY_REQUEST_TIMEOUT_S = 3.0  # every P engine
RECV_TIMEOUT_S = 6.0  # D
ABORT_GRACE_S = 1.5  # D; above the Mooncake progress timeout, as ServiceConfig asks
HANDSHAKE_TIMEOUT_S = 2.0
# Raw clients pose as D workers whose pool is a real D's (`_ghost`): P writes there over Mooncake, so every engine
# runs it from the start.
MOONCAKE = MooncakeConfig(progress_timeout_s=1, drain_timeout_s=0.5, on_demand=False)

# -- bounds (polling deadlines) --------------------------------------------------------------------------------

SLACK_S = 3.0  # scheduling on a busy 2-core host
SETTLE_S = 20.0  # something that must happen, with no claim on how fast (a transfer finishing)
HOLD_EXPIRY_BOUND_S = HOLD_TIMEOUT_S + SLACK_S
DEAD_P_BOUND_S = 4.0  # < RECV_TIMEOUT_S: the broken connection fails the receive, not its timer
FROZEN_P_BOUND_S = RECV_TIMEOUT_S + ABORT_GRACE_S + SLACK_S
STALE_TRANSFER_BOUND_S = EARLY_REQUEST_TIMEOUT_S + SLACK_S  # P answers "unknown transfer" after it
LEAK_BOUND_S = 15.0
IO_BOUND_S = 5.0  # a worker answering one frame on its control port
POLL_S = 0.01

TOKENS = 50  # 4 blocks, the last one partial
BIG_TOKENS = NUM_BLOCKS * BLOCK_SIZE  # the whole pool

P_SERVICE = ServiceConfig(early_request_timeout_s=EARLY_REQUEST_TIMEOUT_S, handshake_timeout_s=HANDSHAKE_TIMEOUT_S)
CONFIGS = {
    # Two P workers each sourcing half the heads of the one D worker: one transfer per P worker per request.
    "p_tp2": EngineConfig(
        engine_id="faults-p-tp2", role="prefill", tp_size=2, service=P_SERVICE, transport=MOONCAKE, **GEOMETRY
    ),
    "p_expiring": EngineConfig(
        engine_id="faults-p-expiring",
        role="prefill",
        service=dataclasses.replace(P_SERVICE, hold_timeout_s=HOLD_TIMEOUT_S),
        transport=MOONCAKE,
        **GEOMETRY,
    ),
    # Killed, frozen and restarted by the tests.
    "p_fault": EngineConfig(
        engine_id="faults-p-fault", role="prefill", service=P_SERVICE, transport=MOONCAKE, **GEOMETRY
    ),
    "d": EngineConfig(
        engine_id="faults-d",
        role="decode",
        service=ServiceConfig(
            recv_timeout_s=RECV_TIMEOUT_S, abort_grace_s=ABORT_GRACE_S, handshake_timeout_s=HANDSHAKE_TIMEOUT_S
        ),
        transport=MOONCAKE,
        **GEOMETRY,
    ),
}


@pytest.fixture(scope="module", params=["mooncake", "samehost"])
def plane(request: pytest.FixtureRequest) -> str:
    """The data plane P's writes take (`ServiceConfig.transport`): every test on `engines` runs on both."""
    kind: str = request.param
    return kind


@pytest.fixture(scope="module")
def engines(plane: str) -> Iterator[dict[str, Executor]]:
    # The same-host plane by the rule ("auto"): the real pairs take it, and a raw client posing as a D worker falls
    # back to Mooncake, which "samehost" would refuse.
    setting = "auto" if plane == "samehost" else plane
    configs = {
        name: dataclasses.replace(config, service=dataclasses.replace(config.service, transport=setting))
        for name, config in CONFIGS.items()
    }
    executors = {name: Executor(config) for name, config in configs.items()}
    start_all(list(executors.values()))
    try:
        yield executors
    finally:
        for executor in executors.values():
            executor.close()
        assert not any(any(e.alive()) for e in executors.values())


@pytest.fixture(autouse=True)
def nothing_leaks(engines: dict[str, Executor]) -> Iterator[None]:
    """After each test: every worker of every engine holds nothing, writes nothing, has nothing in flight."""
    yield
    for executor in engines.values():  # repair what a failed test left behind, so the next one can run
        for handle in executor.workers:
            if handle.stopped:
                executor.cont(handle.index)
        if not all(executor.alive()):
            executor.restart()

    def leaks() -> list[str]:
        found = []
        for executor in engines.values():
            executor.step()
            for index, s in enumerate(executor.statistics()):
                counts = (
                    s["holds"],
                    s["writes_in_flight"],
                    s["transport"]["descriptors_in_flight"],
                    s["sender"]["early_requests"],
                )
                if any(counts):
                    found.append(f"{executor.engine_id} worker {index}: holds/writes/descriptors/early {counts}")
        return found

    _until(lambda: not leaks(), LEAK_BOUND_S, lambda: "; ".join(leaks()))


# -- helpers ---------------------------------------------------------------------------------------------------


def _until(condition: Callable[[], bool], bound_s: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {bound_s:g} s: {what()}")
        time.sleep(POLL_S)


def _blocks(first: int, tokens: int) -> list[int]:
    return list(range(first, first + -(-tokens // BLOCK_SIZE)))


@dataclass
class Reports:
    """Every `get_finished` report of each worker of one engine since this object was made, counted per worker."""

    executor: Executor
    sending: Counter[tuple[int, str]] = field(default_factory=Counter)
    recving: Counter[tuple[int, str]] = field(default_factory=Counter)
    failed: Counter[tuple[int, str]] = field(default_factory=Counter)
    invalid: defaultdict[int, set[int]] = field(default_factory=lambda: defaultdict(set))

    def poll(self) -> Reports:
        for index, kv in enumerate(self.executor.broadcast(GetFinished())):
            assert isinstance(kv, KVConnectorOutput)
            for req_id in kv.finished_sending or ():
                self.sending[index, req_id] += 1
            for req_id in kv.finished_recving or ():
                self.recving[index, req_id] += 1
            for req_id in kv.failed_recving or ():
                self.failed[index, req_id] += 1
            self.invalid[index] |= kv.invalid_block_ids
        return self

    @property
    def workers(self) -> range:
        return range(self.executor.num_workers)

    def polled_sent(self, req_id: str) -> bool:
        return self.poll().sent(req_id)

    def sent(self, req_id: str) -> bool:
        """Every worker reported the send finished (at least once)."""
        return all(self.sending[i, req_id] for i in self.workers)

    def ended(self, req_id: str) -> bool:
        """Every worker reported the receive, finished or failed (at least once)."""
        return all(self.recving[i, req_id] + self.failed[i, req_id] for i in self.workers)

    def assert_sent_once(self, req_id: str) -> None:
        assert [self.sending[i, req_id] for i in self.workers] == [1] * len(self.workers), req_id

    def assert_received_once(self, req_id: str) -> None:
        assert [(self.recving[i, req_id], self.failed[i, req_id]) for i in self.workers] == [(1, 0)] * len(
            self.workers
        ), req_id

    def assert_failed_once(self, req_id: str, block_ids: Sequence[int]) -> None:
        assert [(self.recving[i, req_id], self.failed[i, req_id]) for i in self.workers] == [(0, 1)] * len(
            self.workers
        ), req_id
        for i in self.workers:
            assert set(block_ids) <= self.invalid[i], f"worker {i}: blocks of {req_id} not all reported invalid"


def _prefill(p: Executor, req_id: str, transfer_id: str, block_ids: Sequence[int], tokens: int, seed: int) -> None:
    p.broadcast(Prefill(req_id, transfer_id, list(block_ids), tokens, seed))


def _recv(d: Executor, req_id: str, transfer_id: str, p: Executor, block_ids: Sequence[int], tokens: int) -> None:
    d.broadcast(Recv(req_id, transfer_id, p.engine_id, p.url, list(block_ids), tokens))


def _assert_bytes(d: Executor, seed: int, block_ids: Sequence[int], tokens: int) -> None:
    results = d.broadcast(Verify(seed, list(block_ids), tokens))
    assert all(isinstance(r, VerifyResult) and r.ok and r.checked > 0 for r in results), results


def _transfer(p: Executor, d: Executor, tag: str, seed: int, d_first_block: int = 0, recv_first: bool = False) -> None:
    """One request from `p` to `d`, start to end: D verifies every byte, each side reports it once."""
    p_reports, d_reports = Reports(p), Reports(d)
    p_blocks, d_blocks = _blocks(0, TOKENS), _blocks(d_first_block, TOKENS)
    if recv_first:  # P holds the KV only once D's request waits there: no hold timeout can race the handshake
        _recv(d, f"d-{tag}", tag, p, d_blocks, TOKENS)
        _until(
            lambda: all(s["sender"]["early_requests"] for s in p.statistics()),
            SETTLE_S,
            lambda: f"D's request for {tag} never reached {p.engine_id}",
        )
    _prefill(p, f"p-{tag}", tag, p_blocks, TOKENS, seed)
    if not recv_first:
        _recv(d, f"d-{tag}", tag, p, d_blocks, TOKENS)
    _until(
        lambda: d_reports.poll().ended(f"d-{tag}") and p_reports.poll().sent(f"p-{tag}"),
        SETTLE_S,
        lambda: f"transfer {tag} from {p.engine_id} to {d.engine_id} did not end",
    )
    d_reports.assert_received_once(f"d-{tag}")
    p_reports.assert_sent_once(f"p-{tag}")
    _assert_bytes(d, seed, d_blocks, TOKENS)


def _stat(executor: Executor, key: str) -> list[Any]:
    return [s[key] for s in executor.statistics()]


def _start_big_write(p: Executor, d: Executor, tag: str, seed: int) -> tuple[str, list[int]]:
    """Start whole-pool requests until P's write is seen with descriptors in flight (D's blocks reversed, so
    every (layer, block) is a descriptor: thousands of them). Returns the D req_id and its blocks.

    A write that finishes between two polls is let go and the next attempt made (3 at most).
    """
    p_blocks, d_blocks = list(range(NUM_BLOCKS)), list(reversed(range(NUM_BLOCKS)))
    d_reports, p_reports = Reports(d), Reports(p)
    for attempt in range(3):
        tid = f"{tag}-{attempt}"
        _prefill(p, f"p-{tid}", tid, p_blocks, BIG_TOKENS, seed)
        _recv(d, f"d-{tid}", tid, p, d_blocks, BIG_TOKENS)
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            (stats,) = p.statistics()
            if stats["writes_in_flight"] and stats["transport"]["descriptors_in_flight"]:
                return f"d-{tid}", d_blocks
            if d_reports.poll().ended(f"d-{tid}"):
                break
        missed = functools.partial(p_reports.polled_sent, f"p-{tid}")
        _until(missed, SETTLE_S, functools.partial(str, f"write {tid}, missed in flight, never ended on P"))
    pytest.fail("P's write of a whole pool was never seen in flight in 3 attempts")


class RawPeer:
    """A bare client of a worker's control port: frames or raw bytes out, decoded frames in."""

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=IO_BOUND_S)
        self.frames = FrameReader()
        self.inbox: deque[Message] = deque()
        self.eof = False

    def send(self, *messages: Message) -> None:
        self.sock.sendall(b"".join(encode(m) for m in messages))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def receive(self, bound_s: float = IO_BOUND_S) -> Message | None:
        """The next frame, or None when the worker closed the connection first."""
        deadline = time.monotonic() + bound_s
        while not self.inbox and not self.eof:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"no frame and no close from the worker within {bound_s:g} s")
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            except ConnectionResetError:
                data = b""
            if not data:
                self.eof = True
            else:
                self.inbox.extend(self.frames.feed(data))
        return self.inbox.popleft() if self.inbox else None

    def until_pong(self, nonce: int) -> list[Message]:
        """Ping, then every frame that came before the pong."""
        self.send(Ping(nonce=nonce))
        before: list[Message] = []
        while not isinstance(message := self.receive(), Pong):
            assert message is not None, f"connection closed before pong {nonce}; got {before}"
            before.append(message)
        assert message.nonce == nonce
        return before

    def close(self) -> None:
        self.sock.close()


def _ghost(d: Executor, name: str) -> WorkerMetadata:
    """A D worker of an engine that exists only as this test's raw client, whose KV memory is `d`'s worker 0:
    what P writes for it lands in `d`'s pool, where `Verify` can check it."""
    return msgspec.structs.replace(d.metas[(0, 0)], engine_id=name, incarnation=uuid.uuid4().hex[:12])


def _hello(sender: WorkerMetadata, target: WorkerMetadata, **changes: Any) -> Hello:
    fields: dict[str, Any] = dict(
        version=PROTOCOL_VERSION,
        sender=sender,
        stage_layers=[(sender.start_layer, sender.end_layer)],
        expect_engine_id=target.engine_id,
        expect_incarnation=target.incarnation,
        expect_pp_rank=target.pp_rank,
        expect_tp_rank=target.tp_rank,
    )
    return Hello(**{**fields, **changes})


def _open(peer: RawPeer, hello: Hello) -> None:
    """Hello a worker without a control token as `hello`'s sender, and check it accepted."""
    peer.send_raw(unkeyed_frames(hello))
    assert isinstance(peer.receive(), HelloChallenge)
    assert isinstance(peer.receive(), HelloOk)


# -- the data plane --------------------------------------------------------------------------------------------


def test_p_writes_over_the_plane_its_configuration_names(engines: dict[str, Executor], plane: str) -> None:
    """One host, one user, CPU pools: "auto" (the fixture's for this plane) picks the same-host plane, "mooncake" forces
    Mooncake."""
    p, d = engines["p_tp2"], engines["d"]
    _transfer(p, d, "plane", seed=5)
    rows = [row for i in range(len(p.workers)) for row in p.call(i, Peers()) if row["direction"] == "from_d"]
    assert rows and {row["transport"] for row in rows} == {plane}, rows


# -- repeats ---------------------------------------------------------------------------------------------------


def test_repeated_start_send_and_start_recv_write_once_and_report_once(engines: dict[str, Executor]) -> None:
    p, d = engines["p_tp2"], engines["d"]
    p_reports, d_reports = Reports(p), Reports(d)
    sent_before = _stat(p, "transfers_sent")
    p_blocks, d_blocks = _blocks(0, TOKENS), _blocks(100, TOKENS)

    # Every repeat comes while the first stands: once a receive ended, the same call is a new receive (and once D
    # fetched the KV, the same hold a new hold: a retried request may reuse its id), and on the same-host plane a
    # receive can end within a command's round trip. A batch's commands run in one turn of the worker's loop, so
    # nothing ends between them.
    p.broadcast(Batch([Prefill("p-repeat", "repeat", p_blocks, TOKENS, 11)] * 4))
    d.broadcast(Batch([Recv("d-repeat", "repeat", p.engine_id, p.url, d_blocks, TOKENS)] * 4))

    _until(
        lambda: d_reports.poll().ended("d-repeat") and p_reports.poll().sent("p-repeat"),
        SETTLE_S,
        lambda: f"not reported: D {dict(d_reports.recving)} P {dict(p_reports.sending)}",
    )
    for _ in range(3):  # a duplicate report would come with the next drains
        time.sleep(0.1)
        d_reports.poll()
        p_reports.poll()
    d_reports.assert_received_once("d-repeat")
    p_reports.assert_sent_once("p-repeat")
    assert [a - b for a, b in zip(_stat(p, "transfers_sent"), sent_before, strict=True)] == [1, 1]
    _assert_bytes(d, 11, d_blocks, TOKENS)


def test_repeated_transfer_requests_on_the_wire_are_answered_with_one_outcome_and_write_once(
    engines: dict[str, Executor],
) -> None:
    p, d = engines["p_tp2"], engines["d"]
    p_reports = Reports(p)
    sent_before, bytes_before = _stat(p, "transfers_sent"), _stat(p, "bytes_sent")
    ghost = _ghost(d, "faults-ghost-repeat")
    d_blocks = _blocks(200, TOKENS)
    secret = harness_secret("wire-repeat")  # as the real D would present it
    request = TransferRequest(transfer_id="wire-repeat", block_ids=d_blocks, num_tokens=TOKENS, secret=secret)
    _prefill(p, "p-wire-repeat", "wire-repeat", _blocks(0, TOKENS), TOKENS, seed=12)

    peers = [RawPeer(p.metas[(0, tp)].control_addr) for tp in range(2)]
    try:
        for tp, peer in enumerate(peers):
            _open(peer, _hello(ghost, p.metas[(0, tp)]))
            peer.send(request, request)  # back to back: the second one arrives while the first is handled
        outcomes = []
        for peer in peers:
            outcome = peer.receive()
            assert isinstance(outcome, TransferDone) and outcome.bytes > 0, outcome
            outcomes.append(outcome)
        _until(lambda: p_reports.poll().sent("p-wire-repeat"), SETTLE_S, lambda: "P did not end the hold")

        for nonce, (peer, outcome) in enumerate(zip(peers, outcomes, strict=True)):
            # Whatever the second request got (nothing while writing, the outcome after) is the same outcome.
            assert all(m == outcome for m in peer.until_pong(10 + nonce)), "a repeat got another answer"
            peer.send(request)  # after the hold ended: the remembered outcome, written no more
            assert peer.until_pong(20 + nonce) == [outcome]
            peer.send(
                Release(transfer_id="wire-repeat", secret=secret), Release(transfer_id="wire-repeat", secret=secret)
            )
            assert peer.until_pong(30 + nonce) == []
    finally:
        for peer in peers:
            peer.close()

    p_reports.poll()
    p_reports.assert_sent_once("p-wire-repeat")
    assert [a - b for a, b in zip(_stat(p, "transfers_sent"), sent_before, strict=True)] == [1, 1]
    assert [a - b for a, b in zip(_stat(p, "bytes_sent"), bytes_before, strict=True)] == [o.bytes for o in outcomes]
    _assert_bytes(d, 12, d_blocks, TOKENS)


def test_a_finished_transfer_is_not_reported_done_to_another_decode_engine(engines: dict[str, Executor]) -> None:
    p, d = engines["p_tp2"], engines["d"]
    p_reports = Reports(p)
    _prefill(p, "p-other-engine", "other-engine", _blocks(0, TOKENS), TOKENS, seed=13)
    served = _ghost(d, "faults-ghost-served")
    secret = harness_secret("other-engine")  # both engines know it: the transfer's end, not its secret, decides
    peers = [RawPeer(p.metas[(0, tp)].control_addr) for tp in range(2)]
    try:
        for tp, peer in enumerate(peers):  # engine "served" fetches the transfer from both P workers
            _open(peer, _hello(served, p.metas[(0, tp)]))
            blocks = _blocks(300, TOKENS)
            peer.send(TransferRequest(transfer_id="other-engine", block_ids=blocks, num_tokens=TOKENS, secret=secret))
            assert isinstance(peer.receive(), TransferDone)
        _until(lambda: p_reports.poll().sent("p-other-engine"), SETTLE_S, lambda: "P did not end the hold")

        # Another engine (a restarted D is one too: another incarnation) asks for it into its own blocks.
        latecomer = RawPeer(p.metas[(0, 0)].control_addr)
        peers.append(latecomer)
        _open(latecomer, _hello(_ghost(d, "faults-ghost-latecomer"), p.metas[(0, 0)]))
        blocks = _blocks(400, TOKENS)
        latecomer.send(TransferRequest(transfer_id="other-engine", block_ids=blocks, num_tokens=TOKENS, secret=secret))
        answer = latecomer.receive()
    finally:
        for peer in peers:
            peer.close()
    # P no longer holds the KV and wrote nothing into these blocks: "done" would hand D garbage as valid KV.
    assert isinstance(answer, TransferFailed), answer


# -- holds bound to their requester ----------------------------------------------------------------------------

ADMIN_TOKEN = "faults-admin-token"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _admin_get(executor: Executor, path: str, headers: dict[str, str]) -> str:
    """The body of `GET path` from an admin app over `executor` (its worker processes answer), served for this call."""

    async def get() -> str:
        server = AdminServer(ExecutorView(executor), token=ADMIN_TOKEN)
        url = await server.start()
        try:
            async with aiohttp.ClientSession() as http, http.get(url + path, headers=headers) as response:
                assert response.status == 200
                return await response.text()
        finally:
            await server.close()

    return asyncio.run(get())


def test_a_d_engine_that_knows_a_transfer_id_but_not_its_secret_gets_no_byte_and_cannot_abort_it(
    engines: dict[str, Executor],
) -> None:
    """A second D engine with a valid hello (a rogue, or a misrouted D) learnt the transfer id: it asks for the KV
    and aborts it on every P worker, with no secret and with a guessed one. P writes it nothing, answers as for a
    transfer it never held, and the real D then receives every byte."""
    p, d = engines["p_tp2"], engines["d"]
    p_reports, d_reports = Reports(p), Reports(d)
    bytes_before, refused_before = (
        _stat(p, "bytes_sent"),
        [s["sender"].get("refused_secrets", 0) for s in p.statistics()],
    )
    _prefill(p, "p-stolen", "stolen", _blocks(0, TOKENS), TOKENS, seed=14)
    rogue = _ghost(d, "faults-ghost-rogue")
    peers = [RawPeer(p.metas[(0, tp)].control_addr) for tp in range(2)]
    try:
        for tp, peer in enumerate(peers):
            _open(peer, _hello(rogue, p.metas[(0, tp)]))
            for secret in ("", "x" * 22):
                peer.send(
                    TransferRequest(
                        transfer_id="stolen", block_ids=_blocks(500, TOKENS), num_tokens=TOKENS, secret=secret
                    )
                )
            peer.send(Abort(transfer_id="stolen", reason="rogue abort", secret="y" * 22), Release(transfer_id="stolen"))
            answers = peer.until_pong(40 + tp)
            # As for any id:
            assert answers == [TransferFailed(transfer_id="stolen", reason="rogue abort", cause="aborted")], answers
        assert _stat(p, "bytes_sent") == bytes_before, "P wrote for a D that lacks the secret"
        # Nor does P's admin endpoint tell the id to a caller without its token.
        public, private = _admin_get(p, "/v1/transfers", {}), _admin_get(p, "/v1/transfers", ADMIN_AUTH)
        assert "stolen" not in public and public.count('"direction":"send"') >= 2, public
        assert private.count('"transfer_id":"stolen"') == 2, private

        _recv(d, "d-stolen", "stolen", p, _blocks(600, TOKENS), TOKENS)
        _until(
            lambda: d_reports.poll().ended("d-stolen") and p_reports.poll().sent("p-stolen"),
            SETTLE_S,
            lambda: f"not reported: D {dict(d_reports.recving)} P {dict(p_reports.sending)}",
        )
        d_reports.assert_received_once("d-stolen")
        _assert_bytes(d, 14, _blocks(600, TOKENS), TOKENS)

        # The rogue's requests wait like ones for a transfer never held, and end with the same answer.
        peers[0].send(TransferRequest(transfer_id="never-held", block_ids=[0], num_tokens=1))
        late = [peers[0].receive(STALE_TRANSFER_BOUND_S) for _ in range(3)]
    finally:
        for peer in peers:
            peer.close()
    reasons = sorted(
        m.reason.replace("'never-held'", "ID").replace("'stolen'", "ID") for m in late if isinstance(m, TransferFailed)
    )
    assert reasons == [f"unknown transfer ID: not held by P within {EARLY_REQUEST_TIMEOUT_S:g} s"] * 3, late
    refused = [s["sender"]["refused_secrets"] - r for s, r in zip(p.statistics(), refused_before, strict=True)]
    assert all(n >= 3 for n in refused), refused


def test_a_request_for_more_tokens_than_p_holds_is_refused_naming_both_counts(engines: dict[str, Executor]) -> None:
    """A D that has the secret but asks for more tokens than P computed would get stale KV from the slots past them
    (P's last block has room for them)."""
    p, d = engines["p_tp2"], engines["d"]
    bytes_before = _stat(p, "bytes_sent")
    _prefill(p, "p-longer", "longer", _blocks(0, TOKENS), TOKENS, seed=15)
    longer = len(_blocks(0, TOKENS)) * BLOCK_SIZE  # every slot of P's blocks
    request = TransferRequest(
        transfer_id="longer", block_ids=_blocks(700, longer), num_tokens=longer, secret=harness_secret("longer")
    )
    ghost = _ghost(d, "faults-ghost-longer")
    peers = [RawPeer(p.metas[(0, tp)].control_addr) for tp in range(2)]
    try:
        for tp, peer in enumerate(peers):
            _open(peer, _hello(ghost, p.metas[(0, tp)]))
            peer.send(request)
            answer = peer.receive()
            assert isinstance(answer, TransferFailed), answer
            assert f"asks for {longer} tokens of transfer 'longer', P holds {TOKENS}" in answer.reason
    finally:
        for peer in peers:
            peer.close()
    assert _stat(p, "bytes_sent") == bytes_before


# -- deadlines -------------------------------------------------------------------------------------------------


def test_a_hold_nobody_asks_for_expires_and_is_reported_finished_once(engines: dict[str, Executor]) -> None:
    """Bound: HOLD_EXPIRY_BOUND_S = hold_timeout_s + SLACK_S after start_send."""
    p, d = engines["p_expiring"], engines["d"]
    p_reports = Reports(p)
    (expired_before,) = (s["sender"]["expired_holds"] for s in p.statistics())
    _prefill(p, "p-unasked", "unasked", _blocks(0, TOKENS), TOKENS, seed=21)
    assert _stat(p, "holds") == [1]

    _until(lambda: p_reports.poll().sent("p-unasked"), HOLD_EXPIRY_BOUND_S, lambda: "the hold did not expire")
    time.sleep(HOLD_TIMEOUT_S)  # a second expiry would be due by now
    p_reports.poll()
    p_reports.assert_sent_once("p-unasked")
    (stats,) = p.statistics()
    assert stats["holds"] == 0 and stats["sender"]["expired_holds"] == expired_before + 1

    # The worker serves on, from the same blocks (D asks first: this P's holds last only HOLD_TIMEOUT_S).
    _transfer(p, d, "after-expiry", seed=22, recv_first=True)


# -- killed, frozen and restarted P workers ------------------------------------------------------------------


def test_a_receive_from_a_killed_prefill_worker_fails_fast_with_its_blocks_invalid(
    engines: dict[str, Executor],
) -> None:
    """Bound: DEAD_P_BOUND_S after start_recv, below D's receive timeout."""
    p, d = engines["p_fault"], engines["d"]
    _transfer(p, d, "before-kill", seed=31)  # D has P's metadata and a connection cached
    p.kill(0)
    assert p.alive() == [False]

    d_reports = Reports(d)
    d_blocks = _blocks(500, TOKENS)
    _recv(d, "d-from-dead", "from-dead", p, d_blocks, TOKENS)
    _until(lambda: d_reports.poll().ended("d-from-dead"), DEAD_P_BOUND_S, lambda: "the receive did not fail")
    d_reports.assert_failed_once("d-from-dead", d_blocks)

    p.restart()
    _transfer(p, d, "after-kill", seed=32)


def test_a_prefill_worker_killed_mid_write_fails_the_receive_and_decode_serves_a_restarted_engine(
    engines: dict[str, Executor],
) -> None:
    """Bound: DEAD_P_BOUND_S after the kill."""
    p, d = engines["p_fault"], engines["d"]
    d_reports = Reports(d)
    req_id, d_blocks = _start_big_write(p, d, "mid-kill", seed=41)
    p.kill(0)

    _until(lambda: d_reports.poll().ended(req_id), DEAD_P_BOUND_S, lambda: "the receive did not fail")
    d_reports.assert_failed_once(req_id, d_blocks)
    assert d.alive() == [True] and _stat(d, "holds") == [0]

    p.restart()
    _transfer(p, d, "after-mid-kill", seed=42)


def test_a_prefill_worker_killed_after_d_asked_fails_the_receive_without_waiting_for_the_abort_grace(
    engines: dict[str, Executor],
) -> None:
    """Bound: DEAD_P_BOUND_S after the kill, with D's abort grace and receive timeout at 600 s: only the probe
    that finds P's transfer engine gone (then `gone_settle_s`) can end the receive that soon."""
    p = engines["p_fault"]
    long_wait = dataclasses.replace(CONFIGS["d"].service, abort_grace_s=600.0, recv_timeout_s=600.0)
    config = dataclasses.replace(CONFIGS["d"], engine_id="faults-d-long-grace", service=long_wait)
    with Executor(config).start() as d:
        d_reports = Reports(d)
        req_id, d_blocks = _start_big_write(p, d, "gone", seed=61)
        p.kill(0)
        _until(lambda: d_reports.poll().ended(req_id), DEAD_P_BOUND_S, lambda: "the receive did not fail")
        d_reports.assert_failed_once(req_id, d_blocks)
        assert _stat(d, "holds") == [0]
    p.restart()
    _transfer(p, engines["d"], "after-gone", seed=62)


def test_a_cut_connection_to_a_live_prefill_worker_ends_the_receive_once_p_confirms_its_write_stopped(
    engines: dict[str, Executor],
) -> None:
    """Bound: SETTLE_S after the cut, with D's abort grace and receive timeout at 600 s. D forgets P mid-write
    (its connection closes), reconnects to the same start of P and asks again; P answers once the write it was
    doing has ended, and only that answer can end the receive this soon. P's hold ends too (reported once)."""
    p = engines["p_fault"]
    long_wait = dataclasses.replace(CONFIGS["d"].service, abort_grace_s=600.0, recv_timeout_s=600.0)
    config = dataclasses.replace(CONFIGS["d"], engine_id="faults-d-fence", service=long_wait)
    with Executor(config).start() as d:
        d_reports, p_reports = Reports(d), Reports(p)
        req_id, d_blocks = _start_big_write(p, d, "fence", seed=63)
        d.broadcast(ForgetEngine(p.engine_id))
        _until(lambda: d_reports.poll().ended(req_id), SETTLE_S, lambda: "the receive did not end")
        d_reports.assert_failed_once(req_id, d_blocks)
        assert _stat(d, "holds") == [0] and _stat(d, "reconnects")[0] >= 1
        p_req = "p-" + req_id.removeprefix("d-")
        _until(lambda: p_reports.poll().sent(p_req), SETTLE_S, lambda: f"P did not end {p_req}")
        p_reports.poll()
        p_reports.assert_sent_once(p_req)
        _transfer(p, d, "after-fence", seed=64)


def test_a_control_token_lets_in_only_the_hellos_that_carry_it(engines: dict[str, Executor]) -> None:
    """A P engine that requires a control token refuses the hello of a D engine without it: that receive fails
    (its blocks invalid), P counts the refusal and holds nothing for it. A D engine with the token transfers."""
    secret = "control-" + uuid.uuid4().hex
    p_config = dataclasses.replace(
        CONFIGS["p_fault"], engine_id="faults-p-token", service=dataclasses.replace(P_SERVICE, control_token=secret)
    )
    d_config = dataclasses.replace(
        CONFIGS["d"],
        engine_id="faults-d-token",
        service=dataclasses.replace(CONFIGS["d"].service, control_token=secret),
    )
    no_token = engines["d"]
    with Executor(p_config) as p, Executor(d_config) as d:
        reports = Reports(no_token)
        blocks = _blocks(800, TOKENS)
        _recv(no_token, "d-no-token", "no-token", p, blocks, TOKENS)
        _until(lambda: reports.poll().ended("d-no-token"), SETTLE_S, lambda: "the receive without the token went on")
        reports.assert_failed_once("d-no-token", blocks)
        assert _stat(p, "protocol_errors")[0] >= 1 and _stat(p, "holds") == [0]
        _transfer(p, d, "with-token", seed=71)


def test_a_frozen_prefill_worker_fails_the_receive_in_time_and_leaks_nothing_once_it_resumes(
    engines: dict[str, Executor],
) -> None:
    """Bound: FROZEN_P_BOUND_S = recv_timeout_s + abort_grace_s + SLACK_S after the freeze; once resumed, P ends
    its hold (reported once) within SETTLE_S."""
    p, d = engines["p_fault"], engines["d"]
    d_reports, p_reports = Reports(d), Reports(p)
    req_id, d_blocks = _start_big_write(p, d, "frozen", seed=51)
    p.stop(0)
    try:
        _until(lambda: d_reports.poll().ended(req_id), FROZEN_P_BOUND_S, lambda: "the receive did not fail")
    finally:
        p.cont(0)
    d_reports.assert_failed_once(req_id, d_blocks)

    p_req = "p-" + req_id.removeprefix("d-")
    _until(lambda: p_reports.poll().sent(p_req), SETTLE_S, lambda: f"P did not end {p_req} after it resumed")
    p_reports.poll()
    p_reports.assert_sent_once(p_req)
    _transfer(p, d, "after-freeze", seed=52)


def test_a_restarted_prefill_engine_serves_new_requests_and_fails_old_ones(engines: dict[str, Executor]) -> None:
    """Bounds: the receive waiting on the old incarnation fails within DEAD_P_BOUND_S after the restart; a
    request for what the old incarnation held fails within STALE_TRANSFER_BOUND_S."""
    p, d = engines["p_fault"], engines["d"]
    d_reports = Reports(d)
    old_incarnation, url = p.incarnation, p.url
    _prefill(p, "p-old-held", "old-held", _blocks(0, TOKENS), TOKENS, seed=61)
    waiting_blocks = _blocks(600, TOKENS)
    _recv(d, "d-old-waiting", "old-waiting", p, waiting_blocks, TOKENS)  # P never holds it: D's request waits
    _until(lambda: p.statistics()[0]["sender"]["early_requests"] == 1, SETTLE_S, lambda: "D's request never reached P")

    p.restart()
    assert p.incarnation != old_incarnation and p.url == url and _stat(p, "holds") == [0]
    _until(lambda: d_reports.poll().ended("d-old-waiting"), DEAD_P_BOUND_S, lambda: "the old receive did not fail")
    d_reports.assert_failed_once("d-old-waiting", waiting_blocks)

    held_blocks = _blocks(700, TOKENS)
    _recv(d, "d-old-held", "old-held", p, held_blocks, TOKENS)
    _until(lambda: d_reports.poll().ended("d-old-held"), STALE_TRANSFER_BOUND_S, lambda: "old-held did not fail")
    d_reports.assert_failed_once("d-old-held", held_blocks)

    for i in range(3):
        _transfer(p, d, f"new-incarnation-{i}", seed=62 + i, d_first_block=800 + 10 * i)


# -- malformed input on control ports -----------------------------------------------------------------------


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


# name -> (what the raw client sends, in chunks each answered before the next, given the target worker and a
# ghost D; the answers expected, in order, before the worker closes the connection)
MALFORMED: dict[str, tuple[Callable[[WorkerMetadata, WorkerMetadata], list[bytes]], list[type[Message]]]] = {
    "garbage bytes": (lambda t, g: [_frame(bytes(range(0xF0, 0x100)))], [ErrorMessage]),
    "an HTTP request": (lambda t, g: [b"GET /kvsvc/v1/metadata HTTP/1.1\r\nHost: x\r\n\r\n"], [ErrorMessage]),
    "an unknown message tag": (lambda t, g: [_frame(msgspec.msgpack.encode({"type": "bogus"}))], [ErrorMessage]),
    "a request before the hello": (
        lambda t, g: [encode(TransferRequest(transfer_id="x", block_ids=[0], num_tokens=1))],
        [ErrorMessage],
    ),
    "a hello of another protocol version": (
        lambda t, g: [encode(start_of(_hello(g, t, version=PROTOCOL_VERSION + 1)))],
        [HelloRefused],
    ),
    "a hello for another incarnation": (
        lambda t, g: [encode(start_of(_hello(g, t, expect_incarnation="stale")))],
        [HelloRefused],
    ),
    "garbage after an accepted hello": (
        lambda t, g: [unkeyed_frames(_hello(g, t)), _frame(b"\xc1\xc1\xc1")],
        [HelloChallenge, HelloOk, ErrorMessage],
    ),
    "a frame cut short": (lambda t, g: [struct.pack(">I", 100) + b"x" * 10], []),
}


@pytest.mark.parametrize("target", ["P worker", "D worker"])
@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_input_on_a_control_port_gets_an_error_frame_and_breaks_nothing(
    engines: dict[str, Executor], case: str, target: str
) -> None:
    p, d = engines["p_tp2"], engines["d"]
    worker = p if target == "P worker" else d
    meta = worker.metas[(0, 0)]
    errors_before = _stat(worker, "protocol_errors")[0]
    build, expected = MALFORMED[case]

    peer = RawPeer(meta.control_addr)
    answers: list[Message | None] = []
    try:
        chunks = build(meta, _ghost(d, "faults-ghost-malformed"))
        for chunk in chunks[:-1]:  # each earlier chunk is answered before the next goes
            peer.send_raw(chunk)
            answers.append(peer.receive())
            if isinstance(answers[-1], HelloChallenge):  # and the answer to the hello after it
                answers.append(peer.receive())
        peer.send_raw(chunks[-1])
        if not expected:
            peer.sock.shutdown(socket.SHUT_WR)
        while (message := peer.receive()) is not None:
            answers.append(message)
    finally:
        peer.close()

    assert [type(m) for m in answers] == expected, answers
    for answer in answers:
        if isinstance(answer, ErrorMessage | HelloRefused):
            assert answer.reason
            if "version" in case:
                assert f"version {PROTOCOL_VERSION + 1}" in answer.reason
    assert _stat(worker, "protocol_errors")[0] - errors_before == (1 if expected else 0)
    assert all(p.alive()) and all(d.alive())
    _transfer(p, d, f"after-{case}-{target}".replace(" ", "-"), seed=70)


def test_frames_before_a_malformed_one_are_handled_whatever_the_segmentation(engines: dict[str, Executor]) -> None:
    p, d = engines["p_tp2"], engines["d"]
    target = p.metas[(0, 0)]
    peer = RawPeer(target.control_addr)
    answers = []
    try:
        # One write: one segment on loopback, read by the worker in one go.
        peer.send_raw(unkeyed_frames(_hello(_ghost(d, "faults-ghost-segment"), target)) + _frame(b"\xc1\xc1\xc1"))
        while (message := peer.receive()) is not None:
            answers.append(message)
    finally:
        peer.close()
    assert [type(m) for m in answers] == [HelloChallenge, HelloOk, ErrorMessage], answers


def _impossible_pool(ghost: WorkerMetadata, pool: str) -> WorkerMetadata:
    if pool == "no blocks":
        return msgspec.structs.replace(ghost, num_blocks=0)
    return msgspec.structs.replace(ghost, base_addrs=[ghost.base_addrs[0]] * len(ghost.base_addrs))


def _hello_answers(target: WorkerMetadata, hello: Hello) -> list[Message]:
    """Every frame the worker sends in answer to `hello`, until it closes the connection."""
    peer = RawPeer(target.control_addr)
    try:
        peer.send_raw(unkeyed_frames(hello))
        answers = []
        while (message := peer.receive()) is not None:
            answers.append(message)
        return answers
    finally:
        peer.close()


@pytest.mark.parametrize("pool", ["no blocks", "overlapping layers"])
def test_a_hello_with_an_impossible_pool_is_not_accepted_and_breaks_nothing(
    engines: dict[str, Executor], pool: str
) -> None:
    p, d = engines["p_tp2"], engines["d"]
    target = p.metas[(0, 0)]
    answers = _hello_answers(target, _hello(_impossible_pool(_ghost(d, "faults-ghost-pool"), pool), target))
    assert not any(isinstance(m, HelloOk) for m in answers), answers
    assert all(p.alive())
    _transfer(p, d, f"after-impossible-pool-{pool}".replace(" ", "-"), seed=80)


@pytest.mark.parametrize("pool", ["no blocks", "overlapping layers"])
def test_a_hello_with_an_impossible_pool_is_refused_with_the_reason(engines: dict[str, Executor], pool: str) -> None:
    p, d = engines["p_tp2"], engines["d"]
    target = p.metas[(0, 0)]
    errors_before = _stat(p, "protocol_errors")[0]
    answers = _hello_answers(target, _hello(_impossible_pool(_ghost(d, "faults-ghost-pool"), pool), target))
    assert [type(m) for m in answers] == [HelloChallenge, HelloRefused], answers
    assert _stat(p, "protocol_errors")[0] == errors_before + 1
