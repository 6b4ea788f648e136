"""Authentication between the engines of one deployment: keys derived from the control token, the signature of the
`kv_transfer_params` P hands out, the proofs of the hello, and the bootstrap addresses a D worker may fetch from.

Pure module: standard library and `kvsvc.core.messages` only. Rules: the control token never leaves its process; each
use gets a key of its own, derived from the token under a label (params, hello), so a value computed for one use never
stands for another. MACs are compared in constant time. A transfer's secret is checked for length
(`kvsvc.core.messages.check_secret`, with the request's other fields) and never put into an error message. The harnesses
and the synthetic runtime, which stand in for both engines and the router, derive a transfer's secret from its id
(`harness_secret`), so that a D started before its P, or in another process, finds it; anyone who knows the id can
derive it, so nothing else may use it. A `Key` never shows its bytes in a repr. An address that comes from a request is
treated as written by an attacker: D builds every URL itself from a host and a port.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from kvsvc.core.messages import METADATA_PATH

# Labels of the derived keys: one per use of the control token.
PARAMS_KEY: Final = "kvsvc/params/v1"
HELLO_KEY: Final = "kvsvc/hello/v1"
# Bytes of a hello nonce.
NONCE_BYTES: Final = 32


class Key:
    """A secret HMAC-SHA256 key; its repr hides it."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("a key must be non-empty")
        self._secret = secret

    def mac(self, *parts: bytes) -> bytes:
        """The HMAC of `parts`, each length-prefixed so that no two sequences of parts encode alike."""
        body = b"".join(len(part).to_bytes(4, "big") + part for part in parts)
        return hmac.new(self._secret, body, hashlib.sha256).digest()

    def verifies(self, mac: bytes, *parts: bytes) -> bool:
        """Whether `mac` is this key's HMAC of `parts` (constant-time)."""
        return hmac.compare_digest(mac, self.mac(*parts))

    def __repr__(self) -> str:
        return "Key(<hidden>)"


def derive_key(token: str | None, label: str) -> Key | None:
    """The key for use `label` (`PARAMS_KEY`, `HELLO_KEY`) from the deployment's control token; None without one."""
    if token is None:
        return None
    return Key(hmac.new(token.encode(), label.encode(), hashlib.sha256).digest())


# -- kv_transfer_params ------------------------------------------------------------------------------------------


