"""P's side of the protocol as a sans-IO object: holds, send jobs, deadlines and exactly-once reporting.

Rules: `Sender` takes events (a hold from the engine, a request or abort from a D worker, a write's end as one value,
`WriteEnd`, the clock) and returns commands (`Submit`, `Reply`); it never touches a socket, a transport or a clock
itself. Each held request is reported in `take_finished()` exactly once: when every D worker that needs it was served,
when it expired, or when it was aborted, and never while a write may still touch its blocks. Requests that arrive before
the hold wait a bounded time, bounded in number and in block ids per D worker, then are answered failed. Each hold has a
secret (`hold`): a request, release or abort that does not carry it is answered exactly as one for a transfer P never
held (so a prober learns nothing of which ids exist), and counted. What the engine asks is one frozen value,
`SendRequest`, built by the engine's side (`kvsvc.vllm.flow`, or `KVTransferService.start_send` from an embedder's
arguments), checked once by `check_send` as the service's role takes it, and from there passed as it is: no layer
below re-checks it or unpacks it into arguments, and no error message shows its secret. A driver (the service's P
role, the test harness) carries out the commands of the `Sender` and of P's writes in rounds through one protocol,
`PSide`, dispatched by the one `match` of `carry_out_p`. Pure module: standard library and kvsvc's pure core only.
"""

from __future__ import annotations

import hmac
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Final, Protocol, TypeAlias, TypeVar

from msgspec.structs import replace

from kvsvc.core.jobs import Deadlines, Effect, Notice, SendEvent, SendJob, SendState
from kvsvc.core.messages import (
    MAX_COUNT,
    Abort,
    ErrorMessage,
    Message,
    Ping,
    Pong,
    Release,
    TransferDone,
    TransferFailed,
    TransferRequest,
    Worker,
    WorkerMetadata,
    WorkerRef,
    check_secret,
    check_transfer_id,
)
from kvsvc.core.planner import check_block_ids, check_window
from kvsvc.core.windows import Announce, Fail, FillCommand

# What an early request costs against `max_early_request_bytes`: its block ids, at their size on the wire at worst,
# its text (transfer id, secret, receive, reason) and what keeping any entry costs.
BLOCK_ID_BYTES: Final = 8
EARLY_ENTRY_BYTES: Final = 256

_K = TypeVar("_K")
EarlyKey: TypeAlias = tuple[str, WorkerRef, str, str]  # (transfer, D worker, secret, receive)
EarlyEntry: TypeAlias = tuple[float, WorkerRef, TransferRequest | Release | Abort, frozenset[Worker]]


@dataclass(frozen=True, slots=True)
class Submit:
    """Plan this transfer's share for `dst` and write it; its end goes back as one `WriteEnd` (`Sender.write_ended`)."""

    transfer_id: str
    dst: WorkerRef
    src_block_ids: list[int]
    dst_block_ids: list[int]
    num_tokens: int
    first_token: int = 0  # tokens before it D holds already
    window_addr: int = 0  # D's window for the share (`TransferRequest.window_bytes`); 0 bytes: write the blocks
    window_bytes: int = 0
    share_bytes: int = 0  # the share as D planned it; above `window_bytes`, it moves in rounds


# From how many prompt tokens a pushing P on CPU streams a request's KV layer by layer during its forward
# (`streams_during_forward`); None: never. `kvsvc bench --vllm --workload sweep`, three runs each way on the 2-core VM
# (docs/performance.md, "Prompt lengths"): streaming from 1,536 tokens made push slower than pull at 4,000 tokens (its
# copies stretch the forward they share the cores with), while writing after the forward kept push at least as fast
# as pull at every length from 128 to 4,000 tokens. A host with cores to spare sets a length.
PUSH_MIN_TOKENS: Final[int | None] = None


def streams_during_forward(num_tokens: int, min_tokens: int | None = PUSH_MIN_TOKENS) -> bool:
    """Whether a pushing P writes a request of `num_tokens` layer by layer while its forward runs (from `min_tokens`
    on; None: never), or in one write once the forward is over, as a pulling P does. On a host where P's copies share
    the cores its forward runs on, per-layer copies stretch the forward by more than the whole write after it takes.
    Raises nothing."""
    return min_tokens is not None and num_tokens >= min_tokens


def streams_by_layer(computed: Sequence[bool]) -> bool:
    """Whether a `Submit` of a layer-wise send (`computed`: each layer's compute ended well, in order) is written
    layer by layer: only while some layer is still computing. Once every layer is computed, a D request that comes
    after the forward (pull, or a push whose D came late) goes as one write: per-layer writes would only split it
    into more submissions, each a round trip to the plane, and take a task where one direct submission does.
    A layer whose compute failed counts as not computed, so the layer-wise path meets and reports the failure."""
    return not all(computed)


@dataclass(frozen=True, slots=True)
class Reply:
    """Send `message` to D worker `dst` on its control connection."""

    dst: WorkerRef
    message: TransferDone | TransferFailed | ErrorMessage | Pong


SendCommand: TypeAlias = Submit | Reply | Notice


@dataclass(frozen=True, slots=True)
class Landed:
    """A `Submit`'s write ended with every byte in D's blocks (or its window): `nbytes` in `descriptors`."""

    nbytes: int
    descriptors: int
    write_s: float = 0.0  # from submission to landing, as the writer timed it (D hears it in `TransferDone`)


