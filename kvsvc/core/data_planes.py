"""Which data plane carries one P worker's writes into one D worker: the rule the hello applies, the same-host
address a worker publishes for it, and the checks of the GPU allocations a D worker exports for the GPU plane.

Rules: Mooncake, unless both workers offer a same-host plane of the same kind (`WorkerMetadata.samehost_addr`:
`samehost:` for KV in CPU memory, `cudaipc:` for KV on a GPU), run on the same host (the same kernel boot and PID
and network namespaces, so a pid names the same process on both sides and their addresses are one host's) and as
the same user. KV in CPU memory on both sides takes the same-host plane (a kernel copy); KV on a GPU on both sides
takes the GPU plane (CUDA IPC: P maps D's allocations and copies on the device), whichever GPUs of the host they
are on, named by UUID. An operator may force Mooncake, or ask for a same-host plane (`ServiceConfig.transport`),
which a pair that does not qualify runs without. The rule decides from the two metadata alone; the driver's one
probe (the kernel's ptrace policy, or opening D's IPC handles) can still refuse, and the pair falls back to
Mooncake. Pure module: standard library and kvsvc's pure core only.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from itertools import pairwise
from typing import Final

from kvsvc.core.errors import PeerMismatch
from kvsvc.core.messages import IpcHandle, WorkerMetadata
from kvsvc.core.staging_plans import StagingRule

Region = tuple[int, int]

SCHEME: Final = "samehost"
GPU_SCHEME: Final = "cudaipc"
IPC_HANDLE_BYTES: Final = 64  # CUipcMemHandle
SAMEHOST_DESCRIPTOR_COST_S: Final = 1e-6
"""What one more piece costs a same-host write: 8 KiB pieces move at half the speed of 1 MiB ones (3.9 against 8.5
GB/s in one `kvsvc bench` run), about 1 us a piece, where Mooncake's TCP transport takes 30 us."""
SAMEHOST_GATHER_COST_S_PER_BYTE: Final = 0.1e-9
"""What gathering a byte costs before a same-host write: the copy alone (about 10 GB/s in place). The write after it
runs at memory speed too, so the gather delays the first byte little, unlike before a Mooncake write."""
GPU_DESCRIPTOR_COST_S: Final = 1e-6
"""What one more piece costs a GPU-plane write: its share of the write's checks and of the one batched copy call
(448 pieces in about 0.3 ms of P's loop), while the copy itself runs at device speed."""
GPU_GATHER_COST_S_PER_BYTE: Final = 0.002e-9
"""What gathering (on P) or scattering (on D) a byte costs on the GPU plane: a kernel on the device, about 1 TB/s."""
SETTINGS: Final = ("auto", "mooncake", "samehost")
PLANES: Final = ("mooncake", "samehost", "cuda_ipc")  # `Route.kind`
SAMEHOST_CHECK_S: Final = 2.0
"""The most P waits for the check of a same-host peer's process (a few /proc reads and one kernel probe, about a
millisecond on an idle host) before the pair takes Mooncake instead."""
"""`ServiceConfig.transport`: choose by the rule, always Mooncake, or the same-host plane wherever it qualifies."""


@dataclass(frozen=True, slots=True)
class SameHostAddress:
    """Where a same-host peer is: the host it runs on (`host`: boot id, PID and network namespace inodes), its user,
    its process (pid and start time in clock ticks, so a reused pid is another process), and for KV on a GPU the
    GPU's UUID (`gpu`, "" for CPU memory). Written as a session string `samehost:host:uid:pid:start`, or
    `cudaipc:host:uid:pid:start:GPU-uuid`."""

    host: str
    uid: int
    pid: int
    start: int
    gpu: str = ""

    def __str__(self) -> str:
        if self.gpu:
            return f"{GPU_SCHEME}:{self.host}:{self.uid}:{self.pid}:{self.start}:{self.gpu}"
        return f"{SCHEME}:{self.host}:{self.uid}:{self.pid}:{self.start}"

    @property
    def kind(self) -> str:
        """The plane it offers: "cuda_ipc" or "samehost"."""
        return "cuda_ipc" if self.gpu else "samehost"

    @classmethod
    def parse(cls, session: str) -> SameHostAddress:
        """The address `session` names.

        Raises:
            ValueError: not a same-host session string.
        """
        parts = session.split(":")
        try:
            if parts[0] == SCHEME and len(parts) == 5:
                return cls(parts[1], int(parts[2]), int(parts[3]), int(parts[4]))
            if parts[0] == GPU_SCHEME and len(parts) == 6 and parts[5]:
                return cls(parts[1], int(parts[2]), int(parts[3]), int(parts[4]), parts[5])
            raise ValueError
        except ValueError:
            raise ValueError(
                f"{session!r} is not a same-host session ({SCHEME}:host:uid:pid:start or "
                f"{GPU_SCHEME}:host:uid:pid:start:gpu)"
            ) from None


