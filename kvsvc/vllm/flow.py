"""The vLLM connector's decisions as sans-IO objects: `SchedulerFlow`, the scheduler side (which requests P holds,
which D loads, and what each engine step tells the workers), and `TransferReports`, what one worker may tell vLLM's
scheduler has finished.

Pure module: standard library and `kvsvc.vllm.params` only (no vllm, torch, asyncio). The vLLM adapter
(`kvsvc.vllm.connector`) feeds `SchedulerFlow` plain values from vLLM's hooks and hands `StepMetadata` to the
workers; `kvsvc.vllm.worker` feeds `TransferReports` one call per event. Rules of the scheduler side:
- P holds a request's prompt KV from the step that computes the prompt's last token when the request ends there
  (`max_tokens` 1, as routers send it): the workers call `start_send` right after that forward, so the send never
  waits for another engine step. A request that decodes on P is held when it finishes (its blocks are final only
  then: a preemption may move them). `request_finished` keeps the blocks (returns True) exactly for the requests
  whose hold started, and an aborted one has its hold aborted.
- D asks for every prompt token its prefix cache does not hold (`first_token` is where its own blocks end) and
  loads each request at most once: after a failed load vLLM recomputes it, it never waits on P again.
- Each decision names the request; nothing here raises on what vLLM hands it, except `ParamsError` for D params
  that cannot be used, which the adapter logs before computing the request locally.
- P draws each held request's transfer secret here (`draw_secret`), once: the workers hold with it, and the params
  D receives carry it; D's workers present it to P.
- Push mode (`push`, on P): P holds each request under a transfer and secret D can derive alone
  (`kvsvc.vllm.params.push_transfer_id`, `push_secret`) and announces push in its params, so a router may send D
  the request at the same time as P; D's request may then reach P before P's hold, which P keeps as an early
  request until the hold starts. D takes router push params only from P endpoints in `push_peers`, and each push
  transfer once: a repeated router id would derive the transfer again, and P answers a transfer it finished with
  its outcome, so D would take blocks nothing wrote as loaded. A pushing P's request that ends unheld (aborted or
  failed mid-prefill) is withdrawn on every worker, so D's waiting fetch fails now, not at its deadline. A
  preemption before the hold changes nothing here: the hold starts with the step that ends the prompt, from the
  request's blocks as vLLM lists them then.
- A router-named transfer (`transfer_id` in both engines' params, llm-d's `mooncake` mode) is held and fetched under
  the router's name, in either mode, with the push secret; D takes it, as push params, from `push_peers` only and
  once; P withdraws it as a pushing P does. D's fetch reaches P before the hold, and P keeps such early requests
  `early_request_timeout_s`: 10 s in pull mode, `recv_timeout_s` in push mode, which the operator's guide asks for.

Rules of a worker's reports (vLLM's scheduler asserts on what it is told; the worker hands in the sends given to the
service and what the service's loop decided of a send or receive, as one `Outcome` value, and asks for each step's
report):
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

import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvsvc.core.auth import Key
from kvsvc.core.groups import DROPPING, FULL, MAMBA
from kvsvc.core.requests import RecvRequest, SendRequest
from kvsvc.vllm.params import (
    ParamsError,
    RemotePrefill,
    is_named_request,
    is_push_request,
    named_transfer_id,
    parse_named_prefill,
    parse_push_prefill,
    parse_remote_prefill,
    producer_params,
    prompt_hash,
    push_announcement,
    push_secret,
    push_transfer_id,
    wants_remote_decode,
    wants_remote_prefill,
)


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


@dataclass(frozen=True, slots=True)
class Withdrawal:
    """P (push mode): the engine will never hold `transfer_id`; D's fetches that wait for it fail with `reason`."""

    transfer_id: str
    secret: str
    reason: str


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """What one engine step asks of every worker: started after the forward (sends), before or after it (receives,
    aborts). Immutable: vLLM may hand the same object to a worker in the same process."""

    sends: tuple[SendRequest, ...] = ()
    recvs: tuple[RecvRequest, ...] = ()
    aborts: tuple[str, ...] = ()
    engine: Mapping[tuple[int, int], Any] | None = None  # the engine's merged worker metadata, in one step
    withdrawn: tuple[Withdrawal, ...] = ()
    idle: bool = False  # the step computes nothing: its report may wait for the service's news (`TransferReports`)


