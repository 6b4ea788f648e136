"""The hello as pure decisions (`kvsvc.core.hello`): D opens, P challenges, D proves, P accepts or refuses; D checks
P's answers. No sockets or event loop: two workers' metadata talk back to back."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsvc.cli.plan import synthetic_engine
from kvsvc.core.auth import HELLO_KEY, NONCE_BYTES, Key, derive_key
from kvsvc.core.errors import HandshakeError, PeerMismatch
from kvsvc.core.hello import (
    HelloAccepted,
    HelloChallenged,
    HelloRefusal,
    accept_hello,
    answer_challenge,
    challenge_hello,
    check_hello_reply,
    make_hello,
    open_hello,
)
from kvsvc.core.messages import (
    PROTOCOL_VERSION,
    ConvPart,
    ErrorMessage,
    Hello,
    HelloChallenge,
    HelloOk,
    HelloRefused,
    IpcHandle,
    KVGroup,
    MambaState,
    Ping,
    encode,
)

P = synthetic_engine("P", pp_size=1, tp_size=1, num_layers=4, num_kv_heads=4, head_size=8, block_size=16, num_blocks=8)
D = synthetic_engine("D", pp_size=2, tp_size=2, num_layers=4, num_kv_heads=4, head_size=8, block_size=16, num_blocks=8)
P0, D0 = P[(0, 0)], D[(0, 0)]
TOKEN = "s3cret-token"
KEY = derive_key(TOKEN, HELLO_KEY)
D_NONCE, P_NONCE = b"d" * NONCE_BYTES, b"p" * NONCE_BYTES


def _exchange(d_key: Key | None, p_key: Key | None) -> HelloAccepted | HelloRefusal:
    """The whole hello between D0 and P0, each side with its own key."""
    start = open_hello(D0, P0, d_key, D_NONCE)
    challenged = challenge_hello(P0, start, p_key, P_NONCE)
    if isinstance(challenged, HelloRefusal):
        return challenged
    hello = answer_challenge(D0, D, P0, start, challenged.reply, d_key)
    return accept_hello(P0, challenged, hello, p_key)


def _challenged(key: Key | None = KEY) -> HelloChallenged:
    challenged = challenge_hello(P0, open_hello(D0, P0, key, D_NONCE), key, P_NONCE)
    assert isinstance(challenged, HelloChallenged)
    return challenged


@pytest.mark.parametrize("key", [KEY, None], ids=["keyed", "no key"])
def test_p_accepts_a_hello_meant_for_it_and_learns_which_d_workers_it_serves(key: Key | None) -> None:
    decision = _exchange(key, key)
    assert isinstance(decision, HelloAccepted)
    assert decision.peer_meta == D0 and decision.expected == frozenset(D)  # P's one worker sources all of D
    assert decision.reply == HelloOk(version=PROTOCOL_VERSION, sender=P0)
    assert sorted(decision.peer_engine) == sorted(D)
    # and D takes the answer, once P's service named the plane it chose (`SendingRole._route`, which probes)
    assert check_hello_reply(P0, msgspec.structs.replace(decision.reply, plane="mooncake")) == "mooncake"


def _keyed_acceptance() -> tuple[HelloChallenged, Hello, HelloAccepted]:
    challenged = _challenged()
    hello = answer_challenge(D0, D, P0, challenged.start, challenged.reply, KEY)
    decision = accept_hello(P0, challenged, hello, KEY)
    assert isinstance(decision, HelloAccepted)
    return challenged, hello, decision


def test_the_proofs_bind_the_transcript_so_a_relay_that_rewrites_any_field_is_refused() -> None:
    """A relay without the key passes both proofs through and rewrites what lies between them: P's metadata in its
    challenge, D's pool in its hello (so that P would write where the relay chose), or the plane P answered."""
    challenged, hello, decision = _keyed_acceptance()
    assert check_hello_reply(P0, decision.seal("samehost"), KEY, challenged.start, challenged.reply, hello)
    # D's pool rewritten on its way to P: P refuses
    elsewhere = msgspec.structs.replace(D0, base_addrs=[a + 4096 for a in D0.base_addrs], transport_addr="6.6.6.6:1")
    forged = accept_hello(P0, challenged, msgspec.structs.replace(hello, sender=elsewhere), KEY)
    assert isinstance(forged, HelloRefusal) and "over the exchange" in forged.reason
    # the stage split or the GPU handles rewritten: refused alike
    for change in (
        {"stage_layers": [(0, 3), (3, 4)]},
        {"ipc_handles": [IpcHandle(handle=b"h" * 64, base=1 << 20, size=1 << 20)]},
    ):
        altered = accept_hello(P0, challenged, msgspec.structs.replace(hello, **change), KEY)
        assert isinstance(altered, HelloRefusal), change
    # P's metadata rewritten on its way to D (D compares it with the engine document the relay may also have
    # rewritten): D's check of P's proof fails
    p_elsewhere = msgspec.structs.replace(P0, transport_addr="6.6.6.6:1")
    with pytest.raises(HandshakeError, match="failed to prove"):
        answer_challenge(
            D0, D, p_elsewhere, challenged.start, msgspec.structs.replace(challenged.reply, sender=p_elsewhere), KEY
        )
    # the plane of P's answer rewritten on its way back: D refuses
    sealed = decision.seal("samehost")
    with pytest.raises(HandshakeError, match="altered"):
        check_hello_reply(
            P0, msgspec.structs.replace(sealed, plane="mooncake"), KEY, challenged.start, challenged.reply, hello
        )
    # an answer without a proof, or one sealed for another hello, does not verify either
    with pytest.raises(HandshakeError, match="altered"):
        check_hello_reply(
            P0, msgspec.structs.replace(sealed, proof=b""), KEY, challenged.start, challenged.reply, hello
        )
    other = msgspec.structs.replace(hello, proof=b"x" * 32)
    with pytest.raises(HandshakeError, match="altered"):
        check_hello_reply(P0, sealed, KEY, challenged.start, challenged.reply, other)


