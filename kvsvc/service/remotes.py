"""What a D worker knows of remote P engines, `RemoteEngines`: their published metadata, the transfer topology
registered from it, and this worker's routes to each (which P workers it fetches from, which it must release).

Rules: one metadata fetch per engine start, shared by the receives that wait on it; a failed fetch is forgotten so
that the next receive fetches again; a refetch unregisters what the old start registered. Routes are computed from
a fetch; the receiving role reuses them while that fetch is `current`, for the same own-engine layout. Part of the D
role (`kvsvc.service.receiving` owns it): no connections, no receives. The metadata client (`fetch_engine_metadata`,
against the endpoint of `kvsvc.engine.bootstrap`) lives here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from kvsvc.core.auth import check_control_addr, parse_bootstrap_addr
from kvsvc.core.bounds import check_engine_bounds
from kvsvc.core.errors import HandshakeError, KVSvcError, MalformedFrame, PeerMismatch, TopologyError
from kvsvc.core.layout import block_bytes
from kvsvc.core.messages import MAX_METADATA_BYTES, Worker, WorkerRef, clip, decode_engine_metadata
from kvsvc.core.planner import release_notifier, sources_of
from kvsvc.core.topology import EngineTransferInfo, TransferTopology
from kvsvc.service.context import EngineMetadata, ServiceContext

log = logging.getLogger(__name__)
# At most this much of an error response is read, for the excerpt its refusal quotes.
MAX_ERROR_BYTES = 256


@dataclass(frozen=True, slots=True)
class Routes:
    """This D worker's routes to one start of a P engine."""

    p_engine: EngineMetadata
    sources: list[Worker]  # the P workers it fetches from
    releases: list[Worker]  # the P workers it tells that nobody needs their hold (`planner.release_notifier`)
    peers: list[Worker]  # sorted union of both: the control connections it needs


@dataclass(frozen=True, slots=True)
class Refusal:
    """A P engine start this worker cannot receive from (its layout does not fit), decided once when they met."""

    engine_id: str
    incarnation: str
    reason: str
    since: float


@dataclass(slots=True)
class _RemoteEngine:
    """One P engine start: its published workers, fetched once and shared by concurrent receives."""

    engine_id: str
    url: str
    fetch: asyncio.Task[EngineMetadata]
    refused: Refusal | None = None  # the fetched start cannot be received from


