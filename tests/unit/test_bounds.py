"""Bounds on what a peer can make a P worker hold (`kvsvc.core.bounds`, the hello and the `Sender`'s early requests):
every claim is checked whole before anything is built from it, and the work a refused claim costs is measured with
tracemalloc, not timed."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.cli.plan import synthetic_engine
from kvsvc.core.bounds import (
    MAX_CONV_PARTS,
    MAX_HELLO_FRAME_BYTES,
    MAX_KV_GROUPS,
    MAX_LAYERS,
    MAX_WORKERS,
    Acceptance,
    Admission,
    ControlConnections,
    check_engine_bounds,
    host_group,
)
from kvsvc.core.errors import LocalProtocolError, PeerMismatch
from kvsvc.core.hello import HelloAccepted, HelloRefusal, make_hello
from kvsvc.core.messages import (
    MAX_NAME_CHARS,
    MAX_SECRET_CHARS,
    Abort,
    ConvPart,
    Hello,
    HelloRefused,
    KVGroup,
    MambaState,
    TransferFailed,
    TransferRequest,
    WorkerMetadata,
    WorkerRef,
    encode,
)
from kvsvc.core.sender import BLOCK_ID_BYTES, EARLY_ENTRY_BYTES, Reply, Sender, SendRequest
from kvsvc.testing.hellos import decide_unkeyed

P = synthetic_engine("P", pp_size=1, tp_size=1, num_layers=4, num_kv_heads=4, head_size=8, block_size=16, num_blocks=8)
D = synthetic_engine("D", pp_size=2, tp_size=2, num_layers=4, num_kv_heads=4, head_size=8, block_size=16, num_blocks=8)
P0, D0 = P[(0, 0)], D[(0, 0)]


@contextmanager
def peak_bytes() -> Iterator[Callable[[], int]]:
    """The peak of traced allocations inside the block, read after it."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    peak = [0]
    try:
        yield lambda: peak[0]
    finally:
        peak[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def hello_of(d: WorkerMetadata, stages: list[tuple[int, int]], p: WorkerMetadata = P0) -> Hello:
    return msgspec.structs.replace(make_hello(d, D, p, b""), sender=d, stage_layers=stages)


def huge_stage_hello() -> Hello:
    """The attack: D's own stage is one honest layer, the stage after it claims 12.5M layers."""
    d = msgspec.structs.replace(D0, start_layer=0, end_layer=1, base_addrs=D0.base_addrs[:1])
    return hello_of(d, [(0, 1), (1, 12_500_001)])


def test_a_hello_claiming_a_stage_of_12_5m_layers_is_refused_by_name_before_anything_is_built() -> None:
    hello = huge_stage_hello()
    assert len(encode(hello)) < 1024  # a small frame
    with peak_bytes() as peak:
        decision = decide_unkeyed(P0, hello)
    assert isinstance(decision, HelloRefusal) and isinstance(decision.reply, HelloRefused)
    assert "stage split of 12500001 layers, limit 1024" in decision.reason
    assert peak() < 256 * 1024, f"refusing it allocated {peak()} bytes"


def largest_hello(layout: str, layers: int = MAX_LAYERS) -> Hello:
    """The largest hello a real D worker sends for a model of `layers` layers: every layer in its one stage, a hybrid
    model's three groups with a Mamba state, long names and addresses."""
    mamba = MambaState(
        conv_parts=[ConvPart(channels=16384, groups=128), ConvPart(channels=2048, groups=8)] * 2,
        conv_width=3,
        conv_dtype="torch.bfloat16",
        ssm_heads=128,
        ssm_head_bytes=64 * 128 * 4,
    )
    groups = [
        KVGroup(kind="full", layers=list(range(0, layers, 4))),
        KVGroup(kind="sliding_window", sliding_window=4096, layers=list(range(1, layers, 4))),
        KVGroup(kind="mamba", layers=[layer for layer in range(layers) if layer % 4 >= 2], mamba=mamba),
    ]
    per_layer = layout != "HND_CROSS_LAYER"
    d = msgspec.structs.replace(
        D0,
        engine_id="decode-" + "x" * 58,
        incarnation="f" * 32,
        pp_size=1,
        pp_rank=0,
        start_layer=0,
        end_layer=layers,
        layout=layout,
        num_blocks=2**31,
        base_addrs=[2**64 - 1 - i for i in range(layers if per_layer else 1)],
        transport_addr="[2001:db8:ffff:ffff:ffff:ffff:ffff:ffff]:65535",
        control_addr="[2001:db8:ffff:ffff:ffff:ffff:ffff:ffff]:65535",
        samehost_addr="/run/kvsvc/" + "s" * 96,
        staging_addr=2**63,
        staging_size=2**40,
        accepts_windows=True,
        kv_groups=groups,
    )
    hello = make_hello(d, {(0, 0): d}, P0, bytes(32))  # an HMAC-SHA256 proof
    return msgspec.structs.replace(hello, expect_engine_id="prefill-" + "y" * 56, expect_incarnation="e" * 32)


@pytest.mark.parametrize("layout", ["HND", "NHD", "HND_CROSS_LAYER"])
@pytest.mark.parametrize("layers", [128, MAX_LAYERS])
def test_the_largest_legitimate_hello_fits_the_frame_limit_before_the_hello(layout: str, layers: int) -> None:
    size = len(encode(largest_hello(layout, layers)))
    assert size <= MAX_HELLO_FRAME_BYTES, f"a hello of {layers} layers ({layout}) is {size} bytes"
    if layers == 128:
        assert size * 4 <= MAX_HELLO_FRAME_BYTES  # a real model's hello has room to spare


def _cross_layer_d(base_addrs: list[int]) -> WorkerMetadata:
    return msgspec.structs.replace(D0, layout="HND_CROSS_LAYER", base_addrs=base_addrs)


@pytest.mark.parametrize(
    ("d", "stages", "reason"),
    [
        (msgspec.structs.replace(D0, tp_size=2048), [(0, 2), (2, 4)], "tp_size 2048, pp_size 2; each must be 1 to"),
        (msgspec.structs.replace(D0, tp_size=1024), [(0, 2), (2, 4)], "= 2048 workers, limit 1024"),
        (D0, [(0, 2)], "a stage split of 1 stages for pp_size 2"),
        (D0, [(0, 2), (3, 4)], "expected a non-empty range from 2"),
        (D0, [(0, 2), (2, 2)], "stage 1 holds [2, 2)"),
        (D0, [(0, 2), (1, 4)], "expected a non-empty range from 2"),
        (D0, [(0, 2), (2, 3)], "stage split of 3 layers; this P worker holds layers [0, 4)"),
        (D0, [(0, 2), (2, 6)], "stage split of 6 layers; the model has 4"),
        (msgspec.structs.replace(D0, base_addrs=[1, 2, 3]), [(0, 2), (2, 4)], "3 base_addrs for 2 layers"),
        (_cross_layer_d([1, 2]), [(0, 2), (2, 4)], "2 base_addrs for layout HND_CROSS_LAYER"),
        (
            msgspec.structs.replace(D0, kv_groups=[KVGroup(kind="full", layers=[0])] * (MAX_KV_GROUPS + 1)),
            [(0, 2), (2, 4)],
            f"{MAX_KV_GROUPS + 1} KV cache groups, limit {MAX_KV_GROUPS}",
        ),
        (
            msgspec.structs.replace(D0, kv_groups=[KVGroup(kind="full", layers=[0, 1, 0])]),
            [(0, 2), (2, 4)],
            "KV cache groups list 3 layers; it holds 2",
        ),
        (
            msgspec.structs.replace(
                D0,
                kv_groups=[
                    KVGroup(
                        kind="mamba",
                        layers=[0, 1],
                        mamba=MambaState(
                            conv_parts=[ConvPart(channels=1, groups=1)] * (MAX_CONV_PARTS + 1),
                            conv_width=1,
                            conv_dtype="bfloat16",
                            ssm_heads=1,
                            ssm_head_bytes=1,
                        ),
                    )
                ],
            ),
            [(0, 2), (2, 4)],
            f"group 0 has {MAX_CONV_PARTS + 1} conv parts, limit {MAX_CONV_PARTS}",
        ),
    ],
)
def test_every_claim_of_a_hello_is_bounded_and_refused_by_name(
    d: WorkerMetadata, stages: list[tuple[int, int]], reason: str
) -> None:
    decision = decide_unkeyed(P0, hello_of(d, stages))
    assert isinstance(decision, HelloRefusal), decision
    assert reason in decision.reason and str(WorkerRef.of(d)) in decision.reason


def test_a_p_worker_of_an_early_stage_refuses_a_model_that_ends_before_its_layers() -> None:
    p2 = synthetic_engine(
        "P", pp_size=2, tp_size=1, num_layers=4, num_kv_heads=4, head_size=8, block_size=16, num_blocks=8
    )
    first = p2[(0, 0)]  # layers [0, 2): it cannot tell the model's size, only that it has 2 layers at least
    d = msgspec.structs.replace(D0, pp_size=1, start_layer=0, end_layer=1, base_addrs=D0.base_addrs[:1])
    decision = decide_unkeyed(first, hello_of(d, [(0, 1)], first))
    assert isinstance(decision, HelloRefusal) and "this P worker holds layers [0, 2)" in decision.reason
    accepted = decide_unkeyed(first, hello_of(D0, [(0, 2), (2, 4)], first))
    assert isinstance(accepted, HelloAccepted)


def test_the_layout_of_d_workers_known_only_by_layout_shares_one_address_list_per_stage() -> None:
    d = msgspec.structs.replace(D0, tp_size=8)
    decision = decide_unkeyed(P0, hello_of(d, [(0, 2), (2, 4)]))
    assert isinstance(decision, HelloAccepted) and len(decision.peer_engine) == 16
    lists = {id(meta.base_addrs) for meta in decision.peer_engine.values()}
    assert len(lists) == 2 and all(len(m.base_addrs) == m.num_layers for m in decision.peer_engine.values())


stage_splits = st.lists(st.tuples(st.integers(-5, 2**40), st.integers(-5, 2**40)), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(
    pp_size=st.integers(-1, 2**31),
    tp_size=st.integers(-1, 2**31),
    split=st.one_of(stage_splits, st.just([(0, 12_500_000)])),
    own=st.tuples(st.integers(-5, 2**40), st.integers(-5, 2**40)),
    addrs=st.integers(0, 3),
)
def test_any_claimed_sizes_are_accepted_only_within_the_bounds_and_never_cost_more_than_the_bounds(
    pp_size: int, tp_size: int, split: list[tuple[int, int]], own: tuple[int, int], addrs: int
) -> None:
    d = msgspec.structs.replace(
        D0, pp_size=pp_size, tp_size=tp_size, start_layer=own[0], end_layer=own[1], base_addrs=[0] * addrs
    )
    with peak_bytes() as peak:
        decision = decide_unkeyed(P0, hello_of(d, split))
    if isinstance(decision, HelloAccepted):
        assert len(decision.peer_engine) == pp_size * tp_size <= MAX_WORKERS
        assert split[-1][1] == P0.end_layer  # P holds the model's last stage: D's split covers the same model
    # Far less than the bounds allow at worst (MAX_WORKERS layout-only workers); nothing sized by a bare claim.
    assert peak() < 4 * 1024 * 1024, f"{peak()} bytes for {pp_size} x {tp_size}, stages {split}"


# -- who may hold a connection ---------------------------------------------------------------------------------


def test_control_connections_are_admitted_up_to_the_pending_accepted_and_per_host_caps_and_leave_once() -> None:
    connections: ControlConnections[str, str] = ControlConnections(max_total=2, max_per_host=2, max_pending=3)
    assert connections.admit("a", "10.0.1.1") == Admission() and connections.admit("b", "10.0.1.2") == Admission()
    # 10.0.1.1 and 10.0.1.2 are one /24: one host's cap; a refused connection is not counted
    assert connections.admit("x", "10.0.1.9") == Admission(
        "10.0.1.9 (of 10.0.1.0/24) holds 2 control connections to this P worker, limit 2"
    )
    assert connections.admit("c", "10.0.2.1") == Admission() and connections.open == 3
    # A fourth pending one is admitted, and the oldest pending gives way to it, once.
    why = "P worker holds 3 control connections before their hello, its limit, and this is the oldest"
    assert connections.admit("d", "10.0.3.1") == Admission(displaced="a", why=why)
    # A displaced connection whose hello is accepted meanwhile is not accepted, and nothing is said: it is closing.
    assert connections.accept("a", "D0") == Acceptance(accepted=False)
    assert connections.leave("a") is None
    assert connections.open == 3 and connections.pending == 3
    # Accepted ones leave the pending cap to new connections; the accepted cap is the total's.
    assert connections.accept("b", "D1") == Acceptance(accepted=True)
    assert connections.accept("c", "D2") == Acceptance(accepted=True)
    assert connections.accept("d", "D3") == Acceptance(
        accepted=False, refusal="P worker holds 2 control connections, limit 2"
    )
    assert connections.pending == 1 and connections.admit("e", "10.0.4.1") == Admission()
    assert connections.leave("b") == "D1" and connections.leave("c") == "D2"
    assert connections.leave("d") is None and connections.leave("e") is None
    assert connections.open == 0 and connections.pending == 0
    with pytest.raises(LocalProtocolError, match="not held"):
        connections.leave("e")
    with pytest.raises(LocalProtocolError, match="not pending"):
        connections.accept("never", "D0")


def test_the_newest_accepted_hello_of_a_d_worker_replaces_its_connection_even_one_still_being_routed() -> None:
    """A reconnect, or a restarted D engine: the newer hello's connection stands for the D worker at once; the older
    one is to be closed (its jobs lost), and one still being routed finds it no longer holds the D worker."""
    connections: ControlConnections[str, str] = ControlConnections(max_total=8, max_per_host=8, max_pending=8)
    for conn in ("old", "new", "newest"):
        assert connections.admit(conn, "127.0.0.1") == Admission()
    assert connections.accept("old", "D0") == Acceptance(accepted=True)
    assert connections.holds("old", "D0")
    assert connections.accept("new", "D0") == Acceptance(accepted=True, replaces="old")
    assert not connections.holds("old", "D0") and connections.holds("new", "D0")
    assert connections.leave("old") is None  # replaced: its D worker's jobs went with the replacement
    assert connections.accept("newest", "D0") == Acceptance(accepted=True, replaces="new")
    assert connections.leave("newest") == "D0"  # closed while it stood for D0: D0's jobs are lost now
    assert not connections.holds("new", "D0") and connections.leave("new") is None
    assert connections.open == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "accept", "leave"]), st.integers(0, 5), st.integers(0, 2))))
