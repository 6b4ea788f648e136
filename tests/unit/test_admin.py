"""Specification of kvsvc.engine.admin: the admin endpoints of one engine over a fake `EngineView`
(docs/operations.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import inspect
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from kvsvc.core.histogram import LatencyHistogram
from kvsvc.core.messages import METADATA_PATH, WorkerMetadata, decode_engine_metadata
from kvsvc.engine.admin import AdminServer, EngineView, build_admin_app, random_token, remote_stages
from kvsvc.engine.bootstrap import publish_metadata

TOKEN = "s3cret-token"


def meta(pp: int, tp: int, *, pp_size: int = 1, tp_size: int = 2) -> WorkerMetadata:
    return WorkerMetadata(
        engine_id="prefill-0",
        incarnation="inc1",
        pp_rank=pp,
        pp_size=pp_size,
        tp_rank=tp,
        tp_size=tp_size,
        start_layer=0,
        end_layer=4,
        num_kv_heads=8,
        head_size=128,
        dtype="bfloat16",
        block_size=16,
        num_blocks=64,
        layout="HND",
        is_mla=False,
        base_addrs=[0x1000 * (i + 1) for i in range(4)],
        transport_addr=f"127.0.0.1:{17000 + tp}",
        control_addr=f"127.0.0.1:{18000 + tp}",
    )


def stats(bytes_sent: int, expired: int = 0, write_seconds: tuple[float, ...] = ()) -> dict[str, object]:
    writes = LatencyHistogram()
    for seconds in write_seconds:
        writes.observe(seconds)
    return {
        "sender": {
            "holds": 3,
            "early_requests": 0,
            "jobs_by_state": {"writing": 2},
            "finished_pending_report": 0,
            "expired_holds": expired,
            "aborted_holds": 1,
            "refused_secrets": 7,
        },
        "receiver": {
            "receives": 4,
            "waiting_for_handshake": 1,
            "jobs_by_state": {"requested": 4},
            "finished": 10,
            "failed": 2,
            "expired": 1,
        },
        "inbound_peers": 1,
        "outbound_peers": 2,
        "remote_engines": 1,
        "writes_in_flight": 2,
        "bytes_sent": bytes_sent,
        "descriptors_sent": 12,
        "transfers_sent": 6,
        "write_failures": 0,
        "protocol_errors": 1,
        "transport": {},
        "send_durations": dataclasses.asdict(writes.statistics()),
        "recv_durations": dataclasses.asdict(LatencyHistogram().statistics()),
    }


@dataclass
class FakeView:
    engine_id: str = "prefill-0"
    incarnation: str = "inc1"
    role: str = "P"
    ready: bool = False
    metas: dict[tuple[int, int], WorkerMetadata] = field(default_factory=dict)
    drained: int = 0
    forgotten: list[str] = field(default_factory=list)

    def workers(self) -> Mapping[tuple[int, int], WorkerMetadata]:
        return self.metas

    def is_ready(self) -> bool:
        return self.ready

    async def statistics(self) -> Mapping[tuple[int, int], Mapping[str, object]]:
        return {(0, 0): stats(4096, expired=5, write_seconds=(0.02,)), (0, 1): stats(8192)}

    async def peers(self) -> Sequence[Mapping[str, object]]:
        return [
            {
                "pp_rank": 0,
                "tp_rank": tp,
                "direction": "to_p",
                "peer": f"decode[x][pp1,tp{tp}]",
                "incarnation": "dinc",
                "state": "connected" if tp == 0 else "failed",
                "describe": "tp_ratio=1 remote_pp=1",
                "last_error": "" if tp == 0 else "refused",
            }
            for tp in (0, 1)
        ]

    async def transfers(self) -> Sequence[Mapping[str, object]]:
        return [{"pp_rank": 0, "tp_rank": 0, "req_id": "r1", "transfer_id": "t1", "state": "held"}]

    async def drain(self) -> None:
        self.drained += 1

    async def forget_peer(self, engine_id: str) -> None:
        if engine_id == "missing":
            raise LookupError("no engine 'missing'")
        self.forgotten.append(engine_id)


@pytest.fixture
def view() -> FakeView:
    return FakeView(metas={(0, 0): meta(0, 0), (0, 1): meta(0, 1)})


async def _client(app: web.Application) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    async with TestClient(TestServer(app)) as client:
        yield client


@pytest.fixture
async def client(view: FakeView) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    async for c in _client(build_admin_app(view, token=TOKEN, max_body_bytes=1024)):
        yield c


@pytest.fixture
async def tokenless(view: FakeView) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    async for c in _client(build_admin_app(view, token=None)):
        yield c


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_fake_view_satisfies_the_protocol(view: FakeView) -> None:
    checked: EngineView = view  # mypy checks the structural match
    assert checked.engine_id == "prefill-0"


async def test_healthz_is_200_while_serving(client: TestClient[web.Request, web.Application]) -> None:
    response = await client.get("/healthz")
    assert response.status == 200
    assert (await response.json())["incarnation"] == "inc1"


async def test_readyz_flips_once_the_engine_is_ready_and_metadata_is_published(
    client: TestClient[web.Request, web.Application], view: FakeView
) -> None:
    response = await client.get("/readyz")
    assert response.status == 503
    body = await response.json()
    assert body["ready"] is False and len(body["reasons"]) == 2
    view.ready = True
    response = await client.get("/readyz")
    assert response.status == 503
    assert "not published" in (await response.json())["reasons"][0]
    publish_metadata(client.app, view.metas)
    response = await client.get("/readyz")
    assert response.status == 200
    assert await response.json() == {"ready": True, "reasons": []}
    view.ready = False
    assert (await client.get("/readyz")).status == 503


async def test_handshake_endpoint_shares_the_app(
    client: TestClient[web.Request, web.Application], view: FakeView
) -> None:
    assert (await client.get(METADATA_PATH)).status == 503
    publish_metadata(client.app, view.metas)
    response = await client.get(METADATA_PATH)
    assert decode_engine_metadata(await response.read()) == view.metas


async def test_the_endpoint_answers_mooncake_connectors_query_with_the_engine_id_under_its_rank(
    client: TestClient[web.Request, web.Application], view: FakeView
) -> None:
    assert (await client.get("/query")).status == 503  # nothing published: no engine to name
    publish_metadata(client.app, view.metas, dp_rank=1)
    response = await client.get("/query")
    (engine_id,) = {meta.engine_id for meta in view.metas.values()}
    assert response.content_type == "application/json"
    assert await response.json() == {"1": {"engine_id": engine_id}}  # as llm-d's mooncake mode parses it


async def test_topology_lists_workers_and_remote_stages_with_describe(
    client: TestClient[web.Request, web.Application],
) -> None:
    public = await (await client.get("/v1/topology")).json()
    assert [remote["engine_id"] for remote in public["remotes"]] == [""]  # no peer identity without the token
    assert "dinc" not in json.dumps(public) and "decode[x]" not in json.dumps(public)
    body = await (await client.get("/v1/topology", headers=AUTH)).json()
    assert (body["engine_id"], body["role"], body["pp_size"], body["tp_size"]) == ("prefill-0", "P", 1, 2)
    assert [(w["pp_rank"], w["tp_rank"], w["end_layer"]) for w in body["workers"]] == [(0, 0, 4), (0, 1, 4)]
    [remote] = body["remotes"]
    assert (remote["engine_id"], remote["pp_rank"], remote["direction"]) == ("decode[x]", 1, "to_p")
    assert "tp_ratio=1" in remote["describe"] and "remote_pp=1" in remote["describe"]
    assert remote["incarnations"] == ["dinc"]
    assert [(c["local"], c["remote_tp_rank"], c["state"]) for c in remote["connections"]] == [
        ([0, 0], 0, "connected"),
        ([0, 1], 1, "failed"),
    ]


def test_remote_stages_prefer_explicit_peer_fields_and_survive_odd_names() -> None:
    rows: list[Mapping[str, object]] = [
        {"peer": "whatever", "peer_engine_id": "e", "peer_pp_rank": 2, "peer_tp_rank": 3, "direction": "from_d"},
        {"peer": "no-brackets", "direction": "to_p"},
    ]
    groups = remote_stages(rows)
    assert [(g["engine_id"], g["pp_rank"]) for g in groups] == [("e", 2), ("no-brackets", None)]


async def test_peers_transfers_and_statistics_are_json(client: TestClient[web.Request, web.Application]) -> None:
    peers = (await (await client.get("/v1/peers", headers=AUTH)).json())["peers"]
    assert [(p["state"], p["last_error"]) for p in peers] == [("connected", ""), ("failed", "refused")]
    transfers = (await (await client.get("/v1/transfers", headers=AUTH)).json())["transfers"]
    assert transfers == [{"pp_rank": 0, "tp_rank": 0, "req_id": "r1", "transfer_id": "t1", "state": "held"}]
    workers = (await (await client.get("/v1/statistics")).json())["workers"]
    assert [(w["pp_rank"], w["tp_rank"], w["bytes_sent"]) for w in workers] == [(0, 0, 4096), (0, 1, 8192)]


async def test_public_gets_show_no_peer_identity_nor_the_wrong_secret_oracle(
    client: TestClient[web.Request, web.Application],
) -> None:
    """A squatter needs a peer's engine id and incarnation; a prober reads `refused_secrets` to tell held ids."""
    public = {path: await (await client.get(path)).text() for path in ("/v1/peers", "/v1/statistics", "/metrics")}
    for text in public.values():
        samples = [line for line in text.splitlines() if not line.startswith("#")]  # HELP lines name every family
        assert not [line for line in samples if "decode[x]" in line or "dinc" in line or "refused_secrets" in line]
    peers = json.loads(public["/v1/peers"])["peers"]
    assert [(p["direction"], p["pp_rank"], p["tp_rank"], p["state"]) for p in peers] == [
        ("to_p", 0, 0, "connected"),
        ("to_p", 0, 1, "failed"),
    ]
    private = {path: await (await client.get(path, headers=AUTH)).text() for path in public}
    assert all("decode[x]" in text for path, text in private.items() if path != "/v1/statistics")
    assert "refused_secrets" in private["/v1/statistics"] and "kvsvc_refused_secrets" in private["/metrics"]


