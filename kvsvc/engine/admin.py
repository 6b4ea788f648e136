"""The admin HTTP application of one engine: health, readiness, topology, peers, transfers, metrics, drain, forget.

Imports: aiohttp, msgspec, kvsvc.engine (bootstrap, metrics) and kvsvc.core.messages; never the service or workers: the
engine is reached only through the `EngineView` protocol. Invariants: it shares one `web.Application` with the
handshake endpoint; it binds loopback by default; every request that is not GET/HEAD/OPTIONS needs the bearer token
(compared in constant time) and is refused outright when none is configured; bodies over the limit get 413. A GET
without the token shows no transfer or request id (a transfer id names a hold to D workers) and no text a remote
sent (refusals, errors): only rows with the fields in `_PUBLIC_TRANSFER_FIELDS` / `_PUBLIC_PEER_FIELDS`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Final, Protocol

import msgspec
from aiohttp import web

from kvsvc.core.messages import Worker, WorkerMetadata
from kvsvc.engine.bootstrap import add_metadata_route, published_metadata, serve_app
from kvsvc.engine.http_bounds import BOUNDS_KEY, HttpBounds
from kvsvc.engine.metrics import EngineMetrics, MetricsSnapshot, PeerRow, StatsDict

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES: Final = 64 * 1024
METRICS_KEY: Final = web.AppKey("kvsvc_metrics", EngineMetrics)
_SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
# What a GET without the token shows of a row; a view's other fields (ids, remote text) need the token.
_PUBLIC_TRANSFER_FIELDS: Final = frozenset({"pp_rank", "tp_rank", "direction", "state", "age_s"})
# No identity of a peer (engine id, incarnation, its description): a squatter would need one to pose as that peer.
_PUBLIC_PEER_FIELDS: Final = frozenset(
    {"direction", "peer_pp_rank", "peer_tp_rank", "state", "expected_destinations", "transport", "pp_rank", "tp_rank"}
)
# Statistics only the token shows: P's count of wrong secrets rises for held ids alone, so beside a request of one's
# own it tells a held transfer id from one never held.
_PRIVATE_STATISTICS: Final = (("sender", "refused_secrets"),)
# WorkerRef.__str__ of kvsvc.core.messages: "engine[pp0,tp1]"; greedy so an engine id may itself hold brackets.
_PEER_RE: Final = re.compile(r"^(?P<engine>.*)\[pp(?P<pp>\d+),tp(?P<tp>\d+)\]$")
_json = msgspec.json.Encoder(enc_hook=str)


class EngineView(Protocol):
    """What the admin app needs of an engine; the standalone runtime (`workers/`) and embedders implement it.

    Every method runs on the admin app's event loop and must not block it. Per-worker data comes from each
    worker's `KVTransferService`; a view over workers in other processes gathers it over its own channel.

    - `engine_id`, `incarnation` (random per start), `role` ("P", "D" or "both"): constant for the view's life.
    - `workers()`: the engine's merged `{(pp_rank, tp_rank): WorkerMetadata}` as published for the handshake;
      empty before it is published.
    - `is_ready()`: True once every worker registered its KV pool and the merged metadata is published.
    - `statistics()`: `{(pp_rank, tp_rank): statistics_dict(service.statistics())}`, one entry per worker that
      answered (keys missing from a dict only drop their metrics).
    - `peers()`: the rows of every worker's `KVTransferService.peers()`, each with the local worker's `pp_rank`
      and `tp_rank` added (see `tag_worker`). Rows carry `direction` ("to_p" / "from_d"), `peer`
      (`engine[ppX,tpY]`), `incarnation`, `state`, and for "to_p" `describe` (holds `tp_ratio=` and
      `remote_pp=`) and `last_error`; `peer_engine_id`/`peer_pp_rank`/`peer_tp_rank` are used when present.
    - `transfers()`: one row per transfer in flight (held by P or awaited by D), with `pp_rank`, `tp_rank` and
      whatever else the view knows (`req_id`, `transfer_id`, `direction`, `state`, `age_s`); shown as given.
    - `drain()`: stop accepting new transfers and return once the in-flight ones ended (finished, failed or
      expired). `forget_peer(engine_id)`: every worker drops what it cached about that remote engine
      (`KVTransferService.forget_engine`); its receives fail; a no-op for an unknown engine. Either may raise
      `LookupError` (answered 404) or `ValueError` (answered 409) with a message for the operator.
    """

    @property
    def engine_id(self) -> str: ...

    @property
    def incarnation(self) -> str: ...

    @property
    def role(self) -> str: ...

    def workers(self) -> Mapping[Worker, WorkerMetadata]: ...

    def is_ready(self) -> bool: ...

    async def statistics(self) -> Mapping[Worker, StatsDict]: ...

    async def peers(self) -> Sequence[PeerRow]: ...

    async def transfers(self) -> Sequence[Mapping[str, object]]: ...

    async def drain(self) -> None: ...

    async def forget_peer(self, engine_id: str) -> None: ...


# A Protocol is no concrete class, so the key is typed by subscription rather than by a `t` argument.
VIEW_KEY: Final = web.AppKey[EngineView]("kvsvc_engine_view")
_TOKEN_KEY: Final = web.AppKey[str | None]("kvsvc_admin_token")


def random_token(nbytes: int = 32) -> str:
    """A fresh URL-safe bearer token (`nbytes` random bytes, default 256 bits). Raises nothing."""
    return secrets.token_urlsafe(nbytes)


def tag_worker(worker: Worker, rows: Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    """Copies of `rows` (e.g. one service's `peers()`) with the local worker's `pp_rank` and `tp_rank` added."""
    return [{**row, "pp_rank": worker[0], "tp_rank": worker[1]} for row in rows]


def engine_metrics(app: web.Application) -> EngineMetrics:
    """The `EngineMetrics` of an app built by `build_admin_app` (its `registry` takes an engine's own metrics).

    Raises:
        KeyError: `app` was not built by `build_admin_app`.
    """
    return app[METRICS_KEY]


def _json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(payload), status=status, content_type="application/json")


def _error(status: int, message: str, **headers: str) -> web.Response:
    response = _json_response({"error": message}, status)
    response.headers.update(headers)
    return response


def _bearer_matches(header: str, token: str) -> bool:
    scheme, _, presented = header.partition(" ")
    # Bytes, not str: compare_digest refuses non-ASCII str, and a header is attacker-controlled.
    # surrogatepass: a header of bytes that are not UTF-8 arrives as lone surrogates, and must simply not match.
    given = presented.strip().encode("utf-8", "surrogatepass")
    return scheme.lower() == "bearer" and hmac.compare_digest(given, token.encode())


def _authorized(request: web.Request) -> bool:
    """Whether `request` carries the admin token (never, when none is configured)."""
    token = request.app[_TOKEN_KEY]
    return token is not None and _bearer_matches(request.headers.get("Authorization", ""), token)


def _public(rows: Sequence[Mapping[str, object]], fields: frozenset[str]) -> list[dict[str, object]]:
    """`rows` as a caller without the token sees them: only `fields`."""
    return [{k: v for k, v in row.items() if k in fields} for row in rows]


def _guard(token: str | None, max_body_bytes: int) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def guard(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        length = request.content_length
        if length is not None and length > max_body_bytes:
            return _error(413, f"request body of {length} bytes exceeds the limit of {max_body_bytes} bytes")
        if request.method not in _SAFE_METHODS:
            if token is None:
                return _error(
                    403,
                    "state-changing admin endpoints are disabled: no admin token is configured on this engine;"
                    " start it with `kvsvc serve --token-file FILE` (or $KVSVC_ADMIN_TOKEN; an embedding passes"
                    " build_admin_app(token=...)) and send the token as 'Authorization: Bearer <token>'",
                )
            if not _bearer_matches(request.headers.get("Authorization", ""), token):
                return _error(401, "missing or wrong bearer token", **{"WWW-Authenticate": 'Bearer realm="kvsvc"'})
            # Read (and drop) the body so a chunked one without Content-Length still meets the limit, in time.
            bounds = request.app.get(BOUNDS_KEY) or HttpBounds()
            try:
                async with asyncio.timeout(bounds.body_timeout_s):
                    await request.read()
            except web.HTTPRequestEntityTooLarge:
                return _error(413, f"request body exceeds the limit of {max_body_bytes} bytes")
            except TimeoutError:
                return _error(408, f"request body not received within {bounds.body_timeout_s:g} s")
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception as exc:  # an operator gets a JSON reason; the log gets the trace
            log.exception("admin %s %s failed", request.method, request.path)
            return _error(500, f"{type(exc).__name__}: {exc}")

    return guard


def _readiness(request: web.Request) -> tuple[bool, list[str]]:
    view = request.app[VIEW_KEY]
    reasons = []
    if not view.is_ready():
        reasons.append("the engine is not ready: not every worker registered its KV pool and published metadata")
    if published_metadata(request.app) is None:
        reasons.append("the handshake metadata is not published on this endpoint yet")
    return not reasons, reasons


async def _healthz(request: web.Request) -> web.Response:
    view = request.app[VIEW_KEY]
    return _json_response({"status": "ok", "engine_id": view.engine_id, "incarnation": view.incarnation})


async def _readyz(request: web.Request) -> web.Response:
    ready, reasons = _readiness(request)
    return _json_response({"ready": ready, "reasons": reasons}, 200 if ready else 503)


def _peer_identity(row: PeerRow) -> tuple[str, int | None, int | None]:
    engine, pp, tp = row.get("peer_engine_id"), row.get("peer_pp_rank"), row.get("peer_tp_rank")
    if isinstance(pp, int) and (isinstance(engine, str) or "peer" not in row):  # a public row: ranks, no engine
        return engine if isinstance(engine, str) else "", pp, tp if isinstance(tp, int) else None
    match = _PEER_RE.match(str(row.get("peer", "")))
    if match is None:
        return str(row.get("peer", "")), None, None
    return match["engine"], int(match["pp"]), int(match["tp"])


def remote_stages(peers: Sequence[PeerRow]) -> list[dict[str, object]]:
    """Group peer rows by remote (engine, pp_rank, direction): the remote stages this engine talks to, with the
    first non-empty `describe()`, the incarnations seen and one entry per connection. Raises nothing."""
    groups: dict[tuple[str, int, str], dict[str, object]] = {}
    for row in peers:
        engine, pp, tp = _peer_identity(row)
        direction = str(row.get("direction", ""))
        key = (engine, -1 if pp is None else pp, direction)
        group = groups.setdefault(
            key,
            {
                "engine_id": engine,
                "pp_rank": pp,
                "direction": direction,
                "describe": "",
                "incarnations": [],
                "connections": [],
            },
        )
        incarnations = group["incarnations"]
        assert isinstance(incarnations, list)
        if (incarnation := str(row.get("incarnation", ""))) not in incarnations:
            incarnations.append(incarnation)
        if not group["describe"] and row.get("describe"):
            group["describe"] = str(row["describe"])
        connections = group["connections"]
        assert isinstance(connections, list)
        connection: dict[str, object] = {
            "local": [row.get("pp_rank"), row.get("tp_rank")],
            "remote_tp_rank": tp,
            "state": row.get("state", ""),
        }
        if "last_error" in row:  # absent from rows shown without the token
            connection["last_error"] = row["last_error"]
        connections.append(connection)
    return [groups[key] for key in sorted(groups)]


async def _topology(request: web.Request) -> web.Response:
    view = request.app[VIEW_KEY]
    workers = view.workers()
    first = next(iter(workers.values()), None)
    return _json_response(
        {
            "engine_id": view.engine_id,
            "incarnation": view.incarnation,
            "role": view.role,
            "ready": _readiness(request)[0],
            "pp_size": first.pp_size if first else None,
            "tp_size": first.tp_size if first else None,
            "workers": [
                {
                    "pp_rank": m.pp_rank,
                    "tp_rank": m.tp_rank,
                    "start_layer": m.start_layer,
                    "end_layer": m.end_layer,
                    "num_kv_heads": m.num_kv_heads,
                    "head_size": m.head_size,
                    "dtype": m.dtype,
                    "block_size": m.block_size,
                    "num_blocks": m.num_blocks,
                    "layout": m.layout,
                    "is_mla": m.is_mla,
                    "transport_addr": m.transport_addr,
                    "control_addr": m.control_addr,
                }
                for _, m in sorted(workers.items())
            ],
            "remotes": remote_stages(await _peer_rows(request)),
        }
    )


async def _peer_rows(request: web.Request) -> list[dict[str, object]]:
    """The view's peer rows, without remote text (`last_error`) unless the request carries the token."""
    rows = await request.app[VIEW_KEY].peers()
    return [dict(row) for row in rows] if _authorized(request) else _public(rows, _PUBLIC_PEER_FIELDS)


async def _peers(request: web.Request) -> web.Response:
    return _json_response({"peers": await _peer_rows(request)})


async def _transfers(request: web.Request) -> web.Response:
    rows = await request.app[VIEW_KEY].transfers()
    return _json_response({"transfers": list(rows) if _authorized(request) else _public(rows, _PUBLIC_TRANSFER_FIELDS)})


async def _worker_statistics(request: web.Request) -> Mapping[Worker, StatsDict]:
    """The view's statistics, without the oracles of `_PRIVATE_STATISTICS` unless the request carries the token."""
    stats = await request.app[VIEW_KEY].statistics()
    if _authorized(request):
        return stats
    return {worker: _without(s, _PRIVATE_STATISTICS) for worker, s in stats.items()}


def _without(stats: StatsDict, paths: Sequence[tuple[str, str]]) -> StatsDict:
    shown = dict(stats)
    for table, key in paths:
        if isinstance(inner := shown.get(table), Mapping):
            shown[table] = {k: v for k, v in inner.items() if k != key}
    return shown


async def _statistics(request: web.Request) -> web.Response:
    stats = await _worker_statistics(request)
    return _json_response({"workers": [{"pp_rank": pp, "tp_rank": tp, **s} for (pp, tp), s in sorted(stats.items())]})


async def _metrics(request: web.Request) -> web.Response:
    """Prometheus text; without the token as the GETs show it: no peer identities (series labelled by the peer's
    ranks) and no private statistics."""
    stats, peers = await asyncio.gather(_worker_statistics(request), _peer_rows(request))
    body = request.app[METRICS_KEY].render(MetricsSnapshot(stats, peers, _readiness(request)[0]))
    # CONTENT_TYPE_LATEST carries a charset parameter, which aiohttp's content_type argument refuses.
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _operator_call(call: Awaitable[None], done: dict[str, object]) -> web.Response:
    # Only the view's own refusals map to 4xx here; the same errors from handler bugs elsewhere stay 500s.
    try:
        await call
    except LookupError as exc:
        return _error(404, str(exc))
    except ValueError as exc:
        return _error(409, str(exc))
    return _json_response(done)


async def _drain(request: web.Request) -> web.Response:
    return await _operator_call(request.app[VIEW_KEY].drain(), {"drained": True})


async def _forget(request: web.Request) -> web.Response:
    engine_id = request.match_info["engine_id"]
    return await _operator_call(request.app[VIEW_KEY].forget_peer(engine_id), {"forgotten": engine_id})


def build_admin_app(
    view: EngineView,
    *,
    token: str | None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics: EngineMetrics | None = None,
) -> web.Application:
    """The engine's aiohttp application: the handshake endpoint (`bootstrap.METADATA_PATH`) plus the admin routes
    GET /healthz, /readyz, /v1/topology, /v1/peers, /v1/transfers, /v1/statistics, /metrics and
    POST /v1/drain, /v1/peers/{engine_id}/forget.

    `token` None disables the POST endpoints (403); an empty token is refused, as it would match an empty header.
    GETs of /v1/transfers, /v1/peers and /v1/topology show ids and remote text only with the token (see module
    docstring); with `token` None, never.
    Publish the handshake metadata with `bootstrap.publish_metadata(app, ...)` (or `EngineCoreConnector`).

    Raises:
        ValueError: `token` is the empty string, or `max_body_bytes` < 1.
    """
    if token == "":
        raise ValueError("admin token must be non-empty (or None to disable state-changing endpoints)")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_guard(token, max_body_bytes)])
    app[VIEW_KEY] = view
    app[_TOKEN_KEY] = token
    app[METRICS_KEY] = metrics or EngineMetrics(view.engine_id, view.incarnation, view.role)
    add_metadata_route(app)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/v1/topology", _topology)
    app.router.add_get("/v1/peers", _peers)
    app.router.add_get("/v1/transfers", _transfers)
    app.router.add_get("/v1/statistics", _statistics)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/v1/drain", _drain)
    app.router.add_post("/v1/peers/{engine_id}/forget", _forget)
    return app


class AdminServer:
    """Serves `build_admin_app(view, ...)` on `host:port` (loopback and a free port by default)."""

    def __init__(
        self,
        view: EngineView,
        *,
        token: str | None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        """Raises:
        ValueError: as `build_admin_app`.
        """
        self.app = build_admin_app(view, token=token, max_body_bytes=max_body_bytes)
        self._host, self._port = host, port
        self._runner: web.AppRunner | None = None
        self.url = ""

    @property
    def metrics(self) -> EngineMetrics:
        return self.app[METRICS_KEY]

    async def start(self) -> str:
        """Bind and serve; returns the base URL (`http://host:port`), also in `url`.

        Raises:
            OSError: the address cannot be bound.
            RuntimeError: already started.
        """
        if self._runner is not None:
            raise RuntimeError(f"admin server already serving at {self.url}")
        self._runner = runner = await serve_app(self.app, self._host, self._port)
        host, port = runner.addresses[0][:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        return self.url

    async def close(self) -> None:
        """Stop serving. Idempotent; raises nothing of its own."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "METRICS_KEY",
    "VIEW_KEY",
    "AdminServer",
    "EngineView",
    "build_admin_app",
    "engine_metrics",
    "random_token",
    "remote_stages",
    "tag_worker",
]