class RemoteEngines:
    """The remote P engines of one D worker (see module docstring). `topology` is the worker's `TransferTopology`."""

    def __init__(self, ctx: ServiceContext) -> None:
        self._ctx = ctx
        meta = ctx.metadata
        self.topology = TransferTopology(
            tp_rank=meta.tp_rank,
            tp_size=meta.tp_size,
            block_size=meta.block_size,
            engine_id=meta.engine_id,
            is_mla=meta.is_mla,
            total_num_kv_heads=meta.num_kv_heads,
            pp_rank=meta.pp_rank,
            pp_size=meta.pp_size,
            start_layer=meta.start_layer,
            end_layer=meta.end_layer,
        )
        self._remotes: dict[str, _RemoteEngine] = {}
        self._http: aiohttp.ClientSession | None = None

    def start(self) -> None:
        """Open the HTTP session that fetches remote engines' metadata (needs the running loop)."""
        # No decompression: a small compressed body must not become a large one before the size cap sees it.
        self._http = aiohttp.ClientSession(auto_decompress=False)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    def __len__(self) -> int:
        return len(self._remotes)

    def current(self, engine_id: str, url: str, p_engine: EngineMetadata) -> bool:
        """Whether `p_engine` is what the latest fetch of `engine_id` from `url` returned, and nothing marked it out
        of date since: routes computed from it still hold."""
        remote = self._remotes.get(engine_id)
        return remote is not None and remote.url == url and _fetched(remote) is p_engine

    async def routes(self, engine_id: str, url: str, own: Callable[[], EngineMetadata]) -> Routes:
        """This worker's routes to `engine_id` as `url` publishes it, fetching its metadata unless a fetch of that
        start is done or running. `own` builds this worker's engine.

        Raises:
            TopologyError: the engine's layout does not fit this worker's. Decided once per engine start: the
                refusal is logged once, listed in `refusals`, and raised at once for the receives of the next
                `handshake_timeout_s`, after which the engine's metadata is fetched again (a restart may fit).
            KVSvcError: the engine is unreachable, malformed or not `engine_id` (`own` may raise
                `LocalProtocolError`). ValueError / KeyError: its layout cannot be routed. The fetch is forgotten,
                so the next receive fetches again.
        """
        remote = self._remotes.get(engine_id)
        if remote is not None and remote.url == url and remote.refused is not None and not self._stale(remote):
            raise TopologyError(remote.refused.reason)
        try:
            p_engine = await self._engine(engine_id, url)
            me = self._ctx.metadata
            sources = sources_of(me, p_engine)
            own_engine = own()
            releases = [w for w, p in sorted(p_engine.items()) if release_notifier(p, own_engine) == me.worker]
        except TopologyError as exc:
            self._refuse(engine_id, url, str(exc))
            raise
        except (KVSvcError, ValueError, KeyError):
            self._remotes.pop(engine_id, None)
            raise
        return Routes(p_engine, sources, releases, sorted({*sources, *releases}))

    def refusals(self) -> list[Refusal]:
        """The P engine starts this worker refused to receive from, and why."""
        return [r.refused for r in self._remotes.values() if r.refused is not None]

    def invalidate(self, engine_id: str) -> None:
        """Mark `engine_id`'s metadata out of date (a lost connection may mean a restart): the next receive fetches
        it again. What the topology registered stays until that fetch (`forget` drops everything at once)."""
        self._remotes.pop(engine_id, None)

    def forget(self, engine_id: str) -> None:
        """Forget `engine_id` entirely, at once: its metadata and what the topology registered for it (the
        operator's `forget_engine`)."""
        self._remotes.pop(engine_id, None)
        self.topology.unregister_remote_engine(engine_id)

    def describe(self, ref: WorkerRef) -> str:
        """The topology's description of `ref`'s stage, or "" for an engine it does not know."""
        try:
            return self.topology.describe(ref.engine_id, ref.pp_rank)
        except KeyError:
            return ""

    async def _engine(self, engine_id: str, url: str) -> EngineMetadata:
        remote = self._remotes.get(engine_id)
        if (
            remote is None
            or remote.url != url
            or (remote.fetch.done() and remote.fetch.exception() is not None)
            or (remote.refused is not None and self._stale(remote))
        ):
            assert self._http is not None
            fetch = self._ctx.tasks.spawn(self._fetch(engine_id, url), name=f"kvsvc-fetch-{engine_id}")
            refused = remote.refused if remote is not None and remote.url == url else None
            remote = self._remotes[engine_id] = _RemoteEngine(engine_id, url, fetch, refused=refused)
        return await asyncio.shield(remote.fetch)

    def _stale(self, remote: _RemoteEngine) -> bool:
        """Whether a refusal is old enough to look at the engine again."""
        assert remote.refused is not None
        return self._ctx.clock() - remote.refused.since >= self._ctx.config.handshake_timeout_s

    def _refuse(self, engine_id: str, url: str, reason: str) -> None:
        remote = self._remotes.get(engine_id)
        fetched = _fetched(remote) if remote is not None and remote.url == url else None
        if remote is None or fetched is None:
            return
        incarnation = next(iter(fetched.values())).incarnation
        known = remote.refused
        if known is None or (known.incarnation, known.reason) != (incarnation, reason):
            me = self._ctx.metadata
            log.warning(
                "worker %s refuses to receive from engine %r (incarnation %s) at %s: %s",
                me.worker,
                engine_id,
                incarnation,
                url,
                reason,
            )
        remote.refused = Refusal(engine_id, incarnation, reason, self._ctx.clock())

    async def _fetch(self, engine_id: str, url: str) -> EngineMetadata:
        assert self._http is not None
        me = self._ctx.metadata
        config = self._ctx.config
        keyed = config.control_token is not None
        metas = await fetch_engine_metadata(self._http, url, timeout_s=config.handshake_timeout_s, keyed=keyed)
        found = next(iter(metas.values())).engine_id
        if found != engine_id:
            raise HandshakeError(f"{url} serves engine {found!r}, not {engine_id!r}")
        # A refetch means a new start of the engine: what was registered for the old one must go.
        self.topology.unregister_remote_engine(engine_id)
        for p in metas.values():
            if p.tp_rank == 0 and p.start_layer < me.end_layer and me.start_layer < p.end_layer:
                info = EngineTransferInfo(
                    p.tp_size, block_bytes(p), p.block_size, 1, p.pp_rank, p.start_layer, p.end_layer
                )
                self.topology.register_remote_engine(engine_id, info)
        return metas