def test_the_token_and_d_s_pool_never_go_out_before_p_proved_the_key() -> None:
    """D's first frame holds its identity and a nonce only: no token, no pool address, no transfer address."""
    d = msgspec.structs.replace(D0, transport_addr="10.9.8.7:15000", control_addr="10.9.8.7:16000")
    start = open_hello(d, P0, KEY, D_NONCE)
    wire = encode(start)
    assert TOKEN.encode() not in wire and b"10.9.8.7" not in wire
    assert set(msgspec.structs.asdict(start)) == {
        *("version", "engine_id", "incarnation", "pp_rank", "tp_rank", "nonce", "keyed"),
        *("expect_engine_id", "expect_incarnation", "expect_pp_rank", "expect_tp_rank"),
    }


@pytest.mark.parametrize(
    ("d_key", "p_key", "reason"),
    [
        (None, KEY, "has no control token and this P worker has one"),
        (KEY, None, "has a control token and this P worker has none"),
    ],
)
def test_a_key_on_one_side_only_is_refused_by_p(d_key: Key | None, p_key: Key | None, reason: str) -> None:
    decision = challenge_hello(P0, open_hello(D0, P0, d_key, D_NONCE), p_key, P_NONCE)
    assert isinstance(decision, HelloRefusal) and reason in decision.reason


def test_a_fake_p_without_the_key_gets_nothing_of_d() -> None:
    """A fake P answers with a challenge it cannot prove (no proof, or one under another key): D raises before it
    builds its hello, so its pool addresses never leave it."""
    start = open_hello(D0, P0, KEY, D_NONCE)
    no_proof = HelloChallenge(version=PROTOCOL_VERSION, sender=P0, nonce=P_NONCE, proof=b"")
    with pytest.raises(HandshakeError, match="proves no control token and this D worker has one"):
        answer_challenge(D0, D, P0, start, no_proof, KEY)
    other = challenge_hello(P0, start, derive_key("another-deployment", HELLO_KEY), P_NONCE)
    assert isinstance(other, HelloChallenged)
    with pytest.raises(HandshakeError, match="failed to prove this deployment's control token"):
        answer_challenge(D0, D, P0, start, other.reply, KEY)
    with pytest.raises(HandshakeError, match="proves a control token and this D worker has none"):
        answer_challenge(D0, D, P0, open_hello(D0, P0, None, D_NONCE), other.reply, None)