def test_control_connections_count_what_is_open_and_stand_one_connection_for_each_d_worker(
    steps: list[tuple[str, int, int]],
) -> None:
    """Whatever order connections come, hello and go in: the counts are what is open, pending ones within their cap
    but for those told to give way, at most one connection stands for a D worker, and each left connection answers
    for its D worker exactly when it was the one standing for it."""
    connections: ControlConnections[int, int] = ControlConnections(max_total=3, max_per_host=4, max_pending=2)
    state: dict[int, str] = {}  # conn -> pending / displaced / accepted
    stands: dict[int, int] = {}  # D worker -> conn
    for op, conn, key in steps:
        if op == "admit" and conn not in state:
            admission = connections.admit(conn, "127.0.0.1")
            if not admission.refusal:
                state[conn] = "pending"
                if admission.displaced is not None:
                    assert state[admission.displaced] == "pending" and admission.displaced != conn
                    state[admission.displaced] = "displaced"
        elif op == "accept" and state.get(conn) in ("pending", "displaced"):
            acceptance = connections.accept(conn, key)
            if acceptance.accepted:
                assert state[conn] == "pending" and acceptance.replaces == stands.get(key)
                state[conn], stands[key] = "accepted", conn
            else:
                assert (state[conn] == "displaced") == (acceptance.refusal == "")
        elif op == "leave" and conn in state:
            lost = connections.leave(conn)
            mine = [k for k, c in stands.items() if c == conn]
            assert lost == (mine[0] if mine else None)
            if mine:
                del stands[mine[0]]
            del state[conn]
        assert connections.open == len(state) <= 4
        assert connections.pending == sum(s != "accepted" for s in state.values())
        assert sum(s == "pending" for s in state.values()) <= 2
        assert all(connections.holds(c, k) for k, c in stands.items())


