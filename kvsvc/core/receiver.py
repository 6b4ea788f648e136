"""D's side of the protocol as a sans-IO object: receive jobs, deadlines and exactly-once reporting.

Rules: `Receiver` takes events (a receive from the engine, the sources the handshake found, a connection that opened
or broke, P's answers, the clock) and returns commands (`SendToSource`); it never does I/O. Each receive is reported
exactly once, in `take_report()`: finished when every P worker it needs answered done, with the bytes D's plan
expects of it (`planned_bytes`); failed, with its blocks invalid, on any failure, expiry or abort. An aborted
receive is reported only after every P worker it asked confirmed its writes stopped, or the abort grace passed. A
lost P worker is probed and tried again after doubling delays (`LostSources`): the driver sleeps and probes, this
only says what and when. `ReportGather` decides when a report of landed receives waits a little for others about to
land, so that a burst reaches the engine in one step. The engine's receive is one frozen value, `RecvRequest`,
checked once by `check_recv` as the service's role takes it, as P's `SendRequest` is. A driver carries out the
commands of the `Receiver` and of D's lent windows through `DSide`, dispatched by `carry_out_d`, as P's through
`PSide`. Pure module: standard library and kvsvc's pure core only.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Final, Protocol, TypeAlias

from kvsvc.core.errors import LocalProtocolError, TopologyError
from kvsvc.core.jobs import Deadlines, Effect, Notice, RecvEvent, RecvJob, RecvState
from kvsvc.core.messages import (
    FAILURE_CAUSES,
    Abort,
    ErrorMessage,
    Message,
    Pong,
    Release,
    TransferDone,
    TransferFailed,
    TransferRequest,
    WindowEmptied,
    WindowFilled,
    Worker,
    WorkerMetadata,
    answers_another_receive,
    check_secret,
    check_transfer_id,
)
from kvsvc.core.planner import check_block_ids, plan_transfer_arrays
from kvsvc.core.windows import Deliver, Scatter, TellP, WindowCommand, WindowKey

ToSource: TypeAlias = TransferRequest | Release | Abort | ErrorMessage
"""What D's `Receiver` sends P workers."""


@dataclass(frozen=True, slots=True)
class SendToSource:
    """Send `message` to P worker `src` of engine `engine_id` on its control connection."""

    engine_id: str
    src: Worker
    message: ToSource


RecvCommand: TypeAlias = SendToSource | Notice


class RecvEnding(Enum):
    """Why a receive is on its way to failing. It is reported only once no P worker can still write into its blocks
    (every asked source confirmed, or the abort grace passed), so the blocks stay held until then."""

    ABORTED = "aborted"  # by D's engine
    PEER_LOST = "peer_lost"  # a connection to an asked source broke: that P may still be writing
    EXPIRED = "expired"  # the receive deadline passed; its sources were told to stop


@dataclass(slots=True)
class _Recv:
    req_id: str
    transfer_id: str
    engine_id: str
    block_ids: list[int]
    num_tokens: int
    deadline: float
    started: float
    first_token: int = 0
    secret: str = ""  # the transfer's secret from P, carried in every message about it
    receive: str = ""  # this receive's name, in every request and abort (`TransferRequest.receive`)
    jobs: dict[Worker, RecvJob] = field(default_factory=dict)
    sources_known: bool = False
    push: bool = False  # the fetch waits at P for a prefill that started with it (`RecvRequest.push`)
    ending: RecvEnding | None = None
    # sources whose connection broke after they were asked, with the start (incarnation) of P that was asked
    lost: dict[Worker, str] = field(default_factory=dict)
    # the bytes each source writes into this worker for the receive, as D plans them (`planned_bytes`)
    planned: dict[Worker, int] = field(default_factory=dict)
    asked: float | None = None  # when its first request went to P (`Receiver.asked`)
    write_s: float = 0.0  # the longest write of its sources, as P timed them (`TransferDone.write_us`)
    landed_bytes: int = 0  # what its sources' done answers report written
    cause: str = ""  # the first failure's cause (`FAILURE_CAUSES`)


@dataclass(frozen=True, slots=True)
class ReceiverStatistics:
    receives: int
    waiting_for_handshake: int
    jobs_by_state: dict[str, int]
    finished: int
    failed: int
    expired: int


