"""Which data plane carries one P worker's writes into one D worker: the rule the hello applies, and the same-host
address a worker publishes for it.

Rules: Mooncake, unless both workers offer the same-host plane (`WorkerMetadata.samehost_addr`, published only for
KV in CPU memory), run on the same host (the same kernel boot and PID and network namespaces, so a pid names the same
process on both sides and their addresses are one host's) and as the same user; an operator may force Mooncake, or
ask for the same-host plane (`ServiceConfig.transport`), which a pair that does not qualify runs without. The rule
decides from the two metadata alone; the kernel's own check (a ptrace policy) is the driver's one probe, and a
refusal there falls back to Mooncake too. Pure module: standard library and kvsvc's pure core only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from typing import Final

from kvsvc.errors import PeerMismatch
from kvsvc.messages import WorkerMetadata
from kvsvc.staging_plans import StagingRule

SCHEME: Final = "samehost"
SAMEHOST_DESCRIPTOR_COST_S: Final = 1e-6
"""What one more piece costs a same-host write: 8 KiB pieces move at half the speed of 1 MiB ones (3.9 against 8.5
GB/s in one `kvsvc bench` run), about 1 us a piece, where Mooncake's TCP transport takes 30 us."""
SAMEHOST_GATHER_COST_S_PER_BYTE: Final = 0.1e-9
"""What gathering a byte costs before a same-host write: the copy alone (about 10 GB/s in place). The write after it
runs at memory speed too, so the gather delays the first byte little, unlike before a Mooncake write."""
SETTINGS: Final = ("auto", "mooncake", "samehost")
SAMEHOST_CHECK_S: Final = 2.0
"""The most P waits for the check of a same-host peer's process (a few /proc reads and one kernel probe, about a
millisecond on an idle host) before the pair takes Mooncake instead."""
"""`ServiceConfig.transport`: choose by the rule, always Mooncake, or the same-host plane wherever it qualifies."""


@dataclass(frozen=True, slots=True)
class SameHostAddress:
    """Where a same-host peer is: the host it runs on (`host`: boot id, PID and network namespace inodes), its user,
    and its process (pid and start time in clock ticks, so a reused pid is another process). Written as a session
    string `samehost:host:uid:pid:start`."""

    host: str
    uid: int
    pid: int
    start: int

    def __str__(self) -> str:
        return f"{SCHEME}:{self.host}:{self.uid}:{self.pid}:{self.start}"

    @classmethod
    def parse(cls, session: str) -> SameHostAddress:
        """The address `session` names.

        Raises:
            ValueError: not a same-host session string.
        """
        parts = session.split(":")
        try:
            if len(parts) != 5 or parts[0] != SCHEME:
                raise ValueError
            return cls(parts[1], int(parts[2]), int(parts[3]), int(parts[4]))
        except ValueError:
            raise ValueError(f"{session!r} is not a same-host session ({SCHEME}:host:uid:pid:start)") from None


def is_same_host(session: str) -> bool:
    return session.startswith(SCHEME + ":")


def samehost_check_budget(hello_timeout_s: float) -> float:
    """How long P waits for the check of a same-host peer: `SAMEHOST_CHECK_S`, and never more than a quarter of the
    hello's budget, so that a slow check still leaves the hello time to succeed on Mooncake."""
    return min(SAMEHOST_CHECK_S, hello_timeout_s / 4)


def check_transport_addr(meta: WorkerMetadata) -> None:
    """A worker's Mooncake address must not name the same-host plane: that plane is reached only through
    `samehost_addr`, whose process P checks against the connection it came on.

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
        return Route("mooncake", mooncake, f"{side} offers no same-host transport (KV not in CPU memory, or off)")
    try:
        mine, theirs = SameHostAddress.parse(p.samehost_addr), SameHostAddress.parse(d.samehost_addr)
    except ValueError as exc:
        return Route("mooncake", mooncake, str(exc))
    if mine.host != theirs.host:
        return Route("mooncake", mooncake, f"another host (P {mine.host}, D {theirs.host})")
    if mine.uid != theirs.uid:
        return Route("mooncake", mooncake, f"another user (P uid {mine.uid}, D uid {theirs.uid})")
    return Route("samehost", d.samehost_addr, "same host, same user, KV in CPU memory")


@cache
def rule_on(kind: str, rule: StagingRule) -> StagingRule:
    """`rule` with the costs of plane `kind`: on the same-host plane a piece costs about a microsecond and a gathered
    byte its copy, so P gathers pieces of a few KiB and writes larger ones direct, and a window (a scatter on D's
    loop) rarely pays; on Mooncake `rule` as configured."""
    if kind != "samehost":
        return rule
    return replace(
        rule, descriptor_cost_s=SAMEHOST_DESCRIPTOR_COST_S, gather_cost_s_per_byte=SAMEHOST_GATHER_COST_S_PER_BYTE
    )


__all__ = [
    "SAMEHOST_CHECK_S",
    "SAMEHOST_DESCRIPTOR_COST_S",
    "SAMEHOST_GATHER_COST_S_PER_BYTE",
    "SCHEME",
    "SETTINGS",
    "Route",
    "SameHostAddress",
    "check_transport_addr",
    "choose_transport",
    "is_same_host",
    "rule_on",
    "samehost_check_budget",
]
