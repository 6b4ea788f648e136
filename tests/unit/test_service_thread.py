"""The thread-safe facade's own rules, with an in-process fake transport (the real one: tests/integration)."""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest

from kvsvc.core.auth import harness_secret
from kvsvc.core.errors import KVSvcTimeout
from kvsvc.core.layout import layer_bytes
from kvsvc.core.messages import WorkerMetadata
from kvsvc.core.outputs import KVConnectorOutput
from kvsvc.service import ServiceConfig, ServiceThread
from kvsvc.testing.fakes import LoopbackTransport


def _thread(**timeouts: float) -> ServiceThread:
    meta = WorkerMetadata(
        engine_id="p", incarnation="1", pp_rank=0, pp_size=1, tp_rank=0, tp_size=1, start_layer=0, end_layer=1,
        num_kv_heads=1, head_size=8, dtype="float16", block_size=4, num_blocks=4, layout="HND", is_mla=False,
        base_addrs=[0],
    )  # fmt: skip
    pool = np.zeros(layer_bytes(meta), dtype=np.uint8)
    meta = msgspec.structs.replace(meta, base_addrs=[pool.ctypes.data])

    def transport() -> LoopbackTransport:
        t = LoopbackTransport()
        t.register([(pool.ctypes.data, pool.nbytes)])
        t.pool = pool  # type: ignore[attr-defined]  # kept alive with the transport
        return t

    thread = ServiceThread(meta, transport, ServiceConfig(hold_timeout_s=0.05), **timeouts)
    thread.start()
    return thread


def test_a_report_the_loop_hands_back_late_comes_with_the_next_call_once() -> None:
    thread = _thread(call_timeout_s=5.0, report_wait_s=0.1)
    try:
        thread.start_send("p1", "t1", [0], 4, secret=harness_secret("t1"))
        time.sleep(0.3)  # the hold expired: its report waits in the service
        service = thread.service
        real = service.get_finished
        drained = threading.Event()
        release = threading.Event()

        def slow_get_finished(step_s: float = 0.0) -> KVConnectorOutput:
            report = real(step_s)  # drained: from here on only the caller holds this report
            drained.set()
            release.wait(5)  # ...and it reaches the caller after its wait
            return report

        service.get_finished = slow_get_finished  # type: ignore[method-assign]
        assert thread.get_finished() == KVConnectorOutput()  # the step goes on without it
        assert drained.wait(5)
        assert thread.get_finished() == KVConnectorOutput()  # still pending: nothing more asked of the loop
        service.get_finished = real  # type: ignore[method-assign]
        release.set()
        _wait_done(thread)
        assert thread.get_finished().finished_sending == {"p1"}
        assert thread.get_finished().finished_sending is None
    finally:
        thread.close()


def test_a_loop_silent_for_the_call_timeout_fails_the_report_naming_it_and_a_busy_one_does_not() -> None:
    thread = _thread(call_timeout_s=0.5, report_wait_s=0.05)
    try:
        wedge = threading.Event()
        drains = 0
        real = thread.service.get_finished

        def counted(step_s: float = 0.0) -> KVConnectorOutput:
            nonlocal drains
            drains += 1
            return real(step_s)

        thread.service.get_finished = counted  # type: ignore[method-assign]
        thread.post(lambda _: wedge.wait(10))  # the loop is stuck in one call
        posted = thread.post(lambda _: "ran")  # handed in behind it: runs once the loop frees up
        assert thread.get_finished() == KVConnectorOutput()
        assert thread.get_finished() == KVConnectorOutput()  # busy for less than the timeout: the step goes on
        time.sleep(0.6)
        with pytest.raises(KVSvcTimeout, match=r"has not answered get_finished for \d+\.\d s \(call_timeout_s 0\.5\)"):
            thread.get_finished()
        wedge.set()
        assert posted.result(5) == "ran"
        _wait_done(thread)
        assert thread.get_finished() == KVConnectorOutput()
        assert drains == 2  # the one that timed out and the last: calls while it was pending asked nothing
    finally:
        wedge.set()
        thread.close()


def _wait_done(thread: ServiceThread) -> None:
    """Until the loop has run everything handed to it so far."""
    thread.call(lambda _: None)


def test_a_report_asked_to_wait_wakes_on_the_services_news_not_at_the_end_of_its_wait() -> None:
    """An idle step's report (`wait_s`) ends when a transfer ends, however long it may wait: here a hold that
    expires after 0.05 s, with a wait of 120 s the caller's 30 s bound would catch."""
    thread = _thread(call_timeout_s=200.0, report_wait_s=0.05)
    try:
        assert thread.get_finished(wait_s=0.01) == KVConnectorOutput()  # nothing happens: the wait ends, empty
        thread.start_send("p1", "t1", [0], 4, secret=harness_secret("t1"))
        sent: list[set[str] | None] = []

        def idle_steps() -> None:  # wake-ups may be spurious (the hold starting is news too): a few steps at most
            while len(sent) < 5 and not any(sent):
                sent.append(thread.get_finished(wait_s=120.0).finished_sending)

        waiter = threading.Thread(target=idle_steps)
        waiter.start()
        waiter.join(30)
        assert not waiter.is_alive(), "the report waited past the news of the expired hold"
        assert sent[-1] == {"p1"}
    finally:
        thread.close()
