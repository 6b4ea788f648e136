"""Faults during load: a killed P worker, a frozen one, a restarted P engine and a cut control connection.

Each case runs load with 10 % random aborts and injects one fault halfway (after parked receives were started, so
every fault has receives it must fail). For each: the receives it hits fail (`failed_recving`, all blocks in
`invalid_block_ids`) within `ChaosOptions.fault_bound_s`, requests submitted after it complete byte-exact, D
recovers without a restart, and nothing is lost or leaked. The engines are started once for the module; deadlines
are short but generous for a loaded 2-core host, and bounds come from the configured deadlines, not measurements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from workers.chaos import FAULTS, ChaosOptions, ChaosResult, ChaosRun, PhaseResult, start_chaos_engines
from workers.engine import DecodeEngine, PrefillEngine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

BASE = ChaosOptions(requests=80, concurrency=8, abort_rate=0.10, freeze_s=6.0, timeout_s=150.0)


@pytest.fixture(scope="module", params=["mooncake", "samehost"])
def base(request: pytest.FixtureRequest) -> ChaosOptions:
    """The options, on each data plane (`ServiceConfig.transport`)."""
    return dataclasses.replace(BASE, service=dataclasses.replace(BASE.service, transport=request.param))


@pytest.fixture(scope="module")
def engines(base: ChaosOptions) -> Iterator[tuple[PrefillEngine, DecodeEngine, str, str]]:
    started = start_chaos_engines(base)
    prefill, decode = started[0], started[1]
    try:
        yield started
    finally:
        decode.executor.close()
        prefill.executor.close()
        assert not any(prefill.executor.alive()) and not any(decode.executor.alive())


def _run(
    engines: tuple[PrefillEngine, DecodeEngine, str, str], base: ChaosOptions, fault: str, seed: int
) -> tuple[ChaosResult, PhaseResult]:
    prefill, decode, url, token = engines
    options = dataclasses.replace(base, faults=(fault,), seed=seed)
    result = ChaosRun(options, prefill, decode, admin_url=url, admin_token=token).run()
    return result, result.phases[-1]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_fails_only_what_it_hits_within_the_bound_and_d_recovers(
    engines: tuple[PrefillEngine, DecodeEngine, str, str], base: ChaosOptions, fault: str
) -> None:
    result, phase = _run(engines, base, fault, seed=FAULTS.index(fault))
    assert phase.name == fault
    assert not result.errors, result.errors[:5]
    # Every parked receive failed, with all its blocks invalid (checked per request into `errors`).
    assert phase.probes == BASE.probes and phase.probes_failed == phase.probes
    assert phase.affected >= phase.probes and phase.affected_failed >= phase.probes
    assert phase.fail_s is not None and phase.bound_s is not None and phase.fail_s <= phase.bound_s
    # D recovered by itself: requests submitted after the fault finished, verified.
    assert phase.after_fault > 0 and phase.after_fault_finished > 0
    assert result.requests_lost == 0
    assert result.holds_leaked == 0
    assert result.p_blocks_leaked == 0 and result.d_blocks_leaked == 0
    assert result.duplicate_reports == 0 and result.late_reports_ignored == 0
    assert result.ok


def test_the_decode_engine_was_never_restarted(
    engines: tuple[PrefillEngine, DecodeEngine, str, str], base: ChaosOptions
) -> None:
    _, decode, _, _ = engines
    assert all(decode.executor.alive())
    pids = [h.pid for h in decode.executor.workers]
    result, phase = _run(engines, base, "cut", seed=99)
    assert result.ok and phase.after_fault_finished > 0
    assert [h.pid for h in decode.executor.workers] == pids