@dataclass(frozen=True, slots=True)
class WriteFault:
    """A `Submit`'s write failed with `error` (the cause, named), and none of its `descriptors` can move any more:
    whatever a plane still had in flight drained first, so the blocks may be released now."""

    error: str
    descriptors: int = 0


WriteEnd: TypeAlias = Landed | WriteFault
"""How every write ends, on any plane and on any path (a task, a direct submission, a write in rounds, staged)."""


# -- the write-failure contract ----------------------------------------------------------------------------------
# A failed write ends (its `WriteFault`, its blocks released) only once none of its descriptors can move any more.
# What it waits for first depends on how it failed, by the transport contract (`kvsvc.transport.base`), and on whether
# a plane was asked at all. The writer sorts a failure into a `FaultKind` and waits as `FAULT_WAITS` says, the one
# place where this is decided; the table has a row for every pair (a test holds it).


class FaultKind(Enum):
    """How a write failed, as the transport contract sorts it."""

    PLANE = "plane"  # the plane's `WriteFailed`, which names its own `drained`
    WITHIN_CONTRACT = "within"  # refused before anything was submitted, or raised once all it submitted ended
    OUTSIDE_CONTRACT = "outside"  # anything else (a failed gather, a plane breaking its contract, a bug of ours)


class FaultWait(Enum):
    """What a failed write waits for before it ends."""

    NOTHING = "nothing"
    DRAINED = "drained"  # the `drained` future the plane's `WriteFailed` carries
    SETTLED = "settled"  # the plane to have nothing in flight to the D worker, bounded by `close_drain_timeout_s`


# (how it failed, whether a plane was asked) -> what it waits for.
FAULT_WAITS: Final[Mapping[tuple[FaultKind, bool], FaultWait]] = {
    (FaultKind.PLANE, True): FaultWait.DRAINED,
    (FaultKind.PLANE, False): FaultWait.DRAINED,  # a `WriteFailed` names its own `drained`, whoever raised it
    (FaultKind.WITHIN_CONTRACT, True): FaultWait.NOTHING,
    (FaultKind.WITHIN_CONTRACT, False): FaultWait.NOTHING,
    (FaultKind.OUTSIDE_CONTRACT, True): FaultWait.SETTLED,  # part of it may still move: the plane must settle
    (FaultKind.OUTSIDE_CONTRACT, False): FaultWait.NOTHING,  # nothing was handed to a plane
}


def fault_wait(kind: FaultKind, plane_asked: bool) -> FaultWait:
    """What a write that failed as `kind` waits for before its `WriteFault` may end it (`FAULT_WAITS`; `plane_asked`:
    the write reached a plane, so part of it may have been submitted). Raises nothing."""
    return FAULT_WAITS[(kind, plane_asked)]


class HoldEnd(Enum):
    """Why a hold stopped waiting for more D workers (it is reported once no write of it can touch its blocks)."""

    ABORTED = "aborted"  # by P's engine, or by the worker shutting down
    EXPIRED = "expired"  # the hold deadline passed


@dataclass(slots=True)
class _Hold:
    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    deadline: float
    secret: bytes
    ready: bool = False
    dst_engine: tuple[str, str] | None = None
    expected: frozenset[Worker] | None = None
    jobs: dict[Worker, SendJob] = field(default_factory=dict)
    refs: dict[Worker, WorkerRef] = field(default_factory=dict)
    # The receive (`TransferRequest.receive`) each D worker's job serves: another receive gets none of it.
    receives: dict[Worker, str] = field(default_factory=dict)
    results: dict[Worker, tuple[int, int, float]] = field(default_factory=dict)  # bytes, descriptors, write_s
    ended: HoldEnd | None = None


@dataclass(frozen=True, slots=True)
class SenderStatistics:
    holds: int
    early_requests: int
    early_request_bytes: int  # block ids of the early requests, at `BLOCK_ID_BYTES` each
    jobs_by_state: dict[str, int]
    finished_pending_report: int
    expired_holds: int
    aborted_holds: int
    # Requests, releases and aborts of a held (or recently held) transfer without its secret: 0 unless a D worker is
    # misconfigured or probing.
    refused_secrets: int = 0
    # Requests that reached P before its hold and were served from the hold's start on (push mode's overlap).
    early_served: int = 0