async def test_metrics_parse_and_show_the_view_values(client: TestClient[web.Request, web.Application]) -> None:
    response = await client.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(await response.text())}
    sent = {(s.labels["pp_rank"], s.labels["tp_rank"]): s.value for s in families["kvsvc_sent_bytes"].samples}
    assert sent == {("0", "0"): 4096.0, ("0", "1"): 8192.0}
    expired = {s.labels["tp_rank"]: s.value for s in families["kvsvc_expired_holds"].samples}
    assert expired == {"0": 5.0, "1": 0.0}
    assert [s.value for s in families["kvsvc_ready"].samples] == [0.0]
    latency = {
        (s.labels["tp_rank"], s.name): s.value
        for s in families["kvsvc_transfer_duration_seconds"].samples
        if s.labels["role"] == "P"
    }
    assert latency[("0", "kvsvc_transfer_duration_seconds_count")] == 1.0  # one 20 ms write on worker (0, 0)
    assert latency[("1", "kvsvc_transfer_duration_seconds_count")] == 0.0
    handshakes = {(s.labels["tp_rank"], s.labels["state"]): s.value for s in families["kvsvc_handshakes"].samples}
    assert handshakes == {("0", "connected"): 1.0, ("1", "failed"): 1.0}


async def test_post_without_token_is_401(client: TestClient[web.Request, web.Application], view: FakeView) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        response = await client.post("/v1/drain", headers=headers)
        assert response.status == 401
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    response = await client.post("/v1/drain", headers={"Authorization": "Bearer tökén"})
    assert response.status == 401
    assert view.drained == 0


