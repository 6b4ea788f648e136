"""Bad input against live engines: the control port of a P worker and the HTTP endpoint of a D engine.

The control channel gets hypothesis-made byte streams (garbage, truncated, oversized and wrong-version frames,
frames out of order, unknown transfers, block ids out of range, repeats) from a client that then half-closes; the
worker must answer only well-formed frames, close, never hang, never crash, never write (its transport refused and
failed nothing, holds nothing) and keep serving real transfers. The HTTP endpoint (handshake + admin app) gets
random methods, paths, headers and bodies: no 5xx, no state change without the token, still healthy. Also: the
endpoints bind loopback, and D refuses a P whose hello does not match what its engine published. Examples are
bounded; engines are started once for the module.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from kvsvc.core.errors import MalformedFrame
from kvsvc.core.messages import (
    PROTOCOL_VERSION,
    Abort,
    ErrorMessage,
    FrameReader,
    Hello,
    HelloChallenge,
    HelloOk,
    HelloRefused,
    HelloStart,
    Message,
    Ping,
    Pong,
    Release,
    TransferDone,
    TransferFailed,
    TransferRequest,
    WorkerMetadata,
    decode,
    encode,
)
from kvsvc.engine.bootstrap import BootstrapServer
from kvsvc.service import ServiceConfig
from kvsvc.testing.hellos import start_of, unkeyed_frames
from kvsvc.transport.mooncake import MooncakeConfig
from workers.chaos import ChaosOptions, ChaosRun, start_chaos_engines
from workers.engine import DecodeEngine, DecodeRequest, PrefillEngine
from workers.process import Peers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

OPTIONS = ChaosOptions(
    requests=20,
    faults=(),
    prefill_tp=1,
    decode_tp=1,
    fault_worker=0,
    abort_rate=0.0,
    service=ServiceConfig(
        hold_timeout_s=8.0, recv_timeout_s=30.0, early_request_timeout_s=2.0, handshake_timeout_s=3.0
    ),
    # The fuzzer's hellos copy D's metadata, a pool P writes over Mooncake: D runs it from the start.
    transport=MooncakeConfig(on_demand=False),
)
REPLY_DEADLINE_S = 30.0  # generous: the worker must close within its handshake timeout; the host may be loaded
ANSWERS = (HelloChallenge, HelloOk, HelloRefused, ErrorMessage, TransferFailed, Pong)


@dataclasses.dataclass
class Live:
    prefill: PrefillEngine
    decode: DecodeEngine
    url: str
    token: str

    @property
    def p_meta(self) -> WorkerMetadata:
        return self.prefill.executor.metas[(0, 0)]

    @property
    def d_meta(self) -> WorkerMetadata:
        return self.decode.executor.metas[(0, 0)]

    def p_stats(self) -> dict[str, Any]:
        (stats,) = self.prefill.executor.statistics()
        return stats


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    prefill, decode_engine, url, token = start_chaos_engines(OPTIONS)
    try:
        yield Live(prefill, decode_engine, url, token)
    finally:
        decode_engine.executor.close()
        prefill.executor.close()
        assert not any(prefill.executor.alive()) and not any(decode_engine.executor.alive())


# -- the control channel ----------------------------------------------------------------------------------------


def _hello(live: Live, *, version: int = PROTOCOL_VERSION, incarnation: str | None = None) -> Hello:
    """A hello from a made-up D engine that is a copy of the real D worker (so P's checks pass)."""
    d = replace(live.d_meta, engine_id="fuzz-d", incarnation="fuzz")
    p = live.p_meta
    return Hello(
        version=version,
        sender=d,
        stage_layers=[(d.start_layer, d.end_layer)],
        expect_engine_id=p.engine_id,
        expect_incarnation=p.incarnation if incarnation is None else incarnation,
        expect_pp_rank=p.pp_rank,
        expect_tp_rank=p.tp_rank,
    )


transfer_ids = st.one_of(st.sampled_from(["t0", "t1", "", "load-0"]), st.text(max_size=12))
block_ids = st.lists(st.one_of(st.integers(-(2**63), 2**64 - 1), st.integers(0, 300)), max_size=8)
messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(TransferRequest, transfer_id=transfer_ids, block_ids=block_ids, num_tokens=st.integers(-5, 10**6)),
    st.builds(Abort, transfer_id=transfer_ids, reason=st.text(max_size=8)),
    st.builds(Release, transfer_id=transfer_ids),
    st.builds(Ping, nonce=st.integers(0, 2**63 - 1)),
    st.builds(TransferDone, transfer_id=transfer_ids, bytes=st.integers(0, 10), descriptors=st.integers(0, 3)),
    st.builds(ErrorMessage, reason=st.text(max_size=8)),
    st.builds(HelloRefused, version=st.integers(0, 3), reason=st.text(max_size=8)),
)
header = struct.Struct(">I")
frames = st.one_of(
    messages.map(encode),
    st.binary(max_size=48),  # garbage
    st.binary(max_size=32).map(lambda b: header.pack(len(b)) + b),  # a frame whose body is garbage
    st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=16)).map(lambda t: header.pack(t[0]) + t[1]),  # lies
    messages.map(lambda m: encode(m)[: max(1, len(encode(m)) // 2)]),  # truncated
)
openings = st.sampled_from(["hello", "none", "wrong-version", "wrong-incarnation", "hello-twice"])


def _opening(live: Live, kind: str) -> bytes:
    if kind == "hello":
        return unkeyed_frames(_hello(live))
    if kind == "hello-twice":
        return unkeyed_frames(_hello(live)) * 2
    if kind == "wrong-version":
        return encode(start_of(_hello(live, version=PROTOCOL_VERSION + 1)))
    if kind == "wrong-incarnation":
        return encode(start_of(_hello(live, incarnation="not-this-start")))
    return b""


def _exchange(address: str, payload: bytes) -> tuple[list[Message], bool]:
    """Send `payload`, half-close, read until the worker closes. Returns the decoded answers and whether the
    worker closed within the deadline. Raises `MalformedFrame` if the worker sent anything but frames."""
    host, _, port = address.rpartition(":")
    reader = FrameReader()
    answers: list[Message] = []
    deadline = time.monotonic() + REPLY_DEADLINE_S
    with socket.create_connection((host, int(port)), timeout=REPLY_DEADLINE_S) as sock:
        with contextlib.suppress(ConnectionError):  # the worker may close before it read everything
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        while time.monotonic() < deadline:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                return answers, True
            except TimeoutError:
                break
            if not data:
                return answers, True
            answers.extend(reader.feed(data))
    return answers, False


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(opening=openings, body=st.lists(frames, max_size=6))
def test_any_byte_stream_on_the_control_port_gets_clear_answers_and_a_close(
    live: Live, opening: str, body: list[bytes]
) -> None:
    answers, closed = _exchange(live.p_meta.control_addr, _opening(live, opening) + b"".join(body))
    assert closed, f"the worker kept the connection open {REPLY_DEADLINE_S} s after EOF"
    assert all(isinstance(a, ANSWERS) for a in answers), answers
    # Frames before a malformed one in the same read are still handled, so the opening is always answered first.
    if opening in ("wrong-version", "wrong-incarnation"):
        assert len(answers) == 1 and isinstance(answers[0], HelloRefused)
        assert ("version" in answers[0].reason) if opening == "wrong-version" else ("incarnation" in answers[0].reason)
    if opening.startswith("hello"):
        assert isinstance(answers[0], HelloChallenge) and answers[0].sender == live.p_meta
        assert isinstance(answers[1], HelloOk) and answers[1].sender == live.p_meta
    if opening == "none" and answers:
        assert isinstance(answers[0], ErrorMessage | HelloRefused) and len(answers) == 1


def test_a_frame_with_invalid_utf8_is_malformed_not_a_crash() -> None:
    # Regression: msgspec raises UnicodeDecodeError (not DecodeError) for a str that is not UTF-8; it escaped
    # `decode` and killed the connection handler without an answer.
    body = b"\x81\xa4type\xa1\x80"  # {"type": <a str holding byte 0x80>}
    with pytest.raises(MalformedFrame):
        decode(body)
    with pytest.raises(MalformedFrame):
        FrameReader().feed(header.pack(len(body)) + body)


def test_frames_completed_before_a_malformed_one_in_the_same_chunk_are_still_delivered() -> None:
    reader = FrameReader()
    delivered: list[Message] = []
    with contextlib.suppress(MalformedFrame):
        delivered += reader.feed(encode(Ping(nonce=7)) + header.pack(0))  # a valid frame, then an empty body
    assert delivered == [Ping(nonce=7)]


def test_out_of_range_block_ids_and_unknown_transfers_are_answered_failed_by_name(live: Live) -> None:
    d = live.d_meta
    requests = [
        TransferRequest(transfer_id="oob", block_ids=[d.num_blocks], num_tokens=1),
        TransferRequest(transfer_id="too-many-tokens", block_ids=[0], num_tokens=d.block_size + 1),
        TransferRequest(transfer_id="never-held", block_ids=[0], num_tokens=1),
    ]
    host, _, port = live.p_meta.control_addr.rpartition(":")
    reader = FrameReader()
    answers: dict[str, str] = {}
    with socket.create_connection((host, int(port)), timeout=REPLY_DEADLINE_S) as sock:
        sock.sendall(unkeyed_frames(_hello(live)) + b"".join(encode(r) for r in requests))
        deadline = time.monotonic() + REPLY_DEADLINE_S
        while len(answers) < len(requests) and time.monotonic() < deadline:
            for message in reader.feed(sock.recv(65536)):
                if isinstance(message, TransferFailed):
                    answers[message.transfer_id] = message.reason
    assert "outside the pool" in answers["oob"]
    assert "do not fit" in answers["too-many-tokens"]
    assert "unknown transfer" in answers["never-held"]  # after the early-request timeout
    # A negative id is past the field's bound: the frame is malformed, named, and the connection closes.
    negative = TransferRequest(transfer_id="neg", block_ids=[-1], num_tokens=1)
    frames, told = FrameReader(), []
    with socket.create_connection((host, int(port)), timeout=REPLY_DEADLINE_S) as sock:
        sock.sendall(unkeyed_frames(_hello(live)) + encode(negative))
        while chunk := sock.recv(65536):
            told += frames.feed(chunk)
    last = told[-1]
    assert isinstance(last, ErrorMessage) and "$.block_ids[0]" in last.reason, told


def test_after_the_fuzzing_the_worker_holds_nothing_wrote_nothing_and_still_serves(live: Live) -> None:
    assert all(live.prefill.executor.alive())
    stats = live.p_stats()
    assert stats["protocol_errors"] > 0  # the fuzzing did reach it
    assert stats["holds"] == 0 and stats["writes_in_flight"] == 0
    assert stats["write_failures"] == 0 and stats["transport"]["refused"] == 0  # no write was even attempted
    assert stats["bytes_sent"] == 0
    result = ChaosRun(OPTIONS, live.prefill, live.decode).run()
    assert result.ok and result.phases[0].verified == OPTIONS.requests, result.errors[:5]


# -- the HTTP endpoint ------------------------------------------------------------------------------------------

ROUTES = [
    "/healthz",
    "/readyz",
    "/v1/topology",
    "/v1/peers",
    "/v1/transfers",
    "/v1/statistics",
    "/metrics",
    "/v1/drain",
    "/v1/peers/nobody/forget",
    "/kvsvc/v1/metadata",
    "/",
]
SAFE = {"GET", "HEAD", "OPTIONS"}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.one_of(
        st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
        st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=7),
    ),
    path=st.one_of(st.sampled_from(ROUTES), st.text(max_size=30).map(lambda s: "/" + s)),
    auth=st.sampled_from(["none", "wrong", "right", "garbage"]),
    content_type=st.sampled_from(["", "application/json", "application/msgpack", "text/plain; charset=utf-8"]),
    body=st.one_of(st.binary(max_size=512), st.just(b"x" * 70_000)),
)
def test_random_http_requests_get_no_5xx_and_change_nothing_without_the_token(
    live: Live, method: str, path: str, auth: str, content_type: str, body: bytes
) -> None:
    parsed = urllib.parse.urlsplit(live.url)
    headers = {"Content-Type": content_type} if content_type else {}
    headers["Authorization"] = {
        "none": "",
        "wrong": "Bearer not-the-token",
        "right": f"Bearer {live.token}",
        "garbage": "Bearer \u00e9\u00e8",
    }[auth]
    if not headers["Authorization"]:
        del headers["Authorization"]
    if path.startswith("/v1/peers/") and path.endswith("/forget") and auth == "right":
        path = "/v1/peers/nobody/forget"  # never cut the engine's real peers from here
    quoted = urllib.parse.quote(path, safe="/")
    conn = http.client.HTTPConnection(parsed.hostname or "", parsed.port, timeout=REPLY_DEADLINE_S)
    try:
        conn.putrequest(method, quoted, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value.encode("utf-8"))
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        response.read()
    finally:
        conn.close()
    assert response.status < 500 or response.status == 501, (method, path, response.status)
    if method not in SAFE and auth != "right" and len(body) <= 64 * 1024:
        assert response.status in (400, 401, 403, 404, 405, 413), (method, path, response.status)
    if method not in SAFE and auth != "right":
        assert not 200 <= response.status < 300