def test_every_loopback_address_is_one_host_and_networks_count_as_one() -> None:
    """Any local process can connect from 127.0.0.2, 127.0.0.3, ...: a per-host cap per address would be no cap."""
    assert {host_group(h) for h in ("127.0.0.1", "127.0.0.2", "127.9.9.9", "::1", "::ffff:127.0.0.3")} == {"loopback"}
    assert host_group("10.1.2.3") == host_group("::ffff:10.1.2.200") == "10.1.2.0/24"
    assert host_group("2001:db8:1:2::5") == host_group("2001:db8:1:2:ffff::1") == "2001:db8:1:2::/64"
    assert host_group("10.1.3.1") != host_group("10.1.2.1")
    assert host_group("not-an-address") == "not-an-address"
    connections: ControlConnections[str, str] = ControlConnections(max_total=10, max_per_host=2, max_pending=10)
    assert connections.admit("a", "127.0.0.2") == Admission() and connections.admit("b", "127.0.0.3") == Admission()
    assert (
        connections.admit("c", "127.0.0.4").refusal == "loopback holds 2 control connections to this P worker, limit 2"
    )


# -- early requests --------------------------------------------------------------------------------------------

D1 = WorkerRef.of(D[(0, 1)])
D0_REF = WorkerRef.of(D0)
EVERY_D = frozenset(D)