async def test_token_is_compared_in_constant_time(
    client: TestClient[web.Request, web.Application], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)  # admin looks it up on the module at each call
    assert (await client.post("/v1/drain", headers={"Authorization": "Bearer nope"})).status == 401
    assert (await client.post("/v1/drain", headers=AUTH)).status == 200
    assert calls == [(b"nope", TOKEN.encode()), (TOKEN.encode(), TOKEN.encode())]


async def test_post_with_token_drains_and_forgets(
    client: TestClient[web.Request, web.Application], view: FakeView
) -> None:
    response = await client.post("/v1/drain", headers=AUTH)
    assert (response.status, await response.json()) == (200, {"drained": True})
    assert view.drained == 1
    response = await client.post("/v1/peers/decode-7/forget", headers=AUTH)
    assert (response.status, await response.json()) == (200, {"forgotten": "decode-7"})
    assert view.forgotten == ["decode-7"]


async def test_forget_of_an_engine_the_view_rejects_is_404(client: TestClient[web.Request, web.Application]) -> None:
    response = await client.post("/v1/peers/missing/forget", headers=AUTH)
    assert response.status == 404
    assert "missing" in (await response.json())["error"]


async def test_without_a_configured_token_posts_are_403(
    tokenless: TestClient[web.Request, web.Application], view: FakeView
) -> None:
    for headers in ({}, {"Authorization": "Bearer anything"}):
        response = await tokenless.post("/v1/drain", headers=headers)
        assert response.status == 403
        assert "kvsvc serve --token-file" in (await response.json())["error"]  # what a CLI user does about it
    assert (await tokenless.get("/healthz")).status == 200
    assert view.drained == 0