def canonical(fields: Mapping[str, Any]) -> bytes:
    """The signed encoding of `fields`: JSON with sorted keys and no spaces (values are str, int, bool, None)."""
    return json.dumps(dict(fields), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_fields(key: Key, fields: Mapping[str, Any]) -> str:
    """The hex signature of exactly `fields` (their names included)."""
    return key.mac(b"params", canonical(fields)).hex()


def fields_verify(key: Key, fields: Mapping[str, Any], signature: str) -> bool:
    """Whether `signature` (hex) signs exactly `fields`."""
    try:
        mac = bytes.fromhex(signature)
    except ValueError:
        return False
    return key.verifies(mac, b"params", canonical(fields))


# -- the hello's proofs ------------------------------------------------------------------------------------------


def hello_proof(
    key: Key,
    label: bytes,
    d_nonce: bytes,
    p_nonce: bytes,
    d: Iterable[object],
    p: Iterable[object],
    *transcript: bytes,
) -> bytes:
    """`label` ("P", "D" or "OK": a proof of one step never stands for another's) over both nonces, both workers'
    identities (engine, start, pp rank, tp rank) and the `transcript` of the exchange so far (the frames' bytes as
    their receiver re-encodes them, `kvsvc.core.messages.canonical`), so a relay that alters any field fails the
    proof."""
    ids = [json.dumps([str(x) for x in who], separators=(",", ":")).encode() for who in (d, p)]
    return key.mac(b"hello", label, d_nonce, p_nonce, *ids, *transcript)


def hello_proof_verifies(
    key: Key,
    proof: bytes,
    label: bytes,
    d_nonce: bytes,
    p_nonce: bytes,
    d: Iterable[object],
    p: Iterable[object],
    *transcript: bytes,
) -> bool:
    """Whether `proof` is `hello_proof` of the same values (constant-time)."""
    return hmac.compare_digest(proof, hello_proof(key, label, d_nonce, p_nonce, d, p, *transcript))


# -- bootstrap addresses -----------------------------------------------------------------------------------------


def unkeyed_peer_refusal(own_uid: int, peer_uid: int | None, *, trust_root: bool = False) -> str:
    """Why a control connection without a control token is refused, or "" when it is not. Without a token nothing
    proves a peer belongs to the deployment, so the kernel's word on who holds the far end of the connection stands
    in for the proof: the peer must run as this worker's own user (or as root, where `trust_root` says so). A far
    end the kernel cannot name (`peer_uid` None: another host or network namespace) is refused too."""
    if peer_uid is None:
        return (
            "without a control token a worker trusts only processes of its own user on its own host, and the kernel "
            "names no local process at the far end of this connection"
        )
    if peer_uid == own_uid or (trust_root and peer_uid == 0):
        return ""
    return (
        f"without a control token a worker trusts only processes of its own user: the far end runs as uid "
        f"{peer_uid}, this worker as uid {own_uid} (set a control token, the same on every engine)"
    )


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address or `localhost` (a name that may resolve elsewhere is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class BootstrapAddress:
    """A P engine's handshake endpoint as D reaches it: a host and a port, nothing else."""

    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def metadata_url(self) -> str:
        """The only URL D fetches from this endpoint."""
        return self.url + METADATA_PATH


def parse_bootstrap_addr(addr: str, keyed: bool) -> BootstrapAddress:
    """Read `addr` ("http://host:port") as D may use it: without a key (`keyed` False), only a loopback host.

    Raises:
        ValueError: another scheme, userinfo, a path, query or fragment, no port, or a host beyond loopback without
            a key; the message names the address.
    """
    what = f"bootstrap address {addr!r}"
    if not isinstance(addr, str) or not addr.isprintable() or " " in addr:
        raise ValueError(f"{what} is not a printable URL")
    try:
        split = urlsplit(addr)
        port = split.port
    except ValueError as exc:
        raise ValueError(f"{what} is malformed: {exc}") from None
    if split.scheme != "http":
        raise ValueError(f"{what}: scheme {split.scheme!r}, only 'http://host:port' is fetched")
    if "@" in split.netloc:
        raise ValueError(f"{what} carries userinfo; only 'http://host:port' is fetched")
    if split.path or split.query or split.fragment or "?" in addr or "#" in addr:
        raise ValueError(f"{what} has a path, query or fragment; only 'http://host:port' is fetched")
    host = split.hostname or ""
    if not host or port is None or not 0 < port < 65536:
        raise ValueError(f"{what} needs a host and a port")
    if not keyed and not is_loopback(host):
        raise ValueError(
            f"{what} is beyond loopback and this engine has no control token: without one, kvsvc fetches only "
            "from loopback addresses (127.0.0.0/8, ::1, localhost)"
        )
    return BootstrapAddress(host, port)


def check_control_addr(bootstrap: BootstrapAddress, control_addr: str) -> None:
    """A P worker's published `control_addr` ("host:port") must be on the bootstrap address's host, or on loopback
    when that is loopback: a metadata document cannot send D's hello to another machine.

    Raises:
        ValueError: another host, or a malformed address; the message names both addresses.
    """
    host, _, port = control_addr.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    same = host.lower() == bootstrap.host.lower() or (is_loopback(bootstrap.host) and is_loopback(host))
    if not port.isdigit() or not same:
        raise ValueError(
            f"control address {control_addr!r} is not on the host of bootstrap address {bootstrap.url!r}: a P "
            "engine's workers must be reached on the host its handshake endpoint is reached at"
        )


def harness_secret(transfer_id: str) -> str:
    """The secret the harnesses (`kvsvc.testing`) and the synthetic runtime (`workers/`) use for `transfer_id`: 32
    hex digits derived from the id, for tests, demos and benchmarks only (a deployment draws each at random:
    `kvsvc.service.new_transfer_secret`, vLLM's producer params). Raises nothing."""
    return hashlib.blake2b(
        transfer_id.encode("utf-8", "surrogatepass"), digest_size=16, person=b"kvsvc-harness"
    ).hexdigest()