def test_a_p_proof_replayed_to_another_nonce_of_d_does_not_verify() -> None:
    recorded = _challenged().reply
    with pytest.raises(HandshakeError, match="failed to prove"):
        answer_challenge(D0, D, P0, open_hello(D0, P0, KEY, b"x" * NONCE_BYTES), recorded, KEY)


def test_a_fake_d_without_the_key_is_refused_by_p() -> None:
    """A fake D that claims a key cannot prove it: no proof, another key's proof, P's own proof reflected back, or a
    proof recorded from another connection (another nonce of P)."""
    challenged = _challenged()
    honest = answer_challenge(D0, D, P0, challenged.start, challenged.reply, KEY)
    recorded = _challenged()
    recorded = HelloChallenged(recorded.start, msgspec.structs.replace(recorded.reply, nonce=b"q" * NONCE_BYTES))
    forged = {
        "none": b"",
        "another key": answer_challenge(
            D0, D, P0, challenged.start, _other_reply(challenged), derive_key("x", HELLO_KEY)
        ).proof,
        "P's own proof": challenged.reply.proof,
    }
    for name, proof in forged.items():
        decision = accept_hello(P0, challenged, msgspec.structs.replace(honest, proof=proof), KEY)
        assert isinstance(decision, HelloRefusal), name
        assert "does not prove this deployment's control token" in decision.reason
        assert TOKEN not in decision.reason
    assert isinstance(accept_hello(P0, recorded, honest, KEY), HelloRefusal)  # the replay of a whole exchange


def _other_reply(challenged: HelloChallenged) -> HelloChallenge:
    """P's challenge as a P worker of another deployment would prove it."""
    other = challenge_hello(P0, challenged.start, derive_key("x", HELLO_KEY), P_NONCE)
    assert isinstance(other, HelloChallenged)
    return other.reply


def test_d_s_hello_must_come_from_the_worker_that_opened_the_connection() -> None:
    challenged = _challenged()
    hello = answer_challenge(D0, D, P0, challenged.start, challenged.reply, KEY)
    decision = accept_hello(P0, challenged, msgspec.structs.replace(hello, sender=D[(1, 1)]), KEY)
    assert isinstance(decision, HelloRefusal) and "the connection was opened as" in decision.reason


@given(d_nonce=st.binary(min_size=NONCE_BYTES, max_size=NONCE_BYTES))
def test_a_p_proof_never_verifies_as_a_d_proof(d_nonce: bytes) -> None:
    """Distinct labels: P's proof over the same values is never D's, so P cannot be used as D's oracle."""
    start = open_hello(D0, P0, KEY, d_nonce)
    challenged = challenge_hello(P0, start, KEY, P_NONCE)
    assert isinstance(challenged, HelloChallenged)
    hello = make_hello(D0, D, P0, challenged.reply.proof)
    assert isinstance(accept_hello(P0, challenged, hello, KEY), HelloRefusal)


@pytest.mark.parametrize(
    ("hello_change", "reason"),
    [
        ({"version": 9}, "peer speaks protocol version 9"),
        ({"expect_incarnation": "old"}, "hello expects engine/incarnation/pp/tp"),
        ({"stage_layers": [(0, 3), (3, 4)]}, "disagree with its engine's stage split"),
    ],
)
def test_p_refuses_a_hello_with_the_reason(hello_change: dict[str, object], reason: str) -> None:
    challenged = _challenged(None)
    hello = answer_challenge(D0, D, P0, challenged.start, challenged.reply, None)
    hello = msgspec.structs.replace(hello, **hello_change)
    decision = accept_hello(P0, challenged, hello, None)
    assert isinstance(decision, HelloRefusal) and reason in decision.reason
    assert isinstance(decision.reply, HelloRefused)


