"""The two engine roles on an `Executor`: a prefill engine that computes and holds KV, a decode engine that fetches it.

Imports `workers.executor`, `workers.process` and kvsvc's scheduler view (`RequestTracker`), which turns each step's
aggregate into what to free, run or recompute. Invariants: a request's blocks are allocated at submit and freed
exactly once, when the aggregate of all workers reports the request finished (or failed); a finished receive is
verified on every D worker before its blocks are freed; a failed one is marked for recompute.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvsvc.core.outputs import KVConnectorOutput
from kvsvc.engine.scheduler import RequestTracker
from workers.blocks import BlockAllocator, NoFreeBlocks
from workers.executor import Executor
from workers.process import AbortRequest, Batch, FailureReasons, Prefill, Recv, Verify
from workers.synthetic import VerifyResult


@dataclass
class PrefillRequest:
    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    seed: int
    finished: bool = False


@dataclass
class DecodeRequest:
    req_id: str
    transfer_id: str
    prefill_engine_id: str
    block_ids: list[int]
    num_tokens: int
    seed: int | None  # the prefill's seed, to verify the KV; None skips verification
    state: str = "waiting"  # "waiting", "finished" or "failed"
    reason: str = ""  # why it failed, as the first D worker that knows says
    needs_recompute: bool = False
    invalid_block_ids: set[int] = field(default_factory=set)
    verified: list[VerifyResult] = field(default_factory=list)  # one per D worker, once finished

    @property
    def verified_ok(self) -> bool:
        """The KV landed and every D worker found every byte right (False until verified)."""
        return self.state == "finished" and bool(self.verified) and all(v.ok for v in self.verified)


class _Engine:
    def __init__(self, executor: Executor, prefix: str) -> None:
        self.executor = executor
        self.allocator = BlockAllocator(executor.config.num_blocks)
        self.tracker = RequestTracker()
        self._ids = itertools.count()
        self._prefix = prefix

    def _new_req_id(self, transfer_id: str) -> str:
        return f"{self._prefix}{next(self._ids)}-{transfer_id}"

    def _blocks_for(self, num_tokens: int) -> list[int]:
        return self.allocator.allocate(max(1, -(-num_tokens // self.executor.config.block_size)))

    def _start(self, started: Sequence[Prefill | Recv]) -> None:
        """Send every request's command to every worker in one `Batch`; if any worker fails, abort them all
        everywhere and take their blocks back.

        The blocks come back when the abort was sent, not when the workers confirmed it, as they did for one
        request at a time: an engine that goes on after a refused batch may hand a block to a new request while an
        aborted write still drains into it (the runtime's callers stop, or verify what they receive).

        Raises:
            WorkerError: as `Executor.broadcast`, after the abort (the blocks are free even if the abort failed).
        """
        try:
            self.executor.broadcast(Batch(list(started)))
        except BaseException:
            # Some workers may hold some of them: abort there so nothing stays held, then the blocks are ours again.
            try:
                self.executor.broadcast(Batch([AbortRequest(command.req_id) for command in started]))
            finally:
                for command in started:
                    self.allocator.free(command.block_ids)
            raise

    def _allocate(self, token_counts: Sequence[int]) -> list[list[int]]:
        """Blocks for each request, all or none.

        Raises:
            NoFreeBlocks: the pool cannot hold them all (nothing stays allocated).
        """
        allocated: list[list[int]] = []
        try:
            for num_tokens in token_counts:
                allocated.append(self._blocks_for(num_tokens))
        except NoFreeBlocks:
            for blocks in allocated:
                self.allocator.free(blocks)
            raise
        return allocated


class PrefillEngine(_Engine):
    """Computes requests' KV with the synthetic model and holds it for decode engines to fetch."""

    def __init__(self, executor: Executor) -> None:
        super().__init__(executor, "p")
        self.requests: dict[str, PrefillRequest] = {}

    def submit(self, transfer_id: str, num_tokens: int, seed: int) -> PrefillRequest:
        """Allocate blocks, run the synthetic prefill on every worker and hold the KV (`start_send`).

        Raises:
            NoFreeBlocks: the pool is full. WorkerError: a worker failed (the blocks are freed again).
        """
        return self.submit_many([(transfer_id, num_tokens, seed)])[0]

    def submit_many(self, specs: Sequence[tuple[str, int, int]]) -> list[PrefillRequest]:
        """`submit` for each `(transfer_id, num_tokens, seed)`, all in one round trip to each worker (an engine
        step's prefills).

        Raises:
            NoFreeBlocks: the pool cannot hold them all. WorkerError: a worker failed. Either way none is started.
        """
        blocks = self._allocate([num_tokens for _, num_tokens, _ in specs])
        reqs = [
            PrefillRequest(self._new_req_id(transfer_id), transfer_id, ids, num_tokens, seed)
            for (transfer_id, num_tokens, seed), ids in zip(specs, blocks, strict=True)
        ]
        self._start([Prefill(r.req_id, r.transfer_id, r.block_ids, r.num_tokens, r.seed) for r in reqs])
        for req in reqs:
            self.requests[req.req_id] = req
            self.tracker.track_send(req.req_id, req.block_ids)
        return reqs

    def abort(self, req: PrefillRequest) -> None:
        """Abort on every worker; the blocks are freed when the workers report it finished."""
        self.executor.broadcast(AbortRequest(req.req_id))

    def step(self) -> list[PrefillRequest]:
        """Collect the workers' reports; free and return the requests whose sends all finished.

        Raises:
            WorkerError: as `Executor.step`.
        """
        return self.apply(self.executor.step())

    def apply(self, output: KVConnectorOutput) -> list[PrefillRequest]:
        done: list[PrefillRequest] = []
        for req_id, blocks in sorted(self.tracker.update(output).sends_finished.items()):
            req = self.requests.pop(req_id)
            req.finished = True
            self.allocator.free(blocks)
            done.append(req)
        return done

    def restart(self) -> list[PrefillRequest]:
        """Restart the engine (a new incarnation); returns the requests that were lost with the old one."""
        lost = list(self.requests.values())
        self.executor.restart()
        self.requests.clear()
        self.allocator = BlockAllocator(self.executor.config.num_blocks)
        self.tracker = RequestTracker()
        return lost


class DecodeEngine(_Engine):
    """Receives requests' KV from prefill engines and checks it byte for byte."""

    def __init__(self, executor: Executor) -> None:
        super().__init__(executor, "d")
        self.requests: dict[str, DecodeRequest] = {}

    def submit(
        self, transfer_id: str, prefill_engine_id: str, prefill_url: str, num_tokens: int, seed: int | None = None
    ) -> DecodeRequest:
        """Allocate blocks and start the receive on every worker.

        Raises:
            NoFreeBlocks: the pool is full. WorkerError: a worker refused (the blocks are freed again).
        """
        return self.submit_many(prefill_engine_id, prefill_url, [(transfer_id, num_tokens, seed)])[0]

    def submit_many(
        self, prefill_engine_id: str, prefill_url: str, specs: Sequence[tuple[str, int, int | None]]
    ) -> list[DecodeRequest]:
        """`submit` for each `(transfer_id, num_tokens, seed)` from one prefill engine, in one round trip to each
        worker (an engine step's receives).

        Raises:
            NoFreeBlocks: the pool cannot hold them all. WorkerError: a worker refused. Either way none is started.
        """
        blocks = self._allocate([num_tokens for _, num_tokens, _ in specs])
        reqs = [
            DecodeRequest(self._new_req_id(transfer_id), transfer_id, prefill_engine_id, ids, num_tokens, seed)
            for (transfer_id, num_tokens, seed), ids in zip(specs, blocks, strict=True)
        ]
        self._start(
            [Recv(r.req_id, r.transfer_id, prefill_engine_id, prefill_url, r.block_ids, r.num_tokens) for r in reqs]
        )
        for req in reqs:
            self.requests[req.req_id] = req
            self.tracker.track_recv(req.req_id, req.block_ids)
        return reqs

    def abort(self, req: DecodeRequest) -> None:
        """Abort on every worker; it is reported failed (and freed) once no write can touch its blocks."""
        self.executor.broadcast(AbortRequest(req.req_id))

    def step(self, verify: bool = True) -> list[DecodeRequest]:
        """Collect the workers' reports; verify finished receives on every D worker (when `verify` and the
        request has a seed), mark failed ones for recompute, free their blocks, return them.

        Raises:
            WorkerError: as `Executor.step`, or a verification that could not run.
        """
        output = self.executor.step()
        update = self.tracker.update(output)
        done: list[DecodeRequest] = []
        reasons: dict[str, str] = {}
        if update.recvs_failed:
            for answer in self.executor.broadcast(FailureReasons(sorted(update.recvs_failed))):
                if isinstance(answer, dict):
                    reasons = {**answer, **reasons}
        for req_id, blocks in sorted(update.recvs_failed.items()):
            req = self.requests.pop(req_id)
            req.state, req.needs_recompute = "failed", True
            req.reason = reasons.get(req_id, "no D worker remembers why")
            # What the workers reported invalid (the tracker recomputes all of a failed request's blocks anyway).
            req.invalid_block_ids = output.invalid_block_ids & set(blocks)
            self.allocator.free(blocks)
            done.append(req)
        finished = [self.requests.pop(req_id) for req_id in sorted(update.recvs_finished)]
        for req in finished:
            req.state = "finished"
        try:
            if verify:
                self.verify([req for req in finished if req.seed is not None])
        finally:  # a check that could not run still ends the requests: their blocks must not stay allocated
            for req in finished:
                self.allocator.free(req.block_ids)
        return done + finished

    def verify(self, reqs: Sequence[DecodeRequest]) -> None:
        """Check every byte of each request's KV on every D worker, in one round trip to each; sets `verified`.
        Call it before the blocks are allocated again.

        Raises:
            WorkerError: a check could not run (bad block ids, a worker gone).
        """
        checked = [req for req in reqs if req.seed is not None]
        if not checked:
            return
        answers = self.executor.broadcast(Batch([Verify(r.seed or 0, r.block_ids, r.num_tokens) for r in checked]))
        for position, req in enumerate(checked):
            req.verified = [
                result
                for worker in answers
                if isinstance(worker, list) and isinstance(result := worker[position], VerifyResult)
            ]

    def restart(self) -> list[DecodeRequest]:
        """Restart the engine (a new incarnation); returns the receives that were lost with the old one."""
        lost = list(self.requests.values())
        self.executor.restart()
        self.requests.clear()
        self.allocator = BlockAllocator(self.executor.config.num_blocks)
        self.tracker = RequestTracker()
        return lost
