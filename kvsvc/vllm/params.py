"""The `kv_transfer_params` of vLLM's remote-prefill convention, as kvsvc reads and writes them.

Pure module: standard library and `kvsvc.core.auth` only. Rules: a request to P carries `{"do_remote_decode": True}`;
P's finished output carries what `producer_params` builds, and the caller hands that dict unchanged to D, so every
key D needs is in it and nothing else is required of a router. With a control token, P signs every field it emits
(their names are listed in the dict, so a field added to `producer_params` is signed without more ado) and D reads
only signed fields of params whose signature verifies: a client can neither forge nor alter them. Keys vLLM or a
router add are ignored. D refuses params it cannot use with a `ParamsError` naming the key and value (never a
secret), so the request is computed locally instead of waiting on a transfer that cannot happen. Every value is a
msgpack-native type: vLLM carries the dict between its processes with msgpack.

Push mode (`push_announcement`, `parse_push_prefill`): a P that pushes says so in its params in the form vllm-router
reads, and the router then sends D params of its own making, at the same time as it sends P the request, so they
carry nothing P drew. Both sides derive the transfer from what they share: the id (`push_transfer_id`, the router's
request id as vLLM embeds it in each engine's request id) and the secret (`push_secret`, a MAC under the
deployment's key over that id and the prompt's length and digest). A D whose prompt differs presents another
secret, which P refuses: a client naming another request's id gets nothing. Router params are unsigned, so D opens
only P endpoints its own config lists (`push_peers`).

Router-named transfers (`named_transfer_id`, `parse_named_prefill`): llm-d's `mooncake` mode, which MooncakeConnector
defines, names the transfer itself. It sends P `{do_remote_decode, transfer_id}` and D, at the same time,
`{do_remote_prefill, transfer_id, remote_bootstrap_addr, remote_engine_id}`. P holds under that name and D fetches
it, with the push secret over the name and the prompt; as for push params, D opens only endpoints in `push_peers`.
"""

from __future__ import annotations

import base64
import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvsvc.core.auth import Key, fields_verify, parse_bootstrap_addr, sign_fields
from kvsvc.core.messages import MAX_SECRET_CHARS, clip
from kvsvc.core.requests import MIN_SECRET_CHARS

PARAMS_VERSION: Final = 2
# P signs nine fields, thirteen when it pushes: params that name more are not P's.
MAX_SIGNED_FIELDS: Final = 32
# The keys vLLM's tooling and routers already know (NixlConnector and MooncakeConnector use them too).
DO_REMOTE_DECODE: Final = "do_remote_decode"
DO_REMOTE_PREFILL: Final = "do_remote_prefill"
# The names of the signed fields, and their signature (`kvsvc.core.auth.sign_fields`); absent without a control token.
SIGNED: Final = "kvsvc_signed"
SIGNATURE: Final = "kvsvc_signature"
# The keys of push mode, as vllm-router reads them from P's params and writes them into D's.
TRANSFER_MODE: Final = "transfer_mode"
PUSH: Final = "push"
REMOTE_REQUEST_ID: Final = "remote_request_id"
# The keys of a router-named transfer (llm-d's `mooncake` mode, as MooncakeConnector reads them).
TRANSFER_ID: Final = "transfer_id"
REMOTE_BOOTSTRAP_ADDR: Final = "remote_bootstrap_addr"
MAX_NAME_CHARS: Final = 200  # a UUID with a prefix, with room to spare
MAX_REQUEST_ID_CHARS: Final = 512  # a router's id with vLLM's prefix and suffix, with room to spare
# Without a control token there is no trust boundary (loopback only), but the push secret is still a MAC over the
# request, so a D with another prompt is still refused.
_LOOPBACK_PUSH_KEY: Final = Key(b"kvsvc/push/loopback")


class ParamsError(ValueError):
    """A request's `kv_transfer_params` cannot be used; the message names the key and the value."""


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """What D needs to fetch a request's KV from the P engine that prefilled it."""

    engine_id: str  # P's engine
    bootstrap_addr: str  # P's bootstrap endpoint, "http://host:port"
    transfer_id: str  # the key P holds the KV under
    num_tokens: int  # prompt tokens whose KV P computed
    prompt_hash: str  # of P's prompt token ids, so D never takes the KV of another prompt
    secret: str  # the transfer's secret: P serves only a D that presents it (`kvsvc.core.sender.Sender.hold`)


