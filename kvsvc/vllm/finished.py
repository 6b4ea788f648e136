"""What one vLLM worker may tell vLLM's scheduler has finished, `TransferReports`: which request ids go out as
finished sending, finished receiving and failed receiving, which wait, and which are dropped.

Pure module: standard library and `kvsvc.vllm.flow` only (no torch, asyncio, vllm). `kvsvc.vllm.worker` feeds it one
call per event (sends handed to the service; what the service's loop decided of a send or receive, as one `Outcome`
value) and asks it for each step's report. Rules (vLLM's scheduler asserts on what it is told):
- Each id is reported at most once, and only an id vLLM handed this worker: a send of the step's `sends`, a receive
  of its `recvs`. Anything else the service reports (an id never handed in, a repeat) is dropped.
- A send is reported once the service ended it (or refused it) and vLLM reported the request finished
  (`finished_req_ids`); whichever comes first waits for the other. Its id is held from the step's bind, before
  the forward: with drafts on, vLLM reports the step's finished ids before the step's sends reach the service.
- A receive is reported once it ended; a failed one is in both `finished_recving` and `failed_recving`, with its
  blocks in the load errors of the same step; one whose start was refused fails at the next report.
- Load errors never name vLLM's null block (no request owns it), and none go out for a hybrid model, whose failed
  receives vLLM takes only as whole requests.
- vLLM's engine steps without pause while a request waits for its KV, even when it has nothing to compute; such an
  idle step may wait for the service's news instead (`may_wait`), but only while a receive is owed and nothing is
  ready to report.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvsvc.vllm.flow import NULL_BLOCK


@dataclass(frozen=True, slots=True)
class SendRefused:
    """The service refused to start a send handed in."""

    req_id: str


@dataclass(frozen=True, slots=True)
class RecvStarted:
    """The service started a receive of the step; `push`: it waits for a pushing P's prefill."""

    req_id: str
    block_ids: tuple[int, ...]
    push: bool = False


@dataclass(frozen=True, slots=True)
class RecvRefused:
    """The service refused to start a receive of the step."""

    req_id: str
    block_ids: tuple[int, ...]


# What the service's loop decided of one send or receive handed to it: posted by the loop, taken in order.
Outcome = SendRefused | RecvStarted | RecvRefused


