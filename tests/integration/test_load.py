"""Load with random aborts through a P engine and a D engine (separate processes, over each data plane): nothing lost.

CI scale of `kvsvc chaos --faults none` (full scale: `kvsvc chaos --requests 10000`). One module-scoped pair of
engines; deadlines are generous (other suites share the 2 cores) and nothing asserts a duration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from kvsvc.service import ServiceConfig
from workers.chaos import ChaosOptions, ChaosResult, ChaosRun, start_chaos_engines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REQUESTS = 300
# Generous receive deadline (no spurious failures under CPU contention), short holds (a D abort before its request
# was sent leaves P to its hold deadline).
OPTIONS = ChaosOptions(
    requests=REQUESTS,
    faults=(),
    concurrency=16,
    abort_rate=0.10,
    seed=4,
    timeout_s=180.0,
    service=ServiceConfig(hold_timeout_s=8.0, recv_timeout_s=60.0, early_request_timeout_s=4.0, abort_grace_s=30.0),
)


@pytest.fixture(scope="module", params=["mooncake", "samehost"])
def result(request: pytest.FixtureRequest) -> Iterator[ChaosResult]:
    """The run, on each data plane (`ServiceConfig.transport`)."""
    options = dataclasses.replace(OPTIONS, service=dataclasses.replace(OPTIONS.service, transport=request.param))
    prefill, decode, _, _ = start_chaos_engines(options)
    try:
        yield ChaosRun(options, prefill, decode).run()
    finally:
        decode.executor.close()
        prefill.executor.close()
        assert not any(prefill.executor.alive()) and not any(decode.executor.alive())


def test_every_request_ends_exactly_once_on_both_engines(result: ChaosResult) -> None:
    (phase,) = result.phases
    assert phase.requests == REQUESTS
    assert result.requests_lost == 0, result.errors[:5]
    assert phase.finished + phase.failed == REQUESTS
    assert result.duplicate_reports == 0 and result.late_reports_ignored == 0


def test_every_finished_request_is_byte_exact_on_every_d_worker(result: ChaosResult) -> None:
    (phase,) = result.phases
    assert phase.verified == phase.finished > 0
    assert not result.errors, result.errors[:5]


def test_aborts_happened_on_both_sides_and_only_aborted_requests_failed(result: ChaosResult) -> None:
    (phase,) = result.phases
    assert phase.aborted_p > 0 and phase.aborted_d > 0
    # A failure without an abort is recorded in `errors`; an abort after completion leaves a request finished.
    assert phase.failed <= phase.aborted_p + phase.aborted_d
    assert not [e for e in result.errors if "no abort and no fault" in e]


def test_no_hold_and_no_block_is_left_on_either_engine(result: ChaosResult) -> None:
    assert result.holds_leaked == 0
    assert result.p_blocks_leaked == 0 and result.d_blocks_leaked == 0
    assert result.ok
