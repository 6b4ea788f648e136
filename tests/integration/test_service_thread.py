"""The thread-safe facade: synchronous code drives two services on their own uvloop threads over real Mooncake."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from kvsvc.core.auth import harness_secret
from kvsvc.core.errors import ServiceClosed
from kvsvc.core.layout import layer_bytes
from kvsvc.core.messages import WorkerMetadata
from kvsvc.core.outputs import KVConnectorOutput
from kvsvc.engine.bootstrap import BootstrapServer
from kvsvc.service import ServiceThread, new_incarnation
from kvsvc.transport.mooncake import MooncakeTransport

pytestmark = pytest.mark.integration
LAYERS, BLOCKS, BLOCK = 2, 16, 4


def worker(engine_id: str) -> tuple[np.ndarray, ServiceThread]:
    meta = WorkerMetadata(
        engine_id=engine_id, incarnation=new_incarnation(), pp_rank=0, pp_size=1, tp_rank=0, tp_size=1,
        start_layer=0, end_layer=LAYERS, num_kv_heads=2, head_size=8, dtype="float16", block_size=BLOCK,
        num_blocks=BLOCKS, layout="HND", is_mla=False, base_addrs=[0] * LAYERS,
    )  # fmt: skip
    size = layer_bytes(meta)
    pool = np.zeros(LAYERS * size, dtype=np.uint8)
    meta = msgspec.structs.replace(meta, base_addrs=[pool.ctypes.data + i * size for i in range(LAYERS)])

    def transport() -> MooncakeTransport:
        t = MooncakeTransport()
        t.register([(pool.ctypes.data, pool.nbytes)])
        return t

    return pool, ServiceThread(meta, transport)


class Bootstrap:
    """The handshake endpoint on a loop thread of its own, as an engine core would run it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = BootstrapServer()

    def serve(self, metas: dict[tuple[int, int], WorkerMetadata]) -> str:
        async def go() -> str:
            self.server = BootstrapServer(metas)
            return await self.server.start()

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def engines() -> Iterator[tuple[np.ndarray, ServiceThread, np.ndarray, ServiceThread, str]]:
    p_pool, p = worker("thread-p")
    d_pool, d = worker("thread-d")
    bootstrap = Bootstrap()
    try:
        p_meta = p.start()
        d.start()
        url = bootstrap.serve({(0, 0): p_meta})
        yield p_pool, p, d_pool, d, url
    finally:
        d.close()
        p.close()
        bootstrap.close()


def wait(service: ServiceThread, field: str, req_id: str, deadline_s: float = 20.0) -> KVConnectorOutput:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        out = service.get_finished()
        if req_id in (getattr(out, field) or set()):
            return out
        time.sleep(0.01)
    raise AssertionError(f"{req_id} not in {field} within {deadline_s} s")


def test_synchronous_code_moves_a_request_whose_kv_becomes_ready_later(
    engines: tuple[np.ndarray, ServiceThread, np.ndarray, ServiceThread, str],
) -> None:
    p_pool, p, d_pool, d, url = engines
    p_pool[:] = np.random.default_rng(1).integers(1, 255, p_pool.size, dtype=np.uint8)
    ready: concurrent.futures.Future[None] = concurrent.futures.Future()
    p.start_send("p1", "t1", [0, 1], 2 * BLOCK, ready, secret=harness_secret("t1"))  # the compute is still "running"
    d.start_recv("d1", "t1", "thread-p", url, [5, 9], 2 * BLOCK, secret=harness_secret("t1"))
    time.sleep(0.2)
    assert not d.get_finished().finished_recving  # nothing may move before the KV is ready
    ready.set_result(None)
    wait(d, "finished_recving", "d1")
    wait(p, "finished_sending", "p1")
    per_layer, per_block = p_pool.size // LAYERS, p_pool.size // LAYERS // BLOCKS
    for layer in range(LAYERS):
        for src, dst in ((0, 5), (1, 9)):
            a = layer * per_layer + src * per_block
            b = layer * per_layer + dst * per_block
            assert np.array_equal(p_pool[a : a + per_block], d_pool[b : b + per_block])
    assert p.statistics().holds == 0 and d.statistics().holds == 0


def test_errors_cross_the_thread_boundary_unchanged(
    engines: tuple[np.ndarray, ServiceThread, np.ndarray, ServiceThread, str],
) -> None:
    _, p, _, _, _ = engines
    with pytest.raises(ValueError, match="outside the pool of 16 blocks"):
        p.start_send("p1", "t1", [99], 1, secret=harness_secret("t1"))
    p.close()
    with pytest.raises(ServiceClosed):
        p.start_send("p2", "t2", [0], 1, secret=harness_secret("t2"))