def _fetched(remote: _RemoteEngine) -> EngineMetadata | None:
    """The metadata `remote`'s fetch returned, or None while it runs or when it failed."""
    fetch = remote.fetch
    if not fetch.done() or fetch.cancelled() or fetch.exception() is not None:
        return None
    return fetch.result()


async def fetch_engine_metadata(
    session: aiohttp.ClientSession, url: str, *, timeout_s: float, keyed: bool = False
) -> EngineMetadata:
    """GET a remote engine's merged worker metadata from its bootstrap address `url` ("http://host:port"): D builds
    the URL from the host and port alone, follows no redirect, reads at most `MAX_METADATA_BYTES` of a document and
    `MAX_ERROR_BYTES` of an error, and takes only workers whose control addresses are on that host. `keyed`: this
    worker has a control token; without one, only loopback addresses are fetched from.

    Raises:
        HandshakeError: an address D does not fetch from, unreachable, not ready (non-200, redirects included), too
            large, malformed, empty, past the bounds a hello is held to (`kvsvc.core.bounds.check_engine_bounds`), or a
            control address on another host; the message names the URL.
    """
    try:
        address = parse_bootstrap_addr(url, keyed)
    except ValueError as exc:
        raise HandshakeError(str(exc)) from None
    target = address.metadata_url
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(target, timeout=timeout, allow_redirects=False) as response:
            if response.status != 200:
                excerpt = (await response.content.read(MAX_ERROR_BYTES)).decode("utf-8", "replace")
                raise HandshakeError(f"GET {target}: HTTP {response.status}: {excerpt!r}")
            if (response.content_length or 0) > MAX_METADATA_BYTES:
                raise HandshakeError(
                    f"GET {target}: body of {response.content_length} bytes, more than {MAX_METADATA_BYTES}"
                )
            # `content.read(n)` returns what is buffered, not the whole body: read to the end, with a cap.
            buffer = bytearray()
            async for chunk in response.content.iter_chunked(64 * 1024):
                buffer += chunk
                if len(buffer) > MAX_METADATA_BYTES:
                    raise HandshakeError(f"GET {target}: body larger than {MAX_METADATA_BYTES} bytes")
            body = bytes(buffer)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise HandshakeError(f"GET {target}: {type(exc).__name__}: {exc}") from None
    try:
        metas = decode_engine_metadata(body)
    except MalformedFrame as exc:
        raise HandshakeError(f"GET {target}: {exc}") from None
    if not metas:
        raise HandshakeError(f"GET {target}: the engine published no workers")
    try:
        check_engine_bounds(metas, f"GET {target}")
    except PeerMismatch as exc:
        raise HandshakeError(str(exc)) from None
    engines = {(m.engine_id, m.incarnation) for m in metas.values()}
    if len(engines) != 1:
        starts = clip(repr(sorted(engines)), 512)
        raise HandshakeError(f"GET {target}: workers of several engine starts in one document: {starts}")
    for meta in metas.values():
        try:
            check_control_addr(address, meta.control_addr)
        except ValueError as exc:
            raise HandshakeError(f"GET {target}: worker {meta.worker}: {exc}") from None
    return metas
