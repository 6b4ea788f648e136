"""`OnDemand`: a worker's Mooncake transport, started only once a pair of workers needs it.

Mooncake's listeners take no token and bind every interface whatever address they are given (docs/mooncake.md): once
an engine runs, whoever reaches its ports can read and write every byte registered with it. So a worker whose peers
are all served by the same-host or GPU plane starts no engine and registers nothing with one. Rules: `register`
only records the regions until the engine starts, then registers all of them with it; `start` runs the engine's
initialisation and registration off the loop, once (concurrent callers wait for that one start); `session_id` is ""
until then, which is what a worker publishes, so a peer can tell the engine is not running; a transport built with
`allowed` False (`transport: samehost`) never starts one. Every write, peer and probe goes to the started engine;
before the start there is none to write to. Once started, the worker logs every port the engine listens on.
Imports the standard library, kvsvc's pure core and `kvsvc.transport` modules (mooncake only inside the factory it
is given).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from kvsvc.core.data_planes import is_same_host
from kvsvc.core.errors import ERR_FAILED, InvalidDescriptor, TransportError
from kvsvc.core.messages import IpcHandle
from kvsvc.core.planner import Descriptors, Region
from kvsvc.transport.base import Transport, TransportClosed, TransportStatistics, Written
from kvsvc.transport.samehost import listening_sockets

log = logging.getLogger(__name__)

NOT_ALLOWED = "this worker's transport setting is samehost, which never starts Mooncake"


class OnDemand:
    """A `Transport` whose engine `factory` builds (a `MooncakeTransport`) at the first `start` (module docstring)."""

    def __init__(self, factory: Callable[[], Transport], *, allowed: bool = True) -> None:
        self._factory = factory
        self._allowed = allowed
        self._engine: Transport | None = None
        self._starting: asyncio.Future[Transport] | None = None
        self._regions: list[Region] = []
        self._closed = False

    @property
    def started(self) -> bool:
        return self._engine is not None

    @property
    def engine(self) -> Transport | None:
        """The started engine's transport, None before the start."""
        return self._engine

    @property
    def session_id(self) -> str:
        """The engine's `host:rpc_port`, or "" before it started."""
        return self._engine.session_id if self._engine is not None else ""

    @property
    def local_session_id(self) -> str:
        return ""

    def start_now(self) -> str:
        """Start the engine in this thread (a worker whose peers need Mooncake from the first: it listens beyond
        loopback, or is forced to it); returns its session.

        Raises:
            TransportError: the setting forbids Mooncake, or the engine could not start or register.
        """
        if self._engine is None:
            self._engine = self._build(list(self._regions))
        return self._engine.session_id

    async def start(self) -> str:
        """Start the engine, once, off the loop; returns its session. Concurrent callers wait for the one start;
        cancelling one leaves the start running for the others (and for the next call).

        Raises:
            TransportError: the setting forbids Mooncake, the engine could not start or register (then a later
                call tries again), or the transport is closed.
        """
        if self._engine is not None:
            return self._engine.session_id
        if self._closed:
            raise TransportClosed("transport closed: Mooncake not started")
        if not self._allowed:
            raise TransportError(NOT_ALLOWED, ERR_FAILED)
        if self._starting is None:
            regions = list(self._regions)
            starting = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(None, self._build, regions))
            # Kept even when every caller was cancelled meanwhile; a failed start lets a later pair try again.
            starting.add_done_callback(lambda done: self._started(done, len(regions)))
            self._starting = starting
        await asyncio.shield(self._starting)
        if self._engine is None or self._closed:
            raise TransportClosed("transport closed while Mooncake started")
        return self._engine.session_id

    def _started(self, done: asyncio.Future[Transport], registered: int) -> None:
        if done.cancelled() or done.exception() is not None:
            self._starting = None
            return
        self._engine = engine = done.result()  # a `close` under way closes it
        if len(self._regions) > registered and not self._closed:  # recorded while it started
            engine.register(self._regions[registered:])

    def _build(self, regions: list[Region]) -> Transport:
        """The engine, started and holding `regions`, from a thread.

        Raises:
            TransportError: the setting forbids it, or it failed to start or register (anything it raised, an
                ImportError of a missing `mooncake` included, named); nothing is left running then.
        """
        if not self._allowed:
            raise TransportError(NOT_ALLOWED, ERR_FAILED)
        before = listening_sockets()
        try:
            engine = self._factory()
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(f"Mooncake could not start: {type(exc).__name__}: {exc}", ERR_FAILED) from exc
        try:
            engine.register(regions)
        except Exception as exc:
            _close_soon(engine)
            raise TransportError(
                f"registering {len(regions)} region(s) with Mooncake failed: {exc}", ERR_FAILED
            ) from exc
        opened = sorted(listening_sockets() - before)
        log.warning(
            "Mooncake transfer engine %s started: it listens on %s, and whoever reaches those ports can read and "
            "write every byte registered with it, without a token (docs/operations.md, Security)",
            engine.session_id,
            ", ".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in opened) or "no port this process could see",
        )
        return engine

    # -- the Transport protocol ------------------------------------------------------------------------------------

    def register(self, regions: Sequence[Region]) -> None:
        """As `Transport.register`; before the start the regions wait for it (the engine registers them all)."""
        if self._closed:
            raise TransportClosed("transport closed")
        if self._engine is not None:
            self._engine.register(regions)
        self._regions.extend(regions)

    def add_peer(self, session_id: str, regions: Sequence[Region]) -> None:
        """As `Transport.add_peer`, once started.

        Raises:
            InvalidDescriptor: the engine is not started (nothing could write to the peer), or as `Transport.add_peer`.
        """
        if self._engine is None:
            raise InvalidDescriptor(f"Mooncake is not started on this worker; cannot add peer {session_id}")
        self._engine.add_peer(session_id, regions)

    def remove_peer(self, session_id: str) -> None:
        if self._engine is not None:
            self._engine.remove_peer(session_id)

    async def write(self, peer: str, descriptors: Descriptors) -> Written:
        if self._engine is None:
            raise InvalidDescriptor(f"Mooncake is not started on this worker; write to {peer} refused")
        return await self._engine.write(peer, descriptors)

    def start_write(self, peer: str, descriptors: Descriptors) -> asyncio.Future[Written] | None:
        return self._engine.start_write(peer, descriptors) if self._engine is not None else None

    async def drained(self, peer: str | None = None) -> None:
        if self._engine is not None:
            await self._engine.drained(peer)

    async def reachable(
        self,
        session: str,
        regions: Sequence[Region],
        via: tuple[tuple[str, int], tuple[str, int]] | None = None,
        handles: Sequence[IpcHandle] = (),
    ) -> str:
        return ""

    async def peer_gone(self, session: str) -> bool:
        """As the engine's; False before it started (nothing to probe with) and for a same-host session, which no
        Mooncake probe can tell of (a refused probe would read as a death)."""
        if self._engine is None or is_same_host(session):
            return False
        return await self._engine.peer_gone(session)

    def statistics(self) -> TransportStatistics:
        if self._engine is not None:
            return self._engine.statistics()
        return TransportStatistics()

    async def close(self) -> None:
        """Close the engine if it started (a start under way closes its engine once it is up). Idempotent."""
        self._closed = True
        if self._starting is not None and self._engine is None:
            with contextlib.suppress(Exception):  # a failed start left nothing to close
                self._engine = await asyncio.shield(self._starting)
        if self._engine is not None:
            await self._engine.close()


def _close_soon(engine: Transport) -> None:
    """Close an engine that failed to register, from the thread that built it."""
    with contextlib.suppress(Exception):
        asyncio.run(engine.close())


__all__ = ["NOT_ALLOWED", "OnDemand"]