class RecvPhase(Enum):
    WAITING = "waiting"  # params accepted; vLLM has not allocated blocks yet
    LOADING = "loading"  # the workers were told to fetch
    ENDED = "ended"  # loaded, failed or never needed: never loaded again


@dataclass(slots=True)
class _Producer:
    prompt_len: int
    prompt_hash: str
    early: bool  # ends in its prefill step: held from that step's forward on
    moved: int  # the prompt tokens whose KV moves (`SchedulerFlow._moved`)
    transfer_id: str  # the request id; in push mode, what D derives from its own (`push_transfer_id`)
    secret: str  # the transfer's, drawn when the request arrives (derived in push mode)
    held: bool = False
    derived: bool = False  # D derives the transfer and secret (push mode, a router-named transfer): D may wait at P


@dataclass(slots=True)
class _Consumer:
    remote: RemotePrefill
    phase: RecvPhase = RecvPhase.WAITING
    push: bool = False


@dataclass(slots=True)
class FlowStatistics:
    producing: int
    consuming: int
    holds_started: int
    loads_started: int
    params_refused: int
    withdrawn: int  # P (push): transfers withdrawn, their requests ended unheld
    recent_loads: dict[str, tuple[int, int]]  # req_id -> (first_token, num_tokens) of the latest loads


RECENT_LOADS = 1024
# Push transfers a D engine remembers having taken: at least as many as P remembers outcomes of
# (`kvsvc.core.sender.Sender`'s `remembered_outcomes`), so none that P could answer again is ever taken twice.
REMEMBERED_PUSHES = 65536


def draw_secret() -> str:
    """A fresh transfer secret: 128 random bits, 22 URL-safe characters."""
    return secrets.token_urlsafe(16)


NULL_BLOCK = 0  # vLLM's null block id: a group's list holds it where it keeps nothing


