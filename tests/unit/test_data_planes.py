"""The rule that picks a data plane per (P worker, D worker) pair, decided from the two workers' metadata alone:
the same-host plane only where both offer it on one host (kernel boot, PID and network namespaces) as one user;
Mooncake otherwise, or when an operator forces it; every fallback says why, naming both sides."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsvc.core.data_planes import SameHostAddress, choose_transport, is_same_host, probed
from kvsvc.core.messages import WorkerMetadata

BASE = WorkerMetadata(
    engine_id="e",
    incarnation="i",
    pp_rank=0,
    pp_size=1,
    tp_rank=0,
    tp_size=1,
    start_layer=0,
    end_layer=2,
    num_kv_heads=2,
    head_size=8,
    dtype="float16",
    block_size=4,
    num_blocks=8,
    layout="HND",
    is_mla=False,
    base_addrs=[4096, 8192],
    transport_addr="127.0.0.1:16000",
)


def worker(samehost: str = "", engine: str = "e") -> WorkerMetadata:
    return msgspec.structs.replace(BASE, engine_id=engine, samehost_addr=samehost)


HOST = "b00t.4026531836.4026531840"
P_ADDR, D_ADDR = f"samehost:{HOST}:0:100:5", f"samehost:{HOST}:0:200:7"


@given(st.text("0123456789abcdef.", min_size=1), st.integers(0, 2**31), st.integers(1, 2**22), st.integers(0, 2**40))
def test_a_same_host_address_reads_back_what_it_wrote(host: str, uid: int, pid: int, start: int) -> None:
    address = SameHostAddress(host, uid, pid, start)
    assert SameHostAddress.parse(str(address)) == address and is_same_host(str(address))


@pytest.mark.parametrize("text", ["", "127.0.0.1:16000", "samehost:h:0:1", "samehost:h:x:1:2", "other:h:0:1:2"])
def test_anything_else_is_not_a_same_host_address(text: str) -> None:
    with pytest.raises(ValueError, match="is not a same-host session"):
        SameHostAddress.parse(text)


def test_two_workers_on_one_host_as_one_user_take_the_same_host_plane() -> None:
    route = choose_transport(worker(P_ADDR), worker(D_ADDR, "d"))
    assert (route.kind, route.session) == ("samehost", D_ADDR)


def test_a_plane_the_probe_refused_falls_back_to_mooncake_saying_why_and_one_it_passed_stays() -> None:
    d = worker(D_ADDR, "d")
    route = choose_transport(worker(P_ADDR), d)
    assert probed(route, d, "") == route
    fallen = probed(route, d, "ptrace: operation not permitted")
    assert (fallen.kind, fallen.session) == ("mooncake", d.transport_addr)
    assert fallen.reason == "the same-host plane is refused: ptrace: operation not permitted"
    mooncake = choose_transport(worker(P_ADDR), d, "mooncake")
    assert probed(mooncake, d, "anything") == mooncake  # nothing was probed


def test_forced_mooncake_is_mooncake_even_on_one_host() -> None:
    route = choose_transport(worker(P_ADDR), worker(D_ADDR, "d"), "mooncake")
    assert (route.kind, route.session) == ("mooncake", BASE.transport_addr) and "forced" in route.reason


@pytest.mark.parametrize("setting", ["auto", "samehost"])
@pytest.mark.parametrize(
    ("p", "d", "why"),
    [
        ("", D_ADDR, "this P worker offers no same-host plane"),
        (P_ADDR, "", "D worker (0, 0) of 'd' offers no same-host plane"),
        (P_ADDR, "samehost:otherhost:0:200:7", f"another host (P {HOST}, D otherhost)"),
        (P_ADDR, f"samehost:{HOST}:1000:200:7", "another user (P uid 0, D uid 1000)"),
        (P_ADDR, "samehost:garbled", "is not a same-host session"),
    ],
)
def test_a_pair_that_does_not_qualify_runs_on_mooncake_saying_why(setting: str, p: str, d: str, why: str) -> None:
    route = choose_transport(worker(p), worker(d, "d"), setting)
    assert (route.kind, route.session) == ("mooncake", BASE.transport_addr)
    assert why in route.reason


def test_an_unknown_setting_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="'shm' is not one of auto, mooncake, samehost"):
        choose_transport(worker(P_ADDR), worker(D_ADDR), "shm")


def test_on_the_same_host_plane_a_gather_pays_only_for_pieces_of_a_few_kib() -> None:
    from kvsvc.core.data_planes import rule_on
    from kvsvc.core.staging_plans import StagingRule

    mooncake, samehost = rule_on("mooncake", StagingRule()), rule_on("samehost", StagingRule())
    assert mooncake == StagingRule()
    # 224 pieces of 16 KiB into 28 runs: Mooncake gathers (a descriptor costs 30 us), the same-host plane does not.
    assert mooncake.stage(224, 28, 224 * 16384) and not samehost.stage(224, 28, 224 * 16384)
    # 4 KiB pieces (a block-size change): the copy costs less than the pieces saved, on either plane.
    assert samehost.stage(868, 28, 868 * 4096) and mooncake.stage(868, 28, 868 * 4096)


def test_writes_merged_into_one_call_fail_one_by_one_when_the_call_fails() -> None:
    import os

    import numpy as np

    from kvsvc.transport.samehost import _copy_group

    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros((2, 4096), dtype=np.uint8)
    good = np.array([[src.ctypes.data, dst.ctypes.data, 4096]], dtype=np.int64)
    also_good = np.array([[src.ctypes.data, dst.ctypes.data + 4096, 4096]], dtype=np.int64)
    unmapped = np.array([[src.ctypes.data, 4096, 4096]], dtype=np.int64)  # page 1 is never mapped
    outcomes = _copy_group(os.getpid(), [good, unmapped, also_good])
    assert outcomes[0] == outcomes[2] == 4096
    assert isinstance(outcomes[1], OSError)
    assert (dst == src).all()
    assert _copy_group(os.getpid(), [good, also_good]) == [4096, 4096]


def test_a_burst_of_small_writes_lands_in_one_group_and_writes_past_the_bounds_one_by_one() -> None:
    import errno
    import os

    import numpy as np

    from kvsvc.core.planner import COALESCE_DESCRIPTORS
    from kvsvc.transport.samehost import _copy_all, start_time

    rows = COALESCE_DESCRIPTORS
    src = np.arange(4 * rows, dtype=np.uint64).view(np.uint8)  # 32 KiB
    dst = np.zeros_like(src)
    start = start_time(os.getpid())

    def write(offset: int, pieces: int, piece: int) -> tuple[int, int, int, np.ndarray]:
        at = offset + np.arange(pieces, dtype=np.int64) * piece
        table = np.stack([src.ctypes.data + at, dst.ctypes.data + at, np.full(pieces, piece)], axis=1)
        return os.getpid(), start, os.getuid(), table.astype(np.int64)

    delivered: list[tuple[int, list[int | OSError]]] = []

    def deliver(first: int, outcomes: list[int | OSError]) -> None:
        delivered.append((first, outcomes))

    _copy_all([write(i * 4096, 1, 4096) for i in range(8)], deliver)
    assert delivered == [(0, [4096] * 8)]
    delivered.clear()
    # Each write has as many pieces as one call takes: together they would pass the bound, so each goes alone.
    _copy_all([write(i * rows * 8, rows, 8) for i in range(3)], deliver)
    assert delivered == [(0, [rows * 8]), (1, [rows * 8]), (2, [rows * 8])]
    assert (dst[: 3 * rows * 8] == src[: 3 * rows * 8]).all()
    delivered.clear()
    dst[:] = 0
    stale = (os.getpid(), start + 1, os.getuid(), write(0, 1, 4096)[3])  # the pid names a process started later
    _copy_all([stale], deliver)
    ((_, (gone,)),) = delivered
    assert isinstance(gone, OSError) and gone.errno == errno.ESRCH and not dst.any()
    delivered.clear()
    other_user = (os.getpid(), start, os.getuid() + 1, write(0, 1, 4096)[3])  # the process changed its real uid
    _copy_all([other_user], deliver)
    ((_, (refused,)),) = delivered
    assert isinstance(refused, OSError) and refused.errno == errno.EPERM and not dst.any()
    delivered.clear()
    # A stale write queued behind a good one to the same pid is a target of its own: checked, and refused, alone.
    _copy_all([write(0, 1, 4096), (*stale[:3], write(4096, 1, 4096)[3])], deliver)
    ((first, (landed,)), (second, (late,))) = delivered
    assert (first, landed, second) == (0, 4096, 1) and isinstance(late, OSError) and late.errno == errno.ESRCH
    assert dst[:4096].any() and not dst[4096:8192].any()


_queued = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 100), st.integers(0, 10)), max_size=30)


@given(_queued, st.integers(1, 150), st.integers(1, 12))
def test_coalesced_groups_keep_order_and_target_and_stay_within_bounds_unless_alone(
    writes: list[tuple[int, int, int]], max_bytes: int, max_descriptors: int
) -> None:
    from kvsvc.core.planner import coalesce

    groups = coalesce(writes, max_bytes, max_descriptors)
    assert [i for group in groups for i in group] == list(range(len(writes)))  # every write once, in order
    for group in groups:
        members = [writes[i] for i in group]
        assert len({target for target, _, _ in members}) == 1
        nbytes, pieces = sum(m[1] for m in members), sum(m[2] for m in members)
        assert len(group) == 1 or (nbytes <= max_bytes and pieces <= max_descriptors)
    for group, after in itertools.pairwise(groups):  # greedy: the next write could not have joined
        members, next_one = [writes[i] for i in group], writes[after.start]
        assert (
            next_one[0] != members[0][0]
            or sum(m[1] for m in members) + next_one[1] > max_bytes
            or sum(m[2] for m in members) + next_one[2] > max_descriptors
        )


def test_coalescing_refuses_bounds_below_one_and_negative_sizes_by_value() -> None:
    from kvsvc.core.planner import coalesce

    with pytest.raises(ValueError, match="max_bytes 0, max_descriptors 4"):
        coalesce([], 0, 4)
    with pytest.raises(ValueError, match="write 1 to 'b' has -1 bytes"):
        coalesce([("a", 1, 1), ("b", -1, 1)])


@given(
    st.lists(st.lists(st.tuples(st.integers(0, 64), st.integers(1, 4096)), min_size=1, max_size=6), max_size=12),
    st.integers(1, 8192),
    st.integers(1, 8),
)
def test_coalesced_copies_land_the_same_bytes_as_writes_one_by_one(
    queued: list[list[tuple[int, int]]], max_bytes: int, max_descriptors: int
) -> None:
    """The real copy path (`process_vm_writev`, into this process) against memmove write by write, for any queue of
    writes and any bounds: each group the rule formed is delivered once, and every byte lands where its write says."""
    import os

    import numpy as np

    from kvsvc.core.planner import coalesce
    from kvsvc.transport.samehost import _copy_all, start_time

    src = np.random.default_rng(len(queued)).integers(0, 255, 1 << 13, dtype=np.uint8)
    # Room for the longest queue drawn (12 writes of 6 pieces of at most 64 + 4096 bytes): nothing lands past `dst`.
    dst, expected = np.zeros(12 * 6 * 4160, dtype=np.uint8), np.zeros(12 * 6 * 4160, dtype=np.uint8)
    start, cursor = start_time(os.getpid()), 0
    writes, sizes = [], []
    for pieces in queued:
        rows = []
        for skip, length in pieces:  # destinations never overlap: each piece lands after the one before
            at, cursor = cursor + skip, cursor + skip + length
            rows.append((src.ctypes.data + skip, dst.ctypes.data + at, length))
            expected[at : at + length] = src[skip : skip + length]
        table = np.array(rows, dtype=np.int64)
        writes.append((os.getpid(), start, os.getuid(), table))
        sizes.append(((os.getpid(), start, os.getuid()), int(table[:, 2].sum()), len(table)))
    delivered: list[tuple[int, list[int | OSError]]] = []
    _copy_all(writes, lambda first, outcomes: delivered.append((first, outcomes)), max_bytes, max_descriptors)
    groups = coalesce(sizes, max_bytes, max_descriptors)
    assert [(first, len(outcomes)) for first, outcomes in delivered] == [(g.start, len(g)) for g in groups]
    assert [out for _, outcomes in delivered for out in outcomes] == [size for _, size, _ in sizes]
    assert (dst == expected).all()


async def test_a_routed_transport_counts_its_memory_once_and_closes_the_same_host_plane_first() -> None:
    from kvsvc.testing.fakes import LoopbackTransport
    from kvsvc.transport.routed import RoutedTransport
    from kvsvc.transport.samehost import SameHostTransport

    closed: list[str] = []

    class Primary(LoopbackTransport):
        async def close(self) -> None:
            closed.append("primary")
            await super().close()

    class Local(SameHostTransport):
        async def close(self) -> None:
            closed.append("local")
            await super().close()

    routed = RoutedTransport(Primary(), Local())
    routed.register([(1 << 20, 4096)])
    assert routed.statistics().registered_bytes == 4096
    await routed.close()
    await routed.close()  # idempotent
    assert closed[:2] == ["local", "primary"]


async def test_the_same_host_plane_writes_only_sessions_its_check_admitted() -> None:
    """A session string is no key to the plane: `add_peer` refuses one that never passed `reachable`, and the routed
    transport sends an unadmitted `samehost:` session to the primary plane, never to the kernel copy (nor does the
    plane a writer holds for the pair, `plane_of`)."""
    import ctypes
    import socket

    from kvsvc.testing.fakes import LoopbackTransport
    from kvsvc.transport import InvalidDescriptor
    from kvsvc.transport.routed import RoutedTransport, plane_of
    from kvsvc.transport.samehost import SameHostTransport, own_address

    raw = ctypes.create_string_buffer(4096)
    regions = [(ctypes.addressof(raw), 4096)]
    me = str(own_address())
    local = SameHostTransport()
    routed = RoutedTransport(LoopbackTransport(), local)
    try:
        with pytest.raises(InvalidDescriptor, match="was not admitted"):
            local.add_peer(me, regions)
        assert not local.admits(me) and local.statistics().refused == 1
        routed.add_peer(me, regions)  # goes to the primary plane: the string alone routes nothing to the kernel
        assert local.statistics().peers == 0 and routed.primary.statistics().peers == 1
        assert plane_of(routed, me) is routed.primary
        # This process holds the client end of a real connection: the check passes, and the session is admitted.
        with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()):
            accepted, _ = server.accept()
            with accepted:
                via = (accepted.getsockname()[:2], accepted.getpeername()[:2])
                assert await routed.reachable(me, regions, via) == ""
        assert local.admits(me)
        routed.add_peer(me, regions)
        assert local.statistics().peers == 1 and plane_of(routed, me) is local
        routed.remove_peer(me)
        assert not local.admits(me)
    finally:
        await routed.close()
