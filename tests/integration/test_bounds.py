"""Attacks on a P worker's control port, against a real running P (a `LoopbackEngine` on Mooncake, served from an
event loop in a thread of this process, so tracemalloc sees every allocation P makes for the attack).

Each attack is the one the bounds answer (docs/operations.md, "Security"): a small hello that claims a stage of
12.5M layers, a flood of connections past the caps, a frame before the hello past its size, early requests past the
bytes one D worker may have waiting. Then a hypothesis fuzz of the hello and of every frame type. Work is bounded
with resource counters (tracemalloc peaks, the service's statistics, connections back to their baseline), never
timed; after it all P still serves a real transfer byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from kvsvc.core.bounds import MAX_HELLO_FRAME_BYTES, MAX_LAYERS
from kvsvc.core.messages import (
    PROTOCOL_VERSION,
    Abort,
    ConvPart,
    ErrorMessage,
    FrameReader,
    Hello,
    HelloChallenge,
    HelloOk,
    HelloRefused,
    KVGroup,
    MambaState,
    Message,
    Ping,
    Pong,
    Release,
    TransferDone,
    TransferFailed,
    TransferRequest,
    WindowEmptied,
    WindowFilled,
    WorkerMetadata,
    encode,
)
from kvsvc.core.sender import BLOCK_ID_BYTES, EARLY_ENTRY_BYTES
from kvsvc.service import ServiceConfig, ServiceStatistics
from kvsvc.testing.engines import LoopbackEngine
from kvsvc.testing.hellos import unkeyed_frames
from kvsvc.testing.sim import EngineSpec
from tests.unit.test_bounds import peak_bytes  # traces P's loop thread too: it runs in this process

pytest.importorskip("mooncake.engine")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

T = TypeVar("T")
SPEC = EngineSpec(num_blocks=64, block_size=4)
PER_HOST = 12
TOTAL = 24
PENDING = 4
FIRST_BYTE_S = 1.5  # within the handshake timeout, which would end a silent one first
# What one early request of 64 block ids named "early-N", without a secret, costs; four of them may wait.
REQUEST_COST = EARLY_ENTRY_BYTES + 64 * BLOCK_ID_BYTES + 4 * len("early-0")
EARLY_BYTES = 4 * REQUEST_COST
P_CONFIG = ServiceConfig(
    handshake_timeout_s=2.0,
    early_request_timeout_s=60.0,  # early requests leave with their connection, never by this timeout here
    max_control_connections=TOTAL,
    max_control_connections_per_host=PER_HOST,
    max_pending_hellos=PENDING,
    first_byte_timeout_s=FIRST_BYTE_S,
    max_early_request_bytes=EARLY_BYTES,
)
REPLY_DEADLINE_S = 30.0  # P answers and closes within its handshake timeout; the host may be loaded
SETTLE_S = 20.0
PEAK_BOUND = 8 * 1024 * 1024
ANSWERS = (HelloOk, HelloRefused, ErrorMessage, TransferFailed, Pong)
header = struct.Struct(">I")


@dataclass
class Live:
    loop: asyncio.AbstractEventLoop
    p: LoopbackEngine
    d: LoopbackEngine

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(REPLY_DEADLINE_S * 2)

    def call(self, fn: Callable[[], T]) -> T:
        async def on_loop() -> T:
            return fn()

        return self.run(on_loop())

    def stats(self) -> ServiceStatistics:
        return self.call(self.p.services[(0, 0)].statistics)

    @property
    def address(self) -> str:
        return self.p.sim.metas[(0, 0)].control_addr

    @property
    def p_meta(self) -> WorkerMetadata:
        return self.p.sim.metas[(0, 0)]

    def transfer(self, tag: str) -> None:
        """A real transfer from P to D, checked byte for byte."""
        blocks, tokens = [3, 1, 4], 10

        async def go() -> None:
            self.p.start_send(f"p-{tag}", tag, blocks, tokens)
            self.d.start_recv(f"d-{tag}", tag, self.p, blocks, tokens)
            assert await self.d.wait(f"d-{tag}") == "finished"
            assert await self.p.wait(f"p-{tag}") == "finished_sending"
            self.d.check_received(tag, blocks, tokens)

        self.run(go())

    def settled(self) -> None:
        """Wait until P holds only D's accepted connection and nothing else an attack may have left."""

        def clean(s: ServiceStatistics) -> bool:
            return (
                s.control_connections == s.inbound_peers == 1
                and s.sender.early_requests == s.sender.early_request_bytes == 0
                and s.holds == s.writes_in_flight == 0
            )

        deadline = time.monotonic() + SETTLE_S
        while not clean(self.stats()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert clean(self.stats()), self.stats()


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bounds-engines", daemon=True)
    thread.start()

    async def start() -> tuple[LoopbackEngine, LoopbackEngine]:
        p = await LoopbackEngine("bounds-p", SPEC, config=P_CONFIG).start()
        d = await LoopbackEngine("bounds-d", SPEC).start()
        return p, d

    p, d = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    live = Live(loop, p, d)
    try:
        live.transfer("warm-up")  # D's one accepted connection: the baseline every attack must come back to
        live.settled()
        yield live
    finally:
        live.run(d.close())
        live.run(p.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _connect(address: str, source: str = "127.0.0.1") -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=REPLY_DEADLINE_S, source_address=(source, 0))


def _read_until_closed(sock: socket.socket, until: Callable[[list[Message]], bool] | None = None) -> list[Message]:
    """Read frames until the worker closes, or until `until` holds (then the deadline only ends the wait). P's
    challenge is left out: a client without a control token answers it with the hello it sent at once.

    Raises:
        AssertionError: without `until`, the worker kept the connection open past the deadline.
        MalformedFrame: the worker sent anything but frames.
    """
    reader = FrameReader()
    answers: list[Message] = []
    deadline = time.monotonic() + REPLY_DEADLINE_S
    while until is None or not until([a for a in answers if not isinstance(a, HelloChallenge)]):
        left = deadline - time.monotonic()
        if left <= 0:
            assert until is not None, f"the worker kept the connection open {REPLY_DEADLINE_S} s; answers: {answers}"
            break
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        except TimeoutError:
            continue
        if not data:
            break
        answers.extend(reader.feed(data))
    return [a for a in answers if not isinstance(a, HelloChallenge)]


def _exchange(address: str, payload: bytes) -> list[Message]:
    """Send `payload`, half-close, and read every answer until the worker closes."""
    with _connect(address) as sock:
        with contextlib.suppress(ConnectionError):  # the worker may close before it read everything
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        return _read_until_closed(sock)


def _attacker(live: Live, **changes: Any) -> WorkerMetadata:
    """A D worker of a made-up engine, a copy of the real one (so P's other checks pass)."""
    return replace(live.d.sim.metas[(0, 0)], engine_id="attacker-d", incarnation="x", **changes)


def _hello(live: Live, sender: WorkerMetadata, stages: list[tuple[int, int]] | None = None) -> Hello:
    p = live.p_meta
    return Hello(
        version=PROTOCOL_VERSION,
        sender=sender,
        stage_layers=stages if stages is not None else [(sender.start_layer, sender.end_layer)],
        expect_engine_id=p.engine_id,
        expect_incarnation=p.incarnation,
        expect_pp_rank=p.pp_rank,
        expect_tp_rank=p.tp_rank,
    )


# -- the attacks -----------------------------------------------------------------------------------------------


def test_a_small_hello_claiming_a_stage_of_12_5m_layers_is_refused_by_name_and_costs_p_little(live: Live) -> None:
    # D's own stage is one honest layer; the stage after it, which P used to lay out per TP rank, claims 12.5M.
    d = live.d.sim.metas[(0, 0)]
    attacker = _attacker(live, pp_size=2, start_layer=0, end_layer=1, base_addrs=d.base_addrs[:1])
    payload = unkeyed_frames(_hello(live, attacker, [(0, 1), (1, 12_500_001)]))
    assert len(payload) < 1024
    with peak_bytes() as peak:
        answers = _exchange(live.address, payload)
    assert len(answers) == 1 and isinstance(answers[0], HelloRefused), answers
    assert f"sends a stage split of 12500001 layers, limit {MAX_LAYERS}" in answers[0].reason
    assert peak() < PEAK_BOUND, f"P allocated {peak()} bytes for a {len(payload)}-byte hello"
    live.settled()


def test_a_flood_of_connections_is_refused_past_the_caps_by_name_and_leaves_nothing(live: Live) -> None:
    """Silent connections from three loopback addresses: loopback is one host to its cap, a connection that says
    nothing is closed a second after it opened, and pending ones past their own cap give way to newer ones."""
    flood = [_connect(live.address, f"127.0.0.{1 + i % 3}") for i in range(2 * PER_HOST)]
    try:
        assert live.stats().control_connections <= PER_HOST
        answers = [_read_until_closed(sock) for sock in flood]
    finally:
        for sock in flood:
            sock.close()
    assert all(len(a) == 1 and isinstance(a[0], HelloRefused | ErrorMessage) for a in answers), answers
    reasons = [a[0].reason for a in answers]
    capped = f"loopback holds {PER_HOST} control connections to this P worker, limit {PER_HOST}"
    displaced = f"P worker holds {PENDING} control connections before their hello, its limit, and this is the oldest"
    silent = {r for r in reasons if r.endswith(f"sent nothing within {FIRST_BYTE_S:g} s of connecting")}
    # Whether loopback's cap is met depends on how fast the displaced ones leave; the rest always shows.
    assert displaced in reasons and silent and set(reasons) <= {capped, displaced} | silent, reasons
    assert len(silent) <= PENDING  # no more than the pending cap ever waited for a first byte
    live.settled()


def test_a_flood_of_silent_connections_does_not_keep_a_new_d_worker_out(live: Live) -> None:
    """The attack of the accepted slots: more silent connections than P holds before their hello. A new D worker's
    hello still gets its turn (the oldest silent one gives way) and is accepted, where it used to be refused until
    the flood's connections timed out; the accepted D worker's transfers go on meanwhile."""
    flood = [_connect(live.address, f"127.0.0.{2 + i % 2}") for i in range(TOTAL)]  # all P held before
    try:
        # P answered every flood connection but the PENDING newest (refused by loopback's cap, or displaced).
        answered: set[socket.socket] = set()
        deadline = time.monotonic() + SETTLE_S
        while len(answered) < TOTAL - PENDING and time.monotonic() < deadline:
            answered.update(select.select([s for s in flood if s not in answered], [], [], 0.05)[0])
        assert len(answered) == TOTAL - PENDING
        while live.stats().control_connections > PENDING + 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # the last displaced one leaves
        stats = live.stats()
        assert stats.control_connections - stats.inbound_peers == PENDING, stats  # the pending cap is full
        answers = _exchange(live.address, unkeyed_frames(_hello(live, replace(_attacker(live), engine_id="new-d"))))
        assert isinstance(answers[0], HelloOk), answers
        live.transfer("beside-a-flood")
    finally:
        for sock in flood:
            sock.close()
    live.settled()


def test_a_frame_past_the_hello_limit_before_the_hello_is_refused_at_its_header(live: Live) -> None:
    announced = 1024 * 1024  # well under MAX_FRAME_BYTES, far over a hello
    with peak_bytes() as peak:
        # Only what P reads in one go: a close with unread bytes would reset the connection before the answer.
        answers = _exchange(live.address, header.pack(announced) + b"\x00" * (8 * 1024))
    expected = f"frame announces {announced} bytes, limit is {MAX_HELLO_FRAME_BYTES}"
    assert len(answers) == 1 and isinstance(answers[0], ErrorMessage) and answers[0].reason == expected, answers
    assert peak() < 1024 * 1024
    # After an accepted hello the usual limit applies: a request of 100 KiB is answered, not cut off.
    big = TransferRequest(transfer_id="big", block_ids=list(range(10**9, 10**9 + 25_000)), num_tokens=4)
    answers = _exchange(live.address, unkeyed_frames(_hello(live, _attacker(live))) + encode(big))
    assert isinstance(answers[0], HelloOk) and len(encode(big)) > 100_000
    assert isinstance(answers[1], TransferFailed) and "outside the pool" in answers[1].reason, answers
    live.settled()


def test_early_requests_past_the_bytes_one_d_worker_may_have_waiting_are_refused_by_name(live: Live) -> None:
    requests = [
        TransferRequest(transfer_id=f"early-{i}", block_ids=list(range(64)), num_tokens=64 * SPEC.block_size)
        for i in range(EARLY_BYTES // REQUEST_COST + 2)
    ]
    with _connect(live.address) as sock:
        sock.sendall(unkeyed_frames(_hello(live, _attacker(live))) + b"".join(encode(r) for r in requests))
        refused = _read_until_closed(sock, lambda answers: len(answers) >= 3)
        stats = live.stats().sender
    assert isinstance(refused[0], HelloOk), refused
    expected = (
        f"P worker busy: D worker attacker-d[pp0,tp0] has {EARLY_BYTES} bytes of requests waiting for transfers not "
        f"held yet; this one's {REQUEST_COST} would pass max_early_request_bytes={EARLY_BYTES}"
    )
    want = [TransferFailed(transfer_id=r.transfer_id, reason=expected, cause="refused") for r in requests[-2:]]
    assert refused[1:] == want, refused
    assert stats.early_requests == 4 and stats.early_request_bytes == EARLY_BYTES
    live.settled()  # the connection closed: its early requests went with it


# -- fuzz ------------------------------------------------------------------------------------------------------

sizes = st.one_of(st.integers(-2, 4), st.sampled_from([1023, 1024, 1025, 4096, 2**31, 2**63 - 1]))
layers = st.one_of(st.integers(-2, 8), st.sampled_from([MAX_LAYERS, 12_500_000, 2**40]))
int_lists = st.lists(st.one_of(st.integers(0, 8), st.integers(-(2**63), 2**64 - 1)), max_size=6)
mamba = st.builds(
    MambaState,
    conv_parts=st.lists(st.builds(ConvPart, channels=sizes, groups=sizes), max_size=20),
    conv_width=sizes,
    conv_dtype=st.sampled_from(["bfloat16", "float32", "x"]),
    ssm_heads=sizes,
    ssm_head_bytes=sizes,
    conv_layout=st.sampled_from(["DS", "SD"]),
)
groups = st.lists(
    st.builds(
        KVGroup,
        kind=st.sampled_from(["full", "sliding_window", "mamba", "x"]),
        layers=int_lists,
        sliding_window=sizes,
        mamba=st.one_of(st.none(), mamba),
    ),
    max_size=4,
)
stage_splits = st.lists(st.tuples(layers, layers), max_size=5)
transfer_ids = st.sampled_from(["t0", "t1", "", "early-0"])
frames: st.SearchStrategy[Message] = st.one_of(
    st.builds(
        TransferRequest,
        transfer_id=transfer_ids,
        block_ids=int_lists,
        num_tokens=sizes,
        first_token=sizes,
        window_addr=sizes,
        window_bytes=sizes,
        share_bytes=sizes,
    ),
    st.builds(WindowFilled, transfer_id=transfer_ids, round=sizes),
    st.builds(WindowEmptied, transfer_id=transfer_ids, round=sizes),
    st.builds(Release, transfer_id=transfer_ids),
    st.builds(Abort, transfer_id=transfer_ids, reason=st.text(max_size=8)),
    st.builds(TransferDone, transfer_id=transfer_ids, bytes=sizes, descriptors=sizes),
    st.builds(TransferFailed, transfer_id=transfer_ids, reason=st.text(max_size=8)),
    st.builds(ErrorMessage, reason=st.text(max_size=8)),
    st.builds(Ping, nonce=st.integers(0, 2**63 - 1)),
    st.builds(Pong, nonce=st.integers(0, 2**63 - 1)),
    st.builds(HelloRefused, version=st.integers(0, 3), reason=st.text(max_size=8)),
)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_any_hello_and_any_frames_after_it_cost_p_little_and_leave_nothing(live: Live, data: st.DataObject) -> None:
    # honest: accepted, so the frames after it reach P's Sender; split: D's own stage and metadata are consistent,
    # the other stages anything; any: every size claimed at random.
    mode = data.draw(st.sampled_from(["honest", "split", "any"]))
    d = live.d.sim.metas[(0, 0)]
    if mode == "honest":
        sender = _attacker(live)
        stages = [(sender.start_layer, sender.end_layer)]
    elif mode == "split":
        stages = data.draw(st.lists(st.tuples(layers, layers), min_size=1, max_size=4))
        pp_rank = data.draw(st.integers(0, len(stages) - 1))
        end = data.draw(st.integers(1, d.num_layers))
        stages[pp_rank] = (0, end)
        sender = _attacker(
            live, pp_size=len(stages), pp_rank=pp_rank, start_layer=0, end_layer=end, base_addrs=d.base_addrs[:end]
        )
    else:
        sender = _attacker(
            live,
            pp_size=data.draw(sizes),
            pp_rank=data.draw(st.integers(-1, 3)),
            tp_size=data.draw(sizes),
            tp_rank=data.draw(st.integers(-1, 3)),
            start_layer=data.draw(layers),
            end_layer=data.draw(layers),
            layout=data.draw(st.sampled_from([d.layout, "NHD", "HND_CROSS_LAYER", "x"])),
            base_addrs=data.draw(st.one_of(st.just(d.base_addrs), int_lists)),
            num_blocks=data.draw(sizes),
            block_size=data.draw(st.one_of(st.just(d.block_size), sizes)),
            kv_groups=data.draw(st.one_of(st.just([]), groups)),
        )
        own_stage = [(sender.start_layer, sender.end_layer)]
        stages = data.draw(st.one_of(st.just(own_stage), stage_splits))
    after = [encode(m) for m in data.draw(st.lists(frames, max_size=6))]
    if data.draw(st.booleans()):  # a second hello, anywhere after the first
        after.insert(data.draw(st.integers(0, len(after))), unkeyed_frames(_hello(live, _attacker(live))))
    payload = unkeyed_frames(_hello(live, sender, stages)) + b"".join(after)
    with peak_bytes() as peak:
        answers = _exchange(live.address, payload)
    assert answers and all(isinstance(a, ANSWERS) for a in answers), answers
    first = answers[0]
    if mode == "honest":
        assert isinstance(first, HelloOk), answers
    else:  # refused by name: a claim past a bound as its field decodes, the others by the hello's checks
        malformed = isinstance(first, ErrorMessage) and first.reason.startswith("malformed frame")
        assert isinstance(first, HelloOk | HelloRefused) or malformed, answers
    assert peak() < PEAK_BOUND, f"P allocated {peak()} bytes for {len(payload)} bytes of input"
    live.settled()  # its connection, and what it asked for, are gone


def test_after_the_attacks_and_the_fuzzing_p_holds_nothing_and_still_serves(live: Live) -> None:
    live.settled()
    stats = live.stats()
    assert stats.protocol_errors > 0 and stats.write_failures == 0
    live.transfer("after-the-attacks")
    live.settled()
