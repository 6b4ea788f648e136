"""`RoutedTransport`: one worker's data planes behind the one `Transport` the service writes through: Mooncake (or any
transport, for every peer) and a same-host plane for peers on this host whose pair chose it at the hello: the kernel
copy for KV in CPU memory (`kvsvc.transport.samehost`) or CUDA IPC for KV on a GPU (`kvsvc.transport.cuda_ipc`).

Rules: nothing is decided here (`kvsvc.core.data_planes` decides per pair, the service asks `reachable` once, then holds
the pair's plane, `plane_of`, for its writes); a session goes to the same-host plane only when that plane admitted it
(its process passed the check against its control connection), never because of what its string says, so a peer
cannot name its way onto the plane; every other call goes to `primary` (but a probe of a same-host session, which
the local plane answers); registrations go to both; statistics are the sum of the planes'. `worker_transport`
builds a worker's, with Mooncake on demand (`kvsvc.transport.ondemand`). Imports `kvsvc.transport` modules and
kvsvc's pure core only (the GPU plane's driver loads `libcuda` when that plane is built, never on import).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import fields
from typing import Protocol

from kvsvc.core.auth import is_loopback
from kvsvc.core.data_planes import is_same_host
from kvsvc.core.messages import IpcHandle
from kvsvc.core.planner import Descriptors, Region
from kvsvc.transport.base import Transport, TransportStatistics, Written
from kvsvc.transport.cuda_driver import CudaError
from kvsvc.transport.mooncake import MooncakeConfig, MooncakeTransport
from kvsvc.transport.ondemand import OnDemand
from kvsvc.transport.samehost import SameHostTransport

log = logging.getLogger(__name__)


class LocalPlane(Transport, Protocol):
    """A same-host plane: a `Transport` that writes only the sessions it admitted, and hands a peer's hello what it
    exported (the GPU plane's IPC handles; nothing for the kernel copy)."""

    def admits(self, session_id: str) -> bool: ...

    def exported(self) -> list[IpcHandle]: ...


class RoutedTransport:
    """`primary` for every peer, `local` for same-host sessions (see module docstring)."""

    def __init__(self, primary: Transport, local: LocalPlane) -> None:
        self.primary, self.local = primary, local

    @property
    def session_id(self) -> str:
        return self.primary.session_id

    @property
    def local_session_id(self) -> str:
        """The same-host plane's session (`WorkerMetadata.samehost_addr`)."""
        return self.local.session_id

    def plane(self, session: str) -> Transport:
        """The plane that writes to `session`: the same-host one once it admitted the session, else `primary`."""
        return self.local if self.local.admits(session) else self.primary

    def register(self, regions: Sequence[Region]) -> None:
        self.primary.register(regions)
        self.local.register(regions)

    def add_peer(self, session_id: str, regions: Sequence[Region]) -> None:
        self.plane(session_id).add_peer(session_id, regions)

    def remove_peer(self, session_id: str) -> None:
        self.plane(session_id).remove_peer(session_id)

    async def reachable(
        self,
        session: str,
        regions: Sequence[Region],
        via: tuple[tuple[str, int], tuple[str, int]] | None = None,
        handles: Sequence[IpcHandle] = (),
    ) -> str:
        """ "" when writes to `session` can go (a same-host session: the checks and the plane's probe said so, and
        the plane admitted it), else why not."""
        if is_same_host(session):
            return await self.local.reachable(session, regions, via, handles)
        return ""

    async def write(self, peer: str, descriptors: Descriptors) -> Written:
        return await self.plane(peer).write(peer, descriptors)

    def start_write(self, peer: str, descriptors: Descriptors) -> asyncio.Future[Written] | None:
        return self.plane(peer).start_write(peer, descriptors)

    async def drained(self, peer: str | None = None) -> None:
        if peer is not None and self.local.admits(peer):
            await self.local.drained(peer)
            return
        if peer is not None:  # a removed same-host peer is known to neither plane: both are asked
            await asyncio.gather(self.primary.drained(peer), self.local.drained(peer))
            return
        await asyncio.gather(self.primary.drained(), self.local.drained())

    async def peer_gone(self, session: str) -> bool:
        """As the plane's; a same-host session the local plane tells whether or not it writes there (D asks of a
        P it reads from, whose process the kernel can name)."""
        if is_same_host(session):
            return await self.local.peer_gone(session)
        return await self.plane(session).peer_gone(session)

    def statistics(self) -> TransportStatistics:
        """The planes' sums; the registered memory once (both planes bound the same regions, or Mooncake none
        before it started)."""
        a, b = self.primary.statistics(), self.local.statistics()
        summed = {f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(a)}
        return TransportStatistics(**(summed | {"registered_bytes": max(a.registered_bytes, b.registered_bytes)}))

    async def close(self) -> None:
        """The same-host plane first, then `primary`: a D worker takes a Mooncake engine that refuses its probe for
        a dead P, so it must not go while same-host copies may still land. Idempotent, as each plane's close."""
        await self.local.close()
        await self.primary.close()


def with_same_host(primary: Transport, device: str, setting: str = "auto") -> Transport:
    """`primary` with the same-host plane of the KV's memory beside it: the kernel copy for `device` "cpu", CUDA IPC
    for "cuda" (or "cuda:N"); `primary` alone when the worker's transport setting (`ServiceConfig.transport`) is
    "mooncake" (a worker forced to Mooncake has no same-host plane at all), or when no CUDA driver loads (logged)."""
    if setting == "mooncake":
        return primary
    if device == "cpu":
        return RoutedTransport(primary, SameHostTransport())
    if device.startswith("cuda"):
        from kvsvc.transport.cuda_ipc import CudaIpcTransport

        try:
            return RoutedTransport(primary, CudaIpcTransport())
        except CudaError as exc:
            log.warning("no GPU plane: %s; writes go over Mooncake", exc)
    return primary


def worker_transport(config: MooncakeConfig, device: str, setting: str = "auto") -> Transport:
    """A worker's transport as its setting (`ServiceConfig.transport`) asks: "mooncake" is Mooncake alone, started at
    once; otherwise the same-host plane of `device`'s memory (`with_same_host`) beside a Mooncake engine that starts
    only when a pair needs it (`OnDemand`), or at once when its `host` lies beyond loopback (peers on other hosts
    need it, and registering a large pool for RDMA takes too long to wait for in a hello) or its config is not
    `on_demand`; "samehost" never starts Mooncake.

    Raises:
        TransportError: Mooncake could not start (where it starts at once).
        ValueError: "samehost" where this memory has no same-host plane (no CUDA driver).
    """
    if setting == "mooncake":
        return MooncakeTransport(config)
    os.environ.update(config.environment())  # here, not on the thread a later start runs on (setenv is not safe)
    primary = OnDemand(lambda: MooncakeTransport(config), allowed=setting != "samehost")
    transport = with_same_host(primary, device, setting)
    if transport is primary:
        if setting == "samehost":
            raise ValueError(f"transport 'samehost' but KV on {device!r} has no same-host plane here")
        primary.start_now()  # every pair takes Mooncake
    elif setting != "samehost" and (not is_loopback(config.host) or not config.on_demand):
        primary.start_now()
    return transport


async def start_mooncake(transport: Transport) -> str:
    """Start `transport`'s Mooncake engine where it waits for a first pair (`OnDemand`, bare or beside a same-host
    plane); returns the session peers write to ("" where it cannot start, and a transport of another kind's own).

    Raises:
        TransportError: as `OnDemand.start`.
    """
    primary = transport.primary if isinstance(transport, RoutedTransport) else transport
    if isinstance(primary, OnDemand):
        return await primary.start()
    return primary.session_id


def plane_of(transport: Transport, session: str) -> Transport:
    """The plane writes to `session` take through `transport` (`RoutedTransport.plane`; `transport` itself when it
    has one plane). Asked once the session passed `reachable` and `add_peer`: the writer holds it per pair."""
    return transport.plane(session) if isinstance(transport, RoutedTransport) else transport


def exported_handles(transport: Transport) -> list[IpcHandle]:
    """The IPC handles of this worker's GPU memory, as its GPU plane exported them; [] without that plane."""
    return transport.local.exported() if isinstance(transport, RoutedTransport) else []


__all__ = [
    "LocalPlane",
    "RoutedTransport",
    "exported_handles",
    "plane_of",
    "start_mooncake",
    "with_same_host",
    "worker_transport",
]
