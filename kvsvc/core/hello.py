"""The hello that opens every control connection, as sans-IO decisions: D opens it, answers P's challenge and checks
P's acceptance; P challenges D and accepts or refuses it.

Pure module: standard library and kvsvc's pure core only. The hello is the last step of the handshake, which in kvsvc
means everything a D worker does to meet a P engine: fetch its published worker metadata, connect to the P workers
it needs, and hello each. The exchange is a mutual challenge-response over a key derived from the deployment's
control token (`kvsvc.core.auth.HELLO_KEY`), which never goes on the wire:

    D -> P  HelloStart      D's identity, the P worker it expects, D's nonce, whether D has a key
    P -> D  HelloChallenge  P's metadata, P's nonce, P's proof: HMAC(key, "P", both nonces, both identities,
                            the challenge)
    D -> P  Hello           once P's proof verified: D's metadata and stage split, D's proof (label "D", over the
                            challenge and the hello)
    P -> D  HelloOk         once D's proof verified and P can serve D's layout (else HelloRefused): the plane, and
                            P's proof (label "OK", over D's proof and the answer)

Each proof covers the frames before it as their receiver decoded them (`kvsvc.core.messages.canonical`, proof left
empty), so the chain binds the whole transcript: a relay without the key that rewrites either side's metadata (its
pool addresses, planes, IPC handles), the stage split or the plane fails a proof.

Rules: D sends nothing of its pool before P proved the key, and P builds nothing from D's claims before D proved it
(then: another protocol version, a hello meant for another worker or engine start, sizes past `kvsvc.core.bounds`, a
stage split that contradicts D's own layers or P's model, a layout P cannot write into, a same-host address in
`transport_addr` are refused); a proof is only computed once the other side's nonce is known, and D computes its
own only after P's verified, so neither side is an oracle for the other. Without a key on either side the proofs
are empty and unchecked; a key on one side only is refused. Every refusal says why; D accepts only the P worker its
engine published, byte for byte.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from msgspec.structs import replace

from kvsvc.core.auth import NONCE_BYTES, Key, hello_proof, hello_proof_verifies
from kvsvc.core.bounds import check_hello_bounds
from kvsvc.core.data_planes import NEEDS_MOONCAKE, PLANES, check_transport_addr, choose_transport
from kvsvc.core.errors import HandshakeError, NeedsMooncake, PeerMismatch, TopologyError, VersionMismatch
from kvsvc.core.layout import CROSS_LAYER
from kvsvc.core.messages import (
    PROTOCOL_VERSION,
    ErrorMessage,
    Hello,
    HelloChallenge,
    HelloOk,
    HelloRefused,
    HelloStart,
    IpcHandle,
    KVGroup,
    Message,
    Worker,
    WorkerMetadata,
    WorkerRef,
    canonical,
    check_version,
)
from kvsvc.core.planner import check_compatible, expected_destinations

_NO_KEY: Final = "every engine of the deployment needs the same control token, or none has one"


@dataclass(frozen=True, slots=True)
class HelloChallenged:
    """P challenged D: `reply` goes back, and D's `Hello` is checked against `start` (`accept_hello`)."""

    start: HelloStart
    reply: HelloChallenge


@dataclass(frozen=True, slots=True)
class HelloAccepted:
    """P accepts D worker `peer`: `reply` goes back once `seal` gave it its plane and proof, and P serves the D
    workers in `expected` (those of D's engine, laid out as `peer_engine`, that this P worker is the source of)."""

    peer: WorkerRef
    peer_meta: WorkerMetadata
    peer_engine: dict[Worker, WorkerMetadata]
    expected: frozenset[Worker]
    reply: HelloOk
    ipc_handles: list[IpcHandle] = field(default_factory=list)  # D's GPU allocations, checked by P before mapping
    # What P's answer proves over (both nonces, both identities, D's proof); empty without a key.
    transcript: tuple[bytes, bytes, tuple[str, str, int, int], tuple[str, str, int, int], bytes] | None = None
    key: Key | None = None

    def seal(self, plane: str) -> HelloOk:
        """The answer D gets: `reply` with the `plane` P chose, and P's proof over the exchange and this answer."""
        reply = replace(self.reply, plane=plane, proof=b"")
        if self.key is None or self.transcript is None:
            return reply
        d_nonce, p_nonce, d_id, p_id, d_proof = self.transcript
        proof = hello_proof(self.key, b"OK", d_nonce, p_nonce, d_id, p_id, d_proof, canonical(reply))
        return replace(reply, proof=proof)


