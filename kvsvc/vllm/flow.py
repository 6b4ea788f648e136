"""The vLLM connector's decisions as sans-IO objects: `SchedulerFlow`, the scheduler side (which requests P holds,
which D loads, and what each engine step tells the workers), and `TransferReports`, what one worker may tell vLLM's
scheduler has finished.

Pure module: standard library and kvsvc's pure core only (no vllm, torch, asyncio). The vLLM adapter
(`kvsvc.vllm.connector`) feeds `SchedulerFlow` plain values from vLLM's hooks and hands `StepMetadata` to the
workers; `kvsvc.vllm.worker` feeds `TransferReports` one call per event. Rules of the scheduler side:
- P holds a request's prompt KV from the step that computes the prompt's last token when the request ends there
  (`max_tokens` 1, as routers send it): the workers call `start_send` right after that forward, so the send never
  waits for another engine step. A request that decodes on P is held when it finishes (its blocks are final only
  then: a preemption may move them). `request_finished` keeps the blocks (returns True) exactly for the requests
  whose hold started, and an aborted one has its hold aborted.
- D asks for every prompt token its prefix cache does not hold (`first_token` is where its own blocks end) and
  loads each request at most once: after a failed load vLLM recomputes it, it never waits on P again.
- Each decision names the request; nothing here raises on what vLLM hands it, except `ParamsError` for D params
  that cannot be used, which the adapter logs before computing the request locally.
- P draws each held request's transfer secret here (`draw_secret`), once: the workers hold with it, and the params
  D receives carry it; D's workers present it to P.
- Push mode (`push`, on P): P holds each request under a transfer and secret D can derive alone
  (`kvsvc.vllm.flow.push_transfer_id`, `push_secret`) and announces push in its params, so a router may send D
  the request at the same time as P; D's request may then reach P before P's hold, which P keeps as an early
  request until the hold starts. D takes router push params only from P endpoints in `push_peers`, and each push
  transfer once: a repeated router id would derive the transfer again, and P answers a transfer it finished with
  its outcome, so D would take blocks nothing wrote as loaded. A pushing P's request that ends unheld (aborted or
  failed mid-prefill) is withdrawn on every worker, so D's waiting fetch fails now, not at its deadline. A
  preemption before the hold changes nothing here: the hold starts with the step that ends the prompt, from the
  request's blocks as vLLM lists them then.
- A router-named transfer (`transfer_id` in both engines' params, llm-d's `mooncake` mode) is held and fetched under
  the router's name, in either mode, with the push secret; D takes it, as push params, from `push_peers` only and
  once; P withdraws it as a pushing P does. D's fetch reaches P before the hold, and P keeps such early requests
  `early_request_timeout_s`: 10 s in pull mode, `recv_timeout_s` in push mode, which the operator's guide asks for.

Rules of a worker's reports (vLLM's scheduler asserts on what it is told; the worker hands in the sends given to the
service and what the service's loop decided of a send or receive, as one `Outcome` value, and asks for each step's
report):
- Each id is reported at most once, and only an id vLLM handed this worker: a send of the step's `sends`, a receive
  of its `recvs`. Anything else the service reports (an id never handed in, a repeat) is dropped.
- A send is reported once the service ended it (or refused it) and vLLM reported the request finished
  (`finished_req_ids`); whichever comes first waits for the other. Its id is held from the step's bind, before
  the forward: with drafts on, vLLM reports the step's finished ids before the step's sends reach the service.
- A receive is reported once it ended; a failed one is in both `finished_recving` and `failed_recving`, with its
  blocks in the load errors of the same step; one whose start was refused fails at the next report.
- Load errors never name vLLM's null block (no request owns it), and none go out for a hybrid model, whose failed
  receives vLLM takes only as whole requests.
- vLLM's engine steps without pause while a request waits for its KV, even when it has nothing to compute; such an
  idle step may wait for the service's news instead (`may_wait`), but only while a receive is owed and nothing is
  ready to report.

The `kv_transfer_params` of vLLM's remote-prefill convention, as kvsvc reads and writes them.

The params (`producer_params`, `parse_remote_prefill`): a request to P carries `{"do_remote_decode": True}`;
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
import secrets
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Final

from kvsvc.core.auth import Key, fields_verify, parse_bootstrap_addr, sign_fields
from kvsvc.core.groups import DROPPING, FULL, MAMBA
from kvsvc.core.messages import MAX_SECRET_CHARS, MIN_SECRET_CHARS, clip
from kvsvc.core.receiver import RecvRequest
from kvsvc.core.sender import SendRequest

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


@dataclass(frozen=True, slots=True)
class SendRefused:
    """The service refused to start a send handed in."""

    req_id: str


@dataclass(frozen=True, slots=True)
class RecvStarted:
    """The service started a receive of the step; `push`: it waits for a pushing P's prefill."""

    req_id: str
    block_ids: tuple[int, ...]
    push: bool = False


