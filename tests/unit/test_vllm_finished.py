"""What a vLLM worker may tell vLLM's scheduler (`kvsvc.vllm.flow.TransferReports`), with no vLLM, torch or
service: each id at most once, only ids vLLM handed in, every handed-in id that ended exactly once."""

from __future__ import annotations

import copy
import subprocess
import sys
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.vllm.flow import NULL_BLOCK, RecvRefused, RecvStarted, SendRefused, TransferReports

IDS = [f"r{i}" for i in range(8)]
STRANGERS = ["x0", "x1"]  # ids vLLM never handed this worker, which a service might still name


def test_a_send_waits_for_both_its_end_and_vllms_finish_in_either_order() -> None:
    reports = TransferReports()
    reports.sends_handed(["p1", "p2"])
    assert reports.report({"p1"}).finished_sending == set()  # vLLM finished it, the service has not ended it
    assert reports.report(set(), finished_sending={"p1", "p2"}).finished_sending == {"p1"}
    assert reports.report({"p2", "p1"}).finished_sending == {"p2"}  # p1 again: not twice
    assert reports.waiting == 0


def test_a_refused_send_is_reported_as_ended_and_an_unknown_one_is_dropped() -> None:
    reports = TransferReports()
    reports.sends_handed(["p1"])
    reports.send_refused("p1")
    reports.send_refused("stranger")
    assert reports.report({"p1", "stranger"}, finished_sending={"stranger"}).finished_sending == {"p1"}


def test_receives_are_reported_once_failed_ones_in_both_sets_with_their_blocks() -> None:
    reports = TransferReports()
    reports.recv_started("d1", (1, 2))
    reports.recv_started("d2", (3,))
    reports.recv_refused("d3", (4, NULL_BLOCK))
    results = reports.report(set(), finished_recving={"d1", "stranger"}, failed_recving={"d2"}, invalid_block_ids={3})
    assert (results.finished_recving, results.failed_recving) == ({"d1", "d2", "d3"}, {"d2", "d3"})
    assert results.service_failures == {"d2"}  # d3 never started: the service has no reason for it
    assert reports.take_load_errors(hybrid=False) == {3, 4}  # never vLLM's null block
    assert reports.take_load_errors(hybrid=False) == set()
    assert reports.report(set(), finished_recving={"d1"}, failed_recving={"d2"}).finished_recving == set()
    reports.recv_refused("d4", (5,))
    reports.report(set())
    assert reports.take_load_errors(hybrid=True) == set()  # a hybrid model's failures go only as whole requests


def test_the_loops_outcomes_as_values_report_as_the_calls_do() -> None:
    outcomes = [SendRefused("p1"), RecvStarted("d1", (1, 2), push=True), RecvRefused("d2", (3,))]
    by_value, by_call = TransferReports(), TransferReports()
    for reports in (by_value, by_call):
        reports.sends_handed(["p1"])
    for outcome in outcomes:
        by_value.decided(outcome)
    by_call.send_refused("p1")
    by_call.recv_started("d1", (1, 2), push=True)
    by_call.recv_refused("d2", (3,))
    assert by_value.report({"p1"}, finished_recving={"d1"}) == by_call.report({"p1"}, finished_recving={"d1"})
    assert by_value.take_load_errors(hybrid=False) == by_call.take_load_errors(hybrid=False) == {3}


@dataclass
class Run:
    """What the events told the reports, and what the reports told vLLM over the run."""

    handed_sends: set[str] = field(default_factory=set)
    handed_recvs: set[str] = field(default_factory=set)
    vllm_finished: set[str] = field(default_factory=set)
    sent: list[str] = field(default_factory=list)
    received: list[str] = field(default_factory=list)


ids = st.sampled_from(IDS + STRANGERS)
events = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.sampled_from(IDS)),
        st.tuples(st.just("recv"), st.sampled_from(IDS), st.booleans()),
        st.tuples(st.just("refuse_send"), ids),
        st.tuples(
            st.just("report"),
            st.frozensets(ids, max_size=4),
            st.frozensets(ids, max_size=4),
            st.frozensets(ids, max_size=4),
            st.frozensets(ids, max_size=4),
        ),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(events)
