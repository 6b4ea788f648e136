"""The GPU plane's logic on CPU: `CudaIpcTransport` over `FakeCudaDriver` (memfd "allocations" mapped twice, so a
write through P's mapping lands in D's allocation as CUDA IPC's would), the rule and the handle checks, and two
services in this process that exchange handles in the hello and move a transfer over the plane. The CUDA driver
itself is exercised by `make gpu-check` on a GPU host (tests marked `cuda`)."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsvc.core.auth import harness_secret
from kvsvc.core.bounds import MAX_IPC_HANDLES, check_hello_bounds
from kvsvc.core.data_planes import (
    IPC_HANDLE_BYTES,
    SameHostAddress,
    check_ipc_handles,
    check_transport_addr,
    choose_transport,
    rule_on,
)
from kvsvc.core.errors import PeerMismatch
from kvsvc.core.hello import make_hello
from kvsvc.core.layout import layer_bytes
from kvsvc.core.messages import IpcHandle, WorkerMetadata
from kvsvc.core.planner import ROWS_CHECKED_ONE_BY_ONE
from kvsvc.core.staging_plans import StagingRule
from kvsvc.engine.bootstrap import BootstrapServer
from kvsvc.service import KVTransferService, ServiceConfig
from kvsvc.service.staging_area import StagingArea
from kvsvc.testing.cuda import FakeCudaDriver
from kvsvc.testing.engines import MemmoveCopies
from kvsvc.testing.fakes import LoopbackTransport
from kvsvc.transport import InvalidDescriptor, TransportClosed, WriteFailed, cuda_ipc, samehost
from kvsvc.transport.cuda_driver import CudaError, LibCuda
from kvsvc.transport.cuda_ipc import CudaIpcTransport
from kvsvc.transport.routed import RoutedTransport, exported_handles, with_same_host
from kvsvc.transport.samehost import own_address

SIZE = 1 << 16
Via = tuple[tuple[str, int], tuple[str, int]]
GPU_A = "GPU-11111111-2222-3333-4444-555555555555"


@pytest.fixture
def driver() -> Iterator[FakeCudaDriver]:
    fake = FakeCudaDriver()
    yield fake
    fake.free()


@pytest.fixture
def connection() -> Iterator[Via]:
    """A real TCP connection whose both ends this process holds: `via` as P sees a D in this process."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()):
        accepted, _ = server.accept()
        with accepted:
            yield (accepted.getsockname()[:2], accepted.getpeername()[:2])


def view(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(addr))


class Pair:
    """P's and D's GPU planes in this process, D's allocation exported, P's source filled with a pattern."""

    def __init__(self, driver: FakeCudaDriver) -> None:
        self.driver = driver
        self.src, self.dst = driver.alloc(SIZE), driver.alloc(SIZE)
        view(self.src, SIZE)[:] = np.arange(SIZE, dtype=np.uint64).astype(np.uint8)
        self.p, self.d = CudaIpcTransport(driver), CudaIpcTransport(driver)
        self.p.register([(self.src, SIZE)])
        self.d.register([(self.dst, SIZE)])
        self.session = self.d.local_session_id
        self.regions = [(self.dst, SIZE)]

    async def admit(self, via: Via) -> None:
        assert await self.p.reachable(self.session, self.regions, via, self.d.exported()) == ""
        self.p.add_peer(self.session, self.regions)

    async def close(self) -> None:
        await self.p.close()
        await self.d.close()


@pytest.fixture
async def pair(driver: FakeCudaDriver) -> AsyncIterator[Pair]:
    made = Pair(driver)
    yield made
    await made.close()


# -- the rule and the checks (pure) ----------------------------------------------------------------------------


def meta(samehost_addr: str, engine_id: str = "e") -> WorkerMetadata:
    return WorkerMetadata(
        engine_id=engine_id, incarnation="i", pp_rank=0, pp_size=1, tp_rank=0, tp_size=1, start_layer=0,
        end_layer=1, num_kv_heads=1, head_size=8, dtype="float16", block_size=4, num_blocks=4, layout="HND",
        is_mla=False, base_addrs=[4096], transport_addr="127.0.0.1:1", samehost_addr=samehost_addr,
    )  # fmt: skip