@dataclass(frozen=True, slots=True)
class HelloRefusal:
    """P refuses the connection: `reply` goes back (a protocol error on P's side), then the connection closes."""

    reason: str
    reply: HelloRefused | ErrorMessage


# -- D's side ----------------------------------------------------------------------------------------------------


def open_hello(me: WorkerMetadata, p: WorkerMetadata, key: Key | None, nonce: bytes) -> HelloStart:
    """D worker `me`'s first frame to P worker `p` as `p`'s engine published it; `nonce` is fresh and random."""
    return HelloStart(
        version=PROTOCOL_VERSION,
        engine_id=me.engine_id,
        incarnation=me.incarnation,
        pp_rank=me.pp_rank,
        tp_rank=me.tp_rank,
        expect_engine_id=p.engine_id,
        expect_incarnation=p.incarnation,
        expect_pp_rank=p.pp_rank,
        expect_tp_rank=p.tp_rank,
        nonce=nonce,
        keyed=key is not None,
    )


def answer_challenge(
    me: WorkerMetadata,
    own_engine: Mapping[Worker, WorkerMetadata],
    p: WorkerMetadata,
    start: HelloStart,
    reply: Message,
    key: Key | None,
    handles: Sequence[IpcHandle] = (),
) -> Hello:
    """D's check of P worker `p`'s answer to `start`, and D's `Hello` once it holds: P's proof verified. `handles`
    are D's exported GPU allocations, which the hello carries only where the pair takes the GPU plane.

    Raises:
        HandshakeError: P refused, answered with something else, another version, a key D lacks (or none where D
            has one), or a proof that does not verify.
        PeerMismatch: P is not the worker its engine published (another start, other metadata).
    """
    ref = WorkerRef.of(p)
    if isinstance(reply, HelloRefused):
        raise HandshakeError(f"{ref} refused the hello: {reply.reason}")
    if not isinstance(reply, HelloChallenge):
        raise HandshakeError(f"{ref} answered the hello with {type(reply).__name__}")
    try:
        check_version(reply.version)
    except VersionMismatch as exc:
        raise HandshakeError(f"{ref}: {exc}") from None
    if reply.sender != p:
        raise PeerMismatch(
            f"{ref} says it is {WorkerRef.of(reply.sender)} with other metadata than its engine published"
        )
    hello = make_hello(me, own_engine, p, b"", handles)
    if key is None:
        if reply.proof:
            raise HandshakeError(f"{ref} proves a control token and this D worker has none: {_NO_KEY}")
        return hello
    if not reply.proof:
        raise HandshakeError(f"{ref} proves no control token and this D worker has one: {_NO_KEY}")
    d_id, p_id = _identity(start), tuple(ref)
    if len(reply.nonce) != NONCE_BYTES or not hello_proof_verifies(
        key, reply.proof, b"P", start.nonce, reply.nonce, d_id, p_id, canonical(_unproven(reply))
    ):
        raise HandshakeError(
            f"{ref} failed to prove this deployment's control token (its proof does not verify): this D worker "
            "sends it nothing more"
        )
    return replace(
        hello, proof=hello_proof(key, b"D", start.nonce, reply.nonce, d_id, p_id, *_transcript(reply, hello))
    )