@dataclass(frozen=True, slots=True)
class RecvRefused:
    """The service refused to start a receive of the step."""

    req_id: str
    block_ids: tuple[int, ...]


# What the service's loop decided of one send or receive handed to it: posted by the loop, taken in order.
Outcome = SendRefused | RecvStarted | RecvRefused


@dataclass(slots=True)
class TransferResults:
    """One step's report for vLLM (see module docstring). `service_failures`: the ids of `failed_recving` that
    the service failed (the others could not start), whose reasons the worker logs."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    service_failures: set[str] = field(default_factory=set)


class TransferReports:
    """The ids of one worker between vLLM handing them in and vLLM hearing they finished (see module docstring)."""

    def __init__(self) -> None:
        self._holding: set[str] = set()  # sends handed to the service (started or refused), until reported
        self._ended: set[str] = set()  # of those, the ones the service ended, waiting for vLLM's finish
        self._seen_finished: set[str] = set()  # of those, the ones vLLM reported finished, waiting for the end
        self._receiving: dict[str, tuple[int, ...]] = {}  # started receives, with their blocks
        self._pushed: set[str] = set()  # those of them that wait for a pushing P's prefill (router push params)
        self._refused: dict[str, tuple[int, ...]] = {}  # receives that could not start: fail at the next report
        self._invalid: set[int] = set()  # blocks of failed receives, until `take_load_errors`

    # -- events ------------------------------------------------------------------------------------------------

    def sends_handed(self, req_ids: Iterable[str]) -> None:
        """The step's sends are bound (vLLM names them before its forward): each is reported once the service ended
        it and vLLM saw its request finish, whether vLLM reports the finish before or after the sends reach the
        service. Handing the same ids in again changes nothing."""
        self._holding.update(req_ids)

    def sends_dropped(self, req_ids: Iterable[str]) -> None:
        """The step's sends never reached the service (its loop is closed): nothing is owed for them."""
        for req_id in req_ids:
            self._holding.discard(req_id)
            self._ended.discard(req_id)
            self._seen_finished.discard(req_id)

    def decided(self, outcome: Outcome) -> None:
        """Take what the service's loop decided of a send or receive (`Outcome`)."""
        match outcome:
            case SendRefused(req_id):
                self.send_refused(req_id)
            case RecvStarted(req_id, block_ids, push):
                self.recv_started(req_id, block_ids, push)
            case RecvRefused(req_id, block_ids):
                self.recv_refused(req_id, block_ids)

    def send_refused(self, req_id: str) -> None:
        """The service refused to start a send handed in (vLLM keeps the blocks until it hears of the id, so it is
        reported as if the send ended; D's fetch fails cleanly)."""
        if req_id in self._holding:
            self._ended.add(req_id)

    def recv_started(self, req_id: str, block_ids: Sequence[int], push: bool = False) -> None:
        """The service started a receive of the step: reported once the service reports it ended. `push`: it waits
        for a pushing P's prefill, which the router started at the same time."""
        self._receiving[req_id] = tuple(block_ids)
        if push:
            self._pushed.add(req_id)

    def recv_refused(self, req_id: str, block_ids: Sequence[int]) -> None:
        """The service refused to start a receive of the step: reported failed at the next report."""
        self._refused[req_id] = tuple(block_ids)

    # -- each step's report ------------------------------------------------------------------------------------

    def report(
        self,
        finished_req_ids: Iterable[str],
        finished_sending: Iterable[str] = (),
        finished_recving: Iterable[str] = (),
        failed_recving: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
    ) -> TransferResults:
        """What vLLM is told this step: `finished_req_ids` are the requests vLLM reports finished, the rest is the
        service's report since the last step (`KVTransferService.get_finished`)."""
        results = TransferResults()
        self._seen_finished |= self._holding.intersection(finished_req_ids)
        self._ended |= self._holding.intersection(finished_sending)
        ready = self._ended & self._seen_finished
        results.finished_sending = ready
        self._ended -= ready
        self._seen_finished -= ready
        self._holding -= ready
        failed = set(failed_recving)
        for req_id in finished_recving:
            self._pushed.discard(req_id)
            if self._receiving.pop(req_id, None) is not None:
                results.finished_recving.add(req_id)
        self._pushed.difference_update(failed)
        ours = {req_id for req_id in failed if self._receiving.pop(req_id, None) is not None}
        results.finished_recving |= ours
        results.failed_recving |= ours
        results.service_failures = ours
        self._invalid.update(invalid_block_ids)
        for req_id, blocks in self._refused.items():
            results.finished_recving.add(req_id)
            results.failed_recving.add(req_id)
            self._invalid.update(blocks)
        self._refused.clear()
        return results

    def take_load_errors(self, *, hybrid: bool) -> set[int]:
        """The blocks of failed receives since the last call, less vLLM's null block (which a sliding-window group's
        list holds where the window has passed); none for a `hybrid` model."""
        invalid, self._invalid = self._invalid, set()
        return set() if hybrid else invalid - {NULL_BLOCK}

    def may_wait(self, finished_req_ids: Iterable[str]) -> bool:
        """Whether an idle step may wait for the service's news before it reports: true while a receive has not
        ended in the service and nothing could be reported now (a refused receive, a send ended in the service
        whose request vLLM reports finished now or earlier). Sends alone never make a step wait: that step is P's,
        where a new request's prefill would wait behind it, and D's fetch ends P's wait soon."""
        if self._refused or not self._receiving:
            return False
        return not self._ended & (self._seen_finished | self._holding.intersection(finished_req_ids))

    def idle_wait(self, finished_req_ids: Iterable[str], pull_s: float, push_s: float) -> float:
        """How long an idle step waits for the service's news (a receive's end wakes it at once): 0 unless
        `may_wait`; `push_s` while every receive owed waits for a pushing P's prefill, hundreds of milliseconds of
        steps that would compute nothing and take the cores P's forward may share; else `pull_s`, as a new request
        arriving meanwhile waits for the step's end."""
        if not self.may_wait(finished_req_ids):
            return 0.0
        return push_s if self._pushed.issuperset(self._receiving) else pull_s

    @property
    def waiting(self) -> int:
        """Ids handed in and not reported yet: 0 once every transfer of this worker was reported."""
        return len(self._holding) + len(self._receiving) + len(self._refused)