@dataclass(slots=True)
class TransferResults:
    """One step's report for vLLM (see module docstring). `service_failures`: the ids of `failed_recving` that
    the service failed (the others could not start), whose reasons the worker logs."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    service_failures: set[str] = field(default_factory=set)


class TransferReports:
    """The ids of one worker between vLLM handing them in and vLLM hearing they finished (see module docstring)."""

    def __init__(self) -> None:
        self._holding: set[str] = set()  # sends handed to the service (started or refused), until reported
        self._ended: set[str] = set()  # of those, the ones the service ended, waiting for vLLM's finish
        self._seen_finished: set[str] = set()  # of those, the ones vLLM reported finished, waiting for the end
        self._receiving: dict[str, tuple[int, ...]] = {}  # started receives, with their blocks
        self._pushed: set[str] = set()  # those of them that wait for a pushing P's prefill (router push params)
        self._refused: dict[str, tuple[int, ...]] = {}  # receives that could not start: fail at the next report
        self._invalid: set[int] = set()  # blocks of failed receives, until `take_load_errors`

    # -- events ------------------------------------------------------------------------------------------------

    def sends_handed(self, req_ids: Iterable[str]) -> None:
        """The step's sends are bound (vLLM names them before its forward): each is reported once the service ended
        it and vLLM saw its request finish, whether vLLM reports the finish before or after the sends reach the
        service. Handing the same ids in again changes nothing."""
        self._holding.update(req_ids)

    def sends_dropped(self, req_ids: Iterable[str]) -> None:
        """The step's sends never reached the service (its loop is closed): nothing is owed for them."""
        for req_id in req_ids:
            self._holding.discard(req_id)
            self._ended.discard(req_id)
            self._seen_finished.discard(req_id)

    def decided(self, outcome: Outcome) -> None:
        """Take what the service's loop decided of a send or receive (`Outcome`)."""
        match outcome:
            case SendRefused(req_id):
                self.send_refused(req_id)
            case RecvStarted(req_id, block_ids, push):
                self.recv_started(req_id, block_ids, push)
            case RecvRefused(req_id, block_ids):
                self.recv_refused(req_id, block_ids)

    def send_refused(self, req_id: str) -> None:
        """The service refused to start a send handed in (vLLM keeps the blocks until it hears of the id, so it is
        reported as if the send ended; D's fetch fails cleanly)."""
        if req_id in self._holding:
            self._ended.add(req_id)

    def recv_started(self, req_id: str, block_ids: Sequence[int], push: bool = False) -> None:
        """The service started a receive of the step: reported once the service reports it ended. `push`: it waits
        for a pushing P's prefill, which the router started at the same time."""
        self._receiving[req_id] = tuple(block_ids)
        if push:
            self._pushed.add(req_id)

    def recv_refused(self, req_id: str, block_ids: Sequence[int]) -> None:
        """The service refused to start a receive of the step: reported failed at the next report."""
        self._refused[req_id] = tuple(block_ids)

    # -- each step's report ------------------------------------------------------------------------------------

    def report(
        self,
        finished_req_ids: Iterable[str],
        finished_sending: Iterable[str] = (),
        finished_recving: Iterable[str] = (),
        failed_recving: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
    ) -> TransferResults:
        """What vLLM is told this step: `finished_req_ids` are the requests vLLM reports finished, the rest is the
        service's report since the last step (`KVTransferService.get_finished`)."""
        results = TransferResults()
        self._seen_finished |= self._holding.intersection(finished_req_ids)
        self._ended |= self._holding.intersection(finished_sending)
        ready = self._ended & self._seen_finished
        results.finished_sending = ready
        self._ended -= ready
        self._seen_finished -= ready
        self._holding -= ready
        failed = set(failed_recving)
        for req_id in finished_recving:
            self._pushed.discard(req_id)
            if self._receiving.pop(req_id, None) is not None:
                results.finished_recving.add(req_id)
        self._pushed.difference_update(failed)
        ours = {req_id for req_id in failed if self._receiving.pop(req_id, None) is not None}
        results.finished_recving |= ours
        results.failed_recving |= ours
        results.service_failures = ours
        self._invalid.update(invalid_block_ids)
        for req_id, blocks in self._refused.items():
            results.finished_recving.add(req_id)
            results.failed_recving.add(req_id)
            self._invalid.update(blocks)
        self._refused.clear()
        return results

    def take_load_errors(self, *, hybrid: bool) -> set[int]:
        """The blocks of failed receives since the last call, less vLLM's null block (which a sliding-window group's
        list holds where the window has passed); none for a `hybrid` model."""
        invalid, self._invalid = self._invalid, set()
        return set() if hybrid else invalid - {NULL_BLOCK}

    def may_wait(self, finished_req_ids: Iterable[str]) -> bool:
        """Whether an idle step may wait for the service's news before it reports: true while a receive has not
        ended in the service and nothing could be reported now (a refused receive, a send ended in the service
        whose request vLLM reports finished now or earlier). Sends alone never make a step wait: that step is P's,
        where a new request's prefill would wait behind it, and D's fetch ends P's wait soon."""
        if self._refused or not self._receiving:
            return False
        return not self._ended & (self._seen_finished | self._holding.intersection(finished_req_ids))

    def idle_wait(self, finished_req_ids: Iterable[str], pull_s: float, push_s: float) -> float:
        """How long an idle step waits for the service's news (a receive's end wakes it at once): 0 unless
        `may_wait`; `push_s` while every receive owed waits for a pushing P's prefill, hundreds of milliseconds of
        steps that would compute nothing and take the cores P's forward may share; else `pull_s`, as a new request
        arriving meanwhile waits for the step's end."""
        if not self.may_wait(finished_req_ids):
            return 0.0
        return push_s if self._pushed.issuperset(self._receiving) else pull_s

    @property
    def waiting(self) -> int:
        """Ids handed in and not reported yet: 0 once every transfer of this worker was reported."""
        return len(self._holding) + len(self._receiving) + len(self._refused)


__all__ = ["Outcome", "RecvRefused", "RecvStarted", "SendRefused", "TransferReports", "TransferResults"]