SECRET = "s" * 22  # each transfer's secret, as P's engine drew it


def early(transfer_id: str, blocks: int) -> TransferRequest:
    return TransferRequest(transfer_id=transfer_id, block_ids=list(range(blocks)), num_tokens=blocks, secret=SECRET)


def cost(blocks: int, transfer_id: str = "t1") -> int:
    """What an early request of `early(transfer_id, blocks)` costs: block ids, text at 4 bytes a character, an entry."""
    return EARLY_ENTRY_BYTES + BLOCK_ID_BYTES * blocks + 4 * (len(transfer_id) + len(SECRET))


def test_early_requests_are_bounded_in_bytes_per_d_worker() -> None:
    sender = Sender(max_early_request_bytes=cost(60) + cost(40))
    assert sender.request(D0_REF, EVERY_D, early("t1", 60), 0.0) == []
    refused = sender.request(D0_REF, EVERY_D, early("t2", 41), 0.0)
    assert refused == [
        Reply(
            D0_REF,
            TransferFailed(
                transfer_id="t2",
                reason=f"P worker busy: D worker {D0_REF} has {cost(60)} bytes of requests waiting for transfers not "
                f"held yet; this one's {cost(41)} would pass max_early_request_bytes={cost(60) + cost(40)}",
                cause="refused",
            ),
        )
    ]
    assert sender.request(D0_REF, EVERY_D, early("t3", 40), 0.0) == []  # up to the bound exactly
    assert sender.request(D1, EVERY_D, early("t2", 100), 0.0) == []  # another D worker has a bound of its own
    assert sender.statistics().early_request_bytes == cost(60) + cost(40) + cost(100)