class Sender:
    """The send side of one P worker (see module docstring)."""

    def __init__(
        self,
        *,
        hold_timeout_s: float = 60.0,
        early_request_timeout_s: float = 10.0,
        max_early_requests: int = 65536,
        max_early_request_bytes: int = 16 * 1024 * 1024,
        max_early_request_bytes_total: int = 64 * 1024 * 1024,
        remembered_outcomes: int = 65536,
        exact_tokens: bool = False,
    ) -> None:
        """`exact_tokens`: the model keeps state (Mamba, GDN), which P holds as of its hold's last token: a request
        for fewer tokens would take that state for an earlier token's, so it is refused like one for more."""
        self._exact = exact_tokens
        self._hold_timeout = hold_timeout_s
        self._early_timeout = early_request_timeout_s
        self._max_early = max_early_requests
        self._holds: dict[str, _Hold] = {}
        self._deadlines = Deadlines(self._hold_deadline)
        self._by_req: dict[str, str] = {}  # req_id -> transfer_id of each hold, for the engine's aborts
        # Requests for transfers not held yet, in arrival order (deadline, request, expected set), keyed by
        # (transfer, D worker, secret, receive): a request without the secret must not take the place of the one with
        # it, nor one receive's request or abort another's.
        # Indexed by transfer and by D worker, so a hold or a lost peer costs its own entries, not the table's.
        self._early: OrderedDict[EarlyKey, EarlyEntry] = OrderedDict()
        self._early_of: dict[str, dict[EarlyKey, None]] = {}
        self._early_from: dict[WorkerRef, dict[EarlyKey, None]] = {}
        self._max_early_bytes = max_early_request_bytes
        self._early_bytes: Counter[WorkerRef] = Counter()  # what each D worker's early requests cost (`_cost`)
        self._max_early_total = max_early_request_bytes_total  # and of all D workers together
        # Outcomes of finished transfers, so a repeated request is answered again rather than left to fail.
        # Keyed by the D worker's whole identity: another engine, or a restart, must never be told an old outcome.
        # Each names the receive it answered: another receive of the same D worker is told nothing of it.
        self._outcomes: OrderedDict[tuple[str, WorkerRef], TransferDone | TransferFailed] = OrderedDict()
        self._remembered = remembered_outcomes
        # Why each recently finished transfer ended, and its secret, for D workers that ask only after it did.
        self._closed: OrderedDict[str, tuple[str, bytes, str]] = OrderedDict()
        self._finished: set[str] = set()
        self._expired_count = 0
        self._aborted_count = 0
        self._refused_secrets = 0
        self.early_served = 0  # requests served from a hold's start that reached P before it (`SenderStatistics`)

    # -- events from the engine -------------------------------------------------------------------------------

    def hold(self, request: SendRequest, now: float) -> list[SendCommand]:
        """The engine holds `request.req_id`'s KV for `request.transfer_id` until D workers fetched it (or the hold
        expires). `request` passed `check_send` as the service's role took it.

        Only D workers that present the request's secret are served. A repeated hold of a held transfer is a no-op.
        Requests that arrived early are applied now if they carry the secret; the others wait out their early
        deadline, as for an unknown transfer.

        Raises:
            ValueError: `transfer_id` is held already for another request or with another secret.
        """
        req_id, transfer_id, secret = request.req_id, request.transfer_id, request.secret
        block_ids, num_tokens = list(request.block_ids), request.num_tokens
        held = self._holds.get(transfer_id)
        if held is not None:
            if held.req_id != req_id:
                raise ValueError(
                    f"transfer {transfer_id!r} is already held for request {held.req_id!r}, not {req_id!r}"
                )
            if not _matches(held.secret, secret):
                raise ValueError(f"transfer {transfer_id!r} is already held for {req_id!r} with another secret")
            return []
        deadline = now + self._hold_timeout
        self._closed.pop(transfer_id, None)  # held again (a withdrawal or an end of an earlier request with its id)
        hold = _Hold(req_id, transfer_id, block_ids, num_tokens, deadline, _encode(secret))
        self._holds[transfer_id] = hold
        self._deadlines.set(transfer_id, deadline)
        self._by_req[req_id] = transfer_id
        commands: list[SendCommand] = []
        for key in list(self._early_of.get(transfer_id, ())):
            if not _matches(hold.secret, key[2]):
                self._refused_secrets += 1
                continue  # answered at its early deadline, as a request for a transfer never held
            _, dst, message, expected = self._pop_early(key)
            if isinstance(message, Abort):
                commands += self.remote_abort(dst, message, now, expected)
            elif isinstance(message, Release):
                commands += self.release(dst, expected, message, now)
            else:
                self.early_served += 1
                commands += self.request(dst, expected, message, now)
        return commands

    def ready(self, transfer_id: str) -> list[SendCommand]:
        """The compute that wrote the transfer's KV finished; requested jobs may write now."""
        hold = self._holds.get(transfer_id)
        if hold is None or hold.ready:
            return []
        hold.ready = True
        commands: list[SendCommand] = []
        for job in list(hold.jobs.values()):
            commands += self._apply(hold, job, SendEvent.READY)
        return commands

    def abort(self, req_id: str) -> list[SendCommand]:
        """The engine aborted `req_id`: answer waiting D workers failed; writing jobs drain first."""
        transfer_id = self._by_req.get(req_id)
        if transfer_id is None:
            return []
        return self._abort_hold(self._holds[transfer_id], "aborted by P")

    def withdraw(self, transfer_id: str, secret: str, reason: str) -> list[SendCommand]:
        """P's engine will never hold `transfer_id` (its request ended before its KV was computed: aborted or
        failed mid-prefill). D workers whose requests for it wait early, with its `secret`, are answered failed now
        instead of at their early deadline, and later ones at once, as for a transfer that ended (`reason`). A held
        transfer is left alone: its engine aborts it by request id. Requests with another secret keep waiting.

        Raises:
            ValueError: `secret` is refused by `check_secret`, `transfer_id` by `check_transfer_id`.
        """
        check_transfer_id(transfer_id)
        check_secret(secret, transfer_id)
        if transfer_id in self._holds:
            return []
        encoded = _encode(secret)
        commands: list[SendCommand] = []
        for key in [k for k in self._early_of.get(transfer_id, ()) if _matches(encoded, k[2])]:
            _, dst, message, _ = self._pop_early(key)
            if isinstance(message, TransferRequest):  # an early abort was answered when it came; a release needs none
                commands.append(Reply(dst, _failed(message, reason, "aborted")))
        self._remember_closed(transfer_id, reason, encoded, "aborted")
        return commands

    def shut_down(self, reason: str) -> list[SendCommand]:
        """The worker is closing: answer failed every D request that waits (early ones, and jobs whose KV never
        became ready), as an engine abort of every hold would, so that D need not wait for its deadlines.
        Jobs still writing drain first, as for an abort; holds end as aborted and are reported finished."""
        commands: list[SendCommand] = []
        for _, dst, message, _ in self._early.values():
            if isinstance(message, TransferRequest):
                commands.append(Reply(dst, _failed(message, reason, "p_lost")))
        self._early.clear()
        self._early_of.clear()
        self._early_from.clear()
        self._early_bytes.clear()
        for hold in list(self._holds.values()):
            for job in hold.jobs.values():
                if job.ended_by is None:  # D counts what a closing P ends as P lost, not as an abort
                    job.ended_by = SendEvent.PEER_LOST
            commands += self._abort_hold(hold, reason)
        return commands

    # -- events from D workers ---------------------------------------------------------------------------------

    def receive(
        self, dst: WorkerRef, dst_meta: WorkerMetadata, expected: frozenset[Worker], message: Message, now: float
    ) -> list[SendCommand]:
        """A frame from D worker `dst` (whose hello published `dst_meta`) on its accepted connection: every driver
        hands each frame here. A request whose block ids D's pool cannot hold is refused (`refuse`); anything
        that is not a D-to-P message is answered with an error and noticed as a protocol error."""
        if isinstance(message, TransferRequest):
            try:
                check_block_ids(dst_meta, message.block_ids, message.num_tokens, "D", message.first_token)
                check_window(dst_meta, message.window_addr, message.window_bytes, message.share_bytes)
            except ValueError as exc:
                return self.refuse(dst, message, str(exc), now, expected)
            return self.request(dst, expected, message, now)
        if isinstance(message, Release):
            return self.release(dst, expected, message, now)
        if isinstance(message, Abort):
            return self.remote_abort(dst, message, now, expected)
        if isinstance(message, Ping):
            return [Reply(dst, Pong(nonce=message.nonce))]
        if isinstance(message, ErrorMessage):
            return [Notice(f"D worker {dst} reports a protocol error: {message.reason}", from_peer=True)]
        what = f"unexpected {type(message).__name__} from D worker {dst}"
        return [Notice(what, protocol_error=True), Reply(dst, ErrorMessage(reason=what))]

    def request(
        self, dst: WorkerRef, expected: frozenset[Worker], message: TransferRequest, now: float
    ) -> list[SendCommand]:
        """D worker `dst` asks for its share. `expected` is every D worker of dst's engine that this P worker sources.

        A repeat is a no-op, or re-answers the outcome if the job ended. A request without the hold's secret is
        treated as one for a transfer not held (`hold`); one for more tokens than P holds is refused, and for a model
        that keeps state one for any other count.
        """
        hold = self._holds.get(message.transfer_id)
        if hold is None or not self._secret_ok(hold.secret, message.secret):
            return self._early_or_outcome(dst, message, expected, now)
        refused = self._check_engine(hold, dst, expected)
        if refused:
            return [refused]
        job = hold.jobs.get(dst.worker)
        if job is not None:
            if not self._same_receive(hold, dst.worker, message.receive):
                return [Reply(dst, _another_receive(message, dst))]
            return self._apply(hold, job, SendEvent.REQUEST)
        if message.num_tokens > hold.num_tokens or (self._exact and message.num_tokens != hold.num_tokens):
            # P and D hold back their own count of prompt tokens (`kvsvc.vllm.flow`): engines on other speculative
            # configs can disagree, and a state holds every token it saw.
            reason = (
                f"D worker {dst} asks for {message.num_tokens} tokens of transfer {hold.transfer_id!r}, P holds "
                f"{hold.num_tokens}" + (" and a state as of its last token" if self._exact else "")
            )
            job = self._new_job(hold, dst, message.receive)
            job.ended_by = SendEvent.REQUEST  # ended as an abort, but D counts it as a refusal (`_CAUSE_OF`)
            return self._apply(hold, job, SendEvent.ABORT, reason)
        job = self._new_job(hold, dst, message.receive, message)
        commands = self._apply(hold, job, SendEvent.REQUEST)
        if hold.ended is not None:
            return commands + self._apply(hold, job, _END_EVENTS[hold.ended])
        return commands + (self._apply(hold, job, SendEvent.READY) if hold.ready else [])

    def release(self, dst: WorkerRef, expected: frozenset[Worker], message: Release, now: float) -> list[SendCommand]:
        """D's designated worker says no D worker needs data from this P worker: finish the hold now. Without the
        hold's secret it is treated as a release of a transfer not held."""
        hold = self._holds.get(message.transfer_id)
        if hold is None or not self._secret_ok(hold.secret, message.secret):
            return self._early_or_outcome(dst, message, expected, now)
        refused = self._check_engine(hold, dst, expected)
        if refused:
            return [refused]
        self._maybe_finish(hold)
        return []

    def remote_abort(
        self, dst: WorkerRef, message: Abort, now: float = 0.0, expected: frozenset[Worker] | None = None
    ) -> list[SendCommand]:
        """D worker `dst` aborted its receive: stop its job (after any write drained); it counts as served.

        Every abort is answered once nothing of the job can be written any more: at once when no write runs (no
        hold, no job, a job already ended: its outcome), else when the write ended. D relies on that answer to
        free its blocks after a lost connection (a fence: docs/decisions.md, "After a lost connection, D's blocks
        wait for proof").
        An abort for a transfer not held yet is kept like an early request, so the hold that comes later counts
        `dst` as served at once. `expected` is as for `request`; without it an abort before any request cannot tell
        P which other D workers to wait for. An abort without the hold's secret is answered as one for a transfer
        not held, and changes nothing.
        """
        transfer_id, reason = message.transfer_id, message.reason or "aborted by D"
        hold, closed = self._holds.get(transfer_id), self._closed.get(transfer_id)
        known = hold.secret if hold is not None else closed[1] if closed is not None else None
        if known is None or not self._secret_ok(known, message.secret):
            # Never held, or not for this secret: kept like an early request (the hold checks its secret).
            key = (transfer_id, dst, message.secret, message.receive)
            if key in self._early:
                self._pop_early(key)
            abort = Abort(transfer_id=transfer_id, reason=reason, secret=message.secret, receive=message.receive)
            self._keep_early(key, (now + self._early_timeout, dst, abort, expected or frozenset()))
        if known is None or hold is None or not _matches(hold.secret, message.secret):
            # Nothing was written for D in a transfer P does not hold for it: D may end its abort now.
            return [Reply(dst, _failed(message, reason, "aborted"))]
        if hold.dst_engine is None and expected is not None:
            self._check_engine(hold, dst, expected)
        if hold.dst_engine is not None and hold.dst_engine != (dst.engine_id, dst.incarnation):
            reason = f"abort of transfer {transfer_id!r} from {dst}, which is not the engine fetching it"
            return [Reply(dst, ErrorMessage(reason=reason, transfer_id=transfer_id))]
        job = hold.jobs.get(dst.worker)
        if job is None:
            # D gave up before asking: the job ends at once, and the D worker counts as served.
            job = self._new_job(hold, dst, message.receive)
            return self._apply(hold, job, SendEvent.ABORT, reason or "aborted by D")
        if not self._same_receive(hold, dst.worker, message.receive):
            return [Reply(dst, _another_receive(message, dst))]  # the job is another receive's: left alone
        if job.terminal:
            # Its write (if any) ended: repeat the outcome, which tells D nothing more will land.
            return [Reply(dst, _outcome(hold, job))]
        return self._apply(hold, job, SendEvent.ABORT, reason)

    def refuse(
        self, dst: WorkerRef, request: TransferRequest, reason: str, now: float, expected: frozenset[Worker]
    ) -> list[SendCommand]:
        """D worker `dst` sent a request P cannot serve (block ids outside its pool, say): answer it failed once,
        and count `dst` as served; a job `dst` already has is left alone (the bad frame is only answered). Without
        the hold's secret it is answered as for a transfer not held, and changes nothing."""
        transfer_id = request.transfer_id
        hold = self._holds.get(transfer_id)
        if hold is not None and dst.worker in hold.jobs and _matches(hold.secret, request.secret):
            return [Reply(dst, ErrorMessage(reason=reason, transfer_id=transfer_id))]
        abort = Abort(transfer_id=transfer_id, reason=reason, secret=request.secret, receive=request.receive)
        commands = [  # ended as an abort would end it, but D counts it as what it is
            Reply(c.dst, replace(c.message, cause="refused"))
            if isinstance(c, Reply) and isinstance(c.message, TransferFailed)
            else c
            for c in self.remote_abort(dst, abort, now, expected)
        ]
        if not any(isinstance(c, Reply) for c in commands):
            commands.append(Reply(dst, _failed(request, reason, "refused")))
        return commands

    def peer_lost(self, dst: WorkerRef) -> list[SendCommand]:
        """The control connection to `dst` broke: its pending jobs fail; writing ones drain first."""
        commands: list[SendCommand] = []
        reason = f"control connection to {dst} lost"
        for hold in list(self._holds.values()):
            job = hold.jobs.get(dst.worker)
            if job is not None and hold.refs.get(dst.worker) == dst:
                commands += self._apply(hold, job, SendEvent.PEER_LOST, reason)
            elif (
                job is None
                and hold.dst_engine == (dst.engine_id, dst.incarnation)
                and dst.worker in (hold.expected or ())
            ):
                # D's receive fails with the connection, so it will never ask: count it served now, not at expiry.
                commands += self._apply(hold, self._new_job(hold, dst, ""), SendEvent.PEER_LOST, reason)
        for key in list(self._early_from.get(dst, ())):
            self._pop_early(key)
        return commands

    # -- events from the transport and the clock ---------------------------------------------------------------

    def write_ended(self, transfer_id: str, dst: Worker, end: WriteEnd) -> list[SendCommand]:
        """The write that a `Submit` of `transfer_id` to D worker `dst` started ended as `end`: the job's event is
        `WRITE_OK` when it `Landed`, `WRITE_FAILED` with the fault's error otherwise. Nothing for a hold or job that
        already ended (an abort or expiry answered D meanwhile)."""
        hold = self._holds.get(transfer_id)
        job = hold.jobs.get(dst) if hold is not None else None
        if hold is None or job is None:
            return []
        match end:
            case Landed(nbytes, descriptors, write_s):
                hold.results[dst] = (nbytes, descriptors, write_s)
                return self._apply(hold, job, SendEvent.WRITE_OK)
            case WriteFault(error, descriptors):
                hold.results[dst] = (0, descriptors, 0.0)
                return self._apply(hold, job, SendEvent.WRITE_FAILED, error)

    def expire(self, now: float) -> list[SendCommand]:
        """Apply every deadline that passed at `now`: holds nobody fully fetched, early requests never held."""
        commands: list[SendCommand] = []
        for transfer_id in self._deadlines.due(now):
            hold = self._holds[transfer_id]  # `due` names held transfers not yet ended (`_hold_deadline`)
            hold.ended = HoldEnd.EXPIRED
            self._expired_count += 1
            reason = f"hold of transfer {hold.transfer_id!r} expired after {self._hold_timeout:g} s"
            for job in list(hold.jobs.values()):
                commands += self._apply(hold, job, SendEvent.EXPIRE, reason)
            self._maybe_finish(hold)
        while self._early:
            key, (deadline, dst, message, _) = next(iter(self._early.items()))
            if deadline > now:
                break
            self._pop_early(key)
            if isinstance(message, TransferRequest):
                reason = f"unknown transfer {message.transfer_id!r}: not held by P within {self._early_timeout:g} s"
                commands.append(Reply(dst, _failed(message, reason, "expired")))
        return commands

    def next_deadline(self) -> float | None:
        """The earliest time at which `expire` has something to do, or None."""
        deadlines = [d for d in (self._deadlines.earliest(),) if d is not None]
        if self._early:
            deadlines.append(next(iter(self._early.values()))[0])
        return min(deadlines, default=None)

    def _hold_deadline(self, transfer_id: str) -> float | None:
        """The deadline `expire` applies to `transfer_id`'s hold: none once it is gone or ended."""
        hold = self._holds.get(transfer_id)
        return hold.deadline if hold is not None and hold.ended is None else None

    def take_finished(self) -> set[str]:
        """The req_ids whose holds ended since the last call; each appears exactly once over the Sender's life."""
        finished, self._finished = self._finished, set()
        return finished

    def writing(self, transfer_id: str, dst: Worker) -> bool:
        """Whether the job of D worker `dst` in `transfer_id` still wants its write (WRITING, not aborted into
        DRAINING): a write in rounds stops at the next round once it does not."""
        hold = self._holds.get(transfer_id)
        job = hold.jobs.get(dst) if hold is not None else None
        return job is not None and job.state is SendState.WRITING

    def holds(self, transfer_id: str) -> bool:
        """Whether `transfer_id` is still held (its outcome not decided)."""
        return transfer_id in self._holds

    def statistics(self) -> SenderStatistics:
        states: dict[str, int] = {}
        for hold in self._holds.values():
            for job in hold.jobs.values():
                states[job.state.value] = states.get(job.state.value, 0) + 1
        return SenderStatistics(
            holds=len(self._holds),
            early_requests=len(self._early),
            early_request_bytes=sum(self._early_bytes.values()),
            jobs_by_state=states,
            finished_pending_report=len(self._finished),
            expired_holds=self._expired_count,
            aborted_holds=self._aborted_count,
            refused_secrets=self._refused_secrets,
            early_served=self.early_served,
        )

    # -- internals ---------------------------------------------------------------------------------------------

    def _early_or_outcome(
        self, dst: WorkerRef, message: TransferRequest | Release, expected: frozenset[Worker], now: float
    ) -> list[SendCommand]:
        """A request or release for a transfer not held, or not held for this secret: its outcome or closing
        reason when it ended recently (and the secret is its own), else it waits for the hold (early)."""
        receive = message.receive if isinstance(message, TransferRequest) else ""
        key = (message.transfer_id, dst, message.secret, receive)
        closed = self._closed.get(message.transfer_id)
        if closed is not None and self._secret_ok(closed[1], message.secret):
            remembered = self._outcomes.get((message.transfer_id, dst))
            if remembered is not None:
                if not isinstance(message, TransferRequest):
                    return []
                # The same params in a later request: its blocks got nothing. A failure that no receive asked for
                # (a lost connection ended the job) answers any, as while held (`_same_receive`).
                unnamed_failure = isinstance(remembered, TransferFailed) and not remembered.receive
                if not unnamed_failure and remembered.receive != message.receive:
                    return [Reply(dst, _another_receive(message, dst))]
                return [Reply(dst, remembered)]
            if isinstance(message, Release):
                return []
            reason = f"transfer {message.transfer_id!r} is no longer held by P: {closed[0]}"
            return [Reply(dst, _failed(message, reason, closed[2]))]
        if key in self._early:
            return []
        refusal = self._keep_early(key, (now + self._early_timeout, dst, message, expected))
        if refusal:
            return [Reply(dst, _failed(message, refusal, "refused"))]
        return []

    def _keep_early(self, key: EarlyKey, entry: EarlyEntry) -> str:
        """Keep `entry` (not kept yet) until its hold comes or its deadline passes; "" once kept, else why not: the
        table is full (`max_early_requests`) or its bytes would pass `max_early_request_bytes` for its D worker or
        `max_early_request_bytes_total` for all of them (`_cost`)."""
        dst, message = entry[1], entry[2]
        if len(self._early) >= self._max_early:
            return f"P worker busy: {len(self._early)} requests already wait for transfers not held yet"
        cost = _cost(message)
        if self._early_bytes[dst] + cost > self._max_early_bytes:
            return (
                f"P worker busy: D worker {dst} has {self._early_bytes[dst]} bytes of requests waiting for transfers "
                f"not held yet; this one's {cost} would pass max_early_request_bytes={self._max_early_bytes}"
            )
        total = sum(self._early_bytes.values())  # one entry per D worker: at most the connection cap
        if total + cost > self._max_early_total:
            return (
                f"P worker busy: D workers have {total} bytes of requests waiting for transfers not held yet; this "
                f"one's {cost} would pass max_early_request_bytes_total={self._max_early_total}"
            )
        self._early[key] = entry
        self._early_of.setdefault(key[0], {})[key] = None
        self._early_from.setdefault(dst, {})[key] = None
        self._early_bytes[dst] += cost
        return ""

    def _remember_closed(self, transfer_id: str, reason: str, secret: bytes, cause: str) -> None:
        """Answer later requests for `transfer_id` with `reason` and `cause` (`_early_or_outcome`); the newest
        `remembered_outcomes` are kept."""
        self._closed[transfer_id] = (reason, secret, cause)
        self._closed.move_to_end(transfer_id)
        while len(self._closed) > self._remembered:
            self._closed.popitem(last=False)

    def _pop_early(self, key: EarlyKey) -> EarlyEntry:
        """Take the early request at `key` (present) out, with its cost and its index entries."""
        entry = self._early.pop(key)
        dst = entry[1]
        _unindex(self._early_of, key[0], key)
        _unindex(self._early_from, dst, key)
        self._early_bytes[dst] -= _cost(entry[2])
        if self._early_bytes[dst] <= 0:
            del self._early_bytes[dst]
        return entry

    def _new_job(self, hold: _Hold, dst: WorkerRef, receive: str, request: TransferRequest | None = None) -> SendJob:
        """The job of D worker `dst` in `hold`, serving its receive `receive` (UNASKED: the caller's first event says
        what happened)."""
        if request is None:
            job = SendJob(hold.transfer_id, dst.worker, [], 0)
        else:
            job = SendJob(hold.transfer_id, dst.worker, request.block_ids, request.num_tokens, request.first_token)
            job.window = (request.window_addr, request.window_bytes, request.share_bytes)
        hold.jobs[dst.worker] = job
        hold.refs[dst.worker] = dst
        hold.receives[dst.worker] = receive
        return job

    @staticmethod
    def _same_receive(hold: _Hold, worker: Worker, receive: str) -> bool:
        """Whether `receive` is the one `worker`'s job serves; a job that no receive asked for (a lost connection
        ended it) takes any."""
        served = hold.receives.get(worker, "")
        return not served or served == receive

    def _abort_hold(self, hold: _Hold, reason: str) -> list[SendCommand]:
        if hold.ended is None:
            hold.ended = HoldEnd.ABORTED
            self._aborted_count += 1
        commands: list[SendCommand] = []
        for job in list(hold.jobs.values()):
            commands += self._apply(hold, job, SendEvent.ABORT, reason)
        self._maybe_finish(hold)
        return commands

    def _secret_ok(self, held: bytes, presented: str) -> bool:
        """Whether `presented` is the secret `held`; a wrong one is counted (`refused_secrets`)."""
        if _matches(held, presented):
            return True
        self._refused_secrets += 1
        return False

    def _check_engine(self, hold: _Hold, dst: WorkerRef, expected: frozenset[Worker]) -> Reply | None:
        engine = (dst.engine_id, dst.incarnation)
        if hold.dst_engine is None:
            hold.dst_engine, hold.expected = engine, expected
            return None
        if hold.dst_engine != engine:
            reason = (
                f"transfer {hold.transfer_id!r} is already being fetched by engine {hold.dst_engine[0]!r} "
                f"(incarnation {hold.dst_engine[1]}), not {dst.engine_id!r} (incarnation {dst.incarnation})"
            )
            return Reply(dst, ErrorMessage(reason=reason, transfer_id=hold.transfer_id))
        return None

    def _apply(self, hold: _Hold, job: SendJob, event: SendEvent, reason: str = "") -> list[SendCommand]:
        effects = job.handle(event, reason)
        dst = hold.refs[job.dst]
        commands: list[SendCommand] = []
        for effect in effects:
            if effect is Effect.SUBMIT:
                commands.append(
                    Submit(
                        hold.transfer_id,
                        dst,
                        hold.block_ids,
                        job.block_ids,
                        job.num_tokens,
                        job.first_token,
                        *job.window,
                    )
                )
            elif effect in (Effect.REPLY_DONE, Effect.REPLY_FAILED):
                commands.append(Reply(dst, _outcome(hold, job)))
        if job.terminal:
            self._maybe_finish(hold)
        return commands

    def _maybe_finish(self, hold: _Hold) -> None:
        if hold.transfer_id not in self._holds:
            return
        if any(not job.terminal for job in hold.jobs.values()):
            return  # a write may still touch the blocks
        served = all(w in hold.jobs for w in hold.expected) if hold.expected is not None else False
        if hold.ended is None and not served:
            return
        del self._holds[hold.transfer_id]
        self._by_req.pop(hold.req_id, None)
        self._finished.add(hold.req_id)
        reason = hold.ended.value if hold.ended else "every D worker that needed it was served"
        # A D worker asking after the hold ended (for another receive) is refused; after an expiry or abort, P's.
        cause = hold.ended.value if hold.ended else "refused"
        self._remember_closed(hold.transfer_id, reason, hold.secret, cause)
        for worker, job in hold.jobs.items():
            self._outcomes[(hold.transfer_id, hold.refs[worker])] = _outcome(hold, job)
        while len(self._outcomes) > self._remembered:
            self._outcomes.popitem(last=False)