@dataclass(frozen=True, slots=True)
class RecvReport:
    """What `Receiver.take_report` hands to the engine: each req_id once, in exactly one of the two sets; each
    failed one with its reason and its cause (one of `FAILURE_CAUSES`)."""

    finished: set[str]
    failed: set[str]
    invalid_block_ids: set[int]
    reasons: dict[str, str]
    causes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LoadTimes:
    """One receive that landed, in phases: what the engine's metrics and the slow-transfer log show of it. The
    phases add up to `total_s`; D cannot split P's answer further than P's own timing of its write."""

    req_id: str
    transfer_id: str
    engine_id: str
    sources: tuple[Worker, ...]
    nbytes: int
    total_s: float  # from `start` to the last source's answer
    handshake_s: float  # until its first request went to P: P's metadata, the hello, a connection
    queue_s: float  # P's answer less P's write: waiting at P (for its KV, for its copy thread) and the round trip
    write_s: float  # P's write, submission to landing (the longest of its sources)

    @property
    def gbps(self) -> float:
        """The bytes over P's write time, in GB/s (0 when P did not time it)."""
        return self.nbytes / self.write_s / 1e9 if self.write_s > 0 else 0.0


class Receiver:
    """The receive side of one D worker (see module docstring)."""

    def __init__(
        self, *, recv_timeout_s: float = 60.0, abort_grace_s: float = 35.0, report_gather_s: float = 0.0
    ) -> None:
        """`report_gather_s`: `ReportGather`'s bound (0, the default: every report goes at once).

        Raises:
            ValueError: `report_gather_s` is negative.
        """
        self._gather = ReportGather(report_gather_s)
        self._timeout = recv_timeout_s
        self._abort_grace = abort_grace_s
        self._recvs: dict[str, _Recv] = {}
        self._deadlines = Deadlines(self._recv_deadline)
        self._by_req: dict[str, str] = {}  # req_id -> transfer_id of each receive, for the engine's aborts
        self._finished: set[str] = set()
        self._failed: dict[str, str] = {}
        self._invalid: set[int] = set()
        self._landed: list[_Recv] = []  # receives landed since `take_landed`
        self._causes: dict[str, str] = {}
        self._counts = {"finished": 0, "failed": 0, "expired": 0}

    # -- events from the engine --------------------------------------------------------------------------------

    def start(self, request: RecvRequest, now: float, receive: str = "") -> bool:
        """Begin receiving tokens `[first_token, num_tokens)` of `request.transfer_id` from engine
        `request.engine_id` into its blocks; `request` passed `check_recv` as the service's role took it.
        Its secret is the one P issued with its hold; every request, release and abort carries it (P answers one
        without it as for a transfer it does not hold). `receive`: a name drawn for this receive alone
        (`TransferRequest.receive`), so P never answers it with another receive's outcome.

        Returns False (and changes nothing) when the transfer is already being received: repeats are no-ops.

        Raises:
            ValueError: `transfer_id` is being received already for another request.
        """
        req_id, transfer_id = request.req_id, request.transfer_id
        known = self._recvs.get(transfer_id)
        if known is not None:
            if known.req_id != req_id:
                raise ValueError(
                    f"transfer {transfer_id!r} is already received for request {known.req_id!r}, not {req_id!r}"
                )
            return False
        deadline = now + self._timeout
        self._recvs[transfer_id] = _Recv(
            req_id,
            transfer_id,
            request.engine_id,
            list(request.block_ids),
            request.num_tokens,
            deadline,
            started=now,
            first_token=request.first_token,
            secret=request.secret,
            receive=receive,
            push=request.push,
        )
        self._by_req[req_id] = transfer_id
        self._deadlines.set(transfer_id, deadline)
        return True

    def abort(self, req_id: str, now: float) -> list[SendToSource]:
        """The engine aborted `req_id`: ask P workers to stop; report failed once they confirmed or grace passed."""
        transfer_id = self._by_req.get(req_id)
        recv = self._recvs.get(transfer_id) if transfer_id is not None else None
        if recv is None or recv.ending is not None:
            return []
        recv.ending = RecvEnding.ABORTED
        _blame(recv, "aborted")
        self._set_deadline(recv, min(recv.deadline, now + self._abort_grace))
        commands: list[SendToSource] = []
        for job in list(recv.jobs.values()):
            commands += self._apply(recv, job, RecvEvent.ABORT, "aborted by D")
        # Before the handshake it ends in `sources_known`, which still owes the P workers their Releases.
        return commands

    # -- events from the handshake and connections -------------------------------------------------------------

    def request_of(self, transfer_id: str) -> tuple[list[int], int, int] | None:
        """The block ids, `num_tokens` and `first_token` of the receive of `transfer_id`, or None for none."""
        recv = self._recvs.get(transfer_id)
        return None if recv is None else (recv.block_ids, recv.num_tokens, recv.first_token)

    def sources_known(
        self,
        transfer_id: str,
        sources: list[Worker],
        releases: list[Worker],
        connected: set[Worker],
        planned: Mapping[Worker, int] | None = None,
    ) -> list[SendToSource]:
        """The handshake found which P workers this receive needs (`sources`) and which P workers this D worker
        must tell that nobody needs them (`releases`). `connected` are the sources whose connection is open.
        `planned`: the bytes each source writes (`planned_bytes`); a source's done answer that reports other
        bytes fails the receive."""
        recv = self._recvs.get(transfer_id)
        if recv is None or recv.sources_known:
            return []
        recv.sources_known = True
        recv.planned = dict(planned or {})
        release = Release(transfer_id=transfer_id, secret=recv.secret)
        commands = [SendToSource(recv.engine_id, src, release) for src in releases]
        if recv.ending is not None:
            # Nothing was asked yet, so nothing can be written; still tell the sources, so a P that holds the
            # transfer later frees it at once instead of at its hold expiry.
            reason = "aborted by D before the handshake completed"
            abort = Abort(transfer_id=transfer_id, reason=reason, secret=recv.secret, receive=recv.receive)
            commands += [SendToSource(recv.engine_id, src, abort) for src in sources]
            self._end(recv, abort.reason)
            return commands
        for src in sources:
            recv.jobs[src] = RecvJob(transfer_id, src)
        for src in sources:
            if src in connected:
                commands += self._apply(recv, recv.jobs[src], RecvEvent.CONNECTED)
        self._maybe_end(recv)
        return commands

    def connected(self, engine_id: str, src: Worker) -> list[SendToSource]:
        """The control connection to P worker `src` of `engine_id` is open: send the requests waiting for it."""
        commands: list[SendToSource] = []
        for recv in list(self._recvs.values()):
            job = recv.jobs.get(src)
            if recv.engine_id == engine_id and job is not None:
                commands += self._apply(recv, job, RecvEvent.CONNECTED)
        return commands

    def engine_failed(self, engine_id: str, reason: str) -> list[SendToSource]:
        """Engine `engine_id`'s metadata cannot be fetched or is incompatible: fail every receive from it that still
        waits for the handshake (nothing was asked, so nothing is to be said). Receives already routed keep their
        connections (and their own failures)."""
        for recv in list(self._recvs.values()):
            if recv.engine_id == engine_id and not recv.sources_known:
                _blame(recv, "handshake")
                self._end(recv, reason)
        return []

    def peer_lost(
        self, engine_id: str, src: Worker, reason: str, now: float, incarnation: str = "", cause: str = "p_lost"
    ) -> list[SendToSource]:
        """The connection to P worker `src` (of start `incarnation`) broke or was refused. Jobs that never asked
        fail; jobs that asked may still be written to by that P, so their receive ends only after `abort_grace_s`
        (or once that same start answers again, `reconnected`), and its other sources are told to stop at once
        (the receive is lost anyway). `cause`: what the receives it fails count as ("handshake" for a refused
        hello)."""
        commands: list[SendToSource] = []
        for recv in list(self._recvs.values()):
            job = recv.jobs.get(src)
            if recv.engine_id != engine_id or job is None or job.terminal:
                continue
            asked = job.state is not RecvState.PENDING
            _blame(recv, cause)
            commands += self._apply(recv, job, RecvEvent.PEER_LOST, reason)
            if recv.transfer_id not in self._recvs:
                continue
            if asked:
                recv.lost.setdefault(src, incarnation)
            if asked and recv.ending is None:
                recv.ending = RecvEnding.PEER_LOST
                self._set_deadline(recv, min(recv.deadline, now + self._abort_grace))
            for other in list(recv.jobs.values()):
                if other is not job and not other.terminal:
                    commands += self._apply(recv, other, RecvEvent.ABORT, f"P{src} lost: {reason}")
        return commands

    def waits_on_lost(self, engine_id: str, src: Worker) -> bool:
        """True while some receive holds its blocks only because its connection to P worker `src` broke after
        asking (the abort grace): confirming that worker's transfer engine is gone would end the wait."""
        return any(
            recv.engine_id == engine_id and src in recv.lost and not recv.jobs[src].terminal
            for recv in self._recvs.values()
        )

    def source_gone(self, engine_id: str, src: Worker, reason: str) -> list[SendToSource]:
        """P worker `src`'s transfer engine is gone (its process died) and what it had sent has settled: the
        receives that lost their connection to it stop waiting for it. A receive ends once its other sources are
        done too; none is touched whose connection to `src` did not break after asking."""
        commands: list[SendToSource] = []
        for recv in list(self._recvs.values()):
            job = recv.jobs.get(src)
            if recv.engine_id == engine_id and job is not None and src in recv.lost:
                commands += self._apply(recv, job, RecvEvent.GONE, reason)
        return commands

    def reconnected(self, engine_id: str, src: Worker, incarnation: str) -> list[SendToSource]:
        """A new connection reached P worker `src` of the same start (`incarnation`) that receives lost: ask it
        again to stop their jobs. Its answer comes once a job's write ended, so it frees the blocks before the
        abort grace. Receives that lost another start of `src` are left to the grace: this one cannot speak for
        that one's writes."""
        commands: list[SendToSource] = []
        for recv in list(self._recvs.values()):
            job = recv.jobs.get(src)
            if recv.engine_id == engine_id and job is not None and recv.lost.get(src) == incarnation:
                commands += self._apply(recv, job, RecvEvent.RECONNECTED)
        return commands

    def receive(self, engine_id: str, src: Worker, message: Message) -> list[RecvCommand]:
        """A frame from P worker `src` of `engine_id` on an open connection: every driver hands each frame here
        (with windows lent, after they took theirs). A `WindowFilled` that no window took (given back, or none ever
        lent) is dropped at debug level, and so is an answer naming another receive than the one D runs for its
        transfer. Anything that is not a P-to-D message is answered with an error and noticed as a protocol error."""
        if isinstance(message, TransferDone | TransferFailed):
            recv = self._recvs.get(message.transfer_id)
            if recv is not None and answers_another_receive(message, recv.receive):
                # An earlier receive's answer (the same params again, after it ended here): not this one's blocks.
                return [Notice(f"answer for another receive of {message.transfer_id!r} from P{src}", level="debug")]
            error = (
                message.reason if isinstance(message, TransferFailed) else self._wrong_bytes(engine_id, src, message)
            )
            if recv is not None and recv.engine_id == engine_id and src in recv.jobs:
                if isinstance(message, TransferFailed):
                    # A P that names no cause (or one D does not know) failed its write as far as D can tell.
                    _blame(recv, message.cause if message.cause in _P_CAUSES else "transport")
                elif error is not None:
                    _blame(recv, "protocol")
                elif not recv.jobs[src].terminal:  # a repeated answer adds nothing
                    recv.write_s = max(recv.write_s, message.write_us / 1e6)
                    recv.landed_bytes += message.bytes
            commands = self.answer(engine_id, src, message.transfer_id, error)
            if commands is None:
                return [Notice(f"late or unknown answer for {message.transfer_id!r} from P{src}", level="debug")]
            return list(commands)
        if isinstance(message, ErrorMessage):
            notice = Notice(
                f"P worker {src} of {engine_id!r} reports a protocol error: {message.reason}", from_peer=True
            )
            if not message.transfer_id:
                return [notice]
            recv = self._recvs.get(message.transfer_id)
            if recv is not None and recv.engine_id == engine_id and src in recv.jobs:
                _blame(recv, "protocol")
            return [notice, *(self.answer(engine_id, src, message.transfer_id, f"P error: {message.reason}") or [])]
        if isinstance(message, Pong):
            return []
        if isinstance(message, WindowFilled):
            return [Notice(f"late round {message.round} of {message.transfer_id!r} from P{src}", level="debug")]
        what = f"unexpected {type(message).__name__} from P worker {src} of {engine_id!r}"
        return [Notice(what, protocol_error=True), SendToSource(engine_id, src, ErrorMessage(reason=what))]

    def _wrong_bytes(self, engine_id: str, src: Worker, done: TransferDone) -> str | None:
        """Why P's done answer cannot be believed (it reports other bytes than D's plan has it write), or None."""
        recv = self._recvs.get(done.transfer_id)
        planned = recv.planned.get(src) if recv is not None and recv.engine_id == engine_id else None
        if planned is None or planned == done.bytes:
            return None
        return (
            f"P worker {src} of {engine_id!r} reports {done.bytes} bytes written for {done.transfer_id!r}; D's plan "
            f"has it write {planned}"
        )

    def answer(self, engine_id: str, src: Worker, transfer_id: str, error: str | None) -> list[SendToSource] | None:
        """P worker `src` answered done (`error` None) or failed; returns the commands that follow (repeats
        included), or None for an unknown transfer or source."""
        recv = self._recvs.get(transfer_id)
        job = recv.jobs.get(src) if recv is not None and recv.engine_id == engine_id else None
        if recv is None or job is None:
            return None
        event = RecvEvent.DONE if error is None else RecvEvent.FAILED
        return self._apply(recv, job, event, error or "")

    # -- the clock and reporting -------------------------------------------------------------------------------

    def expire(self, now: float) -> list[SendToSource]:
        """Fail every receive whose deadline passed; end aborts whose grace passed."""
        commands: list[SendToSource] = []
        for transfer_id in self._deadlines.due(now):
            recv = self._recvs[transfer_id]  # `due` names receives that have not ended (`_recv_deadline`)
            if recv.ending is not None:
                cause = next((f"P{j.src}: {j.reason}" for j in recv.jobs.values() if j.reason), "aborted")
                reason = f"{cause}; its writes were not confirmed stopped within {self._abort_grace:g} s"
            else:
                # First expiry: abort the sources still asked, and wait (bounded) for them to stop writing.
                self._counts["expired"] += 1
                recv.ending = RecvEnding.EXPIRED
                _blame(recv, "expired")
                self._set_deadline(recv, now + self._abort_grace)
                reason = f"receive of {recv.transfer_id!r} from {recv.engine_id!r} timed out after {self._timeout:g} s"
            for job in list(recv.jobs.values()):
                commands += self._apply(recv, job, RecvEvent.EXPIRE, reason)
            if recv.transfer_id in self._recvs and (not recv.sources_known or recv.deadline <= now):
                self._end(recv, reason)
        return commands

    def next_deadline(self) -> float | None:
        return self._deadlines.earliest()

    def _recv_deadline(self, transfer_id: str) -> float | None:
        recv = self._recvs.get(transfer_id)
        return recv.deadline if recv is not None else None

    def _set_deadline(self, recv: _Recv, deadline: float) -> None:
        if deadline != recv.deadline:
            recv.deadline = deadline
            self._deadlines.set(recv.transfer_id, deadline)

    def take_report(self, now: float = 0.0, step_s: float = 0.0) -> RecvReport:
        """Receives that ended since the last call; each req_id appears exactly once over the Receiver's life.
        Finished ones stay for a later call while `ReportGather` holds them (`step_s`: the engine's forward time
        when it calls from a step that computes nothing, else 0, which never holds); failures always go at once."""
        hold = bool(self._finished) and step_s > 0 and self._gather.holds(now, *self._in_flight(), step_s)
        finished = set() if hold else self._finished
        report = RecvReport(finished, set(self._failed), self._invalid, self._failed, self._causes)
        self._failed, self._invalid, self._causes = {}, set(), {}
        if not hold:
            self._finished = set()
            self._gather.reported()
        return report

    @property
    def report_held_until(self) -> float | None:
        """When the finished receives the last `take_report` held go out at the latest; None when it held none."""
        return self._gather.until

    def asked(self, transfer_id: str, now: float) -> None:
        """`transfer_id`'s request went to a P worker at `now`; the first one ends its handshake phase."""
        recv = self._recvs.get(transfer_id)
        if recv is not None and recv.asked is None:
            recv.asked = now

    def take_landed(self, now: float) -> list[LoadTimes]:
        """The receives that finished with their KV landed since the last call, which landed at `now`, in phases
        (the caller has the clock; this also feeds the landing rate `ReportGather` estimates)."""
        landed, self._landed = self._landed, []
        times = []
        for recv in landed:
            self._gather.landed(now, recv.started, sum(recv.planned.values()))
            asked = min(max(recv.started, recv.asked if recv.asked is not None else recv.started), now)
            answer = now - asked
            write = min(recv.write_s, answer)
            sources = tuple(sorted(recv.jobs))
            times.append(
                LoadTimes(
                    recv.req_id, recv.transfer_id, recv.engine_id, sources, recv.landed_bytes, now - recv.started,
                    asked - recv.started, answer - write, write,
                )
            )  # fmt: skip
        return times

    def _in_flight(self) -> tuple[int, int]:
        """The receives P workers were asked for and have not all answered, and the bytes D planned for the
        answers still owed; receives still in their handshake, waiting for a pushing P's prefill, or ending, are
        not counted (their end is not near in any way D can estimate)."""
        count = owed = 0
        for recv in self._recvs.values():
            if not recv.sources_known or recv.push or recv.ending is not None:
                continue
            waiting = [src for src, job in recv.jobs.items() if job.state is RecvState.REQUESTED]
            if waiting:
                count += 1
                owed += sum(recv.planned.get(src, 0) for src in waiting)
        return count, owed

    def waits_on(self, transfer_id: str, engine_id: str, src: Worker) -> bool:
        """Whether `transfer_id`'s receive from P worker `src` of `engine_id` has not ended (its blocks, and any
        window lent for it, may still be written)."""
        recv = self._recvs.get(transfer_id)
        job = recv.jobs.get(src) if recv is not None and recv.engine_id == engine_id else None
        return job is not None and not job.terminal

    def ending(self, transfer_id: str) -> bool:
        """Whether `transfer_id`'s receive is being aborted or expired (it will be reported failed)."""
        recv = self._recvs.get(transfer_id)
        return recv is not None and recv.ending is not None

    def req_of(self, transfer_id: str) -> str | None:
        """The req_id of `transfer_id`'s receive, while it has not ended."""
        recv = self._recvs.get(transfer_id)
        return recv.req_id if recv is not None else None

    def statistics(self) -> ReceiverStatistics:
        states: dict[str, int] = {}
        for recv in self._recvs.values():
            for job in recv.jobs.values():
                states[job.state.value] = states.get(job.state.value, 0) + 1
        return ReceiverStatistics(
            receives=len(self._recvs),
            waiting_for_handshake=sum(not r.sources_known for r in self._recvs.values()),
            jobs_by_state=states,
            finished=self._counts["finished"],
            failed=self._counts["failed"],
            expired=self._counts["expired"],
        )

    # -- internals ---------------------------------------------------------------------------------------------

    def _apply(self, recv: _Recv, job: RecvJob, event: RecvEvent, reason: str = "") -> list[SendToSource]:
        effects = job.handle(event, reason)
        commands: list[SendToSource] = []
        for effect in effects:
            if effect is Effect.SEND_REQUEST:
                request = TransferRequest(
                    transfer_id=recv.transfer_id,
                    block_ids=recv.block_ids,
                    num_tokens=recv.num_tokens,
                    first_token=recv.first_token,
                    secret=recv.secret,
                    receive=recv.receive,
                )
                commands.append(SendToSource(recv.engine_id, job.src, request))
            elif effect is Effect.SEND_ABORT:
                reason = job.reason or "aborted by D"
                abort = Abort(transfer_id=recv.transfer_id, reason=reason, secret=recv.secret, receive=recv.receive)
                commands.append(SendToSource(recv.engine_id, job.src, abort))
        self._maybe_end(recv)
        return commands

    def _maybe_end(self, recv: _Recv) -> None:
        if recv.transfer_id not in self._recvs or not recv.sources_known:
            return
        if any(not job.terminal for job in recv.jobs.values()):
            return
        failed = [job for job in recv.jobs.values() if job.state is not RecvState.DONE]
        if not failed and recv.ending is None:
            del self._recvs[recv.transfer_id]
            self._by_req.pop(recv.req_id, None)
            self._finished.add(recv.req_id)
            self._landed.append(recv)
            self._counts["finished"] += 1
            return
        job = failed[0] if failed else None
        reason = f"P{job.src}: {job.reason or job.state.value}" if job is not None else "aborted by D"
        self._end(recv, reason)

    def _end(self, recv: _Recv, reason: str) -> None:
        if self._recvs.pop(recv.transfer_id, None) is None:
            return
        self._by_req.pop(recv.req_id, None)
        self._failed[recv.req_id] = reason
        self._causes[recv.req_id] = recv.cause or "transport"
        self._invalid.update(recv.block_ids)
        self._counts["failed"] += 1


