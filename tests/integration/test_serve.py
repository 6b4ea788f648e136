"""`kvsvc serve`'s engine (the same `ServedEngine.start` the command runs): one port serves the handshake metadata and
the admin endpoints over a view of the worker processes; POSTs need the bearer token.

One small engine (pp1 × tp2) for the module; polls nothing, asserts no durations.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from kvsvc.core.messages import METADATA_PATH, decode_engine_metadata
from workers.commands.serve import ServedEngine, ServeOptions

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TOKEN = "test-token-0123456789"


@pytest.fixture(scope="module")
def engine() -> Iterator[ServedEngine]:
    options = ServeOptions(
        role="prefill", engine_id="serve-p", tp=2, layers=2, kv_heads=2, head_size=16, num_blocks=16, token=TOKEN
    )
    served = ServedEngine.start(options)
    try:
        yield served
    finally:
        served.close()
        assert not any(served.executor.alive())


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_one_port_serves_the_handshake_metadata_of_every_worker(
    engine: ServedEngine, http: aiohttp.ClientSession
) -> None:
    async with http.get(engine.url + METADATA_PATH) as response:
        assert response.status == 200
        metas = decode_engine_metadata(await response.read())
    assert sorted(metas) == [(0, 0), (0, 1)]
    assert {m.incarnation for m in metas.values()} == {engine.executor.incarnation}


async def test_readyz_is_200_once_the_engine_serves(engine: ServedEngine, http: aiohttp.ClientSession) -> None:
    async with http.get(engine.url + "/readyz") as response:
        assert response.status == 200
        assert (await response.json())["ready"] is True


async def test_metrics_export_per_worker_counters_from_the_worker_processes(
    engine: ServedEngine, http: aiohttp.ClientSession
) -> None:
    async with http.get(engine.url + "/metrics") as response:
        assert response.status == 200
        body = await response.text()
    assert 'kvsvc_engine_info{engine_id="serve-p"' in body
    assert "kvsvc_ready 1.0" in body
    assert "kvsvc_workers 2.0" in body
    assert 'kvsvc_sent_bytes_total{pp_rank="0",tp_rank="1"}' in body


async def test_peers_statistics_and_transfers_answer_per_worker(
    engine: ServedEngine, http: aiohttp.ClientSession
) -> None:
    async with http.get(engine.url + "/v1/peers") as response:
        assert response.status == 200
        assert (await response.json()) == {"peers": []}  # nobody connected yet
    async with http.get(engine.url + "/v1/statistics") as response:
        workers = (await response.json())["workers"]
    assert [(w["pp_rank"], w["tp_rank"]) for w in workers] == [(0, 0), (0, 1)]
    assert all(w["holds"] == 0 for w in workers)
    async with http.get(engine.url + "/v1/transfers") as response:
        assert (await response.json()) == {"transfers": []}


@pytest.mark.parametrize("path", ["/v1/drain", "/v1/peers/some-engine/forget"])
async def test_posts_without_the_token_are_refused(
    engine: ServedEngine, http: aiohttp.ClientSession, path: str
) -> None:
    async with http.post(engine.url + path) as response:
        assert response.status == 401
    async with http.post(engine.url + path, headers={"Authorization": "Bearer wrong"}) as response:
        assert response.status == 401


async def test_forget_and_drain_with_the_token_reach_every_worker(
    engine: ServedEngine, http: aiohttp.ClientSession
) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with http.post(engine.url + "/v1/peers/some-engine/forget", headers=auth) as response:
        assert response.status == 200
        assert (await response.json()) == {"forgotten": "some-engine"}
    async with http.post(engine.url + "/v1/drain", headers=auth) as response:
        assert response.status == 200
        assert (await response.json()) == {"drained": True}
    assert engine.view.draining
