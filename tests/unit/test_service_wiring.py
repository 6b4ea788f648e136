"""The asyncio service's wiring, in one process: real control sockets and HTTP, an in-process fake transport.

These tests are about the driver (handshake, framing, refusals, deadlines reaching the engine); that bytes move
through real Mooncake between processes is shown in tests/integration.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest

from kvsvc.core.auth import harness_secret
from kvsvc.core.data_planes import SameHostAddress, is_same_host
from kvsvc.core.errors import ServiceClosed
from kvsvc.core.layout import layer_bytes
from kvsvc.core.messages import (
    PROTOCOL_VERSION,
    ErrorMessage,
    FrameReader,
    Hello,
    HelloChallenge,
    HelloRefused,
    IpcHandle,
    Message,
    TransferRequest,
    WindowFilled,
    WorkerMetadata,
    encode,
)
from kvsvc.core.outputs import KVConnectorOutput
from kvsvc.core.planner import Region
from kvsvc.engine.bootstrap import BootstrapServer
from kvsvc.service import KVTransferService, ServiceConfig
from kvsvc.testing.fakes import LoopbackTransport
from kvsvc.testing.hellos import unkeyed_frames
from kvsvc.transport.samehost import own_address

LAYERS, HEADS, HEAD, BLOCK, BLOCKS = 2, 2, 8, 4, 16


@dataclass
class Side:
    service: KVTransferService
    pool: np.ndarray
    transport: LoopbackTransport


def make_side(engine_id: str, config: ServiceConfig, seed: int) -> Side:
    meta0 = WorkerMetadata(
        engine_id=engine_id,
        incarnation=f"{engine_id}-1",
        pp_rank=0,
        pp_size=1,
        tp_rank=0,
        tp_size=1,
        start_layer=0,
        end_layer=LAYERS,
        num_kv_heads=HEADS,
        head_size=HEAD,
        dtype="float16",
        block_size=BLOCK,
        num_blocks=BLOCKS,
        layout="HND",
        is_mla=False,
        base_addrs=[0] * LAYERS,
    )
    per_layer = layer_bytes(meta0)
    pool = np.random.default_rng(seed).integers(0, 255, size=LAYERS * per_layer, dtype=np.uint8)
    base = pool.ctypes.data
    meta = msgspec.structs.replace(meta0, base_addrs=[base + i * per_layer for i in range(LAYERS)])
    transport = LoopbackTransport()
    transport.register([(base, LAYERS * per_layer)])
    return Side(KVTransferService(meta, transport, config), pool, transport)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Side, Side, str]]:
    config = ServiceConfig(hold_timeout_s=5, recv_timeout_s=5, early_request_timeout_s=0.3, handshake_timeout_s=2)
    p, d = make_side("prefill", config, 1), make_side("decode", config, 2)
    p_meta = await p.service.start()
    await d.service.start()
    bootstrap = BootstrapServer({(0, 0): p_meta})
    url = await bootstrap.start()
    yield p, d, url
    await p.service.close()
    await d.service.close()
    await bootstrap.close()


async def until(condition: Callable[[], object], timeout: float = 10.0) -> None:
    """Yield to the loop until `condition()` holds, for up to `timeout` seconds (then fail naming it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"condition never held within {timeout:g} s")
        await asyncio.sleep(0.01)


async def wait_output(service: KVTransferService, what: str, req: str, timeout: float = 10.0) -> KVConnectorOutput:
    collected = KVConnectorOutput()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        out = service.get_finished()
        for name in ("finished_sending", "finished_recving", "failed_recving"):
            got = getattr(out, name)
            if got:
                setattr(collected, name, (getattr(collected, name) or set()) | got)
        collected.invalid_block_ids |= out.invalid_block_ids
        if req in (getattr(collected, what) or set()):
            return collected
        await asyncio.sleep(0.01)
    raise AssertionError(f"{req} never appeared in {what}; got {collected}")