def _unindex(index: dict[_K, dict[EarlyKey, None]], at: _K, key: EarlyKey) -> None:
    keys = index[at]
    del keys[key]
    if not keys:
        del index[at]


def _cost(message: TransferRequest | Release | Abort) -> int:
    """What keeping `message` early costs (`max_early_request_bytes`): its block ids and text, at their wire size
    at worst, and a fixed `EARLY_ENTRY_BYTES`."""
    ids = len(message.block_ids) * BLOCK_ID_BYTES if isinstance(message, TransferRequest) else 0
    text = len(message.transfer_id) + len(message.secret)
    if isinstance(message, TransferRequest | Abort):
        text += len(message.receive) + (len(message.reason) if isinstance(message, Abort) else 0)
    return EARLY_ENTRY_BYTES + ids + 4 * text  # 4: the most bytes a character takes in UTF-8


_END_EVENTS = {HoldEnd.ABORTED: SendEvent.ABORT, HoldEnd.EXPIRED: SendEvent.EXPIRE}


def _encode(secret: str) -> bytes:
    # Bytes, not str: compare_digest refuses str with characters outside ASCII, and D chooses what it sends.
    return secret.encode("utf-8", "surrogatepass")


def _matches(held: bytes, presented: str) -> bool:
    """Whether `presented` is the secret `held`, compared in constant time."""
    return hmac.compare_digest(held, _encode(presented))


