"""The hello as pure decisions (`kvsvc.hello`): P accepts or refuses a D worker's first frame, D checks P's answer.
No sockets or event loop: two workers' metadata talk back to back."""

from __future__ import annotations

import msgspec
import pytest

from kvsvc.cli.plan import synthetic_engine
from kvsvc.errors import HandshakeError, PeerMismatch
from kvsvc.hello import HelloAccepted, HelloRefusal, accept_hello, check_hello_reply, make_hello
from kvsvc.messages import ErrorMessage, HelloOk, HelloRefused, Ping

P = synthetic_engine("P", pp_size=1, tp_size=1, num_layers=4, num_kv_heads=4, head_size=8, block_size=16, num_blocks=8)
D = synthetic_engine("D", pp_size=2, tp_size=2, num_layers=4, num_kv_heads=4, head_size=8, block_size=16, num_blocks=8)
P0, D0 = P[(0, 0)], D[(0, 0)]


def test_p_accepts_a_hello_meant_for_it_and_learns_which_d_workers_it_serves() -> None:
    decision = accept_hello(P0, make_hello(D0, D, P0, token="s"), token="s")
    assert isinstance(decision, HelloAccepted)
    assert decision.peer_meta == D0 and decision.expected == frozenset(D)  # P's one worker sources all of D
    assert decision.reply == HelloOk(version=1, sender=P0)
    assert sorted(decision.peer_engine) == sorted(D)
    check_hello_reply(P0, decision.reply)  # and D takes the answer


@pytest.mark.parametrize(
    ("hello_change", "token", "reason"),
    [
        ({"token": "wrong"}, "s3cret", "does not carry this deployment's control token"),
        ({"version": 9}, None, "peer speaks protocol version 9"),
        ({"expect_incarnation": "old"}, None, "hello expects engine/incarnation/pp/tp"),
        ({"stage_layers": [(0, 3), (3, 4)]}, None, "disagree with its engine's stage split"),
    ],
)
def test_p_refuses_a_hello_with_the_reason(hello_change: dict[str, object], token: str | None, reason: str) -> None:
    hello = msgspec.structs.replace(make_hello(D0, D, P0, token=None), **hello_change)
    decision = accept_hello(P0, hello, token=token)
    assert isinstance(decision, HelloRefusal) and reason in decision.reason
    assert isinstance(decision.reply, HelloRefused) and "s3cret" not in decision.reply.reason


def test_p_refuses_absurd_sizes_and_layouts_it_cannot_write_into() -> None:
    huge = msgspec.structs.replace(D0, tp_size=4096)
    decision = accept_hello(P0, make_hello(huge, D, P0, None), token=None)
    assert isinstance(decision, HelloRefusal) and "tp_size 4096" in decision.reason
    other = msgspec.structs.replace(D0, head_size=16)
    decision = accept_hello(P0, make_hello(other, D, P0, None), token=None)
    assert isinstance(decision, HelloRefusal) and "P head_size 8 != D head_size 16" in decision.reason


def test_a_first_frame_that_is_not_a_hello_gets_an_error() -> None:
    decision = accept_hello(P0, Ping(nonce=1), token=None)
    assert isinstance(decision, HelloRefusal) and isinstance(decision.reply, ErrorMessage)
    assert "expected hello as the first frame, got Ping" in decision.reason


def test_d_refuses_an_answer_from_another_p_than_its_engine_published() -> None:
    with pytest.raises(HandshakeError, match="refused the hello: full"):
        check_hello_reply(P0, HelloRefused(version=1, reason="full"))
    with pytest.raises(HandshakeError, match="answered the hello with Ping"):
        check_hello_reply(P0, Ping(nonce=1))
    restarted = msgspec.structs.replace(P0, incarnation="new")
    with pytest.raises(PeerMismatch, match="other metadata than its engine published"):
        check_hello_reply(P0, HelloOk(version=1, sender=restarted))


def test_p_lays_out_a_hybrid_d_at_pp2_from_one_stage_hello() -> None:
    """A hybrid D at PP 2 sends its own stage's groups only: P lays out the other stage with D's kinds over that
    stage's layers, as P groups them, and learns it sources both stages (a hello from either stage once crashed P
    checking the other stage's layers against the sender's groups)."""
    from kvsvc.messages import KVGroup, WorkerMetadata

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
        decision = accept_hello(p, make_hello(sender, d, p, None), token=None)
        assert isinstance(decision, HelloAccepted), decision
        assert decision.expected == frozenset(d)
        assert decision.peer_engine[(0, 0)].kv_groups == d[(0, 0)].kv_groups
        assert decision.peer_engine[(1, 0)].kv_groups == d[(1, 0)].kv_groups