def block_bytes_of(side: Side, layer: int, block: int) -> bytes:
    per_layer = side.pool.size // LAYERS
    per_block = per_layer // BLOCKS
    start = layer * per_layer + block * per_block
    return side.pool[start : start + per_block].tobytes()


async def test_a_transfer_moves_every_byte_and_reports_once_on_each_side(pair: tuple[Side, Side, str]) -> None:
    p, d, url = pair
    p.service.start_send("p-req", "t1", [3, 4], 2 * BLOCK, secret=harness_secret("t1"))
    d.service.start_recv("d-req", "t1", "prefill", url, [9, 1], 2 * BLOCK, secret=harness_secret("t1"))
    await wait_output(d.service, "finished_recving", "d-req")
    await wait_output(p.service, "finished_sending", "p-req")
    for layer in range(LAYERS):
        assert block_bytes_of(d, layer, 9) == block_bytes_of(p, layer, 3)
        assert block_bytes_of(d, layer, 1) == block_bytes_of(p, layer, 4)
    assert p.service.get_finished().is_empty() and d.service.get_finished().is_empty()
    assert p.service.statistics().holds == 0 and d.service.statistics().holds == 0


async def test_a_late_window_round_reaching_a_d_with_no_window_lent_is_dropped_not_a_protocol_error(
    pair: tuple[Side, Side, str],
) -> None:
    p, d, url = pair
    p.service.start_send("p-req", "t1", [3], BLOCK, secret=harness_secret("t1"))
    d.service.start_recv("d-req", "t1", "prefill", url, [9], BLOCK, secret=harness_secret("t1"))
    await wait_output(d.service, "finished_recving", "d-req")
    (inbound,) = p.service._sending._inbound.values()  # P's end of D's control connection
    inbound.channel.send(WindowFilled(transfer_id="t1", round=0))  # as if P's round arrived after D gave it back
    # The connection keeps order: t2's answer follows the round.
    p.service.start_send("p-req2", "t2", [4], BLOCK, secret=harness_secret("t2"))
    d.service.start_recv("d-req2", "t2", "prefill", url, [10], BLOCK, secret=harness_secret("t2"))
    out = await wait_output(d.service, "finished_recving", "d-req2")
    assert out.failed_recving is None
    assert d.service.statistics().protocol_errors == 0 and p.service.statistics().protocol_errors == 0


async def test_the_same_params_in_a_second_receive_get_none_of_the_first_ones_kv(pair: tuple[Side, Side, str]) -> None:
    """A client replaying a finished request's params: D's service names each receive anew, so P's remembered
    outcome answers only the first, and the second fails with its blocks invalid instead of finishing unwritten."""
    p, d, url = pair
    p.service.start_send("p-req", "t1", [3], BLOCK, secret=harness_secret("t1"))
    d.service.start_recv("d-req", "t1", "prefill", url, [9], BLOCK, secret=harness_secret("t1"))
    await wait_output(d.service, "finished_recving", "d-req")
    await wait_output(p.service, "finished_sending", "p-req")
    d.service.start_recv("d-replay", "t1", "prefill", url, [10], BLOCK, secret=harness_secret("t1"))
    out = await wait_output(d.service, "failed_recving", "d-replay")
    assert out.finished_recving is None and 10 in out.invalid_block_ids


async def test_repeated_start_calls_change_nothing(pair: tuple[Side, Side, str]) -> None:
    p, d, url = pair
    for _ in range(3):
        p.service.start_send("p-req", "t2", [0], BLOCK, secret=harness_secret("t2"))
        d.service.start_recv("d-req", "t2", "prefill", url, [5], BLOCK, secret=harness_secret("t2"))
    out = await wait_output(d.service, "finished_recving", "d-req")
    assert out.failed_recving is None
    await wait_output(p.service, "finished_sending", "p-req")
    assert p.service.statistics().transfers_sent == 1


