"""The runtime's engines hand a step's requests to their workers in one `Batch`: all of them start or none does,
blocks are allocated all or none, and a finished receive is checked before its blocks are free again. A fake
executor stands in for the worker processes (the integration tests run the real ones)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvsvc.core.outputs import KVConnectorOutput
from workers.blocks import NoFreeBlocks
from workers.engine import DecodeEngine, PrefillEngine
from workers.executor import WorkerError
from workers.process import AbortRequest, Batch, Prefill, Recv, Verify
from workers.synthetic import VerifyResult


class FakeExecutor:
    """Two workers; records every broadcast, refuses what `refuse` names, answers checks from `on_verify`."""

    num_workers = 2

    def __init__(self, num_blocks: int = 8) -> None:
        self.config = SimpleNamespace(num_blocks=num_blocks, block_size=4)
        self.sent: list[Any] = []
        self.refuse: set[type] = set()
        self.next_output = KVConnectorOutput()
        self.on_verify = lambda: [VerifyResult(ok=True, checked=1, mismatches=0)]

    def broadcast(self, command: Any) -> list[object]:
        self.sent.append(command)
        kinds = {type(c) for c in command.commands} if isinstance(command, Batch) else {type(command)}
        if kinds & self.refuse:
            raise WorkerError(f"worker 1: refused {sorted(k.__name__ for k in kinds)}")
        if kinds == {Verify}:
            return [[self.on_verify()[0] for _ in command.commands] for _ in range(self.num_workers)]
        return [[None] * len(command.commands)] * self.num_workers if isinstance(command, Batch) else []

    def step(self) -> KVConnectorOutput:
        output, self.next_output = self.next_output, KVConnectorOutput()
        return output


def test_a_step_of_requests_goes_to_the_workers_as_one_batch() -> None:
    executor = FakeExecutor()
    engine = PrefillEngine(executor)  # type: ignore[arg-type]
    reqs = engine.submit_many([("a", 8, 1), ("b", 5, 2)])
    (batch,) = executor.sent
    assert isinstance(batch, Batch) and [type(c) for c in batch.commands] == [Prefill, Prefill]
    assert [r.block_ids for r in reqs] == [c.block_ids for c in batch.commands] and len(reqs[1].block_ids) == 2
    assert engine.allocator.num_free == 4 and set(engine.requests) == {r.req_id for r in reqs}


def test_blocks_are_allocated_for_all_or_none() -> None:
    executor = FakeExecutor(num_blocks=3)
    engine = PrefillEngine(executor)  # type: ignore[arg-type]
    with pytest.raises(NoFreeBlocks):
        engine.submit_many([("a", 8, 1), ("b", 8, 2)])  # 2 blocks each, 3 in the pool
    assert engine.allocator.num_free == 3 and not executor.sent and not engine.requests


@pytest.mark.parametrize("abort_fails", [False, True], ids=["aborted", "the abort fails too"])
def test_a_refused_batch_is_aborted_everywhere_and_its_blocks_are_free(abort_fails: bool) -> None:
    executor = FakeExecutor()
    executor.refuse = {Recv, AbortRequest} if abort_fails else {Recv}
    engine = DecodeEngine(executor)  # type: ignore[arg-type]
    with pytest.raises(WorkerError, match="refused"):
        engine.submit_many("P", "http://p", [("a", 8, 1), ("b", 8, 2)])
    started, abort = executor.sent
    assert [c.req_id for c in abort.commands] == [c.req_id for c in started.commands]
    assert all(isinstance(c, AbortRequest) for c in abort.commands)
    assert engine.allocator.num_free == 8 and not engine.requests


def test_a_finished_receive_is_checked_before_its_blocks_are_free_even_when_the_check_fails() -> None:
    executor = FakeExecutor()
    engine = DecodeEngine(executor)  # type: ignore[arg-type]
    (req,) = engine.submit_many("P", "http://p", [("a", 8, 1)])
    free_during_check: list[int] = []

    def check() -> list[VerifyResult]:
        free_during_check.append(engine.allocator.num_free)
        return [VerifyResult(ok=True, checked=8, mismatches=0)]

    executor.on_verify = check
    executor.next_output = KVConnectorOutput(finished_recving={req.req_id})
    (done,) = engine.step()
    assert done is req and req.state == "finished" and req.verified_ok and len(req.verified) == 2
    assert set(free_during_check) == {6} and engine.allocator.num_free == 8

    (again,) = engine.submit_many("P", "http://p", [("b", 8, 2)])
    executor.refuse = {Verify}
    executor.next_output = KVConnectorOutput(finished_recving={again.req_id})
    with pytest.raises(WorkerError):
        engine.step()
    assert engine.allocator.num_free == 8 and not engine.requests