def test_gpu_pairs_of_one_host_take_the_gpu_plane_and_mixed_memory_takes_mooncake() -> None:
    cpu = SameHostAddress("h", 0, 10, 20)
    gpu_p, gpu_d = SameHostAddress("h", 0, 10, 20, GPU_A), SameHostAddress("h", 0, 11, 21, "GPU-other")
    assert SameHostAddress.parse(str(gpu_d)) == gpu_d and str(gpu_d).startswith("cudaipc:")
    route = choose_transport(meta(str(gpu_p)), meta(str(gpu_d)))
    assert (route.kind, route.session) == ("cuda_ipc", str(gpu_d))
    assert GPU_A in route.reason and "GPU-other" in route.reason  # GPUs by UUID
    mixed = choose_transport(meta(str(cpu)), meta(str(gpu_d)))
    assert mixed.kind == "mooncake" and mixed.reason == "P's KV is in CPU memory, D's on a GPU"
    other_host = SameHostAddress("h2", 0, 11, 21, "GPU-other")
    assert choose_transport(meta(str(gpu_p)), meta(str(other_host))).kind == "mooncake"
    assert choose_transport(meta(str(gpu_p)), meta(str(gpu_d)), "mooncake").kind == "mooncake"
    with pytest.raises(PeerMismatch, match="gives transport_addr 'cudaipc:"):
        check_transport_addr(msgspec.structs.replace(meta(""), transport_addr=str(gpu_d)))
    rule = StagingRule()
    assert rule_on("cuda_ipc", rule).gather_cost_s_per_byte < rule_on("samehost", rule).gather_cost_s_per_byte


def handle(base: int, size: int, n: int = IPC_HANDLE_BYTES) -> IpcHandle:
    return IpcHandle(handle=b"h" * n, base=base, size=size)


def test_handle_checks_name_what_is_wrong() -> None:
    regions = [(1000, 100)]
    assert check_ipc_handles("s", regions, [handle(1000, 100)]) == ""
    assert check_ipc_handles("s", regions, []) == "s exports no GPU allocation"
    assert "has 8 bytes, not 64" in check_ipc_handles("s", regions, [handle(1000, 100, 8)])
    assert "lies in no allocation" in check_ipc_handles("s", regions, [handle(1000, 99)])
    assert "overlap" in check_ipc_handles("s", regions, [handle(1000, 100), handle(1050, 100)])
    assert "no allocation" in check_ipc_handles("s", regions, [handle(-1, 100)])


@given(
    st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), max_size=6),
    st.lists(st.tuples(st.integers(0, 80), st.integers(1, 30)), max_size=5),
)
def test_handle_cover_matches_a_byte_by_byte_check(
    spans: list[tuple[int, int]], regions: list[tuple[int, int]]
) -> None:
    handles = [handle(b, s) for b, s in spans]
    covered = [set(range(b, b + s)) for b, s in spans]
    overlapping = any(covered[i] & covered[j] for i in range(len(spans)) for j in range(i))
    inside = all(any(set(range(a, a + n)) <= c for c in covered) for a, n in regions)
    verdict = check_ipc_handles("s", regions, handles)
    assert (verdict == "") == (bool(spans) and not overlapping and inside)


def test_the_hello_carries_handles_only_to_a_p_on_the_gpu_plane() -> None:
    d_addr, p_gpu = SameHostAddress("h", 0, 11, 21, GPU_A), SameHostAddress("h", 0, 10, 20, GPU_A)
    d = meta(str(d_addr), "d")
    handles = [handle(4096, 1 << 20)]
    to_gpu_p = make_hello(d, {(0, 0): d}, meta(str(p_gpu), "p"), b"", handles)
    assert to_gpu_p.ipc_handles == handles
    for other in ("", str(SameHostAddress("h", 0, 10, 20)), str(SameHostAddress("h2", 0, 10, 20, GPU_A))):
        assert make_hello(d, {(0, 0): d}, meta(other, "p"), b"", handles).ipc_handles == []