def make_hello(
    me: WorkerMetadata,
    own_engine: Mapping[Worker, WorkerMetadata],
    p: WorkerMetadata,
    proof: bytes,
    handles: Sequence[IpcHandle] = (),
) -> Hello:
    """D's hello to P worker `p` as `p`'s engine published it, with `proof` as given (`answer_challenge` computes
    D's over this hello); `own_engine` is D's engine (its stage split). D's exported GPU allocations `handles` go
    only where the rule puts the pair on the GPU plane: a handle lets its holder write the allocation, so no other
    P ever sees one."""
    stages = sorted({(m.pp_rank, m.start_layer, m.end_layer) for m in own_engine.values()})
    return Hello(
        version=PROTOCOL_VERSION,
        sender=me,
        stage_layers=[(start, end) for _, start, end in stages],
        expect_engine_id=p.engine_id,
        expect_incarnation=p.incarnation,
        expect_pp_rank=p.pp_rank,
        expect_tp_rank=p.tp_rank,
        proof=proof,
        ipc_handles=list(handles) if choose_transport(p, me).kind == "cuda_ipc" else [],
    )


def check_hello_reply(
    p: WorkerMetadata,
    reply: Message,
    key: Key | None = None,
    start: HelloStart | None = None,
    challenge: Message | None = None,
    hello: Hello | None = None,
) -> str:
    """D's check of P worker `p`'s answer to its `hello` (after `start` and P's `challenge`); the plane P said its
    writes take, which D's staging rule takes (the plane is chosen once, on P). With a `key`, P's proof must cover
    the exchange and this answer.

    Raises:
        NeedsMooncake: P refused the hello for want of D's Mooncake engine.
        HandshakeError: P refused the hello (its reason), answered with something else, named a plane D does not
            know (none, or one of another release), or its proof does not verify (a relay altered the exchange).
        PeerMismatch: P accepted, but is not the worker its engine published (another start, other metadata).
    """
    ref = WorkerRef.of(p)
    if isinstance(reply, HelloRefused):
        if reply.reason.startswith(NEEDS_MOONCAKE):
            raise NeedsMooncake(f"{ref} refused the hello: {reply.reason}")
        raise HandshakeError(f"{ref} refused the hello: {reply.reason}")
    if not isinstance(reply, HelloOk):
        raise HandshakeError(f"{ref} answered the hello with {type(reply).__name__}")
    if reply.sender != p:
        raise PeerMismatch(
            f"{ref} says it is {WorkerRef.of(reply.sender)} with other metadata than its engine published"
        )
    if reply.plane not in PLANES:
        raise HandshakeError(f"{ref} says its writes take plane {reply.plane[:40]!r}; this D knows {', '.join(PLANES)}")
    if key is not None:
        if start is None or not isinstance(challenge, HelloChallenge) or hello is None:
            raise HandshakeError(f"{ref}'s acceptance cannot be checked without the exchange before it")
        answer = replace(reply, proof=b"")
        d_id, p_id = _identity(start), tuple(ref)
        if not hello_proof_verifies(
            key, reply.proof, b"OK", start.nonce, challenge.nonce, d_id, p_id, hello.proof, canonical(answer)
        ):
            raise HandshakeError(
                f"{ref}'s acceptance does not prove this deployment's control token over the exchange: something "
                "between the two workers altered it"
            )
    elif reply.proof:
        raise HandshakeError(f"{ref} proves a control token and this D worker has none: {_NO_KEY}")
    return reply.plane


# -- P's side ----------------------------------------------------------------------------------------------------