_P_CAUSES: Final = frozenset(FAILURE_CAUSES) - {"handshake"}


def _blame(recv: _Recv, cause: str) -> None:
    """`cause` is why `recv` fails, unless an earlier failure already named one (the first cause is the one)."""
    if not recv.cause:
        recv.cause = cause


def planned_bytes(
    p: WorkerMetadata, d: WorkerMetadata, block_ids: Sequence[int], num_tokens: int, first_token: int
) -> int | None:
    """The bytes P worker `p` writes into D worker `d`'s `block_ids` for tokens `[first_token, num_tokens)`: its
    plan's total, which P's block ids do not change (D plans with placeholders); None when it cannot be planned
    (P then refuses the request itself)."""
    per_group = max(1, -(-num_tokens // p.block_size))
    src_ids = [i % p.num_blocks for i in range(per_group * max(1, len(p.kv_groups)))] if p.num_blocks > 0 else []
    try:
        *_, lengths = plan_transfer_arrays(p, d, src_ids, block_ids, num_tokens, first_token=first_token)
    except (TopologyError, ValueError):
        return None
    return int(lengths.sum())


GATHER_STEP_SHARE: Final = 0.25
"""The longest a report of landed receives waits for others, as a share of the engine's step: a landed receive
reported at once starts its forward now, and one landing just after waits the whole of that step, so waiting a
quarter of a step for the rest of a burst costs the first a quarter and saves each of the others most of a step."""
GATHER_RATE_WEIGHT: Final = 0.5  # weight of the newest sample in the landing rate's moving average


class ReportGather:
    """When a report of landed receives waits for receives about to land (module docstring), by one rule:

    A report holds only while the engine waits on it doing nothing (`step_s` > 0: the caller passes its forward
    time from an idle step, 0 otherwise, where holding would cost a whole step), something it asked for is still
    owed, and the first unreported landing is younger than `min(max_hold_s, GATHER_STEP_SHARE * step_s)`; and,
    once a rate is known, only while everything owed is expected within that bound at the rate at which landings
    followed one another. The rate is sampled only between landings of receives that were in flight together
    (the gap then is P's copy time, not a request's round trip). Failures are never held.

    Raises (constructor):
        ValueError: `max_hold_s` is negative.
    """

    def __init__(self, max_hold_s: float) -> None:
        if max_hold_s < 0:
            raise ValueError(f"max_hold_s must be >= 0 (0 never holds), got {max_hold_s:g}")
        self.max_hold_s = max_hold_s
        self.rate: float | None = None  # bytes per second at which landings followed one another
        self._last: float | None = None  # when the latest receive landed
        self._first: float | None = None  # when the earliest landing not reported yet landed
        self._until: float | None = None  # when the latest hold ends

    def landed(self, now: float, started: float, nbytes: int) -> None:
        """A receive started at `started`, of `nbytes` planned bytes, landed at `now`."""
        last, self._last = self._last, now
        if self._first is None:
            self._first = now
        if last is not None and started < last < now and nbytes > 0:
            sample = nbytes / (now - last)
            self.rate = sample if self.rate is None else self.rate + GATHER_RATE_WEIGHT * (sample - self.rate)

    def holds(self, now: float, in_flight: int, in_flight_bytes: int, step_s: float) -> bool:
        """Whether the landed receives not reported yet wait for a later report (the class's rule); on True,
        `until` says when the hold ends at the latest."""
        self._until = None
        if self._first is None or in_flight <= 0 or step_s <= 0:
            return False
        until = self._first + min(self.max_hold_s, GATHER_STEP_SHARE * step_s)
        if now >= until:  # as `until` is computed, so that a waiter woken then finds the hold over
            return False
        if self.rate is not None and now + in_flight_bytes / self.rate > until:
            return False
        self._until = until
        return True

    @property
    def until(self) -> float | None:
        """When the latest hold ends at the latest, while one holds (a waiter wakes then to report)."""
        return self._until

    def reported(self) -> None:
        """Every landed receive went out in a report."""
        self._first = self._until = None


RECONNECT_FIRST_S: Final = 0.05
RECONNECT_MAX_S: Final = 2.0


class Backoff:
    """Doubling delays between tries, per key (module docstring).

    Raises (constructor):
        ValueError: `first_s` not above 0, or `max_s` below it.
    """

    def __init__(self, first_s: float = RECONNECT_FIRST_S, max_s: float = RECONNECT_MAX_S) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"backoff needs 0 < first_s <= max_s, got first_s {first_s:g}, max_s {max_s:g}")
        self.first_s, self.max_s = first_s, max_s
        self._next: dict[Hashable, float] = {}

    def __len__(self) -> int:
        return len(self._next)

    def delay(self, key: Hashable) -> float:
        """The wait before the next try for `key`; the try after it (if this one fails) waits twice as long."""
        delay = self._next.get(key, self.first_s)
        self._next[key] = min(2 * delay, self.max_s)
        return delay

    def forget(self, key: Hashable) -> None:
        """`key` was reached, or nothing waits on it: its next loss starts at `first_s` again."""
        self._next.pop(key, None)


@dataclass(frozen=True, slots=True)
class Recovery:
    """What D does about a P worker whose connection broke (`LostSources.lost`)."""

    # Ask, in order and until one says so, whether the process behind each address is gone: the kernel's word on a
    # same-host P first, then Mooncake's. Empty: nothing waits on it, or a probe of that process runs already.
    probe: tuple[str, ...] = ()
    retry_after_s: float | None = None  # try the connection again after this wait; None: nothing waits on it


class LostSources:
    """D's policy for P workers whose connection broke, as the service's D role follows it: while some receive holds
    its blocks only because of one (`Receiver.waits_on_lost`), D probes whether that worker's process is gone (one
    probe per process at a time: P's workers on one host may share it) and tries the connection again after
    doubling delays (`Backoff`) until it is reached or nothing waits on it; a closing service does neither. The
    driver sleeps and probes; this only says what and when. Raises nothing."""

    def __init__(self, backoff: Backoff | None = None) -> None:
        self._backoff = backoff if backoff is not None else Backoff()
        self._probing: set[str] = set()

    @staticmethod
    def process(p: WorkerMetadata) -> str:
        """The process a probe of P worker `p` asks after: its Mooncake session, or its same-host one without it."""
        return p.transport_addr or p.samehost_addr

    def lost(self, key: tuple[str, Worker], p: WorkerMetadata, *, waiting: bool, closing: bool) -> Recovery:
        """P worker `key` (engine id, worker), published as `p`, lost its connection; `waiting`: receives hold
        blocks only because of it."""
        if closing or not waiting:
            return Recovery()
        probe: tuple[str, ...] = ()
        process = self.process(p)
        if process and process not in self._probing:
            self._probing.add(process)
            probe = tuple(address for address in (p.samehost_addr, p.transport_addr) if address)
        return Recovery(probe, self._backoff.delay(key))

    def probe_ended(self, p: WorkerMetadata) -> None:
        """The probe `lost` asked for of P worker `p`'s process ended, whatever it found."""
        self._probing.discard(self.process(p))

    def retry(self, key: tuple[str, Worker], *, waiting: bool, closing: bool, connecting: bool) -> bool:
        """After `Recovery.retry_after_s`: whether to connect to P worker `key` again now. Not when nothing waits on
        it any more (its next loss starts at the first delay again), when the service closes, or when a connection
        to it is being opened already (maybe to a newer start, which `Receiver.reconnected` tells apart)."""
        if not waiting:
            self._backoff.forget(key)
            return False
        return not (closing or connecting)

    def reached(self, key: tuple[str, Worker]) -> None:
        """A connection to P worker `key` opened: its next loss starts at the first delay again."""
        self._backoff.forget(key)


@dataclass(frozen=True, slots=True)
class RecvRequest:
    """D: fetch tokens `[first_token, num_tokens)` of `transfer_id` from P engine `engine_id`, whose bootstrap
    endpoint is `bootstrap_addr`, into `block_ids` (token t into block `block_ids[t // block_size]`), presenting
    `secret` as P issued it. `push`: the router asked D and P at once, so the fetch waits at P for a prefill that
    started with it (the engine's side reports such a receive as pushed; the service treats it as any other)."""

    req_id: str
    transfer_id: str
    engine_id: str
    bootstrap_addr: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    secret: str
    push: bool = False


def check_recv(meta: WorkerMetadata, request: RecvRequest) -> None:
    """The one check of a receive, against D worker `meta`.

    Raises:
        ValueError: a block id is outside the pool, the blocks cannot hold `num_tokens`, `first_token` lies
            outside `[0, num_tokens]` (`check_block_ids`), `transfer_id` is longer than `MAX_NAME_CHARS`, or the
            secret is refused (`check_secret`).
    """
    check_block_ids(meta, list(request.block_ids), request.num_tokens, "D", request.first_token)
    check_transfer_id(request.transfer_id)
    check_secret(request.secret, request.transfer_id)


# -- carrying out the Receiver's commands ----------------------------------------------------------------------------
# As P's `PSide`: the service's D role and the test harness implement `DSide`, and both dispatch through `carry_out_d`.

DCommand: TypeAlias = RecvCommand | WindowCommand
"""What D's core objects ask of their driver: the `Receiver`'s and a `LentWindow`'s commands."""


class DSide(Protocol):
    """What a D worker's driver does for its core objects (`kvsvc.service.receiving.ReceivingRole`, the harness)."""

    def tell_p(self, engine_id: str, src: Worker, message: ToSource | WindowEmptied) -> None:
        """Send `message` to P worker `src` of `engine_id`, or keep it for the connection being opened; dropped
        when there is neither."""

    def windowed(self, engine_id: str, src: Worker, request: TransferRequest) -> TransferRequest | None:
        """`request` as it goes to P worker `src`: with a window of D's staging region lent for its share (as
        `lent_window` decides), as it is, or None (held back until there is room: the driver sends it then)."""

    def scatter(self, key: WindowKey, command: Scatter) -> None:
        """Start copying a round of window `key` into the blocks; its end goes back to `LentWindows.scattered`."""

    def deliver(self, key: WindowKey, command: Deliver) -> None:
        """Hand P's answer about window `key` to the `Receiver` (`Receiver.receive`)."""

    def log(self, notice: Notice) -> None:
        """Log (and count, for a protocol error) what the core noticed."""


def carry_out_d(commands: Sequence[DCommand], side: DSide, key: WindowKey | None = None) -> None:
    """Carry out what D's `Receiver` or the window `key` (`LentWindows`) decided, in order. A `TransferRequest` goes
    as `DSide.windowed` makes it.

    Raises:
        LocalProtocolError: a window's command without the window's `key` (a driver bug).
    """
    for command in commands:
        match command:
            case SendToSource(engine_id, src, TransferRequest() as request):
                windowed = side.windowed(engine_id, src, request)
                if windowed is not None:
                    side.tell_p(engine_id, src, windowed)
            case SendToSource(engine_id, src, message):
                side.tell_p(engine_id, src, message)
            case Scatter():
                side.scatter(_window(key, command), command)
            case TellP(message):
                window = _window(key, command)
                side.tell_p(window[1], window[2], message)
            case Deliver():
                side.deliver(_window(key, command), command)
            case Notice():
                side.log(command)


def _window(key: WindowKey | None, command: WindowCommand) -> WindowKey:
    if key is None:
        raise LocalProtocolError(f"{type(command).__name__} carried out without the window it is about")
    return key
