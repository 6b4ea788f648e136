"""The hello that opens every control connection, as sans-IO decisions: D builds it and checks P's answer; P accepts
or refuses it.

Pure module: standard library and kvsvc's pure core only. The hello is the last step of the handshake, which in kvsvc
means everything a D worker does to meet a P engine: fetch its published worker metadata, connect to the P workers
it needs, and hello each. Rules: P refuses before anything is built from D's claims (a token that differs, another
protocol version, a hello meant for another worker or engine start, sizes past `kvsvc.bounds`, a stage split that
contradicts D's own layers or P's model, a layout P cannot write into); every refusal says why, and the reason
never echoes the token; D accepts only the P worker its engine published, byte for byte.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from msgspec.structs import replace

from kvsvc.bounds import check_hello_bounds
from kvsvc.errors import HandshakeError, PeerMismatch, TopologyError, VersionMismatch
from kvsvc.layout import CROSS_LAYER
from kvsvc.messages import (
    PROTOCOL_VERSION,
    ErrorMessage,
    Hello,
    HelloOk,
    HelloRefused,
    KVGroup,
    Message,
    Worker,
    WorkerMetadata,
    WorkerRef,
    check_version,
)
from kvsvc.planner import check_compatible, expected_destinations
from kvsvc.transports import check_transport_addr


@dataclass(frozen=True, slots=True)
class HelloAccepted:
    """P accepts D worker `peer`: `reply` goes back, and P serves the D workers in `expected` (those of D's
    engine, laid out as `peer_engine`, that this P worker is the source of)."""

    peer: WorkerRef
    peer_meta: WorkerMetadata
    peer_engine: dict[Worker, WorkerMetadata]
    expected: frozenset[Worker]
    reply: HelloOk


@dataclass(frozen=True, slots=True)
class HelloRefusal:
    """P refuses the connection: `reply` goes back (a protocol error on P's side), then the connection closes."""

    reason: str
    reply: HelloRefused | ErrorMessage


def make_hello(
    me: WorkerMetadata, own_engine: Mapping[Worker, WorkerMetadata], p: WorkerMetadata, token: str | None
) -> Hello:
    """D's hello to P worker `p` as `p`'s engine published it; `own_engine` is D's engine (its stage split)."""
    stages = sorted({(m.pp_rank, m.start_layer, m.end_layer) for m in own_engine.values()})
    return Hello(
        version=PROTOCOL_VERSION,
        sender=me,
        stage_layers=[(start, end) for _, start, end in stages],
        expect_engine_id=p.engine_id,
        expect_incarnation=p.incarnation,
        expect_pp_rank=p.pp_rank,
        expect_tp_rank=p.tp_rank,
        token=token or "",
    )


def check_hello_reply(p: WorkerMetadata, reply: Message) -> None:
    """D's check of P worker `p`'s answer to its hello.

    Raises:
        HandshakeError: P refused the hello (its reason), or answered with something else.
        PeerMismatch: P accepted, but is not the worker its engine published (another start, other metadata).
    """
    ref = WorkerRef.of(p)
    if isinstance(reply, HelloRefused):
        raise HandshakeError(f"{ref} refused the hello: {reply.reason}")
    if not isinstance(reply, HelloOk):
        raise HandshakeError(f"{ref} answered the hello with {type(reply).__name__}")
    if reply.sender != p:
        raise PeerMismatch(
            f"{ref} says it is {WorkerRef.of(reply.sender)} with other metadata than its engine published"
        )


def accept_hello(me: WorkerMetadata, first: Message, token: str | None) -> HelloAccepted | HelloRefusal:
    """P worker `me`'s decision on the first frame of a connection; `token` is the deployment's control token."""
    if not isinstance(first, Hello):
        reason = f"expected hello as the first frame, got {type(first).__name__}"
        return HelloRefusal(reason, ErrorMessage(reason=reason))
    if token is not None and not hmac.compare_digest(first.token.encode(), token.encode()):
        return _refused("the hello does not carry this deployment's control token")
    try:
        check_version(first.version)
        d_engine = _d_engine(me, first)
    except (VersionMismatch, PeerMismatch, TopologyError) as exc:
        return _refused(str(exc))
    d = first.sender
    expected = frozenset(expected_destinations(me, d_engine))
    return HelloAccepted(WorkerRef.of(d), d, d_engine, expected, HelloOk(version=PROTOCOL_VERSION, sender=me))


def _refused(reason: str) -> HelloRefusal:
    return HelloRefusal(reason, HelloRefused(version=PROTOCOL_VERSION, reason=reason))


def _d_engine(me: WorkerMetadata, hello: Hello) -> dict[Worker, WorkerMetadata]:
    """D's engine rebuilt from the hello (layout only: P never writes to the others), after checking the hello is
    meant for `me` and that `me` can serve it.

    Raises:
        PeerMismatch: the hello expects another engine, start or worker, or its layer split is inconsistent.
        TopologyError: D's layout cannot be served from `me`'s.
    """
    d = hello.sender
    expected = (hello.expect_engine_id, hello.expect_incarnation, hello.expect_pp_rank, hello.expect_tp_rank)
    actual = (me.engine_id, me.incarnation, me.pp_rank, me.tp_rank)
    if expected != actual:
        raise PeerMismatch(f"hello expects engine/incarnation/pp/tp {expected}, this worker is {actual}")
    check_hello_bounds(me, hello)  # before anything is built from D's claims: the layout below has pp x tp entries
    stages = [(int(s[0]), int(s[1])) for s in hello.stage_layers]
    own_stage = stages[d.pp_rank] if len(stages) == d.pp_size and 0 <= d.pp_rank < d.pp_size else None
    if own_stage != (d.start_layer, d.end_layer):
        raise PeerMismatch(
            f"D worker {WorkerRef.of(d)} layers [{d.start_layer}, {d.end_layer}) disagree with its engine's "
            f"stage split {stages} (pp_size {d.pp_size})"
        )
    check_compatible(me, d)
    check_transport_addr(d)
    engine: dict[Worker, WorkerMetadata] = {}
    for pp, (start, end) in enumerate(stages):
        # One list of placeholder addresses per stage, shared by its ranks: P plans who it sources, never writes there.
        addrs = [0] * (1 if d.layout == CROSS_LAYER else end - start)
        groups = d.kv_groups if pp == d.pp_rank else _stage_groups(d.kv_groups, me.kv_groups, start, end)
        for tp in range(d.tp_size):
            engine[(pp, tp)] = replace(
                d, pp_rank=pp, tp_rank=tp, start_layer=start, end_layer=end, base_addrs=addrs, kv_groups=groups
            )
    return engine


def _stage_groups(d_groups: list[KVGroup], p_groups: list[KVGroup], start: int, end: int) -> list[KVGroup]:
    """The KV cache groups of another stage of D, as far as P needs them: D's groups (kinds, windows, state) over
    the stage's layers `[start, end)`, each layer in the group P keeps it in (both sides group the model alike, and
    P plans only the layers it holds); a layer P does not hold goes to the first group, where no plan reads it."""
    if not d_groups:
        return d_groups
    group_of = {layer: i for i, group in enumerate(p_groups) for layer in group.layers}
    layers: list[list[int]] = [[] for _ in d_groups]
    for layer in range(start, end):
        index = group_of.get(layer, 0)
        layers[index if index < len(d_groups) else 0].append(layer)
    return [replace(group, layers=members) for group, members in zip(d_groups, layers, strict=True)]