def test_early_requests_are_bounded_in_bytes_across_d_workers_too() -> None:
    total = cost(100) + cost(50)
    sender = Sender(max_early_request_bytes=cost(100), max_early_request_bytes_total=total)
    assert sender.request(D0_REF, EVERY_D, early("t1", 100), 0.0) == []
    refused = sender.request(D1, EVERY_D, early("t2", 51), 0.0)  # within D1's own bound, past the total
    assert refused == [
        Reply(
            D1,
            TransferFailed(
                transfer_id="t2",
                reason=f"P worker busy: D workers have {cost(100)} bytes of requests waiting for transfers not held "
                f"yet; this one's {cost(51)} would pass max_early_request_bytes_total={total}",
                cause="refused",
            ),
        )
    ]
    assert sender.request(D1, EVERY_D, early("t3", 50), 0.0) == []  # up to the total exactly
    sender.expire(11.0)
    assert sender.request(D1, EVERY_D, early("t4", 100), 12.0) == []  # given back when they leave


def test_early_requests_and_aborts_pay_for_their_text() -> None:
    # Long ids, secrets and reasons cost what they hold, so requests or aborts without block ids still reach the
    # bounds (they once cost nothing, and 200 such frames held 800 MiB).
    long_id, long_secret = "t" * MAX_NAME_CHARS, "s" * MAX_SECRET_CHARS
    one = EARLY_ENTRY_BYTES + 4 * (MAX_NAME_CHARS + MAX_SECRET_CHARS)
    sender = Sender(max_early_request_bytes=2 * one + 64, max_early_request_bytes_total=10 * one)
    ask = TransferRequest(transfer_id=long_id, block_ids=[], num_tokens=0, secret=long_secret)
    assert sender.request(D0_REF, EVERY_D, ask, 0.0) == []
    assert sender.statistics().early_request_bytes == one
    abort = Abort(transfer_id=long_id[:-1] + "u", reason="", secret=long_secret)
    assert sender.remote_abort(D0_REF, abort, 0.0, EVERY_D)[0].message.transfer_id == abort.transfer_id
    assert sender.statistics().early_requests == 2  # an abort is kept, charged like a request
    refused = sender.request(D0_REF, EVERY_D, msgspec.structs.replace(ask, transfer_id="x" * MAX_NAME_CHARS), 0.0)
    assert "max_early_request_bytes" in refused[0].message.reason  # type: ignore[union-attr]
    sender.remote_abort(D0_REF, msgspec.structs.replace(abort, transfer_id="y"), 0.0, EVERY_D)
    assert sender.statistics().early_requests == 2  # past the bound an abort is answered and not kept