@dataclass(frozen=True, slots=True)
class Withdrawal:
    """P (push mode): the engine will never hold `transfer_id`; D's fetches that wait for it fail with `reason`."""

    transfer_id: str
    secret: str
    reason: str


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """What one engine step asks of every worker: started after the forward (sends), before or after it (receives,
    aborts). Immutable: vLLM may hand the same object to a worker in the same process."""

    sends: tuple[SendRequest, ...] = ()
    recvs: tuple[RecvRequest, ...] = ()
    aborts: tuple[str, ...] = ()
    engine: Mapping[tuple[int, int], Any] | None = None  # the engine's merged worker metadata, in one step
    withdrawn: tuple[Withdrawal, ...] = ()
    idle: bool = False  # the step computes nothing: its report may wait for the service's news (`TransferReports`)


class RecvPhase(Enum):
    WAITING = "waiting"  # params accepted; vLLM has not allocated blocks yet
    LOADING = "loading"  # the workers were told to fetch
    ENDED = "ended"  # loaded, failed or never needed: never loaded again


@dataclass(slots=True)
class _Producer:
    prompt_len: int
    prompt_hash: str
    early: bool  # ends in its prefill step: held from that step's forward on
    moved: int  # the prompt tokens whose KV moves (`SchedulerFlow._moved`)
    transfer_id: str  # the request id; in push mode, what D derives from its own (`push_transfer_id`)
    secret: str  # the transfer's, drawn when the request arrives (derived in push mode)
    held: bool = False
    derived: bool = False  # D derives the transfer and secret (push mode, a router-named transfer): D may wait at P