def _failed(message: TransferRequest | Release | Abort, reason: str, cause: str) -> TransferFailed:
    """`message`'s transfer failed for its receive, for `reason` (`cause`: one of `FAILURE_CAUSES`)."""
    receive = message.receive if isinstance(message, TransferRequest | Abort) else ""
    return TransferFailed(transfer_id=message.transfer_id, reason=reason, receive=receive, cause=cause)


def _another_receive(message: TransferRequest | Abort, dst: WorkerRef) -> TransferFailed:
    """The answer to `message` of a receive that is not the one P serves `dst` for its transfer."""
    reason = (
        f"transfer {message.transfer_id!r} serves another receive of D worker {dst}; this one gets none of it (the "
        "same params in a second request)"
    )
    return _failed(message, reason, "refused")


def _outcome(hold: _Hold, job: SendJob) -> TransferDone | TransferFailed:
    """What D hears of `job` (terminal) of `hold`: done with its byte and descriptor counts, or failed and why (the
    reason of the event that ended it, else its state)."""
    receive = hold.receives.get(job.dst, "")
    if job.state is SendState.DONE:
        nbytes, descriptors, write_s = hold.results.get(job.dst, (0, 0, 0.0))
        write_us = min(round(write_s * 1e6), MAX_COUNT - 1)
        return TransferDone(
            transfer_id=hold.transfer_id, bytes=nbytes, descriptors=descriptors, receive=receive, write_us=write_us
        )
    cause = _CAUSE_OF.get(job.ended_by, "") if job.ended_by is not None else ""
    reason = job.reason or job.state.value
    return TransferFailed(transfer_id=hold.transfer_id, reason=reason, receive=receive, cause=cause)