async def test_body_over_the_limit_is_413(client: TestClient[web.Request, web.Application], view: FakeView) -> None:
    response = await client.post("/v1/drain", headers=AUTH, data=b"x" * 2048)
    assert response.status == 413

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b"y" * 512

    response = await client.post("/v1/drain", headers=AUTH, data=chunks())
    assert response.status == 413
    assert view.drained == 0
    assert (await client.post("/v1/drain", headers=AUTH, data=b"{}")).status == 200


def test_empty_token_and_bad_limits_are_refused(view: FakeView) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        build_admin_app(view, token="")
    with pytest.raises(ValueError, match="max_body_bytes"):
        build_admin_app(view, token=None, max_body_bytes=0)


def test_random_tokens_are_long_and_distinct() -> None:
    tokens = {random_token() for _ in range(32)}
    assert len(tokens) == 32 and all(len(t) >= 43 for t in tokens)


def test_admin_server_binds_loopback_by_default() -> None:
    assert inspect.signature(AdminServer.__init__).parameters["host"].default == "127.0.0.1"


async def test_admin_server_serves_on_loopback_and_closes(view: FakeView) -> None:
    server = AdminServer(view, token=None)
    url = await server.start()
    try:
        assert url.startswith("http://127.0.0.1:") and server.url == url
        assert not url.endswith(":0")
        async with aiohttp.ClientSession() as session, session.get(url + "/healthz") as response:
            assert response.status == 200
        with pytest.raises(RuntimeError, match="already serving"):
            await server.start()
    finally:
        await server.close()
        await server.close()


async def test_view_refusals_map_to_409_and_view_crashes_to_json_500(
    client: TestClient[web.Request, web.Application], view: FakeView, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refuse() -> None:
        raise ValueError("already draining")

    async def crash() -> Sequence[Mapping[str, object]]:
        raise RuntimeError("worker 1 unreachable")

    monkeypatch.setattr(view, "drain", refuse)
    monkeypatch.setattr(view, "peers", crash)
    response = await client.post("/v1/drain", headers=AUTH)
    assert (response.status, await response.json()) == (409, {"error": "already draining"})
    response = await client.get("/v1/peers")
    assert (response.status, await response.json()) == (500, {"error": "RuntimeError: worker 1 unreachable"})


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
async def test_gets_without_the_token_show_no_transfer_id_and_no_remote_text(
    client: TestClient[web.Request, web.Application], headers: dict[str, str]
) -> None:
    transfers = (await (await client.get("/v1/transfers", headers=headers)).json())["transfers"]
    assert transfers == [{"pp_rank": 0, "tp_rank": 0, "state": "held"}]
    peers = (await (await client.get("/v1/peers", headers=headers)).json())["peers"]
    assert [p["state"] for p in peers] == ["connected", "failed"] and all("last_error" not in p for p in peers)
    topology = await (await client.get("/v1/topology", headers=headers)).text()
    assert '"refused"' not in topology and "last_error" not in topology
    for path in ("/v1/transfers", "/v1/peers", "/v1/topology", "/v1/statistics", "/metrics", "/healthz", "/readyz"):
        body = await (await client.get(path, headers=headers)).text()
        assert '"t1"' not in body and '"r1"' not in body and '"refused"' not in body, path


async def test_the_token_shows_the_remote_text_in_the_topology_too(
    client: TestClient[web.Request, web.Application],
) -> None:
    body = await (await client.get("/v1/topology", headers=AUTH)).json()
    [remote] = body["remotes"]
    assert [c["last_error"] for c in remote["connections"]] == ["", "refused"]


async def test_with_no_token_configured_no_get_shows_ids(
    tokenless: TestClient[web.Request, web.Application],
) -> None:
    response = await tokenless.get("/v1/transfers", headers=AUTH)
    assert (await response.json())["transfers"] == [{"pp_rank": 0, "tp_rank": 0, "state": "held"}]


async def test_an_authorization_header_of_bytes_that_are_not_utf8_is_401_not_500(
    client: TestClient[web.Request, web.Application], view: FakeView
) -> None:
    # Raw bytes on the socket: aiohttp's client would encode the header as valid UTF-8.
    for method, path in (("GET", "/v1/transfers"), ("POST", "/v1/drain")):
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n".encode()
            + b"Authorization: Bearer \xff\xfe\xed\r\n\r\n"
        )
        await writer.drain()
        status = (await reader.readline()).split()[1]
        writer.close()
        await writer.wait_closed()
        assert status == (b"200" if method == "GET" else b"401")  # GET: the public view, as without a token
    assert view.drained == 0