def test_the_endpoint_is_healthy_after_the_http_fuzzing(live: Live) -> None:
    parsed = urllib.parse.urlsplit(live.url)
    conn = http.client.HTTPConnection(parsed.hostname or "", parsed.port, timeout=REPLY_DEADLINE_S)
    try:
        conn.request("GET", "/readyz")
        response = conn.getresponse()
        assert response.status == 200, response.read()
    finally:
        conn.close()
    assert all(live.decode.executor.alive())


# -- security -------------------------------------------------------------------------------------------------


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent; picks the outbound interface
            address = str(probe.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_control_ports_and_the_endpoint_bind_loopback_only(live: Live) -> None:
    control = [m.control_addr for e in (live.prefill, live.decode) for m in e.executor.metas.values()]
    assert all(addr.startswith("127.0.0.1:") for addr in control), control
    assert urllib.parse.urlsplit(live.url).hostname == "127.0.0.1"
    other = _non_loopback_address()
    if other is None:
        pytest.skip("this host has no non-loopback IPv4 address to try")
    ports = [int(addr.rpartition(":")[2]) for addr in control] + [urllib.parse.urlsplit(live.url).port or 0]
    for port in ports:
        with pytest.raises(OSError), socket.create_connection((other, port), timeout=5):
            pass


def test_state_changing_endpoints_refuse_without_the_token_on_a_live_engine(live: Live) -> None:
    parsed = urllib.parse.urlsplit(live.url)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {live.token}"}):
        conn = http.client.HTTPConnection(parsed.hostname or "", parsed.port, timeout=REPLY_DEADLINE_S)
        try:
            conn.request("POST", f"/v1/peers/{live.p_meta.engine_id}/forget", headers=headers)
            assert conn.getresponse().status == 401
        finally:
            conn.close()
    # Nothing was forgotten by the refused calls: D's connection to P is still up.
    (rows,) = live.decode.executor.broadcast(Peers())
    assert isinstance(rows, list) and any(r["state"] == "connected" for r in rows), rows


class _Imposter:
    """A P engine's endpoint that publishes one worker and a control server that answers its hello as some
    other worker: D must refuse it (PeerMismatch) and fail the receive."""

    def __init__(self, published: WorkerMetadata) -> None:
        self.published = published
        self.hellos: list[Message] = []
        self.closed_by_d = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)

    async def _start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.published = replace(self.published, control_addr=f"127.0.0.1:{port}")
        self._bootstrap = BootstrapServer({(0, 0): self.published})
        return await self._bootstrap.start()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (length,) = header.unpack(await reader.readexactly(4))
        self.hellos.append(decode(await reader.readexactly(length)))
        other = replace(self.published, num_blocks=self.published.num_blocks + 1)
        writer.write(encode(HelloChallenge(version=PROTOCOL_VERSION, sender=other, nonce=bytes(32), proof=b"")))
        await writer.drain()
        if not await reader.read(1):
            self.closed_by_d.set()
        writer.close()

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            await self._bootstrap.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


def test_d_refuses_a_p_whose_hello_differs_from_what_its_engine_published(live: Live) -> None:
    imposter = _Imposter(replace(live.p_meta, engine_id="imposter", incarnation="imp"))
    try:
        req = live.decode.submit("imposter-0", "imposter", imposter.url, 4, seed=None)
        deadline = time.monotonic() + REPLY_DEADLINE_S
        done: list[DecodeRequest] = []
        while not done and time.monotonic() < deadline:
            done = live.decode.step()
            time.sleep(0.01)
        assert done == [req] and req.state == "failed" and req.invalid_block_ids == set(req.block_ids)
        assert len(imposter.hellos) == 1 and isinstance(imposter.hellos[0], HelloStart)
        assert imposter.hellos[0].expect_engine_id == "imposter"
        assert imposter.closed_by_d.wait(REPLY_DEADLINE_S)
    finally:
        imposter.close()
    assert live.decode.allocator.num_free == OPTIONS.num_blocks