# What D counts a failed job as, by the event that turned it away from landing.
_CAUSE_OF: Final = {
    SendEvent.REQUEST: "refused",  # the request itself was refused (a job's requests never end it otherwise)
    SendEvent.WRITE_FAILED: "transport",
    SendEvent.EXPIRE: "expired",
    SendEvent.ABORT: "aborted",
    SendEvent.PEER_LOST: "p_lost",
}


@dataclass(frozen=True, slots=True)
class SendRequest:
    """P: hold `req_id`'s KV (its first `num_tokens` tokens, in `block_ids`) as transfer `transfer_id`, for the D
    workers that present `secret` (the same on every P worker of the engine, and in D's params)."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    secret: str


def check_send(meta: WorkerMetadata, request: SendRequest) -> None:
    """The one check of a send, against P worker `meta`.

    Raises:
        ValueError: a block id is outside the pool or the blocks cannot hold `num_tokens`
            (`kvsvc.core.planner.check_block_ids`), `transfer_id` is longer than `MAX_NAME_CHARS`, or the secret is
            refused (`check_secret`).
    """
    check_block_ids(meta, list(request.block_ids), request.num_tokens, "P")
    check_transfer_id(request.transfer_id)
    check_secret(request.secret, request.transfer_id)


# -- carrying out the Sender's commands ------------------------------------------------------------------------------
# The service's P role and the test harness (`kvsvc.testing.pair.PeerPair`) both implement `PSide`, and both carry out
# commands through the one `match` below, so they cannot drift apart; a driver lacking a method is a type error.

PCommand: TypeAlias = SendCommand | FillCommand
"""What P's core objects ask of their driver: the `Sender`'s and a `FillingWindow`'s commands."""


class PSide(Protocol):
    """What a P worker's driver does for its core objects (`kvsvc.service.sending.SendingRole`, the harness)."""

    def submit(self, command: Submit) -> None:
        """Start the write; its end goes back to `Sender.write_ended` later, never from this call."""

    def reply(self, command: Reply) -> None:
        """Send the answer to D worker `command.dst` on its control connection; dropped when it is closed."""

    def announce(self, command: Announce) -> None:
        """Tell D worker `command.dst` that a round of its window landed; dropped when its connection is closed (the
        write in rounds then fails by `FillingWindow.peer_lost`)."""

    def log(self, notice: Notice) -> None:
        """Log (and count, for a protocol error) what the core noticed."""


def carry_out_p(commands: Sequence[PCommand], side: PSide) -> None:
    """Carry out what P's `Sender` or a `FillingWindow` decided, in order. A `Fail` needs no carrying out of its own:
    the state it leaves ends the write in rounds at `round_step`, once no round of it is on the wire."""
    for command in commands:
        match command:
            case Submit():
                side.submit(command)
            case Reply():
                side.reply(command)
            case Announce():
                side.announce(command)
            case Fail():
                pass
            case Notice():
                side.log(command)