@dataclass(slots=True)
class _Consumer:
    remote: RemotePrefill
    phase: RecvPhase = RecvPhase.WAITING
    push: bool = False


@dataclass(slots=True)
class FlowStatistics:
    producing: int
    consuming: int
    holds_started: int
    loads_started: int
    params_refused: int
    withdrawn: int  # P (push): transfers withdrawn, their requests ended unheld
    recent_loads: dict[str, tuple[int, int]]  # req_id -> (first_token, num_tokens) of the latest loads


RECENT_LOADS = 1024
# Push transfers a D engine remembers having taken: at least as many as P remembers outcomes of
# (`kvsvc.core.sender.Sender`'s `remembered_outcomes`), so none that P could answer again is ever taken twice.
REMEMBERED_PUSHES = 65536


def draw_secret() -> str:
    """A fresh transfer secret: 128 random bits, 22 URL-safe characters."""
    return secrets.token_urlsafe(16)


NULL_BLOCK = 0  # vLLM's null block id: a group's list holds it where it keeps nothing


@dataclass(slots=True)
class SchedulerFlow:
    """The requests of one engine that take part in a transfer (see module docstring).

    `engine_id` names this engine to D engines; `bootstrap_addr` is where they fetch its workers' metadata;
    `block_size` is vLLM's (the scheduler's) block size; `group_kinds` the kind of each of the model's KV cache
    groups (`kvsvc.core.groups`), whose block lists every call hands in, one per group.

    Some prompt tokens are held back (`held_back`): P does not compute them (the adapter cuts vLLM's request,
    `dropped_tokens`), D loads the others and computes them. A model that keeps Mamba state holds back the last
    (a state cannot be un-applied); a multi-module MTP drafter the last `lookahead - 1`, each of its modules reading
    one token further ahead than the one before, whose KV P would otherwise write over unverified drafts (D's first
    decode, rejecting nothing, never rewrites them). A prompt no longer than what is held back moves nothing.
    """

    engine_id: str
    bootstrap_addr: str
    block_size: int
    group_kinds: tuple[str, ...] = (FULL,)
    params_key: Key | None = None  # signs P's params, verifies D's (`kvsvc.core.auth.PARAMS_KEY`); None: no token
    new_secret: Callable[[], str] = draw_secret  # what draws each transfer's secret (tests pin it)
    push: bool = False  # P: hold under transfers D derives, and announce push (`kvsvc.vllm.flow`)
    push_peers: frozenset[str] = frozenset()  # D: the P endpoints ("host:port") router push params may name
    tp_size: int = 1  # P: announced with push, as vllm-router expects it
    lookahead: int = 0  # vLLM's `num_prefill_lookahead_tokens`: prompt tokens a drafter reads past the computed ones
    _producers: dict[str, _Producer] = field(default_factory=dict)
    _consumers: dict[str, _Consumer] = field(default_factory=dict)
    _sends: list[SendRequest] = field(default_factory=list)
    _recvs: list[RecvRequest] = field(default_factory=list)
    _aborts: list[str] = field(default_factory=list)
    _withdrawn: list[Withdrawal] = field(default_factory=list)
    _counts: dict[str, int] = field(default_factory=lambda: {"holds": 0, "loads": 0, "refused": 0, "withdrawn": 0})
    _recent: dict[str, tuple[int, int]] = field(default_factory=dict)
    _pushing: dict[str, str] = field(default_factory=dict)  # P: push transfer -> the live request prefilling it
    _pushed: dict[str, None] = field(default_factory=dict)  # push transfers taken, oldest first (`REMEMBERED_PUSHES`)

    # -- a request arrives -------------------------------------------------------------------------------------

    def on_new_request(
        self, req_id: str, prompt: Sequence[int], params: Mapping[str, Any] | None, max_tokens: int | None = None
    ) -> None:
        """Track `req_id` if its params ask for a transfer in either direction; `max_tokens` is its sampling limit.

        Raises:
            ParamsError: D params that cannot be used (malformed, or another prompt's KV); P params naming a bad
                `transfer_id`; a P request whose derived or named transfer another live request prefills. The
                request is not tracked, so vLLM computes it locally (P: without holding its KV).
        """
        if wants_remote_decode(params):
            if self.held_back and len(prompt) <= self.held_back:
                return  # nothing before the tokens held back: D computes the prompt itself
            early = max_tokens == 1 or self.held_back > 0  # P stops after a prefill it cut short
            moved = self._moved(len(prompt))
            digest = prompt_hash(prompt)
            transfer_id, secret = req_id, ""
            named = named_transfer_id(params)
            if named is not None or self.push:
                transfer_id = named or push_transfer_id(req_id)
                if transfer_id in self._pushing:
                    # A repeated X-Request-Id: one hold per transfer, and this one's abort would withdraw the other.
                    raise ParamsError(
                        f"push transfer {transfer_id[:120]!r} is being prefilled here for request "
                        f"{self._pushing[transfer_id][:120]!r} already: P computes this one without holding its KV"
                    )
                self._pushing[transfer_id] = req_id
                secret = push_secret(self.params_key, transfer_id, len(prompt), digest)
            self._producers[req_id] = _Producer(
                len(prompt), digest, early, moved, transfer_id, secret or self.new_secret(), derived=bool(secret)
            )
        elif wants_remote_prefill(params):
            assert params is not None
            push = is_push_request(params) or is_named_request(params)
            try:
                if is_named_request(params):
                    remote = parse_named_prefill(params, prompt, self.params_key, self.push_peers)
                    self._take_push(remote.transfer_id)
                elif push:
                    remote = parse_push_prefill(params, req_id, prompt, self.params_key, self.push_peers)
                    self._take_push(remote.transfer_id)
                else:
                    remote = parse_remote_prefill(params, self.params_key)
                if remote.num_tokens != len(prompt) or remote.prompt_hash != prompt_hash(prompt):
                    raise ParamsError(
                        f"kv_transfer_params describe a prompt of {remote.num_tokens} tokens (hash "
                        f"{remote.prompt_hash}); this request's prompt has {len(prompt)} (hash "
                        f"{prompt_hash(prompt)}): the router passed another request's params"
                    )
            except ParamsError:
                self._counts["refused"] += 1
                raise
            self._consumers[req_id] = _Consumer(remote, push=push)

    def _take_push(self, transfer_id: str) -> None:
        """Remember push transfer `transfer_id` as taken by this engine.

        Raises:
            ParamsError: it was taken before (a repeated router request id).
        """
        if transfer_id in self._pushed:
            raise ParamsError(
                f"push transfer {transfer_id[:120]!r} was already taken by this engine: a repeated X-Request-Id is "
                "computed here, never loaded twice"
            )
        self._pushed[transfer_id] = None
        if len(self._pushed) > REMEMBERED_PUSHES:
            del self._pushed[next(iter(self._pushed))]

    @property
    def keeps_state(self) -> bool:
        """Whether the model keeps Mamba state (see the class docstring)."""
        return MAMBA in self.group_kinds

    @property
    def held_back(self) -> int:
        """The trailing prompt tokens P never computes and D computes itself (see the class docstring), vLLM's
        NixlConnector's rule: one for a state model, `lookahead - 1` for a multi-module MTP drafter."""
        return max(1 if self.keeps_state else 0, self.lookahead - 1)

    def dropped_tokens(self, req_id: str) -> int:
        """How many trailing prompt tokens P must prefill `req_id` without (the adapter cuts vLLM's request)."""
        return self.held_back if req_id in self._producers else 0

    def _moved(self, prompt_len: int) -> int:
        """The prompt tokens whose KV (and state) move from P to D: all but those held back (`held_back`). A
        sliding-window model's D drops the blocks the window has passed as of the tokens it loads; loading the whole
        prompt, vLLM recomputes its last token, whose window reaches one token further back, into a block D already
        dropped (its null block): so D loads one token less and computes the last, whose window its blocks then
        hold. A chunked local group drops likewise, at chunk starts."""
        back = self.held_back if prompt_len > self.held_back else 0
        if any(kind in DROPPING for kind in self.group_kinds) and prompt_len > 1:
            back = max(back, 1)
        return prompt_len - back

    def _flat(self, groups: Sequence[Sequence[int]], num_tokens: int) -> tuple[int, ...]:
        """The blocks of `num_tokens` tokens as kvsvc carries them: each group's list, one group after another, all
        of one length (`kvsvc.core.groups.split_groups`); a Mamba group's state slot (its last block) comes last,
        behind vLLM's null block. A group holding too few leaves the list short, which the planner's checks refuse.

        Raises:
            ValueError: vLLM gave another count of lists than the model has groups.
        """
        if len(groups) != len(self.group_kinds):
            raise ValueError(f"vLLM gave {len(groups)} block lists for {len(self.group_kinds)} KV cache groups")
        used = max(1, -(-num_tokens // self.block_size))
        out: list[int] = []
        for kind, ids in zip(self.group_kinds, groups, strict=True):
            out += [NULL_BLOCK] * (used - 1) + list(ids[-1:]) if kind == MAMBA else list(ids[:used])
        return tuple(out)

    def _holds_all(self, groups: Sequence[Sequence[int]], num_tokens: int) -> bool:
        """Whether every group's list holds the blocks of `num_tokens` tokens."""
        return len(self._flat(groups, num_tokens)) == len(groups) * max(1, -(-num_tokens // self.block_size))

    # -- D: loading --------------------------------------------------------------------------------------------

    def matched_tokens(self, req_id: str, prompt_len: int, num_computed: int) -> tuple[int, bool]:
        """`get_num_new_matched_tokens`: the prompt tokens past `num_computed` (vLLM's own prefix-cache hit) that P
        holds, loaded asynchronously; `(0, False)` for anything else. Has no effect (vLLM calls it repeatedly)."""
        consumer = self._consumers.get(req_id)
        if consumer is None or consumer.phase is not RecvPhase.WAITING:
            return 0, False
        count = self._moved(prompt_len) - num_computed
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, req_id: str, groups: Sequence[Sequence[int]], num_external: int, prompt_len: int) -> None:
        """`update_state_after_alloc`: vLLM gave the request `groups` (each KV cache group's blocks, prefix-cache
        hits first) for `num_external` tokens to load. The second call, once loaded, and calls with nothing to load
        change nothing but end a request that will never load.

        Raises:
            ValueError: as `_flat`.
        """
        consumer = self._consumers.get(req_id)
        if consumer is None or consumer.phase is not RecvPhase.WAITING:
            return
        if num_external <= 0:
            consumer.phase = RecvPhase.ENDED  # vLLM computes it itself (nothing of it is to be fetched)
            return
        consumer.phase = RecvPhase.LOADING
        remote = consumer.remote
        end = self._moved(prompt_len)
        self._recvs.append(
            RecvRequest(
                req_id=req_id,
                transfer_id=remote.transfer_id,
                engine_id=remote.engine_id,
                bootstrap_addr=remote.bootstrap_addr,
                block_ids=self._flat(groups, end),
                num_tokens=end,
                first_token=end - num_external,
                secret=remote.secret,
                push=consumer.push,
            )
        )
        self._counts["loads"] += 1
        self._recent[req_id] = (end - num_external, end)
        if len(self._recent) > RECENT_LOADS:
            del self._recent[next(iter(self._recent))]

    def recvs_reported(self, req_ids: Sequence[str] | set[str]) -> None:
        """The workers reported these receives ended (`finished_recving`): they never load again."""
        for req_id in req_ids:
            consumer = self._consumers.get(req_id)
            if consumer is not None:
                consumer.phase = RecvPhase.ENDED

    # -- P: holding --------------------------------------------------------------------------------------------

    def scheduled(self, req_id: str, num_computed: int, num_scheduled: int, groups: Sequence[Sequence[int]]) -> None:
        """`req_id` is in this step with `num_scheduled` tokens after `num_computed`; `groups` are its blocks, one
        list per KV cache group. A P request that ends in its prefill step is held from right after the forward
        that ends its prompt.

        Raises:
            ValueError: as `_flat`.
        """
        producer = self._producers.get(req_id)
        if producer is None or not producer.early or num_computed + num_scheduled < producer.moved:
            return
        self._hold(req_id, producer, groups)

    def wants_blocks(self, req_id: str) -> bool:
        """Whether `scheduled` needs `req_id`'s block ids (so the adapter looks them up only then)."""
        producer = self._producers.get(req_id)
        return producer is not None and producer.early and not producer.held

    def _hold(self, req_id: str, producer: _Producer, groups: Sequence[Sequence[int]]) -> None:
        if producer.held:
            return
        producer.held = True
        blocks = self._flat(groups, producer.moved)
        self._sends.append(SendRequest(req_id, producer.transfer_id, blocks, producer.moved, producer.secret))
        self._counts["holds"] += 1

    # -- either side: the end of a request ---------------------------------------------------------------------

    def finished(
        self, req_id: str, groups: Sequence[Sequence[int]], *, completed: bool
    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished`: whether vLLM must keep the blocks until the workers report the id, and the params
        to return. `completed` is False for an abort or an error; `groups` are the request's blocks, one list per
        KV cache group.

        P: a completed request is held (from now, if it decoded on P), keeps its blocks and returns D's params; an
        aborted one that was held has its hold aborted and keeps its blocks until the abort drained.
        D: a request still loading is aborted (vLLM keeps its blocks until the workers report it anyway).
        """
        producer = self._producers.pop(req_id, None)
        if producer is not None:
            if self._pushing.get(producer.transfer_id) == req_id:
                del self._pushing[producer.transfer_id]
            if completed and self._holds_all(groups, producer.moved):
                self._hold(req_id, producer, groups)
            if not producer.held:
                if producer.derived:  # D may already wait at P for it: end that wait now
                    why = "completed with its KV not held" if completed else "aborted or failed before its KV was held"
                    reason = f"P's request {req_id[:120]!r} {why}: nothing will be pushed"
                    self._withdrawn.append(Withdrawal(producer.transfer_id, producer.secret, reason))
                    self._counts["withdrawn"] += 1
                return False, None
            if not completed:
                self._aborts.append(req_id)
                return True, None
            remote = RemotePrefill(
                self.engine_id,
                self.bootstrap_addr,
                producer.transfer_id,
                producer.prompt_len,
                producer.prompt_hash,
                producer.secret,
            )
            push = push_announcement(self.bootstrap_addr, self.tp_size) if self.push else None
            return True, producer_params(remote, self.params_key, push)
        consumer = self._consumers.pop(req_id, None)
        if consumer is not None and consumer.phase is RecvPhase.LOADING and not completed:
            self._aborts.append(req_id)
        return False, None

    # -- each step ---------------------------------------------------------------------------------------------

    def build(self) -> StepMetadata:
        """What this step tells the workers; each spec is handed out once."""
        step = StepMetadata(
            tuple(self._sends), tuple(self._recvs), tuple(self._aborts), withdrawn=tuple(self._withdrawn)
        )
        self._sends, self._recvs, self._aborts, self._withdrawn = [], [], [], []
        return step

    def statistics(self) -> FlowStatistics:
        return FlowStatistics(
            producing=len(self._producers),
            consuming=len(self._consumers),
            holds_started=self._counts["holds"],
            loads_started=self._counts["loads"],
            params_refused=self._counts["refused"],
            withdrawn=self._counts["withdrawn"],
            recent_loads=dict(self._recent),
        )