@pytest.mark.parametrize(
    ("start_change", "reason"),
    [
        ({"version": 9}, "peer speaks protocol version 9"),
        ({"expect_incarnation": "old"}, "hello expects engine/incarnation/pp/tp"),
        ({"nonce": b"short"}, "nonce of 5 bytes"),
    ],
)
def test_p_refuses_a_first_frame_with_the_reason(start_change: dict[str, object], reason: str) -> None:
    start = msgspec.structs.replace(open_hello(D0, P0, None, D_NONCE), **start_change)
    decision = challenge_hello(P0, start, None, P_NONCE)
    assert isinstance(decision, HelloRefusal) and reason in decision.reason


def test_p_refuses_absurd_sizes_and_layouts_it_cannot_write_into() -> None:
    challenged = _challenged(None)
    huge = msgspec.structs.replace(D0, tp_size=4096)
    decision = accept_hello(P0, challenged, make_hello(huge, D, P0, b""), None)
    assert isinstance(decision, HelloRefusal) and "tp_size 4096" in decision.reason
    other = msgspec.structs.replace(D0, head_size=16)
    decision = accept_hello(P0, challenged, make_hello(other, D, P0, b""), None)
    assert isinstance(decision, HelloRefusal) and "P head_size 8 != D head_size 16" in decision.reason


def test_a_first_frame_that_is_not_a_hello_gets_an_error() -> None:
    decision = challenge_hello(P0, Ping(nonce=1), None, P_NONCE)
    assert isinstance(decision, HelloRefusal) and isinstance(decision.reply, ErrorMessage)
    assert "expected hello_start as the first frame, got Ping" in decision.reason
    old = make_hello(D0, D, P0, b"")  # a D of the first protocol version opens with its hello
    decision = challenge_hello(P0, msgspec.structs.replace(old, version=1), None, P_NONCE)
    assert isinstance(decision, HelloRefusal) and "peer speaks protocol version 1" in decision.reason
    decision = accept_hello(P0, _challenged(None), Ping(nonce=1), None)
    assert isinstance(decision, HelloRefusal) and "expected hello after the challenge, got Ping" in decision.reason


def test_d_refuses_an_answer_from_another_p_than_its_engine_published() -> None:
    with pytest.raises(HandshakeError, match="refused the hello: full"):
        check_hello_reply(P0, HelloRefused(version=PROTOCOL_VERSION, reason="full"))
    with pytest.raises(HandshakeError, match="answered the hello with Ping"):
        check_hello_reply(P0, Ping(nonce=1))
    restarted = msgspec.structs.replace(P0, incarnation="new")
    with pytest.raises(PeerMismatch, match="other metadata than its engine published"):
        check_hello_reply(P0, HelloOk(version=PROTOCOL_VERSION, sender=restarted))
    start = open_hello(D0, P0, None, D_NONCE)
    challenge = HelloChallenge(version=PROTOCOL_VERSION, sender=restarted, nonce=P_NONCE, proof=b"")
    with pytest.raises(PeerMismatch, match="other metadata than its engine published"):
        answer_challenge(D0, D, P0, start, challenge, None)


def test_a_hello_is_what_d_sends_after_the_challenge() -> None:
    challenged = _challenged()
    assert isinstance(answer_challenge(D0, D, P0, challenged.start, challenged.reply, KEY), Hello)