def prompt_hash(token_ids: Sequence[int]) -> str:
    """A digest of a prompt's token ids (32 hex digits: 128 bits, so finding two prompts of one digest costs about
    2^64 work, not the 2^32 of a 64-bit one, which would load one prompt's KV as another's into D's prefix cache)."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Whether a request sent to P asks for its KV to be held for a remote decode."""
    return bool(params) and bool(params.get(DO_REMOTE_DECODE))  # type: ignore[union-attr]


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """Whether a request sent to D says its prompt was prefilled remotely (its KV is to be fetched)."""
    return bool(params) and bool(params.get(DO_REMOTE_PREFILL))  # type: ignore[union-attr]


def producer_params(remote: RemotePrefill, key: Key | None, push: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The dict P returns in `RequestOutput.kv_transfer_params`: what D's `parse_remote_prefill` reads, signed
    with `key` (derived from the control token; None: unsigned, for loopback deployments), and where P pushes,
    its `push_announcement`.

    A new dict on every call: vLLM adds keys of its own to it.
    """
    fields = {
        DO_REMOTE_PREFILL: True,
        DO_REMOTE_DECODE: False,
        "remote_engine_id": remote.engine_id,
        "remote_bootstrap_addr": remote.bootstrap_addr,
        "transfer_id": remote.transfer_id,
        "remote_num_tokens": remote.num_tokens,
        "remote_prompt_hash": remote.prompt_hash,
        "transfer_secret": remote.secret,
        "kvsvc_params_version": PARAMS_VERSION,
        **(push or {}),
    }
    if key is None:
        return fields
    return {**fields, SIGNED: sorted(fields), SIGNATURE: sign_fields(key, fields)}


def parse_remote_prefill(params: Mapping[str, Any], key: Key | None) -> RemotePrefill:
    """Read the params P returned, as D receives them: with `key` (this engine's, derived from the control token),
    only signed fields of params whose signature verifies; without, only a loopback bootstrap address.

    Raises:
        ParamsError: unsigned params (with a key), a signature that does not verify, a key that is missing or has
            the wrong type, params of another version, or a bootstrap address D does not fetch from; the message
            names the key and what it held.
    """
    fields = _signed_fields(params, key)
    version = fields.get("kvsvc_params_version")
    if version != PARAMS_VERSION:
        raise ParamsError(
            f"kv_transfer_params version {_shown(version)}, this kvsvc reads {PARAMS_VERSION}: pass P's params "
            "unchanged (a P engine running another connector, or an older kvsvc, writes other keys)"
        )
    addr = _get(fields, "remote_bootstrap_addr", str)
    try:
        parse_bootstrap_addr(addr, keyed=key is not None)
    except ValueError as exc:
        raise ParamsError(f"kv_transfer_params['remote_bootstrap_addr']: {exc}") from None
    return RemotePrefill(
        engine_id=_get(fields, "remote_engine_id", str),
        bootstrap_addr=addr,
        transfer_id=_get(fields, "transfer_id", str),
        num_tokens=_get(fields, "remote_num_tokens", int),
        prompt_hash=_get(fields, "remote_prompt_hash", str),
        secret=_secret(fields),
    )


def push_transfer_id(req_id: str) -> str:
    """The transfer a push-mode request is held under on P and asked for on D: its vLLM request id less the random
    suffix vLLM appends (`-` and 8 hex digits). Both engines' ids embed the router's id (`X-Request-Id`) the same
    way, so both derive the same transfer.

    Raises:
        ParamsError: the id is longer than `MAX_REQUEST_ID_CHARS`.
    """
    if len(req_id) > MAX_REQUEST_ID_CHARS:
        raise ParamsError(f"request id of {len(req_id)} characters, limit {MAX_REQUEST_ID_CHARS}")
    head, sep, tail = req_id.rpartition("-")
    if sep and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail):
        req_id = head
    return f"push-{req_id}"


def push_secret(key: Key | None, transfer_id: str, prompt_len: int, digest: str) -> str:
    """The secret of a push-mode transfer (22 URL-safe characters), which P holds with and D presents: a MAC under
    `key` (the deployment's, from the control token) over the transfer and the prompt's length and digest."""
    mac = (key or _LOOPBACK_PUSH_KEY).mac(b"push", transfer_id.encode(), str(prompt_len).encode(), digest.encode())
    return base64.urlsafe_b64encode(mac[:16]).decode().rstrip("=")


def push_announcement(bootstrap_addr: str, tp_size: int) -> dict[str, Any]:
    """The keys a pushing P adds to its params: vllm-router dispatches P and D at once from then on, and hands D
    P's endpoint as `remote_host` and `remote_port`."""
    host, _, port = bootstrap_addr.removeprefix("http://").rpartition(":")
    return {TRANSFER_MODE: PUSH, "remote_host": host.strip("[]"), "remote_port": int(port), "tp_size": tp_size}


def is_push_request(params: Mapping[str, Any]) -> bool:
    """Whether D's params are a router's push-mode params (they name the router's request, not P's transfer)."""
    return REMOTE_REQUEST_ID in params and "kvsvc_params_version" not in params


def parse_push_prefill(
    params: Mapping[str, Any], req_id: str, prompt: Sequence[int], key: Key | None, push_peers: frozenset[str]
) -> RemotePrefill:
    """What D fetches for push-mode params (`is_push_request`) of its request `req_id` with `prompt`: the transfer
    and secret derived from its own id and prompt (`push_transfer_id`, `push_secret`), from the P endpoint the
    params name, which must be one of `push_peers` ("host:port").

    Raises:
        ParamsError: this engine lists no push peers, or not that one; a key missing or of the wrong type; a
            `remote_request_id` that is not part of this request's id; an endpoint D does not fetch from.
    """
    host = _get(params, "remote_host", str)[:255]
    port = _get(params, "remote_port", int)
    peer = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    addr = _push_peer(peer, key, push_peers, "['remote_host'], ['remote_port']")
    router_id = _get(params, REMOTE_REQUEST_ID, str)
    if len(router_id) > MAX_REQUEST_ID_CHARS or router_id not in req_id:
        shown = router_id if len(router_id) <= 80 else f"{router_id[:80]}... ({len(router_id)} characters)"
        raise ParamsError(
            f"kv_transfer_params[{REMOTE_REQUEST_ID!r}] {shown!r} is not part of this request's id {req_id[:200]!r}: "
            "the router must send D the X-Request-Id it sent P"
        )
    return _derived(_get(params, "remote_engine_id", str), addr, push_transfer_id(req_id), prompt, key)


def _push_peer(peer: str, key: Key | None, push_peers: frozenset[str], keys: str) -> str:
    """The bootstrap address of P endpoint `peer` ("host:port") that unsigned router params (`keys`) name, once it
    is one of `push_peers`: the one check that keeps router params from steering D anywhere else.

    Raises:
        ParamsError: no push peers, not one of them, or an address `parse_bootstrap_addr` refuses.
    """
    if not push_peers:
        raise ParamsError(
            f"kv_transfer_params name P endpoint {peer!r}, and this engine's kv_connector_extra_config lists no "
            "push_peers: add the P endpoints it may fetch from"
        )
    if peer not in push_peers:
        raise ParamsError(f"kv_transfer_params name P endpoint {peer!r}, not one of push_peers {sorted(push_peers)}")
    addr = f"http://{peer}"
    try:
        parse_bootstrap_addr(addr, keyed=key is not None)
    except ValueError as exc:
        raise ParamsError(f"kv_transfer_params{keys}: {exc}") from None
    return addr


def _derived(engine_id: str, addr: str, transfer_id: str, prompt: Sequence[int], key: Key | None) -> RemotePrefill:
    """What D fetches of a transfer it derived with P (push mode, a router-named transfer): the secret is the MAC
    over the transfer and D's own prompt, so a D with another prompt presents one P refuses."""
    digest = prompt_hash(prompt)
    secret = push_secret(key, transfer_id, len(prompt), digest)
    return RemotePrefill(engine_id, addr, transfer_id, len(prompt), digest, secret)


def named_transfer_id(params: Mapping[str, Any] | None) -> str | None:
    """The transfer a router named in P's or D's params (`transfer_id`, llm-d's `mooncake` mode), as kvsvc holds
    and fetches it; None when the params name none. kvsvc's own params (`kvsvc_params_version`) never do.

    Raises:
        ParamsError: `transfer_id` is not a string of 1 to `MAX_NAME_CHARS` printable ASCII characters.
    """
    if not params or TRANSFER_ID not in params or "kvsvc_params_version" in params:
        return None
    name = params[TRANSFER_ID]
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS or not name.isascii() or not name.isprintable():
        raise ParamsError(
            f"kv_transfer_params[{TRANSFER_ID!r}] {_shown(name)} is not 1 to {MAX_NAME_CHARS} printable ASCII "
            "characters"
        )
    return f"named-{name}"


def is_named_request(params: Mapping[str, Any]) -> bool:
    """Whether D's params name a router's transfer (`parse_named_prefill`) rather than carry P's params."""
    return TRANSFER_ID in params and REMOTE_BOOTSTRAP_ADDR in params and "kvsvc_params_version" not in params


def parse_named_prefill(
    params: Mapping[str, Any], prompt: Sequence[int], key: Key | None, push_peers: frozenset[str]
) -> RemotePrefill:
    """What D fetches for a router-named transfer (`is_named_request`) of a request with `prompt`: the named transfer
    (`named_transfer_id`), with the push secret over it and the prompt, from the endpoint the params name, which
    must be one of `push_peers` ("host:port").

    Raises:
        ParamsError: this engine lists no push peers, or not that endpoint; a key missing or of the wrong type; a
            bad `transfer_id`; an address that is not `http://host:port`.
    """
    given = _get(params, REMOTE_BOOTSTRAP_ADDR, str)
    peer = given.removeprefix("http://")
    if peer == given or "/" in peer or len(given) > 300:
        raise ParamsError(f"kv_transfer_params[{REMOTE_BOOTSTRAP_ADDR!r}] {_shown(given)} is not 'http://host:port'")
    addr = _push_peer(peer, key, push_peers, f"[{REMOTE_BOOTSTRAP_ADDR!r}]")
    transfer_id = named_transfer_id(params)
    assert transfer_id is not None  # `is_named_request`
    return _derived(_get(params, "remote_engine_id", str)[:MAX_NAME_CHARS], addr, transfer_id, prompt, key)


def _signed_fields(params: Mapping[str, Any], key: Key | None) -> Mapping[str, Any]:
    """The fields D may read: with `key`, exactly those the signature covers, once it verifies; else all."""
    if key is None:
        return params
    names, signature = params.get(SIGNED), params.get(SIGNATURE)
    if signature is None and names is None:
        raise ParamsError(
            f"kv_transfer_params carry no {SIGNATURE!r}, and this engine has a control token: only params a P engine "
            "of the deployment signed are used (pass P's params unchanged)"
        )
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or not isinstance(signature, str):
        raise ParamsError(f"kv_transfer_params[{SIGNED!r}] / [{SIGNATURE!r}] are malformed")
    if len(names) > MAX_SIGNED_FIELDS:
        raise ParamsError(
            f"kv_transfer_params[{SIGNED!r}] names {len(names)} fields, P signs {MAX_SIGNED_FIELDS} at most"
        )
    missing = [name for name in names if name not in params]
    if missing or len(set(names)) != len(names):
        raise ParamsError(f"kv_transfer_params lack signed fields {_shown(missing)} or repeat one")
    fields = {name: params[name] for name in names}
    # P signs strings, numbers and flags only: anything else is not P's, and is refused before it is encoded.
    nested = sorted(name for name, value in fields.items() if not isinstance(value, str | int | float | None))
    if nested:
        raise ParamsError(f"kv_transfer_params fields {_shown(nested)} hold lists or objects; P signs none")
    try:
        verified = fields_verify(key, fields, signature)
    except (TypeError, ValueError):  # a value JSON cannot encode: not what P signed
        verified = False
    if not verified:
        raise ParamsError(
            f"kv_transfer_params[{SIGNATURE!r}] does not verify over fields {_shown(sorted(names))}: they were "
            "altered, or signed with another deployment's control token"
        )
    return fields


def _secret(params: Mapping[str, Any]) -> str:
    """The transfer secret, bounded (it travels in every request to P); an error never shows it."""
    value = params.get("transfer_secret")
    if not isinstance(value, str) or not MIN_SECRET_CHARS <= len(value) <= MAX_SECRET_CHARS:
        shape = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
        raise ParamsError(
            f"kv_transfer_params['transfer_secret'] holds {shape}, expected a string of {MIN_SECRET_CHARS} to "
            f"{MAX_SECRET_CHARS} characters: pass P's params unchanged"
        )
    return value


def _get(params: Mapping[str, Any], key: str, kind: type[Any]) -> Any:
    value = params.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) or value in ("", None):
        raise ParamsError(f"kv_transfer_params[{key!r}] is {_shown(value)}, expected a non-empty {kind.__name__}")
    return value


def _shown(value: object) -> str:
    """`value` as an error shows it: its repr, cut to a line (a client chose it, and errors are logged)."""
    return clip(repr(value) if not isinstance(value, list | dict) else _short_repr(value), 120)


def _short_repr(value: list[Any] | dict[Any, Any]) -> str:
    # Never the whole repr: a nested value deep enough would exhaust the stack, a long one the log.
    items = list(value)[:8]
    more = f", ... {len(value)} in all" if len(value) > 8 else ""
    opening, closing = ("[", "]") if isinstance(value, list) else ("{", "}")
    return opening + ", ".join(clip(repr(x) if isinstance(x, str | int | float | None) else type(x).__name__, 40)
                               for x in items) + more + closing  # fmt: skip