def is_same_host(session: str) -> bool:
    """Whether `session` names a same-host plane (of CPU or GPU memory), by its scheme alone."""
    return session.startswith((SCHEME + ":", GPU_SCHEME + ":"))


def samehost_check_budget(hello_timeout_s: float) -> float:
    """How long P waits for the check of a same-host peer: `SAMEHOST_CHECK_S`, and never more than a quarter of the
    hello's budget, so that a slow check still leaves the hello time to succeed on Mooncake."""
    return min(SAMEHOST_CHECK_S, hello_timeout_s / 4)


def check_transport_addr(meta: WorkerMetadata) -> None:
    """A worker's Mooncake address must not name a same-host plane (of CPU or GPU memory): such a plane is reached
    only through `samehost_addr`, whose process P checks against the connection it came on.

    Raises:
        PeerMismatch: `transport_addr` is a same-host session string (naming it).
    """
    if is_same_host(meta.transport_addr):
        raise PeerMismatch(
            f"worker {meta.worker} of {meta.engine_id!r} gives transport_addr {meta.transport_addr!r}, a same-host "
            "session: the same-host plane is offered only as samehost_addr"
        )


@dataclass(frozen=True, slots=True)
class Route:
    """The plane for one (P worker, D worker) pair: `kind` "samehost" or "mooncake", the D session to write to, and
    why (for the log and the admin endpoint)."""

    kind: str
    session: str
    reason: str


PLANE_NAMES: Final = {"mooncake": "Mooncake", "samehost": "same-host plane", "cuda_ipc": "GPU plane"}


def probed(route: Route, d: WorkerMetadata, refused: str) -> Route:
    """`route` after P's one probe of its plane (`Transport.reachable`, which may also never answer): as it was when
    the probe passed (`refused` ""), else Mooncake to D worker `d`, saying why."""
    if not refused or route.kind == "mooncake":
        return route
    return Route("mooncake", d.transport_addr, f"the {PLANE_NAMES[route.kind]} is refused: {refused}")


NEEDS_MOONCAKE: Final = "this pair takes Mooncake and the D worker runs none"
"""How P's refusal of a hello begins when the pair's writes must go over Mooncake and D's hello named no Mooncake
session: D starts its engine, where its setting allows, and says hello again (`needs_mooncake`)."""


def needs_mooncake(route: Route, d: WorkerMetadata) -> str:
    """Why P refuses D worker `d` on `route`, or "": a pair on Mooncake needs D's engine running, and D starts it
    only for a pair it expects there (a probe that refused the same-host plane is the surprise)."""
    if route.kind != "mooncake" or d.transport_addr:
        return ""
    return f"{NEEDS_MOONCAKE} (its hello names no Mooncake session): {route.reason}"