@pytest.mark.parametrize("how", ["hold", "expire", "peer_lost", "abort", "shut_down"])
def test_the_bytes_of_an_early_request_are_given_back_however_it_leaves(how: str) -> None:
    sender = Sender(max_early_request_bytes=cost(100), early_request_timeout_s=10.0)
    sender.request(D0_REF, EVERY_D, early("t1", 100), 0.0)
    assert sender.statistics().early_request_bytes == cost(100)
    if how == "hold":
        sender.hold(SendRequest("r1", "t1", (0,) * 100, 100, SECRET), 1.0)
    elif how == "expire":
        sender.expire(11.0)
    elif how == "peer_lost":
        sender.peer_lost(D0_REF)
    elif how == "abort":
        sender.remote_abort(D0_REF, Abort(transfer_id="t1", reason="gone", secret=SECRET), 1.0, EVERY_D)
    else:
        sender.shut_down("closing")
    # An early abort takes the request's place, and pays for its own text.
    kept = EARLY_ENTRY_BYTES + 4 * len("t1" + SECRET + "gone") if how == "abort" else 0
    assert sender.statistics().early_request_bytes == kept
    if how not in ("hold", "abort"):
        assert sender.request(D0_REF, EVERY_D, early("t9", 100), 1.0) == []  # room again


def test_an_engine_document_d_fetches_is_held_to_the_bounds_of_a_hello() -> None:
    check_engine_bounds(D, "GET d")  # an honest engine passes
    many = {(0, tp): msgspec.structs.replace(D0, tp_rank=tp, tp_size=2000) for tp in range(MAX_WORKERS + 1)}
    with pytest.raises(PeerMismatch, match=f"GET x lists {MAX_WORKERS + 1} workers, limit {MAX_WORKERS}"):
        check_engine_bounds(many, "GET x")
    # One worker claiming a huge engine: D would open a connection per worker it names (or overflow planning it).
    wide = {(0, 0): msgspec.structs.replace(D0, tp_size=2**31 - 1)}
    with pytest.raises(PeerMismatch, match=r"GET x: worker D\[pp0,tp0\] claims tp_size 2147483647"):
        check_engine_bounds(wide, "GET x")
    deep = {(0, 0): msgspec.structs.replace(D0, end_layer=MAX_LAYERS + 1)}
    with pytest.raises(PeerMismatch, match=f"claims layers up to {MAX_LAYERS + 1}, limit {MAX_LAYERS}"):
        check_engine_bounds(deep, "GET x")
    odd = {(0, 0): msgspec.structs.replace(D0, base_addrs=D0.base_addrs * 3)}
    with pytest.raises(PeerMismatch, match="base_addrs"):
        check_engine_bounds(odd, "GET x")
    outside = {(0, 0): msgspec.structs.replace(D0, tp_rank=D0.tp_size)}
    with pytest.raises(PeerMismatch, match=f"ranks outside its sizes pp_size 2, tp_size {D0.tp_size}"):
        check_engine_bounds(outside, "GET x")
    backwards = {(0, 0): msgspec.structs.replace(D0, start_layer=D0.end_layer + 1)}
    with pytest.raises(PeerMismatch, match="ending before they begin"):
        check_engine_bounds(backwards, "GET x")