async def test_an_unreachable_engine_fails_the_receive_with_its_blocks_invalid(pair: tuple[Side, Side, str]) -> None:
    _, d, _ = pair
    d.service.start_recv("d-req", "t3", "prefill", "http://127.0.0.1:9", [2, 3], BLOCK, secret=harness_secret("t3"))
    out = await wait_output(d.service, "failed_recving", "d-req")
    assert out.invalid_block_ids == {2, 3}
    assert d.service.statistics().holds == 0


async def test_a_request_p_never_holds_is_answered_failed_after_the_early_timeout(
    pair: tuple[Side, Side, str],
) -> None:
    p, d, url = pair
    d.service.start_recv("d-req", "never-held", "prefill", url, [2], BLOCK, secret=harness_secret("never-held"))
    out = await wait_output(d.service, "failed_recving", "d-req")
    assert out.invalid_block_ids == {2}
    # P's early deadline (0.3 s) answered it, not D's own recv_timeout_s (5 s), which would name no P reason.
    reason = d.service.failure_reason("d-req")
    assert reason is not None and "unknown transfer 'never-held': not held by P within 0.3 s" in reason, reason
    assert p.service.statistics().sender.early_requests == 0


async def test_a_deadline_check_that_raises_leaves_later_deadlines_kept(
    pair: tuple[Side, Side, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    p, d, url = pair
    expire, raised = p.service._sending.expire, []

    def fails_once(now: float) -> list[object]:
        if not raised:
            raised.append(True)
            raise RuntimeError("a bug in one deadline check")
        return expire(now)

    def always_fails(now: float) -> None:
        raise RuntimeError("a bug in every deadline check")

    monkeypatch.setattr(p.service._sending, "expire", fails_once)
    monkeypatch.setattr(p.service._receiving, "expire", always_fails)  # the other role's failures stop nothing
    d.service.start_recv("d-req", "never-held", "prefill", url, [2], BLOCK, secret=harness_secret("never-held"))
    await wait_output(d.service, "failed_recving", "d-req")
    # P's loop lived on: its early deadline (0.3 s) answered, not D's own recv_timeout_s (5 s).
    reason = d.service.failure_reason("d-req")
    assert raised and reason is not None and "not held by P within 0.3 s" in reason, reason
    assert caplog.text.count("checking the P deadlines of worker") == 1
    assert caplog.text.count("checking the D deadlines of worker") == 1  # once per run of failures, not each round


async def test_a_start_write_that_raises_fails_the_write_and_never_resubmits_it(
    pair: tuple[Side, Side, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A plane's fast path must raise nothing; one that does may have submitted part, so the write fails rather
    than going again through `write`, and both sides still end the transfer."""
    p, d, url = pair
    writes: list[object] = []

    def broken(peer: str, descriptors: object) -> None:
        raise RuntimeError("a plane's bug after submitting part")

    async def write(peer: str, descriptors: object) -> int:
        writes.append(descriptors)
        return 0

    monkeypatch.setattr(p.transport, "start_write", broken)
    monkeypatch.setattr(p.transport, "write", write)
    p.service.start_send("p-req", "t1", [3], BLOCK, secret=harness_secret("t1"))
    d.service.start_recv("d-req", "t1", "prefill", url, [9], BLOCK, secret=harness_secret("t1"))
    out = await wait_output(d.service, "failed_recving", "d-req")
    assert out.invalid_block_ids == {9}
    await wait_output(p.service, "finished_sending", "p-req")
    assert writes == [] and "start_write of transfer 't1'" in caplog.text
    assert "a plane's bug" in (d.service.failure_reason("d-req") or "")


async def test_a_write_that_raises_outside_its_contract_ends_only_once_its_plane_drained(
    pair: tuple[Side, Side, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A write that raised anything but the contract's errors may have left descriptors moving: P holds the blocks
    (and D hears nothing) until the plane says nothing to that D worker is in flight."""
    p, d, url = pair
    plane_idle = asyncio.Event()
    asked: list[str | None] = []

    def broken(peer: str, descriptors: object) -> None:
        raise RuntimeError("a plane's bug after submitting part")

    async def drained(peer: str | None = None) -> None:
        asked.append(peer)
        await plane_idle.wait()

    monkeypatch.setattr(p.transport, "start_write", broken)
    monkeypatch.setattr(p.transport, "drained", drained)
    p.service.start_send("p-req", "t1", [3], BLOCK, secret=harness_secret("t1"))
    d.service.start_recv("d-req", "t1", "prefill", url, [9], BLOCK, secret=harness_secret("t1"))
    await until(lambda: asked)
    assert asked == [d.service.metadata.transport_addr], asked
    assert p.service.statistics().writes_in_flight == 1
    assert not p.service.get_finished().finished_sending and not d.service.get_finished().failed_recving
    plane_idle.set()
    out = await wait_output(d.service, "failed_recving", "d-req")
    assert out.invalid_block_ids == {9}
    await wait_output(p.service, "finished_sending", "p-req")
    assert p.service.statistics().writes_in_flight == 0


async def test_block_ids_outside_the_pool_are_refused_at_the_call(pair: tuple[Side, Side, str]) -> None:
    p, d, url = pair
    with pytest.raises(ValueError, match=r"block ids \[99\] outside the pool of 16 blocks"):
        p.service.start_send("p-req", "t4", [99], 1, secret=harness_secret("t4"))
    with pytest.raises(ValueError, match="do not fit"):
        d.service.start_recv("d-req", "t4", "prefill", url, [1], BLOCK + 1, secret=harness_secret("t4"))


def hello_to(
    p: WorkerMetadata, sender: WorkerMetadata, *, version: int = PROTOCOL_VERSION, incarnation: str | None = None
) -> Hello:
    """D's hello to P worker `p` (pp0, tp0), for tests that speak the control protocol by hand."""
    return Hello(
        version=version,
        sender=sender,
        stage_layers=[(0, LAYERS)],
        expect_engine_id=p.engine_id,
        expect_incarnation=p.incarnation if incarnation is None else incarnation,
        expect_pp_rank=0,
        expect_tp_rank=0,
    )


async def raw_exchange(address: str, payload: bytes) -> list[Message]:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(payload)
    frames = FrameReader()
    out: list[Message] = []
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 5):
            out += frames.feed(chunk)
    finally:
        writer.close()
    return out


async def test_garbage_on_the_control_port_gets_an_error_and_the_service_keeps_serving(
    pair: tuple[Side, Side, str],
) -> None:
    p, d, url = pair
    replies = await raw_exchange(p.service.metadata.control_addr, struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")
    assert len(replies) == 1 and isinstance(replies[0], ErrorMessage)
    assert "malformed frame" in replies[0].reason
    oversized = await raw_exchange(p.service.metadata.control_addr, struct.pack(">I", 2**31))
    assert isinstance(oversized[0], ErrorMessage) and "limit" in oversized[0].reason
    await test_a_transfer_moves_every_byte_and_reports_once_on_each_side((p, d, url))


async def test_a_flood_of_garbage_connections_logs_a_bounded_number_of_lines_and_counts_every_one(
    pair: tuple[Side, Side, str], caplog: pytest.LogCaptureFixture
) -> None:
    # Anyone who reaches the control port can open connections with bad frames: each is answered and counted, but
    # the engine's log takes only a burst of them per window (`PeerLog`), however many come.
    p, d, url = pair
    before = p.service.statistics().protocol_errors
    with caplog.at_level(logging.WARNING, logger="kvsvc.service"):
        for _ in range(60):
            (reply,) = await raw_exchange(p.service.metadata.control_addr, struct.pack(">I", 1) + b"\xc1")
            assert isinstance(reply, ErrorMessage)
    lines = [r for r in caplog.records if "closing control connection" in r.getMessage()]
    assert len(lines) == 20
    assert p.service.statistics().protocol_errors - before == 60
    await test_a_transfer_moves_every_byte_and_reports_once_on_each_side((p, d, url))


async def test_a_wrong_protocol_version_is_refused_naming_both_versions(pair: tuple[Side, Side, str]) -> None:
    p, d, _ = pair
    pm = p.service.metadata
    hello = hello_to(pm, d.service.metadata, version=PROTOCOL_VERSION + 1)
    (reply,) = await raw_exchange(pm.control_addr, unkeyed_frames(hello))
    assert isinstance(reply, HelloRefused)
    assert f"version {PROTOCOL_VERSION + 1}, this side speaks {PROTOCOL_VERSION}" in reply.reason


async def test_a_frame_begun_and_never_finished_closes_the_connection_by_its_deadline(
    pair: tuple[Side, Side, str],
) -> None:
    p, d, _ = pair
    pm = p.service.metadata
    hello = hello_to(pm, d.service.metadata)
    # Accepted, then 10 bytes of a frame announcing 4 MiB: P must not hold that buffer (or the connection) for good.
    partial = unkeyed_frames(hello) + struct.pack(">I", 4 << 20) + b"\x00" * 10
    replies = await asyncio.wait_for(raw_exchange(pm.control_addr, partial), 60)  # a hang fails here, not in CI
    assert [type(r).__name__ for r in replies] == ["HelloChallenge", "HelloOk", "ErrorMessage"], replies
    reason = replies[-1].reason  # type: ignore[union-attr]
    assert "began a frame and sent 14 bytes of it" in reason and "limit 2 s" in reason, reason
    assert p.service.statistics().control_connections == 0


async def test_a_hello_for_another_incarnation_is_refused(pair: tuple[Side, Side, str]) -> None:
    p, d, _ = pair
    pm = p.service.metadata
    hello = hello_to(pm, d.service.metadata, incarnation="an-older-start")
    (reply,) = await raw_exchange(pm.control_addr, unkeyed_frames(hello))
    assert isinstance(reply, HelloRefused) and "an-older-start" in reply.reason


async def test_a_request_before_the_hello_is_a_protocol_error(pair: tuple[Side, Side, str]) -> None:
    p, _, _ = pair
    request = TransferRequest(transfer_id="x", block_ids=[1], num_tokens=1)
    (reply,) = await raw_exchange(p.service.metadata.control_addr, encode(request))
    assert isinstance(reply, ErrorMessage) and "expected hello" in reply.reason
    assert p.service.statistics().protocol_errors == 1


async def test_a_write_failure_reaches_both_engines(pair: tuple[Side, Side, str]) -> None:
    p, d, url = pair
    p.transport.fail_next_writes(code=-1)
    p.service.start_send("p-req", "t5", [0], BLOCK, secret=harness_secret("t5"))
    d.service.start_recv("d-req", "t5", "prefill", url, [7], BLOCK, secret=harness_secret("t5"))
    out = await wait_output(d.service, "failed_recving", "d-req")
    assert out.invalid_block_ids == {7}
    await wait_output(p.service, "finished_sending", "p-req")
    assert p.service.statistics().write_failures == 1


async def test_an_abort_on_d_frees_both_sides(pair: tuple[Side, Side, str]) -> None:
    p, d, url = pair
    p.transport.stall()
    p.service.start_send("p-req", "t6", [0], BLOCK, secret=harness_secret("t6"))
    d.service.start_recv("d-req", "t6", "prefill", url, [7], BLOCK, secret=harness_secret("t6"))
    while p.service.statistics().writes_in_flight == 0:
        await asyncio.sleep(0.01)
    d.service.abort("d-req")
    await asyncio.sleep(0.05)
    # The write is still stalled: neither side may report yet.
    assert not p.service.get_finished().finished_sending
    p.transport.release()
    await wait_output(d.service, "failed_recving", "d-req")
    await wait_output(p.service, "finished_sending", "p-req")
    assert p.service.statistics().holds == 0 and d.service.statistics().holds == 0


async def test_a_closed_service_refuses_new_work(pair: tuple[Side, Side, str]) -> None:
    p, _, _ = pair
    await p.service.close()
    with pytest.raises(ServiceClosed):
        p.service.start_send("p-req", "t7", [0], 1, secret=harness_secret("t7"))


async def test_a_layer_whose_compute_failed_fails_the_transfer_and_frees_both_sides(
    pair: tuple[Side, Side, str],
) -> None:
    p, d, url = pair
    loop = asyncio.get_running_loop()
    layers: list[asyncio.Future[None]] = [loop.create_future() for _ in range(LAYERS)]
    p.service.start_send("p-req", "t8", [0], BLOCK, layers, secret=harness_secret("t8"))
    d.service.start_recv("d-req", "t8", "prefill", url, [7], BLOCK, secret=harness_secret("t8"))
    layers[0].set_result(None)
    layers[1].set_exception(RuntimeError("CUDA kernel failed"))
    out = await wait_output(d.service, "failed_recving", "d-req")
    assert out.invalid_block_ids == {7}
    await wait_output(p.service, "finished_sending", "p-req")
    assert p.service.statistics().holds == 0 and d.service.statistics().holds == 0


async def test_repeated_d_block_ids_are_refused_at_the_call(pair: tuple[Side, Side, str]) -> None:
    _, d, url = pair
    with pytest.raises(ValueError, match=r"D block ids \[3\] appear more than once"):
        d.service.start_recv("d-req", "t9", "prefill", url, [3, 3], 2 * BLOCK, secret=harness_secret("t9"))


async def test_a_hello_claiming_an_absurd_tp_size_is_refused_before_anything_is_built(
    pair: tuple[Side, Side, str],
) -> None:
    p, d, _ = pair
    pm = p.service.metadata
    hello = hello_to(pm, msgspec.structs.replace(d.service.metadata, tp_size=2**30))
    (challenge, reply) = await raw_exchange(pm.control_addr, unkeyed_frames(hello))
    assert isinstance(challenge, HelloChallenge)
    assert isinstance(reply, HelloRefused) and "tp_size 1073741824" in reply.reason


async def test_engine_metadata_larger_than_one_read_is_fetched_whole() -> None:
    import aiohttp

    from kvsvc.service.remotes import fetch_engine_metadata

    base = make_side("big", ServiceConfig(), 3).service.metadata
    metas = {
        (0, tp): msgspec.structs.replace(
            base,
            tp_rank=tp,
            tp_size=1024,
            end_layer=128,
            base_addrs=[2**40 + i for i in range(128)],
            control_addr="127.0.0.1:9",
        )
        for tp in range(1024)
    }  # about 1.3 MB: many reads on any socket
    server = BootstrapServer(metas)
    url = await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            assert await fetch_engine_metadata(session, url, timeout_s=10) == metas
    finally:
        await server.close()


async def test_an_engine_document_beyond_a_hellos_bounds_is_refused_before_d_plans_by_it() -> None:
    import aiohttp

    from kvsvc.core.errors import HandshakeError
    from kvsvc.service.remotes import fetch_engine_metadata

    base = msgspec.structs.replace(make_side("huge", ServiceConfig(), 3).service.metadata, control_addr="127.0.0.1:9")
    server = BootstrapServer({(0, 0): msgspec.structs.replace(base, tp_size=2**31 - 1)})
    url = await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(HandshakeError, match=r"worker huge\[pp0,tp0\] claims tp_size 2147483647"):
                await fetch_engine_metadata(session, url, timeout_s=10)
    finally:
        await server.close()


async def test_an_engine_whose_layout_does_not_fit_is_refused_once_when_they_meet(
    pair: tuple[Side, Side, str], caplog: pytest.LogCaptureFixture
) -> None:
    p, d, _ = pair
    # P publishes a head size D does not have: nothing can be received from it, whatever the request.
    wider = msgspec.structs.replace(p.service.metadata, head_size=2 * HEAD)
    bootstrap = BootstrapServer({(0, 0): wider})
    url = await bootstrap.start()
    try:
        with caplog.at_level("WARNING", logger="kvsvc.service.remotes"):
            for i in range(3):
                d.service.start_recv(f"d{i}", f"t{i}", "prefill", url, [i], BLOCK, secret=harness_secret(f"t{i}"))
                await wait_output(d.service, "failed_recving", f"d{i}")
        reasons = {d.service.failure_reason(f"d{i}") for i in range(3)}
        assert len(reasons) == 1 and "P head_size 16 != D head_size 8" in reasons.pop()  # type: ignore[operator]
        refusals = [r for r in caplog.records if "refuses to receive from engine 'prefill'" in r.getMessage()]
        assert len(refusals) == 1, "the refusal is decided and logged once per engine start"
        (row,) = [r for r in d.service.peers() if r["state"] == "refused"]
        assert row["peer_engine_id"] == "prefill" and "head_size" in str(row["last_error"])
        assert d.service.statistics().holds == 0
    finally:
        await bootstrap.close()


class SameHostRefusedTransport(LoopbackTransport):
    """Offers a same-host plane whose kernel probe refuses, as under a ptrace policy that forbids it."""

    @property
    def local_session_id(self) -> str:
        return str(own_address())

    async def reachable(
        self,
        session: str,
        regions: Sequence[Region],
        via: tuple[tuple[str, int], tuple[str, int]] | None = None,
        handles: Sequence[IpcHandle] = (),
    ) -> str:
        return "process_vm_readv: Operation not permitted (errno 1)" if is_same_host(session) else ""


async def test_a_same_host_pair_the_kernel_refuses_runs_on_mooncake_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = ServiceConfig(hold_timeout_s=5, recv_timeout_s=5, handshake_timeout_s=2)
    sides = []
    for engine_id, seed in (("prefill", 1), ("decode", 2)):
        side = make_side(engine_id, config, seed)
        transport = SameHostRefusedTransport()
        transport.register(side.transport._local.regions())  # the same pool, in a transport that offers the plane
        sides.append(Side(KVTransferService(side.service.metadata, transport, config), side.pool, transport))
    p, d = sides
    p_meta = await p.service.start()
    await d.service.start()
    assert is_same_host(p_meta.samehost_addr)  # offered and published
    bootstrap = BootstrapServer({(0, 0): p_meta})
    url = await bootstrap.start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvsvc.service.sending"):
            p.service.start_send("p-req", "t1", [3], BLOCK, secret=harness_secret("t1"))
            d.service.start_recv("d-req", "t1", "prefill", url, [9], BLOCK, secret=harness_secret("t1"))
            await wait_output(d.service, "finished_recving", "d-req")
        assert block_bytes_of(d, 0, 9) == block_bytes_of(p, 0, 3)  # the bytes came over Mooncake's session
        (row,) = [r for r in p.service.peers() if r["direction"] == "from_d"]
        assert row["transport"] == "mooncake"
        assert "same-host plane is refused: process_vm_readv: Operation not permitted" in caplog.text
    finally:
        await p.service.close()
        await d.service.close()
        await bootstrap.close()


class AdmittingTransport(LoopbackTransport):
    """Offers a same-host plane under a session of its own (`pid` stands for its process) and admits each session
    `reachable` is asked about, as the kernel's check would; `add_peer` takes only an admitted one and `remove_peer`
    forgets the admission, as `SameHostTransport` does. The check of a session in `gates` waits until its gate opens:
    a probe that takes its time."""

    def __init__(self, pid: int) -> None:
        super().__init__()
        mine = own_address()
        self._samehost = str(SameHostAddress(mine.host, mine.uid, pid, mine.start))
        self.admitted: set[str] = set()
        self.ever_admitted: set[str] = set()
        self.asked: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    @property
    def local_session_id(self) -> str:
        return self._samehost

    async def reachable(
        self,
        session: str,
        regions: Sequence[Region],
        via: tuple[tuple[str, int], tuple[str, int]] | None = None,
        handles: Sequence[IpcHandle] = (),
    ) -> str:
        self.asked.append(session)
        if session in self.gates:
            await self.gates[session].wait()
        self.admitted.add(session)
        self.ever_admitted.add(session)
        return ""

    def add_peer(self, session_id: str, regions: Sequence[Region]) -> None:
        assert session_id in self.admitted, f"{session_id} published without being admitted"
        super().add_peer(session_id, regions)

    def remove_peer(self, session_id: str) -> None:
        self.admitted.discard(session_id)
        super().remove_peer(session_id)


def admitting_side(engine_id: str, config: ServiceConfig, seed: int, pid: int) -> Side:
    side = make_side(engine_id, config, seed)
    transport = AdmittingTransport(pid)
    transport.register(side.transport._local.regions())
    return Side(KVTransferService(side.service.metadata, transport, config), side.pool, transport)


@pytest.fixture
async def restarting_d() -> AsyncIterator[tuple[Side, Side, Side, str]]:
    """P, and two D services of the same engine and worker on their own same-host sessions: a D worker and the same
    worker restarted (another process)."""
    config = ServiceConfig(hold_timeout_s=5, recv_timeout_s=5, early_request_timeout_s=0.3, handshake_timeout_s=5)
    base = own_address().pid
    p = admitting_side("prefill", config, 1, base)
    d1, d2 = admitting_side("decode", config, 2, base + 100_001), admitting_side("decode", config, 3, base + 100_002)
    p_meta = await p.service.start()
    bootstrap = BootstrapServer({(0, 0): p_meta})
    url = await bootstrap.start()
    for d in (d1, d2):
        await d.service.start()
    yield p, d1, d2, url
    for side in (p, d1, d2):
        await side.service.close()
    await bootstrap.close()


async def test_a_replaced_d_worker_s_session_is_unpublished_when_its_newer_hello_is_accepted(
    restarting_d: tuple[Side, Side, Side, str],
) -> None:
    p, d1, d2, url = restarting_d
    old, new = d1.transport.local_session_id, d2.transport.local_session_id
    p.service.start_send("p1", "t1", [3], BLOCK, secret=harness_secret("t1"))
    d1.service.start_recv("d1", "t1", "prefill", url, [9], BLOCK, secret=harness_secret("t1"))
    await wait_output(d1.service, "finished_recving", "d1")
    assert old in p.transport._peers and old in p.transport.admitted  # D1's connection stays open
    # The same D worker, restarted (its old connection not yet seen closed), says hello again: it replaces the old.
    p.service.start_send("p2", "t2", [4], BLOCK, secret=harness_secret("t2"))
    d2.service.start_recv("d2", "t2", "prefill", url, [9], BLOCK, secret=harness_secret("t2"))
    await wait_output(d2.service, "finished_recving", "d2")
    assert block_bytes_of(d2, 0, 9) == block_bytes_of(p, 0, 4)
    assert new in p.transport._peers and new in p.transport.admitted
    assert old not in p.transport._peers and old not in p.transport.admitted


async def test_a_hello_replaced_while_its_session_is_checked_leaves_no_admission_behind(
    restarting_d: tuple[Side, Side, Side, str],
) -> None:
    p, d1, d2, url = restarting_d
    old, new = d1.transport.local_session_id, d2.transport.local_session_id
    gate = p.transport.gates[old] = asyncio.Event()
    d1.service.start_recv("d1", "t1", "prefill", url, [9], BLOCK, secret=harness_secret("t1"))
    await until(lambda: old in p.transport.asked)  # D1's hello is accepted and its process being checked
    await d1.service.close()  # D1 is gone; P learns it only when the check returns
    p.service.start_send("p2", "t2", [4], BLOCK, secret=harness_secret("t2"))
    d2.service.start_recv("d2", "t2", "prefill", url, [9], BLOCK, secret=harness_secret("t2"))
    await wait_output(d2.service, "finished_recving", "d2")  # the newer hello stands, though the older one routes
    gate.set()
    await until(lambda: old in p.transport.ever_admitted and old not in p.transport.admitted)  # admitted, then let go
    assert old not in p.transport._peers
    assert new in p.transport._peers and new in p.transport.admitted
    assert block_bytes_of(d2, 0, 9) == block_bytes_of(p, 0, 4)