def test_d_reads_the_plane_p_chose_from_its_hello_ok_and_refuses_one_it_does_not_know_by_name() -> None:
    from kvsvc.core.errors import HandshakeError
    from kvsvc.core.hello import check_hello_reply
    from kvsvc.core.messages import HelloOk

    p = meta("", "p")
    assert check_hello_reply(p, HelloOk(version=2, sender=p, plane="cuda_ipc")) == "cuda_ipc"
    with pytest.raises(HandshakeError, match="plane 'warp-drive'; this D knows mooncake, samehost, cuda_ipc"):
        check_hello_reply(p, HelloOk(version=2, sender=p, plane="warp-drive"))
    with pytest.raises(HandshakeError, match="plane ''"):
        check_hello_reply(p, HelloOk(version=2, sender=p))


def test_a_hello_exporting_too_many_allocations_is_refused_by_name() -> None:
    d = meta("", "d")
    hello = make_hello(d, {(0, 0): d}, meta("", "p"), b"")
    hello = msgspec.structs.replace(hello, ipc_handles=[handle(i * 4096, 4096) for i in range(MAX_IPC_HANDLES + 1)])
    with pytest.raises(PeerMismatch, match=f"exports {MAX_IPC_HANDLES + 1} GPU allocations, limit {MAX_IPC_HANDLES}"):
        check_hello_bounds(meta("", "p"), hello)


# -- the transport over the fake driver ----------------------------------------------------------------------


async def test_a_write_lands_in_d_through_p_s_mapping_and_completes_by_its_event(pair: Pair, connection: Via) -> None:
    await pair.admit(connection)
    assert pair.p.admits(pair.session) and pair.driver.mappings == 1
    here = pair.p.peer_pointer(pair.session, pair.dst + 100)
    assert here != pair.dst + 100  # another mapping of the same allocation
    assert await pair.p.write(pair.session, [(pair.src, pair.dst + 100, 4000), (pair.src + 8000, pair.dst, 50)]) == 4050
    assert view(pair.dst + 100, 4000).tobytes() == view(pair.src, 4000).tobytes()
    assert view(pair.dst, 50).tobytes() == view(pair.src + 8000, 50).tobytes()
    event = pair.driver.events[-1]
    assert event.queries > event.lag and event.released  # polled until it fired, then freed
    stats = pair.p.statistics()
    assert (stats.bytes_written, stats.descriptors_written, stats.writes_in_flight) == (4050, 2, 0)


async def test_writes_outside_what_d_published_are_refused_before_any_copy(pair: Pair, connection: Via) -> None:
    with pytest.raises(InvalidDescriptor, match="was not admitted"):
        pair.p.add_peer(pair.session, pair.regions)
    await pair.admit(connection)
    for descriptors, match in (
        ([(pair.src, pair.dst + SIZE - 10, 20)], "outside the peer's regions"),
        ([(pair.dst, pair.dst, 20)], "outside registered local memory"),
        ([(pair.src, pair.dst, 0)], "not positive"),
    ):
        with pytest.raises(InvalidDescriptor, match=match):
            await pair.p.write(pair.session, descriptors)
    assert pair.driver.calls == [] and pair.p.statistics().refused == 4
    with pytest.raises(InvalidDescriptor, match="lies in no allocation"):
        pair.p.add_peer(pair.session, [(pair.dst, SIZE + 1)])


async def test_handles_that_do_not_cover_or_do_not_open_leave_nothing_admitted_or_mapped(
    pair: Pair,
    connection: Via,
) -> None:
    (real,) = pair.d.exported()
    larger = msgspec.structs.replace(real, size=SIZE * 2)
    refused = await pair.p.reachable(pair.session, [(pair.dst, SIZE * 2)], connection, [larger])
    assert "maps 65536 bytes, D claims 131072" in refused
    short = await pair.p.reachable(
        pair.session, [(pair.dst, SIZE)], connection, [msgspec.structs.replace(real, size=8)]
    )
    assert "lies in no allocation" in short
    pair.driver.fail_opens = 1
    refused = await pair.p.reachable(pair.session, pair.regions, connection, [real])
    assert refused.startswith(f"D's GPU memory ({pair.driver.uuid}) does not open here: cuIpcOpenMemHandle failed")
    assert not pair.p.admits(pair.session) and pair.driver.mappings == 0