@dataclass(slots=True)
class SchedulerFlow:
    """The requests of one engine that take part in a transfer (see module docstring).

    `engine_id` names this engine to D engines; `bootstrap_addr` is where they fetch its workers' metadata;
    `block_size` is vLLM's (the scheduler's) block size; `group_kinds` the kind of each of the model's KV cache
    groups (`kvsvc.core.groups`), whose block lists every call hands in, one per group.

    Some prompt tokens are held back (`held_back`): P does not compute them (the adapter cuts vLLM's request,
    `dropped_tokens`), D loads the others and computes them. A model that keeps Mamba state holds back the last
    (a state cannot be un-applied); a multi-module MTP drafter the last `lookahead - 1`, each of its modules reading
    one token further ahead than the one before, whose KV P would otherwise write over unverified drafts (D's first
    decode, rejecting nothing, never rewrites them). A prompt no longer than what is held back moves nothing.
    """

    engine_id: str
    bootstrap_addr: str
    block_size: int
    group_kinds: tuple[str, ...] = (FULL,)
    params_key: Key | None = None  # signs P's params, verifies D's (`kvsvc.core.auth.PARAMS_KEY`); None: no token
    new_secret: Callable[[], str] = draw_secret  # what draws each transfer's secret (tests pin it)
    push: bool = False  # P: hold under transfers D derives, and announce push (`kvsvc.vllm.params`)
    push_peers: frozenset[str] = frozenset()  # D: the P endpoints ("host:port") router push params may name
    tp_size: int = 1  # P: announced with push, as vllm-router expects it
    lookahead: int = 0  # vLLM's `num_prefill_lookahead_tokens`: prompt tokens a drafter reads past the computed ones
    _producers: dict[str, _Producer] = field(default_factory=dict)
    _consumers: dict[str, _Consumer] = field(default_factory=dict)
    _sends: list[SendRequest] = field(default_factory=list)
    _recvs: list[RecvRequest] = field(default_factory=list)
    _aborts: list[str] = field(default_factory=list)
    _withdrawn: list[Withdrawal] = field(default_factory=list)
    _counts: dict[str, int] = field(default_factory=lambda: {"holds": 0, "loads": 0, "refused": 0, "withdrawn": 0})
    _recent: dict[str, tuple[int, int]] = field(default_factory=dict)
    _pushing: dict[str, str] = field(default_factory=dict)  # P: push transfer -> the live request prefilling it
    _pushed: dict[str, None] = field(default_factory=dict)  # push transfers taken, oldest first (`REMEMBERED_PUSHES`)

    # -- a request arrives -------------------------------------------------------------------------------------

    def on_new_request(
        self, req_id: str, prompt: Sequence[int], params: Mapping[str, Any] | None, max_tokens: int | None = None
    ) -> None:
        """Track `req_id` if its params ask for a transfer in either direction; `max_tokens` is its sampling limit.

        Raises:
            ParamsError: D params that cannot be used (malformed, or another prompt's KV); P params naming a bad
                `transfer_id`; a P request whose derived or named transfer another live request prefills. The
                request is not tracked, so vLLM computes it locally (P: without holding its KV).
        """
        if wants_remote_decode(params):
            if self.held_back and len(prompt) <= self.held_back:
                return  # nothing before the tokens held back: D computes the prompt itself
            early = max_tokens == 1 or self.held_back > 0  # P stops after a prefill it cut short
            moved = self._moved(len(prompt))
            digest = prompt_hash(prompt)
            transfer_id, secret = req_id, ""
            named = named_transfer_id(params)
            if named is not None or self.push:
                transfer_id = named or push_transfer_id(req_id)
                if transfer_id in self._pushing:
                    # A repeated X-Request-Id: one hold per transfer, and this one's abort would withdraw the other.
                    raise ParamsError(
                        f"push transfer {transfer_id[:120]!r} is being prefilled here for request "
                        f"{self._pushing[transfer_id][:120]!r} already: P computes this one without holding its KV"
                    )
                self._pushing[transfer_id] = req_id
                secret = push_secret(self.params_key, transfer_id, len(prompt), digest)
            self._producers[req_id] = _Producer(
                len(prompt), digest, early, moved, transfer_id, secret or self.new_secret(), derived=bool(secret)
            )
        elif wants_remote_prefill(params):
            assert params is not None
            push = is_push_request(params) or is_named_request(params)
            try:
                if is_named_request(params):
                    remote = parse_named_prefill(params, prompt, self.params_key, self.push_peers)
                    self._take_push(remote.transfer_id)
                elif push:
                    remote = parse_push_prefill(params, req_id, prompt, self.params_key, self.push_peers)
                    self._take_push(remote.transfer_id)
                else:
                    remote = parse_remote_prefill(params, self.params_key)
                if remote.num_tokens != len(prompt) or remote.prompt_hash != prompt_hash(prompt):
                    raise ParamsError(
                        f"kv_transfer_params describe a prompt of {remote.num_tokens} tokens (hash "
                        f"{remote.prompt_hash}); this request's prompt has {len(prompt)} (hash "
                        f"{prompt_hash(prompt)}): the router passed another request's params"
                    )
            except ParamsError:
                self._counts["refused"] += 1
                raise
            self._consumers[req_id] = _Consumer(remote, push=push)

    def _take_push(self, transfer_id: str) -> None:
        """Remember push transfer `transfer_id` as taken by this engine.

        Raises:
            ParamsError: it was taken before (a repeated router request id).
        """
        if transfer_id in self._pushed:
            raise ParamsError(
                f"push transfer {transfer_id[:120]!r} was already taken by this engine: a repeated X-Request-Id is "
                "computed here, never loaded twice"
            )
        self._pushed[transfer_id] = None
        if len(self._pushed) > REMEMBERED_PUSHES:
            del self._pushed[next(iter(self._pushed))]

    @property
    def keeps_state(self) -> bool:
        """Whether the model keeps Mamba state (see the class docstring)."""
        return MAMBA in self.group_kinds

    @property
    def held_back(self) -> int:
        """The trailing prompt tokens P never computes and D computes itself (see the class docstring), vLLM's
        NixlConnector's rule: one for a state model, `lookahead - 1` for a multi-module MTP drafter."""
        return max(1 if self.keeps_state else 0, self.lookahead - 1)

    def dropped_tokens(self, req_id: str) -> int:
        """How many trailing prompt tokens P must prefill `req_id` without (the adapter cuts vLLM's request)."""
        return self.held_back if req_id in self._producers else 0

    def _moved(self, prompt_len: int) -> int:
        """The prompt tokens whose KV (and state) move from P to D: all but those held back (`held_back`). A
        sliding-window model's D drops the blocks the window has passed as of the tokens it loads; loading the whole
        prompt, vLLM recomputes its last token, whose window reaches one token further back, into a block D already
        dropped (its null block): so D loads one token less and computes the last, whose window its blocks then
        hold. A chunked local group drops likewise, at chunk starts."""
        back = self.held_back if prompt_len > self.held_back else 0
        if any(kind in DROPPING for kind in self.group_kinds) and prompt_len > 1:
            back = max(back, 1)
        return prompt_len - back

    def _flat(self, groups: Sequence[Sequence[int]], num_tokens: int) -> tuple[int, ...]:
        """The blocks of `num_tokens` tokens as kvsvc carries them: each group's list, one group after another, all
        of one length (`kvsvc.core.groups.split_groups`); a Mamba group's state slot (its last block) comes last,
        behind vLLM's null block. A group holding too few leaves the list short, which the planner's checks refuse.

        Raises:
            ValueError: vLLM gave another count of lists than the model has groups.
        """
        if len(groups) != len(self.group_kinds):
            raise ValueError(f"vLLM gave {len(groups)} block lists for {len(self.group_kinds)} KV cache groups")
        used = max(1, -(-num_tokens // self.block_size))
        out: list[int] = []
        for kind, ids in zip(self.group_kinds, groups, strict=True):
            out += [NULL_BLOCK] * (used - 1) + list(ids[-1:]) if kind == MAMBA else list(ids[:used])
        return tuple(out)

    def _holds_all(self, groups: Sequence[Sequence[int]], num_tokens: int) -> bool:
        """Whether every group's list holds the blocks of `num_tokens` tokens."""
        return len(self._flat(groups, num_tokens)) == len(groups) * max(1, -(-num_tokens // self.block_size))

    # -- D: loading --------------------------------------------------------------------------------------------

    def matched_tokens(self, req_id: str, prompt_len: int, num_computed: int) -> tuple[int, bool]:
        """`get_num_new_matched_tokens`: the prompt tokens past `num_computed` (vLLM's own prefix-cache hit) that P
        holds, loaded asynchronously; `(0, False)` for anything else. Has no effect (vLLM calls it repeatedly)."""
        consumer = self._consumers.get(req_id)
        if consumer is None or consumer.phase is not RecvPhase.WAITING:
            return 0, False
        count = self._moved(prompt_len) - num_computed
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, req_id: str, groups: Sequence[Sequence[int]], num_external: int, prompt_len: int) -> None:
        """`update_state_after_alloc`: vLLM gave the request `groups` (each KV cache group's blocks, prefix-cache
        hits first) for `num_external` tokens to load. The second call, once loaded, and calls with nothing to load
        change nothing but end a request that will never load.

        Raises:
            ValueError: as `_flat`.
        """
        consumer = self._consumers.get(req_id)
        if consumer is None or consumer.phase is not RecvPhase.WAITING:
            return
        if num_external <= 0:
            consumer.phase = RecvPhase.ENDED  # vLLM computes it itself (nothing of it is to be fetched)
            return
        consumer.phase = RecvPhase.LOADING
        remote = consumer.remote
        end = self._moved(prompt_len)
        self._recvs.append(
            RecvRequest(
                req_id=req_id,
                transfer_id=remote.transfer_id,
                engine_id=remote.engine_id,
                bootstrap_addr=remote.bootstrap_addr,
                block_ids=self._flat(groups, end),
                num_tokens=end,
                first_token=end - num_external,
                secret=remote.secret,
                push=consumer.push,
            )
        )
        self._counts["loads"] += 1
        self._recent[req_id] = (end - num_external, end)
        if len(self._recent) > RECENT_LOADS:
            del self._recent[next(iter(self._recent))]

    def recvs_reported(self, req_ids: Sequence[str] | set[str]) -> None:
        """The workers reported these receives ended (`finished_recving`): they never load again."""
        for req_id in req_ids:
            consumer = self._consumers.get(req_id)
            if consumer is not None:
                consumer.phase = RecvPhase.ENDED

    # -- P: holding --------------------------------------------------------------------------------------------

    def scheduled(self, req_id: str, num_computed: int, num_scheduled: int, groups: Sequence[Sequence[int]]) -> None:
        """`req_id` is in this step with `num_scheduled` tokens after `num_computed`; `groups` are its blocks, one
        list per KV cache group. A P request that ends in its prefill step is held from right after the forward
        that ends its prompt.

        Raises:
            ValueError: as `_flat`.
        """
        producer = self._producers.get(req_id)
        if producer is None or not producer.early or num_computed + num_scheduled < producer.moved:
            return
        self._hold(req_id, producer, groups)

    def wants_blocks(self, req_id: str) -> bool:
        """Whether `scheduled` needs `req_id`'s block ids (so the adapter looks them up only then)."""
        producer = self._producers.get(req_id)
        return producer is not None and producer.early and not producer.held

    def _hold(self, req_id: str, producer: _Producer, groups: Sequence[Sequence[int]]) -> None:
        if producer.held:
            return
        producer.held = True
        blocks = self._flat(groups, producer.moved)
        self._sends.append(SendRequest(req_id, producer.transfer_id, blocks, producer.moved, producer.secret))
        self._counts["holds"] += 1

    # -- either side: the end of a request ---------------------------------------------------------------------

    def finished(
        self, req_id: str, groups: Sequence[Sequence[int]], *, completed: bool
    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished`: whether vLLM must keep the blocks until the workers report the id, and the params
        to return. `completed` is False for an abort or an error; `groups` are the request's blocks, one list per
        KV cache group.

        P: a completed request is held (from now, if it decoded on P), keeps its blocks and returns D's params; an
        aborted one that was held has its hold aborted and keeps its blocks until the abort drained.
        D: a request still loading is aborted (vLLM keeps its blocks until the workers report it anyway).
        """
        producer = self._producers.pop(req_id, None)
        if producer is not None:
            if self._pushing.get(producer.transfer_id) == req_id:
                del self._pushing[producer.transfer_id]
            if completed and self._holds_all(groups, producer.moved):
                self._hold(req_id, producer, groups)
            if not producer.held:
                if producer.derived:  # D may already wait at P for it: end that wait now
                    why = "completed with its KV not held" if completed else "aborted or failed before its KV was held"
                    reason = f"P's request {req_id[:120]!r} {why}: nothing will be pushed"
                    self._withdrawn.append(Withdrawal(producer.transfer_id, producer.secret, reason))
                    self._counts["withdrawn"] += 1
                return False, None
            if not completed:
                self._aborts.append(req_id)
                return True, None
            remote = RemotePrefill(
                self.engine_id,
                self.bootstrap_addr,
                producer.transfer_id,
                producer.prompt_len,
                producer.prompt_hash,
                producer.secret,
            )
            push = push_announcement(self.bootstrap_addr, self.tp_size) if self.push else None
            return True, producer_params(remote, self.params_key, push)
        consumer = self._consumers.pop(req_id, None)
        if consumer is not None and consumer.phase is RecvPhase.LOADING and not completed:
            self._aborts.append(req_id)
        return False, None

    # -- each step ---------------------------------------------------------------------------------------------

    def build(self) -> StepMetadata:
        """What this step tells the workers; each spec is handed out once."""
        step = StepMetadata(
            tuple(self._sends), tuple(self._recvs), tuple(self._aborts), withdrawn=tuple(self._withdrawn)
        )
        self._sends, self._recvs, self._aborts, self._withdrawn = [], [], [], []
        return step

    def statistics(self) -> FlowStatistics:
        return FlowStatistics(
            producing=len(self._producers),
            consuming=len(self._consumers),
            holds_started=self._counts["holds"],
            loads_started=self._counts["loads"],
            params_refused=self._counts["refused"],
            withdrawn=self._counts["withdrawn"],
            recent_loads=dict(self._recent),
        )
