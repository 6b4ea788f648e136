"""Bounds on what a peer can make a P worker hold or do: the sizes a hello may claim, and who may hold a control
connection.

Pure module: standard library and kvsvc's pure core only. Every claim of a hello that anything is built from (D's
parallel sizes, its stage split, the lists in its metadata) is checked here whole, before the first allocation
sized by it; what passes costs P at most a few KiB per D worker of D's engine, whatever the frame said. Every bound
is named here, and in docs/operations.md ("Security", "Bounds") with what happens past it. Refusals name the peer
(or its host group), the value it claimed and the limit.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Final, Generic, Literal, TypeVar

from kvsvc.core.errors import LocalProtocolError, PeerMismatch, TopologyError
from kvsvc.core.layout import check_base_addrs, check_layer_split
from kvsvc.core.messages import Hello, Worker, WorkerMetadata, WorkerRef

C = TypeVar("C", bound=Hashable)  # a control connection, as its owner holds it
K = TypeVar("K", bound=Hashable)  # the D worker a connection stands for

# More ranks than any deployment has: pp_size and tp_size each, and their product (the D workers P lays out).
MAX_PARALLEL: Final = 1024
MAX_WORKERS: Final = 1024
# Layers of a model: the largest today have under 130; 8 times that still fits a hello in MAX_HELLO_FRAME_BYTES.
MAX_LAYERS: Final = 1024
# KV cache groups of a hybrid model (vLLM makes a handful), and sub-projections of a Mamba conv state (3 today).
MAX_KV_GROUPS: Final = 64
MAX_CONV_PARTS: Final = 16
# GPU allocations a D worker exports for the GPU plane (one per distinct allocation of its KV pool and staging
# region: vLLM and kvsvc's engines make one to a few per layer at most).
MAX_IPC_HANDLES: Final = 256
# A frame before the hello was accepted: the largest legitimate hello (MAX_LAYERS per-layer addresses and a hybrid
# model's groups) is about 13 KiB, one of 128 layers 2.6 KiB; MAX_IPC_HANDLES handles add about 22 KiB. Past it the
# connection closes (MAX_FRAME_BYTES after).
MAX_HELLO_FRAME_BYTES: Final = 40 * 1024


def check_hello_bounds(me: WorkerMetadata, hello: Hello) -> None:
    """Check that `hello` describes a D engine P worker `me` can lay out at bounded cost: parallel sizes within
    `MAX_PARALLEL` and `MAX_WORKERS`; a stage split of `pp_size` non-empty stages, contiguous from layer 0, within
    `MAX_LAYERS` and covering `me`'s layers (all of the model's, where `me` holds its last stage); D's metadata
    lists of the lengths its layers give them; at most `MAX_IPC_HANDLES` exported GPU allocations (each checked
    against D's regions by `kvsvc.core.data_planes.check_ipc_handles` before P maps any).

    Raises:
        PeerMismatch: the first claim at fault, naming the D worker, the value and the limit.
    """
    d = hello.sender
    who = f"D worker {WorkerRef.of(d)}"
    _check_parallel(d, who)
    _check_stages(me, hello.stage_layers, d.pp_size, who)
    _check_lists(d, who)
    if len(hello.ipc_handles) > MAX_IPC_HANDLES:
        raise PeerMismatch(f"{who} exports {len(hello.ipc_handles)} GPU allocations, limit {MAX_IPC_HANDLES}")


def check_engine_bounds(metas: Mapping[Worker, WorkerMetadata], where: str) -> None:
    """Check that an engine's metadata document (fetched from `where`) describes an engine D can reach at bounded
    cost: at most `MAX_WORKERS` workers, each within the bounds a hello is held to (parallel sizes, layers, lists),
    before D plans anything or opens a connection by it.

    Raises:
        PeerMismatch: the first claim at fault, naming the worker, the value and the limit.
    """
    if len(metas) > MAX_WORKERS:
        raise PeerMismatch(f"{where} lists {len(metas)} workers, limit {MAX_WORKERS}")
    for meta in metas.values():
        who = f"{where}: worker {WorkerRef.of(meta)}"
        _check_parallel(meta, who)
        if not (meta.pp_rank < meta.pp_size and meta.tp_rank < meta.tp_size):
            raise PeerMismatch(f"{who} claims ranks outside its sizes pp_size {meta.pp_size}, tp_size {meta.tp_size}")
        if meta.start_layer > meta.end_layer:
            raise PeerMismatch(f"{who} claims layers {meta.start_layer} to {meta.end_layer}: ending before they begin")
        if meta.end_layer > MAX_LAYERS:
            raise PeerMismatch(f"{who} claims layers up to {meta.end_layer}, limit {MAX_LAYERS}")
        _check_lists(meta, who)


def _check_parallel(d: WorkerMetadata, who: str) -> None:
    if not (1 <= d.tp_size <= MAX_PARALLEL and 1 <= d.pp_size <= MAX_PARALLEL):
        raise PeerMismatch(f"{who} claims tp_size {d.tp_size}, pp_size {d.pp_size}; each must be 1 to {MAX_PARALLEL}")
    if d.tp_size * d.pp_size > MAX_WORKERS:
        raise PeerMismatch(
            f"{who} claims pp_size {d.pp_size} x tp_size {d.tp_size} = {d.pp_size * d.tp_size} workers, "
            f"limit {MAX_WORKERS}"
        )


def _check_stages(me: WorkerMetadata, stages: list[tuple[int, int]], pp_size: int, who: str) -> None:
    if len(stages) != pp_size:
        raise PeerMismatch(f"{who} sends a stage split of {len(stages)} stages for pp_size {pp_size}")
    total = stages[-1][1]
    try:
        check_layer_split(stages, total)  # each stage non-empty, contiguous from layer 0: none ends after the last
    except ValueError as exc:
        raise PeerMismatch(f"{who} sends an impossible stage split: {exc}") from None
    if total > MAX_LAYERS:
        raise PeerMismatch(f"{who} sends a stage split of {total} layers, limit {MAX_LAYERS}")
    if me.end_layer > total:
        raise PeerMismatch(
            f"{who} sends a stage split of {total} layers; this P worker holds layers [{me.start_layer}, "
            f"{me.end_layer})"
        )
    if me.pp_rank == me.pp_size - 1 and me.end_layer != total:
        raise PeerMismatch(
            f"{who} sends a stage split of {total} layers; the model has {me.end_layer} (this P worker holds its "
            "last stage)"
        )


def _check_lists(d: WorkerMetadata, who: str) -> None:
    try:
        check_base_addrs(d, who)
    except TopologyError as exc:
        raise PeerMismatch(str(exc)) from None
    if len(d.kv_groups) > MAX_KV_GROUPS:
        raise PeerMismatch(f"{who} claims {len(d.kv_groups)} KV cache groups, limit {MAX_KV_GROUPS}")
    listed = sum(len(group.layers) for group in d.kv_groups)
    if listed > d.num_layers:
        raise PeerMismatch(f"{who}'s KV cache groups list {listed} layers; it holds {d.num_layers}")
    for i, group in enumerate(d.kv_groups):
        parts = len(group.mamba.conv_parts) if group.mamba is not None else 0
        if parts > MAX_CONV_PARTS:
            raise PeerMismatch(f"{who}'s KV cache group {i} has {parts} conv parts, limit {MAX_CONV_PARTS}")


def host_group(host: str) -> str:
    """The hosts one connection cap counts together: all of loopback as one (any process of this host can take
    127.0.0.2, 127.0.0.3, ...), an IPv4 /24 and an IPv6 /64 (what one site hands one machine), an IPv4-mapped IPv6
    address as its IPv4 one; a name that is no address as itself."""
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return "loopback"
    prefix = 24 if isinstance(address, ipaddress.IPv4Address) else 64
    return str(ipaddress.ip_network(f"{address}/{prefix}", strict=False))


@dataclass(frozen=True, slots=True)
class Admission(Generic[C]):
    """What `ControlConnections.admit` decided of a new connection."""

    refusal: str = ""  # refused (and not counted): why, to tell the peer before closing
    displaced: C | None = None  # admitted, and this oldest pending connection must give way: tell it `why`, close it
    why: str = ""


@dataclass(frozen=True, slots=True)
class Acceptance(Generic[C]):
    """What `ControlConnections.accept` decided of a connection whose hello was accepted."""

    accepted: bool
    refusal: str = ""  # not accepted: why, to tell D; "" when it was displaced meanwhile (it is closing already)
    replaces: C | None = None  # accepted: the D worker's earlier connection, to close now (its jobs are lost)


@dataclass(slots=True)
class _Held(Generic[K]):
    host: str
    state: Literal["pending", "displaced", "accepted"] = "pending"
    key: K | None = None


class ControlConnections(Generic[C, K]):
    """The control connections a P worker holds (each a handle `C` the caller owns), by host group (`host_group`),
    and which one stands for each D worker (a key `K`). A connection is pending from its admission until its hello
    is accepted: pending ones have a small cap of their own (`max_pending`), so a flood of connections that never
    hello cannot take the slots accepted D workers hold (`max_total`); past that cap the oldest pending connection
    gives way to the new one (`Admission.displaced`), so a flood cannot keep a D worker's hello, which takes a round
    trip, from its turn either. Every connection counts against its host group's cap (`max_per_host`). An accepted
    connection replaces the one its D worker held (a reconnect, or a restarted D engine: the newest hello wins);
    the replaced one's jobs are lost at once, and one replaced while the service still routed it (`holds`) is not
    installed. Each admitted connection `leave`s once, when it closes."""

    def __init__(self, max_total: int, max_per_host: int, max_pending: int = 64) -> None:
        self._max_total = max_total
        self._max_per_host = max_per_host
        self._max_pending = max_pending
        self._by_group: Counter[str] = Counter()
        self._held: dict[C, _Held[K]] = {}  # in admission order: the oldest pending connection first
        self._of_key: dict[K, C] = {}
        self._accepted = 0
        self._pending = 0
        self._displacing = 0  # pending connections told to close, until they leave

    @property
    def open(self) -> int:
        return self._accepted + self._pending

    @property
    def pending(self) -> int:
        """Connections before their hello was accepted."""
        return self._pending

    def admit(self, conn: C, host: str) -> Admission[C]:
        """Count `conn`, new from `host`, as pending, or refuse it (then it is not counted and never `leave`s).
        Raises nothing."""
        group = host_group(host)
        if self._by_group[group] >= self._max_per_host:
            where = "loopback" if group == "loopback" else f"{host} (of {group})"
            held = self._by_group[group]
            return Admission(f"{where} holds {held} control connections to this P worker, limit {self._max_per_host}")
        self._by_group[group] += 1
        self._pending += 1
        self._held[conn] = _Held(host)
        if self._pending - self._displacing <= self._max_pending:
            return Admission()
        oldest = next(c for c, held in self._held.items() if held.state == "pending")
        self._held[oldest].state = "displaced"  # still counted until it leaves, but never told twice
        self._displacing += 1
        why = f"P worker holds {self._max_pending} control connections before their hello, its limit, and this is"
        why += " the oldest"
        return Admission(displaced=oldest, why=why)

    def accept(self, conn: C, key: K) -> Acceptance[C]:
        """`conn`'s hello was accepted, from D worker `key`: make it the connection of `key`, or refuse it (then it
        stays pending, to `leave` as such).

        Raises:
            LocalProtocolError: `conn` was never admitted, or was accepted already.
        """
        held = self._held.get(conn)
        if held is None or held.state == "accepted":
            raise LocalProtocolError(f"accept of a connection that is not pending: {conn!r}")
        if held.state == "displaced":
            return Acceptance(accepted=False)
        if self._accepted >= self._max_total:
            return Acceptance(
                accepted=False, refusal=f"P worker holds {self._accepted} control connections, limit {self._max_total}"
            )
        held.state, held.key = "accepted", key
        self._pending -= 1
        self._accepted += 1
        replaced = self._of_key.get(key)
        self._of_key[key] = conn
        return Acceptance(accepted=True, replaces=replaced)

    def holds(self, conn: C, key: K) -> bool:
        """Whether `conn` is still the connection of D worker `key` (no newer hello replaced it). Raises nothing."""
        return self._of_key.get(key) is conn

    def leave(self, conn: C) -> K | None:
        """`conn` closed: it stops counting. Returns the D worker whose connection it still was (its jobs are lost
        now), else None (pending, refused at its hello, or replaced already).

        Raises:
            LocalProtocolError: `conn` was never admitted, or left already.
        """
        held = self._held.pop(conn, None)
        if held is None:
            raise LocalProtocolError(f"leave of a connection that is not held: {conn!r}")
        if held.state == "accepted":
            self._accepted -= 1
        else:
            self._pending -= 1
            self._displacing -= held.state == "displaced"
        group = host_group(held.host)
        self._by_group[group] -= 1
        if not self._by_group[group]:
            del self._by_group[group]
        if held.key is not None and self._of_key.get(held.key) is conn:
            del self._of_key[held.key]
            return held.key
        return None
