"""Staged writes between processes over real Mooncake (staging pays where a descriptor is dear, so these engines
are forced to Mooncake; on the same-host plane the rule writes direct, which one test shows): P tp1 gathers what each
D worker of a tp2 engine needs into its staging region and writes one descriptor per contiguous run, in chunks when
the region is smaller than a request, waiting for room when it is full; every byte is verified on D. A run without a
staging region is the negative control of the descriptor counts. P tp2 writes into windows of a tp1 D engine's
region that D scatters, with a D engine without a region as the negative control. Faults: aborts on both sides and a
P worker killed while staged writes or windowed transfers are in flight lose and leak nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from kvsvc.service import ServiceConfig
from workers.chaos import ChaosOptions, ChaosRun, start_chaos_engines
from workers.chaos_spec import default_service
from workers.engine import DecodeEngine, DecodeRequest, PrefillEngine
from workers.executor import EngineConfig, Executor, start_all
from workers.process import Peers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

GEOMETRY = dict(num_layers=4, num_kv_heads=4, head_size=64, block_size=16, num_blocks=512)
MOONCAKE = ServiceConfig(transport="mooncake")
TOKENS = 1024  # 1024 tokens x 4 layers x K/V x 4 heads x 64 x bf16 = 4 MiB per request, 2 MiB per D worker


def _engines(
    staging_bytes: int, service: ServiceConfig = MOONCAKE, geometry: dict[str, int] = GEOMETRY
) -> tuple[Executor, Executor]:
    p = Executor(EngineConfig(engine_id="staged-p", staging_bytes=staging_bytes, service=service, **geometry))  # type: ignore[arg-type]
    d = Executor(EngineConfig(engine_id="staged-d", role="decode", tp_size=2, **geometry))  # type: ignore[arg-type]
    start_all([p, d])
    return p, d


def _move(p: Executor, d: Executor, count: int) -> tuple[list[DecodeRequest], int]:
    """`count` requests at once; returns them once ended and the descriptors P submitted for them."""
    prefill, decode = PrefillEngine(p), DecodeEngine(d)
    before = sum(int(s["descriptors_sent"]) for s in p.statistics())
    for i in range(count):
        prefill.submit(f"s{i}", TOKENS, seed=50 + i)
        decode.submit(f"s{i}", p.engine_id, p.url, TOKENS, seed=50 + i)
    ended: list[DecodeRequest] = []
    while len(ended) < count:
        ended += decode.step(verify=True)
        prefill.step()
    while prefill.requests:
        prefill.step()
    return ended, sum(int(s["descriptors_sent"]) for s in p.statistics()) - before


@pytest.fixture(scope="module")
def small_region() -> Iterator[tuple[Executor, Executor]]:
    p, d = _engines(staging_bytes=1 << 20)  # chunks of 512 KiB: each 2 MiB write takes 4, two fit at once
    try:
        yield p, d
    finally:
        d.close()
        p.close()


def test_staged_chunked_writes_land_byte_exact_with_one_descriptor_per_run_part(
    small_region: tuple[Executor, Executor],
) -> None:
    p, d = small_region
    ended, descriptors = _move(p, d, 6)  # 12 writes of 4 chunks each into 1 MiB: most wait for room
    assert all(r.verified_ok for r in ended), [(r.transfer_id, r.state, r.reason) for r in ended]
    (stats,) = p.statistics()
    assert stats["staged_writes"] >= 12
    assert stats["staging_waits"] > 0  # the region was full: chunks waited for room
    # Every chunk is timed in each part: its wait for room, its gather and its write (4 chunks a write).
    chunks = {part: sum(stats[f"staged_{part}"]["counts"]) for part in ("room", "gather", "write")}
    assert chunks == dict.fromkeys(chunks, 4 * stats["staged_writes"]), chunks
    assert stats["staged_room"]["total"] > 0  # chunks that waited for room waited some time
    # Per D worker and request: 4 layers, each one contiguous run of D blocks, cut into 4 chunks: at most 4 + 3.
    assert 6 * 2 * 4 <= descriptors <= 6 * 2 * (4 + 3)
    assert stats["holds"] == 0 and stats["writes_in_flight"] == 0 and stats["staging_in_use"] == 0


def test_without_a_staging_region_the_same_requests_take_a_descriptor_per_block_and_half() -> None:
    p, d = _engines(staging_bytes=0)
    try:
        ended, descriptors = _move(p, d, 2)
        assert all(r.verified_ok for r in ended)
        (stats,) = p.statistics()
        assert stats["staged_writes"] == 0
        assert descriptors == 2 * 2 * 4 * (TOKENS // 16) * 2  # requests x D workers x layers x blocks x K/V
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize(
    ("service", "staged"), [(ServiceConfig(), False), (MOONCAKE, True)], ids=["same-host plane", "Mooncake"]
)
def test_pieces_of_16_kib_are_written_direct_on_the_same_host_plane_and_gathered_on_mooncake(
    service: ServiceConfig, staged: bool
) -> None:
    # 16 heads: each D worker's half of a (layer, block, K/V) is 16 KiB. A same-host piece costs about 1 us against
    # the copy's 1.6 us, a Mooncake descriptor 30 us (`kvsvc.core.data_planes.rule_on`).
    p, d = _engines(1 << 20, service, dict(GEOMETRY, num_kv_heads=16, num_blocks=256))
    try:
        ended, descriptors = _move(p, d, 2)
        assert all(r.verified_ok for r in ended)
        (stats,) = p.statistics()
        assert (stats["staged_writes"] > 0) == staged
        direct = 2 * 2 * 4 * (TOKENS // 16) * 2  # requests x D workers x layers x blocks x K/V
        assert descriptors < direct if staged else descriptors == direct
        rows = p.call(0, Peers())
        assert isinstance(rows, list)
        plane = "mooncake" if service.transport == "mooncake" else "samehost"
        assert {row["transport"] for row in rows if row["direction"] == "from_d"} == {plane}
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "staging_bytes", "counter"),
    [
        (1, 2, 64 << 10, "staged_writes"),  # small: gathers wait for room and are chunked
        (2, 1, 256 << 10, "scattered_receives"),  # small: some shares find no window and go direct
    ],
    ids=["gathers on P", "windows on D"],
)
def test_aborts_and_a_killed_p_worker_during_staged_transfers_lose_and_leak_nothing(
    prefill_tp: int, decode_tp: int, staging_bytes: int, counter: str
) -> None:
    options = ChaosOptions(
        requests=80,
        faults=("kill",),
        concurrency=8,
        max_tokens=256,
        abort_rate=0.2,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        prefill_block_size=8,
        decode_block_size=8,
        fault_worker=0,
        staging_bytes=staging_bytes,
        timeout_s=150.0,
        service=dataclasses.replace(default_service(), transport="mooncake"),
    )
    prefill, decode, url, token = start_chaos_engines(options)
    try:
        result = ChaosRun(options, prefill, decode, admin_url=url, admin_token=token).run()
        stats = prefill.executor.statistics() + decode.executor.statistics()
        staged = sum(int(s[counter]) for s in stats)
        lent = sum(int(s["staging_in_use"]) for s in stats)
    finally:
        decode.executor.close()
        prefill.executor.close()
    assert not result.errors, result.errors[:5]
    assert result.ok and result.requests_lost == 0 and result.holds_leaked == 0
    assert result.p_blocks_leaked == 0 and result.d_blocks_leaked == 0
    phase = result.phases[-1]
    assert phase.probes_failed == phase.probes and phase.after_fault_finished > 0
    assert staged > 0  # staged transfers ran (after the restart too, for gathers: the new P engine's)
    assert lent == 0  # no gather room and no window is left lent


def _down(staging_bytes: int) -> tuple[Executor, Executor]:
    """P tp2 -> D tp1: each P worker's heads are every other half of D's blocks, strided in D."""
    p = Executor(EngineConfig(engine_id="down-p", tp_size=2, staging_bytes=8 << 20, service=MOONCAKE, **GEOMETRY))  # type: ignore[arg-type]
    d = Executor(
        EngineConfig(engine_id="down-d", role="decode", staging_bytes=staging_bytes, service=MOONCAKE, **GEOMETRY)  # type: ignore[arg-type]
    )
    start_all([p, d])
    return p, d


@pytest.mark.parametrize(
    "d_region",
    [32 << 20, 1 << 20, 0],
    ids=["windows", "windows in rounds", "negative control: no D region"],
)
def test_p_writes_each_share_into_a_window_that_d_scatters_byte_exact(d_region: int) -> None:
    # 32 MiB: a whole 2 MiB share per window, for 4 requests at once; 1 MiB: windows of 512 KiB, 8 rounds of 256 KiB.
    p, d = _down(staging_bytes=d_region)
    try:
        ended, descriptors = _move(p, d, 4)
        assert all(r.verified_ok for r in ended), [(r.transfer_id, r.state, r.reason) for r in ended]
        (d_stats,) = d.statistics()
        assert d_stats["staging_in_use"] == 0
        if d_region == 32 << 20:
            # Per request and P worker: 4 layers, each one run of P's consecutive blocks, into one window.
            assert d_stats["scattered_receives"] == 4 * 2
            assert descriptors == 4 * 2 * 4
            assert sum(d_stats["window_scatter"]["counts"]) == 4 * 2  # one round each, timed
        elif d_region:
            assert d_stats["scattered_receives"] > 0
            assert sum(d_stats["window_scatter"]["counts"]) >= d_stats["scattered_receives"]  # a share in rounds
            # A share without room goes direct; in rounds, each round cuts at most one more run.
            assert descriptors < 4 * 2 * 4 * (TOKENS // 16) * 2
        else:
            assert d_stats["scattered_receives"] == 0
            assert sum(d_stats["window_scatter"]["counts"]) == 0
            assert descriptors == 4 * 2 * 4 * (TOKENS // 16) * 2  # requests x P workers x layers x blocks x K/V
    finally:
        d.close()
        p.close()