def choose_transport(p: WorkerMetadata, d: WorkerMetadata, setting: str = "auto") -> Route:
    """The route of P worker `p`'s writes into D worker `d` (module docstring).

    Raises:
        ValueError: `setting` is not one of `SETTINGS`.
    """
    if setting not in SETTINGS:
        raise ValueError(f"transport setting {setting!r} is not one of {', '.join(SETTINGS)}")
    mooncake = d.transport_addr
    if setting == "mooncake":
        return Route("mooncake", mooncake, "Mooncake forced by configuration")
    if not p.samehost_addr or not d.samehost_addr:
        side = "this P worker" if not p.samehost_addr else f"D worker {d.worker} of {d.engine_id!r}"
        return Route(
            "mooncake", mooncake, f"{side} offers no same-host plane (off, or GPU memory CUDA IPC cannot export)"
        )
    try:
        mine, theirs = SameHostAddress.parse(p.samehost_addr), SameHostAddress.parse(d.samehost_addr)
    except ValueError as exc:
        return Route("mooncake", mooncake, str(exc))
    if mine.host != theirs.host:
        return Route("mooncake", mooncake, f"another host (P {mine.host}, D {theirs.host})")
    if mine.uid != theirs.uid:
        return Route("mooncake", mooncake, f"another user (P uid {mine.uid}, D uid {theirs.uid})")
    if mine.kind != theirs.kind:
        return Route("mooncake", mooncake, f"P's KV is {_MEMORY[mine.kind]}, D's {_MEMORY[theirs.kind]}")
    if theirs.gpu:
        return Route("cuda_ipc", d.samehost_addr, f"same host, same user, KV on GPUs (P {mine.gpu}, D {theirs.gpu})")
    return Route("samehost", d.samehost_addr, "same host, same user, KV in CPU memory")


_MEMORY: Final = {"samehost": "in CPU memory", "cuda_ipc": "on a GPU"}


def check_ipc_handles(session: str, regions: Sequence[Region], handles: Sequence[IpcHandle]) -> str:
    """ "" when every region D publishes lies inside one allocation D exports (`handles`), each handle being the
    size CUDA IPC gives and the allocations apart from each other, else why not: P maps exactly what D exported and
    writes nothing outside it. Raises nothing."""
    if not handles:
        return f"{session} exports no GPU allocation"
    spans: list[tuple[int, int]] = []
    for i, h in enumerate(handles):
        if len(h.handle) != IPC_HANDLE_BYTES:
            return f"IPC handle {i} of {session} has {len(h.handle)} bytes, not {IPC_HANDLE_BYTES}"
        if h.base < 0 or h.size <= 0 or h.base + h.size > _ADDRESS_END:
            return f"IPC handle {i} of {session} spans [{h.base:#x}, +{h.size}), no allocation"
        spans.append((h.base, h.base + h.size))
    spans.sort()
    for (_, end), (start, _) in pairwise(spans):
        if start < end:
            return f"two IPC handles of {session} overlap at {start:#x}"
    starts = [start for start, _ in spans]
    for addr, length in regions:
        i = bisect_right(starts, addr) - 1
        if i < 0 or addr + length > spans[i][1]:
            return f"region [{addr:#x}, +{length}) of {session} lies in no allocation it exports"
    return ""


_ADDRESS_END: Final = 1 << 64


@cache
def rule_on(kind: str, rule: StagingRule) -> StagingRule:
    """`rule` with the costs of plane `kind`: on the same-host plane a piece costs about a microsecond and a gathered
    byte its copy, so P gathers pieces of a few KiB and writes larger ones direct, and a window (a scatter on D's
    loop) rarely pays; on the GPU plane a piece costs about a microsecond of P's loop and a gather or scatter on
    the device almost nothing, so whatever is split is staged on the device; on Mooncake `rule` as configured."""
    if kind == "samehost":
        return replace(
            rule, descriptor_cost_s=SAMEHOST_DESCRIPTOR_COST_S, gather_cost_s_per_byte=SAMEHOST_GATHER_COST_S_PER_BYTE
        )
    if kind == "cuda_ipc":
        byte = GPU_GATHER_COST_S_PER_BYTE
        return replace(
            rule, descriptor_cost_s=GPU_DESCRIPTOR_COST_S, gather_cost_s_per_byte=byte, scatter_cost_s_per_byte=byte
        )
    return rule


__all__ = [
    "GPU_SCHEME",
    "IPC_HANDLE_BYTES",
    "NEEDS_MOONCAKE",
    "PLANES",
    "PLANE_NAMES",
    "SAMEHOST_CHECK_S",
    "SAMEHOST_DESCRIPTOR_COST_S",
    "SAMEHOST_GATHER_COST_S_PER_BYTE",
    "SCHEME",
    "SETTINGS",
    "Route",
    "SameHostAddress",
    "check_ipc_handles",
    "check_transport_addr",
    "choose_transport",
    "is_same_host",
    "needs_mooncake",
    "probed",
    "rule_on",
    "samehost_check_budget",
]