def challenge_hello(
    me: WorkerMetadata, first: Message, key: Key | None, nonce: bytes
) -> HelloChallenged | HelloRefusal:
    """P worker `me`'s decision on the first frame of a connection: its challenge (with its proof, computed over
    D's nonce and P's fresh random `nonce`), or a refusal."""
    if not isinstance(first, HelloStart | Hello):
        reason = f"expected hello_start as the first frame, got {type(first).__name__}"
        return HelloRefusal(reason, ErrorMessage(reason=reason))
    try:
        check_version(first.version)
    except VersionMismatch as exc:
        return _refused(str(exc))
    if isinstance(first, Hello):
        return _refused("expected hello_start as the first frame, got hello")
    d = _identity(first)
    expected = (first.expect_engine_id, first.expect_incarnation, first.expect_pp_rank, first.expect_tp_rank)
    actual = (me.engine_id, me.incarnation, me.pp_rank, me.tp_rank)
    if expected != actual:
        return _refused(f"hello expects engine/incarnation/pp/tp {expected}, this worker is {actual}")
    who = f"D worker {first.engine_id}[pp{first.pp_rank},tp{first.tp_rank}]"
    if key is not None and not first.keyed:
        return _refused(f"{who} has no control token and this P worker has one: {_NO_KEY}")
    if key is None and first.keyed:
        return _refused(f"{who} has a control token and this P worker has none: {_NO_KEY}")
    if len(first.nonce) != NONCE_BYTES:
        return _refused(f"{who} sent a nonce of {len(first.nonce)} bytes, expected {NONCE_BYTES}")
    challenge = HelloChallenge(version=PROTOCOL_VERSION, sender=me, nonce=nonce, proof=b"")
    if key is None:
        return HelloChallenged(first, challenge)
    proof = hello_proof(key, b"P", first.nonce, nonce, d, tuple(WorkerRef.of(me)), canonical(challenge))
    return HelloChallenged(first, replace(challenge, proof=proof))


def accept_hello(
    me: WorkerMetadata, challenged: HelloChallenged, second: Message, key: Key | None
) -> HelloAccepted | HelloRefusal:
    """P worker `me`'s decision on D's `Hello`, the frame after its challenge: D's proof first, then its claims."""
    if not isinstance(second, Hello):
        reason = f"expected hello after the challenge, got {type(second).__name__}"
        return HelloRefusal(reason, ErrorMessage(reason=reason))
    start, nonce = challenged.start, challenged.reply.nonce
    d_id = _identity(start)
    if key is None and second.proof:
        return _refused(f"D worker {second.sender.engine_id} proves a control token and this P worker has none")
    if tuple(WorkerRef.of(second.sender)) != d_id:
        return _refused(f"the hello comes from {WorkerRef.of(second.sender)}, the connection was opened as {d_id}")
    p_id = tuple(WorkerRef.of(me))
    if key is not None and not hello_proof_verifies(
        key, second.proof, b"D", start.nonce, nonce, d_id, p_id, *_transcript(challenged.reply, second)
    ):
        return _refused(
            "the hello does not prove this deployment's control token over the exchange (a wrong token, or "
            "something between the two workers altered it)"
        )
    try:
        check_version(second.version)
        d_engine = _d_engine(me, second)
    except (VersionMismatch, PeerMismatch, TopologyError) as exc:
        return _refused(str(exc))
    d = second.sender
    expected = frozenset(expected_destinations(me, d_engine))
    reply = HelloOk(version=PROTOCOL_VERSION, sender=me)
    sealed = (
        None
        if key is None
        else (start.nonce, nonce, d_id, (me.engine_id, me.incarnation, me.pp_rank, me.tp_rank), second.proof)
    )
    return HelloAccepted(WorkerRef.of(d), d, d_engine, expected, reply, list(second.ipc_handles), sealed, key)


def _transcript(challenge: HelloChallenge, hello: Hello) -> tuple[bytes, bytes]:
    """What D's proof covers: P's challenge and D's hello, each with its proof left empty."""
    return canonical(_unproven(challenge)), canonical(replace(hello, proof=b""))


def _unproven(challenge: HelloChallenge) -> HelloChallenge:
    return replace(challenge, proof=b"")


def _identity(start: HelloStart) -> tuple[str, str, int, int]:
    """D's identity as its first frame named it (a `WorkerRef`'s fields)."""
    return (start.engine_id, start.incarnation, start.pp_rank, start.tp_rank)


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
