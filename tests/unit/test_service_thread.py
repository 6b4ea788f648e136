"""The thread-safe facade's own rules, with an in-process fake transport (the real one: tests/integration)."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

from kvsvc.errors import KVSvcTimeout
from kvsvc.layout import layer_bytes
from kvsvc.messages import WorkerMetadata
from kvsvc.outputs import KVConnectorOutput
from kvsvc.service import ServiceConfig, ServiceThread
from kvsvc.testing.fakes import LoopbackTransport
from kvsvc.testing.holds import harness_secret


def test_a_report_drained_by_a_timed_out_get_finished_comes_with_the_next_call() -> None:
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
        return t

    thread = ServiceThread(meta, transport, ServiceConfig(hold_timeout_s=0.05), call_timeout_s=0.3)
    thread.start()
    try:
        thread.start_send("p1", "t1", [0], 4, secret=harness_secret("t1"))
        time.sleep(0.3)  # the hold expired: its report waits in the service
        service = thread.service
        real = service.get_finished

        def slow_get_finished() -> KVConnectorOutput:
            report = real()  # drained: from here on only the caller holds this report
            time.sleep(0.6)  # ...and it reaches the caller after its timeout
            return report

        service.get_finished = slow_get_finished  # type: ignore[method-assign]
        with pytest.raises(KVSvcTimeout):
            thread.get_finished()
        service.get_finished = real  # type: ignore[method-assign]
        time.sleep(0.6)
        assert thread.get_finished().finished_sending == {"p1"}
        assert thread.get_finished().finished_sending is None
    finally:
        thread.close()