def test_p_lays_out_a_hybrid_d_at_pp2_from_one_stage_hello() -> None:
    """A hybrid D at PP 2 sends its own stage's groups only: P lays out the other stage with D's kinds over that
    stage's layers, as P groups them, and learns it sources both stages (a hello from either stage once crashed P
    checking the other stage's layers against the sender's groups)."""
    from kvsvc.core.messages import KVGroup, WorkerMetadata

    def grouped(meta: WorkerMetadata, layers: range) -> WorkerMetadata:
        kinds = [
            KVGroup(kind="sliding_window", layers=[i for i in layers if i % 3 == 0], sliding_window=96),
            KVGroup(kind="sliding_window", layers=[i for i in layers if i % 3 == 1], sliding_window=96),
            KVGroup(kind="full", layers=[i for i in layers if i % 3 == 2]),
        ]
        return msgspec.structs.replace(meta, kv_groups=kinds, null_block=0)

    shape = dict(tp_size=1, num_layers=6, num_kv_heads=4, head_size=8, block_size=16, num_blocks=8)
    p = grouped(synthetic_engine("P", pp_size=1, **shape)[(0, 0)], range(6))
    d = {w: grouped(m, range(m.start_layer, m.end_layer)) for w, m in synthetic_engine("D", pp_size=2, **shape).items()}
    for sender in d.values():
        start = open_hello(sender, p, None, D_NONCE)
        challenged = challenge_hello(p, start, None, P_NONCE)
        assert isinstance(challenged, HelloChallenged)
        hello = answer_challenge(sender, d, p, start, challenged.reply, None)
        decision = accept_hello(p, challenged, hello, None)
        assert isinstance(decision, HelloAccepted), decision
        assert decision.expected == frozenset(d)
        assert decision.peer_engine[(0, 0)].kv_groups == d[(0, 0)].kv_groups
        assert decision.peer_engine[(1, 0)].kv_groups == d[(1, 0)].kv_groups


@pytest.mark.parametrize(
    ("crafted", "reason"),
    [
        # A chunk other than P's: P would write the wrong tokens' blocks.
        (lambda groups: [groups[0], msgspec.structs.replace(groups[1], attention_chunk=32), groups[2]], "differs"),
        # The short conv claimed whole on every rank (one group): P would write its whole slot where D holds a slice.
        (
            lambda groups: [
                msgspec.structs.replace(
                    groups[0],
                    mamba=msgspec.structs.replace(groups[0].mamba, conv_parts=[ConvPart(channels=64, groups=1)]),
                ),
                *groups[1:],
            ],
            "differs",
        ),
        # A chunk on a full-attention group.
        (lambda groups: [*groups[:2], msgspec.structs.replace(groups[2], attention_chunk=64)], "attention_chunk 64"),
    ],
)
def test_p_refuses_a_hello_whose_short_conv_or_chunked_groups_are_not_its_own(
    crafted: Callable[[list[KVGroup]], list[KVGroup]], reason: str
) -> None:
    """The group fields of a D worker's hello come from whoever holds a control connection: a state or a chunk
    other than P's own is refused before P plans any byte from it."""
    short_conv = MambaState(
        conv_parts=[ConvPart(channels=64, groups=64)], conv_width=2, conv_dtype="float16", ssm_heads=0, ssm_head_bytes=0
    )
    groups = [
        KVGroup(kind="mamba", layers=[0], mamba=short_conv),
        KVGroup(kind="chunked_local", layers=[1], attention_chunk=64),
        KVGroup(kind="full", layers=[2, 3]),
    ]
    shape = dict(pp_size=1, tp_size=1, num_layers=4, num_kv_heads=4, head_size=8, block_size=16, num_blocks=8)
    p = msgspec.structs.replace(synthetic_engine("P", **shape)[(0, 0)], kv_groups=groups, null_block=0)
    d = {
        w: msgspec.structs.replace(m, kv_groups=groups, null_block=0) for w, m in synthetic_engine("D", **shape).items()
    }
    sender = d[(0, 0)]
    start = open_hello(sender, p, None, D_NONCE)
    challenged = challenge_hello(p, start, None, P_NONCE)
    assert isinstance(challenged, HelloChallenged)
    honest = answer_challenge(sender, d, p, start, challenged.reply, None)
    assert isinstance(accept_hello(p, challenged, honest, None), HelloAccepted)  # the same groups pass
    lying = msgspec.structs.replace(sender, kv_groups=crafted(groups))
    hello = answer_challenge(lying, {(0, 0): lying}, p, start, challenged.reply, None)
    decision = accept_hello(p, challenged, hello, None)
    assert isinstance(decision, HelloRefusal) and reason in decision.reason, decision