async def test_a_driver_call_that_raises_the_unexpected_leaves_nothing_mapped(
    pair: Pair, connection: Via, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(addr: int) -> tuple[int, int]:
        raise OSError("a binding's surprise")

    monkeypatch.setattr(pair.driver, "allocation", broken)
    refused = await pair.p.reachable(pair.session, pair.regions, connection, pair.d.exported())
    assert refused.endswith("does not open here: OSError: a binding's surprise")
    assert not pair.p.admits(pair.session) and pair.driver.mappings == 0


async def test_a_claimed_process_without_the_connection_is_not_admitted(pair: Pair) -> None:
    refused = await pair.p.reachable(pair.session, pair.regions, None, pair.d.exported())
    assert refused == "no control connection to check the claimed process against"
    assert pair.driver.mappings == 0


async def test_memory_cuda_ipc_cannot_export_offers_no_plane(driver: FakeCudaDriver) -> None:
    plane = CudaIpcTransport(driver)
    driver.fail_exports = 1
    plane.register([(driver.alloc(SIZE), SIZE)])
    assert plane.local_session_id == "" and plane.exported() == []
    assert "CUDA IPC cannot export this worker's KV memory: cuIpcGetMemHandle failed" in plane.unexportable
    routed = RoutedTransport(LoopbackTransport(), plane)
    assert routed.local_session_id == "" and exported_handles(routed) == []
    await routed.close()


async def test_a_failed_copy_or_event_fails_the_write_with_nothing_left_moving(pair: Pair, connection: Via) -> None:
    await pair.admit(connection)
    pair.driver.fail_copies = 1
    failed = await pair.p.write(pair.session, [(pair.src, pair.dst, 64)])
    assert isinstance(failed, WriteFailed) and "illegal memory access" in failed.message
    assert failed.drained is not None and failed.drained.done()
    pair.driver.fail_events = 1
    broken_event = await pair.p.write(pair.session, [(pair.src, pair.dst, 64)])
    assert isinstance(broken_event, WriteFailed) and "cuEventQuery failed" in broken_event.message
    assert await pair.p.write(pair.session, [(pair.src, pair.dst, 64)]) == 64  # the plane still works
    stats = pair.p.statistics()
    assert (stats.failures, stats.writes_completed, stats.writes_in_flight) == (2, 1, 0)


def watch_of_an_exited_process() -> samehost.ProcessWatch:
    """A real process's watch (a pidfd polled), taken while it ran and read after it exited."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    watch = samehost.ProcessWatch(
        SameHostAddress(own_address().host, os.getuid(), child.pid, samehost.start_time(child.pid))
    )
    child.wait()
    return watch


async def test_a_dead_peer_fails_the_next_write_at_once(
    pair: Pair,
    connection: Via,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await pair.admit(connection)
    pair.p._peers[pair.session].watch = watch_of_an_exited_process()  # the peer's process exits
    monkeypatch.setattr(samehost, "start_time", lambda pid: -1)  # and `peer_gone`'s /proc read says the same
    failed = await pair.p.write(pair.session, [(pair.src, pair.dst, 64)])
    assert isinstance(failed, WriteFailed) and "is gone" in failed.message
    assert failed.code == cuda_ipc.ERR_GONE and pair.driver.calls == []
    assert await pair.p.peer_gone(pair.session)


async def test_a_removed_peer_s_mapping_closes_after_its_last_write(pair: Pair, connection: Via) -> None:
    await pair.admit(connection)
    pair.driver.lag = 50
    write = asyncio.ensure_future(pair.p.write(pair.session, [(pair.src, pair.dst, 64)]))
    await asyncio.sleep(0)
    pair.p.remove_peer(pair.session)
    assert not pair.p.admits(pair.session) and pair.driver.mappings == 1  # the copy may still run
    assert await write == 64
    assert pair.driver.mappings == 0


async def test_a_cancelled_write_returns_only_once_its_copies_finished(pair: Pair, connection: Via) -> None:
    await pair.admit(connection)
    pair.driver.lag = 30
    write = asyncio.ensure_future(pair.p.write(pair.session, [(pair.src, pair.dst, 64)]))
    await asyncio.sleep(0)
    write.cancel()
    with pytest.raises(asyncio.CancelledError):
        await write
    assert pair.driver.events[-1].queries > 30 and pair.p.statistics().writes_in_flight == 0


async def test_close_is_idempotent_unmaps_and_refuses_later_writes(pair: Pair, connection: Via) -> None:
    await pair.admit(connection)
    await pair.p.write(pair.session, [(pair.src, pair.dst, 64)])
    await asyncio.gather(pair.p.close(), pair.p.close())
    assert pair.driver.mappings == 0
    with pytest.raises(TransportClosed):
        await pair.p.write(pair.session, [(pair.src, pair.dst, 64)])


def test_without_a_cuda_driver_the_worker_keeps_mooncake_alone(caplog: pytest.LogCaptureFixture) -> None:
    try:
        LibCuda()
    except CudaError as exc:
        assert "libcuda" in str(exc) or "cuInit" in str(exc)
    else:
        pytest.skip("a CUDA driver is present here")
    primary = LoopbackTransport()
    with caplog.at_level(logging.WARNING):
        assert with_same_host(primary, "cuda") is primary
    assert "no GPU plane" in caplog.text
    assert with_same_host(primary, "cuda", "mooncake") is primary


# -- two services in this process, over the plane --------------------------------------------------------------

LAYERS, HEADS, HEAD, BLOCK, BLOCKS = 2, 2, 8, 4, 16


def gpu_side(
    engine_id: str, driver: FakeCudaDriver, seed: int, staging: bool = False
) -> tuple[KVTransferService, np.ndarray]:
    m = msgspec.structs.replace(
        meta("", engine_id), end_layer=LAYERS, num_kv_heads=HEADS, head_size=HEAD, block_size=BLOCK,
        num_blocks=BLOCKS, base_addrs=[0] * LAYERS, incarnation=f"{engine_id}-1",
    )  # fmt: skip
    per_layer = layer_bytes(m)
    base = driver.alloc(LAYERS * per_layer)
    pool = view(base, LAYERS * per_layer)
    pool[:] = np.random.default_rng(seed).integers(0, 255, size=pool.size, dtype=np.uint8)
    m = msgspec.structs.replace(m, base_addrs=[base + i * per_layer for i in range(LAYERS)])
    transport = RoutedTransport(LoopbackTransport(), CudaIpcTransport(driver))
    transport.register([(base, LAYERS * per_layer)])
    config = ServiceConfig(hold_timeout_s=5, recv_timeout_s=5, handshake_timeout_s=2)
    area = None
    if staging:  # a region D can lend windows of (`StagingRule` writes one block direct all the same)
        copies, nbytes = MemmoveCopies(), 1 << 16
        addr = driver.alloc(nbytes)
        transport.register([(addr, nbytes)])
        area = StagingArea(addr, nbytes, copies, scatter=copies.scatter)
    return KVTransferService(m, transport, config, staging=area), pool


@pytest.mark.parametrize("opens", [True, False], ids=["gpu-plane", "open-refused"])
async def test_two_services_exchange_handles_in_the_hello_and_write_over_the_gpu_plane(
    driver: FakeCudaDriver, opens: bool, caplog: pytest.LogCaptureFixture
) -> None:
    (p, p_pool), (d, d_pool) = gpu_side("prefill", driver, 1), gpu_side("decode", driver, 2, staging=True)
    p_meta = await p.start()
    d_meta = await d.start()
    assert d_meta.samehost_addr.startswith("cudaipc:") and d_meta.samehost_addr.endswith(driver.uuid)
    bootstrap = BootstrapServer({(0, 0): p_meta})
    url = await bootstrap.start()
    driver.fail_opens = 0 if opens else 1
    try:
        with caplog.at_level(logging.INFO, logger="kvsvc.service.sending"):
            p.start_send("p-req", "t1", [3], BLOCK, secret=harness_secret("t1"))
            d.start_recv("d-req", "t1", "prefill", url, [9], BLOCK, secret=harness_secret("t1"))
            for _ in range(500):
                if "d-req" in (d.get_finished().finished_recving or set()):
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the transfer never finished on D")
        per_block = d_pool.size // LAYERS // BLOCKS
        for layer in range(LAYERS):
            at = layer * (d_pool.size // LAYERS)
            assert d_pool[at + 9 * per_block : at + 10 * per_block].tobytes() == (
                p_pool[at + 3 * per_block : at + 4 * per_block].tobytes()
            )
        (row,) = [r for r in p.peers() if r["direction"] == "from_d"]
        # D stages by the plane P said it chose, not by its own guess (which says cuda_ipc either way).
        assert d._receiving._windows is not None
        assert d._receiving._windows._planes == {("prefill", (0, 0)): row["transport"]}
        gpu = p._ctx.transport.local  # type: ignore[attr-defined]
        if opens:
            assert row["transport"] == "cuda_ipc" and gpu.statistics().bytes_written > 0
            assert "go over the GPU plane: same host, same user, KV on GPUs" in caplog.text
        else:
            assert row["transport"] == "mooncake" and gpu.statistics().bytes_written == 0
            assert "the GPU plane is refused: D's GPU memory" in caplog.text
    finally:
        await p.close()
        await d.close()
        await bootstrap.close()


def test_own_address_is_what_the_gpu_plane_offers(driver: FakeCudaDriver) -> None:
    plane = CudaIpcTransport(driver)
    plane.register([(driver.alloc(4096), 4096)])
    me = own_address()
    assert SameHostAddress.parse(plane.local_session_id) == SameHostAddress(
        me.host, me.uid, me.pid, me.start, driver.uuid
    )


class _StubLib:
    """The two copy calls of libcuda, recording what `LibCuda` hands them."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[int, int, int]]] = []
        self.singles: list[tuple[int, int, int]] = []
        self.stream = 0

    def cuMemcpyBatchAsync_v2(self, dsts, srcs, sizes, count, attrs, idxs, nattrs, stream) -> int:  # type: ignore[no-untyped-def]
        n = count.value
        self.batches.append([(srcs[i], dsts[i], sizes[i]) for i in range(n)])
        self.stream = stream.value
        return 0

    def cuMemcpyDtoDAsync_v2(self, dst: int, src: int, length: int, stream: object) -> int:
        self.singles.append((src, dst, length))
        return 0


@pytest.mark.parametrize("batched", [True, False])
def test_the_driver_is_handed_every_piece_in_one_batch_or_one_call_each(batched: bool) -> None:
    import threading

    lib = _StubLib()
    driver = LibCuda.__new__(LibCuda)  # no libcuda here: the marshalling alone, against a stub
    driver._lib, driver._device, driver._batch, driver._context = lib, 0, batched, 1  # type: ignore[assignment]
    driver._bound = threading.local()
    driver._bound.context = 1
    pieces = [(1 << 40, 2 << 40, 4096), ((1 << 40) + 4096, 3 << 40, 8192), (5, 6, 7), (8, 9, 10), (11, 12, 13)]
    driver.copy(77, np.array(pieces, dtype=np.int64))
    if batched:
        assert lib.batches == [pieces] and lib.stream == 77 and lib.singles == []
    else:
        assert lib.singles == pieces and lib.batches == []


async def test_a_table_of_many_pieces_is_checked_whole_and_lands(pair: Pair, connection: Via) -> None:
    await pair.admit(connection)
    n = 4 * ROWS_CHECKED_ONE_BY_ONE  # past the row by row check: the array one
    table = np.stack([pair.src + 64 * np.arange(n), pair.dst + 128 * np.arange(n), np.full(n, 64)], axis=1)
    assert await pair.p.write(pair.session, table.astype(np.int64)) == 64 * n
    for i in (0, n // 2, n - 1):
        assert view(pair.dst + 128 * i, 64).tobytes() == view(pair.src + 64 * i, 64).tobytes()
    table[n // 2, 1] = pair.dst + SIZE - 8  # one row past D's region: refused whole, naming it
    with pytest.raises(InvalidDescriptor, match=f"descriptor {n // 2} to .*outside the peer's regions"):
        await pair.p.write(pair.session, table.astype(np.int64))
    assert pair.p.statistics().refused == 1