def test_each_id_is_reported_once_only_if_vllm_handed_it_in_and_every_ended_one_is(script: list[tuple]) -> None:
    """Any order of events, a service that names strangers and repeats: never an id twice, never one vLLM did not
    hand in (a send only once vLLM finished it), failed receives within the finished ones; and once the service has
    ended everything handed in and vLLM finished every send, every id has been reported exactly once."""
    reports, run = TransferReports(), Run()
    used: set[str] = set()  # vLLM hands each request id in once, as a send or as a receive

    def report(finished: set[str], sending: set[str], recving: set[str], failed: set[str]) -> None:
        run.vllm_finished |= finished
        results = reports.report(finished, sending, recving, failed)
        assert results.finished_sending <= run.handed_sends & run.vllm_finished
        assert results.finished_recving <= run.handed_recvs
        assert results.failed_recving <= results.finished_recving
        run.sent += results.finished_sending
        run.received += results.finished_recving

    for event in script:
        if event[0] == "send" and event[1] not in used:
            used.add(event[1])
            run.handed_sends.add(event[1])
            reports.sends_handed([event[1]])
        elif event[0] == "recv" and event[1] not in used:
            used.add(event[1])
            run.handed_recvs.add(event[1])
            if event[2]:
                reports.recv_started(event[1], (1,))
            else:
                reports.recv_refused(event[1], (1,))
        elif event[0] == "refuse_send":
            reports.send_refused(event[1])
        elif event[0] == "report":
            _, finished, sending, recving, failed = event
            _check_may_wait(reports, set(finished))
            report(set(finished), set(sending), set(recving), set(failed))
    # The service ends everything handed in (again, for some), vLLM finishes every send: every id went out, once.
    report(set(run.handed_sends), set(run.handed_sends), set(run.handed_recvs), set())
    assert sorted(run.sent) == sorted(run.handed_sends)
    assert sorted(run.received) == sorted(run.handed_recvs)
    assert reports.waiting == 0


def _check_may_wait(reports: TransferReports, finished: set[str]) -> None:
    """An idle step waits only when that delays no report and a receive is owed: if `may_wait`, a report without
    the service's news says nothing; if not, either it says something or no receive is owed (the service ending
    every receive then leaves none waiting)."""
    quiet = copy.deepcopy(reports).report(finished)
    said = quiet.finished_sending or quiet.finished_recving or quiet.failed_recving
    if reports.may_wait(finished):
        assert not said
    elif not said:
        owed = copy.deepcopy(reports)
        assert owed.report(finished, finished_recving=set(IDS)).finished_recving == set()


def test_an_idle_step_waits_only_while_a_receive_is_owed_and_nothing_is_ready() -> None:
    reports = TransferReports()
    assert not reports.may_wait(set())  # nothing handed in: nothing to wait for
    reports.sends_handed(["p1"])
    assert not reports.may_wait(set())  # a send alone: P's step never waits
    reports.recv_started("d1", (1,))
    assert reports.may_wait({"p1"})  # vLLM finished p1, the service has not ended it
    reports.recv_refused("d2", (2,))
    assert not reports.may_wait(set())  # d2 fails at once
    reports.report(set())
    reports.report(set(), finished_sending={"p1"})
    assert not reports.may_wait({"p1"})  # ended in the service, vLLM finishes it now: report at once
    reports.report({"p1"}, finished_recving={"d1"})
    assert not reports.may_wait(set())


def test_an_idle_step_waits_longer_only_while_every_receive_owed_waits_for_a_pushing_p() -> None:
    reports = TransferReports()
    assert reports.idle_wait(set(), 0.01, 0.1) == 0.0  # nothing owed: no wait at all
    reports.recv_started("d1", (1,), push=True)
    assert reports.idle_wait(set(), 0.01, 0.1) == 0.1  # P is prefilling: nothing to compute for a while
    reports.recv_started("d2", (2,))
    assert reports.idle_wait(set(), 0.01, 0.1) == 0.01  # a pulled receive lands soon: the short wait again
    reports.report(set(), finished_recving={"d2"})
    assert reports.idle_wait(set(), 0.01, 0.1) == 0.1
    reports.report(set(), finished_recving={"d1"}, failed_recving={"d1"})
    assert reports.idle_wait(set(), 0.01, 0.1) == 0.0  # everything reported
    reports.recv_started("d3", (3,), push=True)
    reports.recv_refused("d4", (4,))
    assert reports.idle_wait(set(), 0.01, 0.1) == 0.0  # a report is ready now: no wait


def test_the_flow_module_imports_no_torch_asyncio_or_vllm() -> None:
    probe = (
        "import sys, kvsvc.vllm.flow\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'asyncio', 'vllm'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"kvsvc.vllm.flow pulls in {out}"
