"""Faults on the link between a P host and a D host, under load with random aborts: a partition that heals, 1 % and
5 % packet loss, the link down and up, and the P host gone for good.

Each case runs `kvsvc chaos`'s `ChaosRun` with one link fault injected halfway (after parked receives were started,
so each fault has receives it must fail). For each: nothing is lost or leaked, every finished request verified byte
for byte, every receive the fault made fail failed within `ChaosOptions.fault_bound_s`, and requests submitted after
it complete without restarting D. Bounds come from the configured deadlines, not from measurements. Skips where
network namespaces cannot be made; CI runs as root.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from kvsvc.engine.netns import NetnsHosts, skip_reason
from workers.chaos import NET_FAULTS, ChaosOptions, ChaosResult, ChaosRun, PhaseResult, chaos_hosts, start_chaos_engines
from workers.engine import DecodeEngine, PrefillEngine

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]

BASE = ChaosOptions(requests=80, concurrency=8, abort_rate=0.10, hosts="netns", timeout_s=150.0)
Engines = tuple[PrefillEngine, DecodeEngine, str, str, NetnsHosts]


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    with chaos_hosts() as net:
        prefill, decode, url, token = start_chaos_engines(BASE, net)
        try:
            yield prefill, decode, url, token, net
        finally:
            decode.executor.close()
            prefill.executor.close()


def _run(engines: Engines, fault: str, seed: int) -> tuple[ChaosResult, PhaseResult]:
    prefill, decode, url, token, net = engines
    options = dataclasses.replace(BASE, faults=(fault,), seed=seed)
    run = ChaosRun(options, prefill, decode, admin_url=url, admin_token=token, net=net)
    result = run.run()
    return result, result.phases[-1]


def _assert_contract(result: ChaosResult, phase: PhaseResult, fault: str) -> None:
    assert phase.name == fault
    assert not result.errors, result.errors[:5]
    assert phase.probes == BASE.probes and phase.probes_failed == phase.probes
    assert phase.fail_s is not None and phase.bound_s is not None and phase.fail_s <= phase.bound_s
    assert phase.after_fault > 0 and phase.after_fault_finished > 0  # D recovered by itself
    assert result.requests_lost == 0 and result.holds_leaked == 0
    assert result.p_blocks_leaked == 0 and result.d_blocks_leaked == 0
    assert result.duplicate_reports == 0 and result.late_reports_ignored == 0
    assert result.ok


@pytest.mark.parametrize("fault", [f for f in NET_FAULTS if f != "hostgone"])
def test_a_link_fault_fails_only_within_the_bound_and_d_recovers(engines: Engines, fault: str) -> None:
    pids = [h.pid for h in engines[1].executor.workers]
    result, phase = _run(engines, fault, seed=NET_FAULTS.index(fault))
    _assert_contract(result, phase, fault)
    assert [h.pid for h in engines[1].executor.workers] == pids  # D never restarted
    # The fault acted: its rules dropped packets, and no KV left P's link while it was cut or down (ARP frames are
    # not IP, so a few hundred bytes of them may).
    if fault in ("partition", "loss1", "loss5"):
        assert phase.packets_dropped is not None and phase.packets_dropped > 0
    if fault in ("partition", "linkdown"):
        assert phase.link_bytes_during is not None and phase.link_bytes_during < 1024


def test_the_p_host_gone_for_good_fails_its_receives_and_a_new_p_host_takes_over() -> None:
    with chaos_hosts() as net:
        prefill, decode, url, token = start_chaos_engines(BASE, net)
        options = dataclasses.replace(BASE, faults=("hostgone",), seed=7)
        pids = [h.pid for h in decode.executor.workers]
        run: ChaosRun | None = None
        try:
            run = ChaosRun(options, prefill, decode, admin_url=url, admin_token=token, net=net)
            result = run.run()
            _assert_contract(result, result.phases[-1], "hostgone")
            assert not any(prefill.executor.alive())  # the old host's workers are gone
            assert run.prefill is not prefill  # the replacement, on the spare host
            assert run.prefill.executor.url.startswith(f"http://{net.address('spare')}:")
            assert [h.pid for h in decode.executor.workers] == pids  # D never restarted
        finally:
            decode.executor.close()
            prefill.executor.close()
            if run is not None:
                run.prefill.executor.close()
