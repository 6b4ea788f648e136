"""Settings of one worker's transfer service, with the defaults an operator would expect on one host.

Rules: every hold and wait has a deadline here; none is infinite. Values are seconds unless named otherwise. A
control server that listens beyond loopback needs a control token: a hello makes P write KV wherever the caller's
metadata points, so an open control port would hand the KV to anyone who can reach it (docs/decisions.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsvc.core.auth import is_loopback
from kvsvc.core.data_planes import SETTINGS

__all__ = ["ServiceConfig", "is_loopback"]


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """One worker's service settings.

    Raises (constructor):
        ValueError: an empty `control_token` (it would let every hello in), or a `control_host` beyond loopback
            without a `control_token`.
    """

    control_host: str = "127.0.0.1"
    """Address the control server binds; loopback by default."""
    control_port: int = 0
    """0 picks a free port; the bound one is in the published `WorkerMetadata.control_addr`."""
    hold_timeout_s: float = 60.0
    """P frees a request's KV that D workers have not fully fetched after this long, and reports it finished."""
    recv_timeout_s: float = 60.0
    """D fails a receive that its P workers have not completed after this long."""
    early_request_timeout_s: float = 10.0
    """P answers failed a D request for a transfer that was not held (start_send) within this long."""
    abort_grace_s: float = 35.0
    """D reports an aborted receive after this long even if a P worker never confirmed its writes stopped; keep
    it above the transport's progress timeout, after which Mooncake fails writes to a frozen peer."""
    gone_settle_s: float = 1.0
    """When the P worker a receive lost its connection to turns out to be dead (its transfer engine refuses a probe
    at once), D reports the receive failed this long after, instead of after `abort_grace_s`: the time for what
    the dead process had already sent to land."""
    handshake_timeout_s: float = 10.0
    """Fetching a remote engine's metadata, connecting to a worker and its hello each get this long."""
    close_drain_timeout_s: float = 30.0
    """`close` waits this long for in-flight writes before it cancels what is left."""
    window_wait_s: float = 1.0
    """A D worker whose staging region has no room for a window waits this long for some before it asks P without
    one (P then writes the blocks); 0 never waits. Keep it well below P's `hold_timeout_s`."""
    report_gather_s: float = 0.025
    """D: the longest a report of landed receives waits for others about to land, when the engine's step waits on
    it doing nothing (`kvsvc.core.receiver.ReportGather`; never more than a quarter of the engine's step); 0 reports
    each at once."""
    slow_transfer_s: float = 1.0
    """D: a receive that takes longer than this from its start to its landing is logged, once, as a warning naming
    the request, P's engine and workers, the plane, the bytes and the phases; 0 logs none."""
    max_early_requests: int = 65536
    """Requests for transfers not held yet that P buffers; past it, new ones are answered busy."""
    max_early_request_bytes: int = 16 * 1024 * 1024
    """Of those, the block ids one D worker may have waiting, at 8 bytes each (2M ids: hundreds of long requests);
    past it, its new ones are answered busy."""
    max_early_request_bytes_total: int = 64 * 1024 * 1024
    """The same for all D workers together, so that many of them cannot add up past what one P worker budgets."""
    max_control_connections: int = 1024
    """Control connections a P worker holds at once whose hello it accepted; past it, a new hello gets a
    `HelloRefused` naming the limit and is closed. A D engine of TP 8 x PP 4 x DP 8 opens at most 256 to each."""
    max_control_connections_per_host: int = 512
    """Of those and the pending ones, the ones from one host group (`kvsvc.core.bounds.host_group`: all of loopback, an
    IPv4 /24, an IPv6 /64; every D worker of a host shares it)."""
    max_pending_hellos: int = 64
    """Control connections a P worker holds before their hello was accepted, apart from `max_control_connections`:
    a flood of connections that never hello takes these, never the slots of accepted D workers."""
    first_byte_timeout_s: float = 1.0
    """A new control connection to a P worker that sends nothing for this long is closed (its hello then has
    `handshake_timeout_s` in all)."""
    transport: str = "auto"
    """Which data plane this worker's writes take, per D worker (`kvsvc.core.data_planes.choose_transport`): "auto" (the
    same-host plane of the KV's memory where both workers offer it on one host: the kernel copy for CPU memory, CUDA
    IPC for GPUs; else Mooncake), "mooncake", or "samehost" (the same as auto, but a pair that cannot use it is
    logged as a warning)."""
    trust_root_peers: bool = False
    """Without a control token a worker accepts control connections only from processes of its own user, by the
    kernel's word on the far end of the socket; True also accepts root's (uid 0). Ignored with a token."""
    control_token: str | None = field(default=None, repr=False)
    """A secret shared by the deployment's engines, never sent: keys derived from it prove each side of a hello to
    the other, and sign the `kv_transfer_params` P hands out (docs/operations.md, Security). None (the default):
    hellos carry no proof, and D fetches only from loopback bootstrap addresses. Hidden from the repr."""

    def __post_init__(self) -> None:
        if self.transport not in SETTINGS:
            raise ValueError(f"transport {self.transport!r} is not one of {', '.join(SETTINGS)}")
        if self.max_pending_hellos < 1 or self.first_byte_timeout_s <= 0:
            raise ValueError(
                f"max_pending_hellos must be >= 1 and first_byte_timeout_s > 0, got {self.max_pending_hellos} and "
                f"{self.first_byte_timeout_s}"
            )
        if self.slow_transfer_s < 0:
            raise ValueError(f"slow_transfer_s must be >= 0 (0 logs none), got {self.slow_transfer_s:g}")
        if self.report_gather_s < 0:
            raise ValueError(f"report_gather_s must be >= 0 (0 reports at once), got {self.report_gather_s:g}")
        if self.control_token == "":
            raise ValueError("control_token must be a non-empty secret, or None for no token")
        if self.control_token is None and not is_loopback(self.control_host):
            raise ValueError(
                f"control_host {self.control_host!r} is reachable beyond loopback, so the control server needs a "
                "control_token (the same secret on every engine of the deployment)"
            )
