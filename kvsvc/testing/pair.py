"""A back-to-back P/D peer pair for protocol tests with no event loop: `Sender`s and `Receiver`s wired by lists.

Rules: `PeerPair` plays the asyncio service's part (docs/protocol.md) without I/O: it turns `Reply`/`SendToSource`
commands into envelopes on an in-memory wire, delivers them as the other side's events, and carries out `Submit`
by `plan_transfer` plus memmove between simulated KV pools (numpy byte arenas at fake addresses). Nothing happens
until a test calls `step`/`run_until_idle`/`advance`; faults are predicates the test sets. The pair checks the
rule "never report a send while a write may touch its blocks" as it goes. Pure: numpy and kvsvc's pure core only.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

from kvsvc.errors import TopologyError
from kvsvc.jobs import Notice
from kvsvc.layout import block_geometry, pool_regions
from kvsvc.messages import (
    Abort,
    ErrorMessage,
    Pong,
    Release,
    TransferDone,
    TransferFailed,
    TransferRequest,
    WindowEmptied,
    WindowFilled,
    Worker,
)
from kvsvc.planner import Descriptor, expected_destinations, plan_transfer, release_notifier, sources_of
from kvsvc.receiver import Receiver, RecvCommand
from kvsvc.sender import Reply, SendCommand, Sender, Submit
from kvsvc.staging import (
    RangeAllocator,
    StagingRule,
    count_runs,
    plan_staged,
    plan_window,
    region_ids,
    window_plan,
)
from kvsvc.testing.clock import FakeClock
from kvsvc.testing.holds import harness_secret
from kvsvc.testing.sim import EngineSpec, SimEngine, kv_pattern
from kvsvc.windows import (
    Announce,
    Deliver,
    Fail,
    FillCommand,
    FillingWindow,
    FillState,
    LentWindows,
    Scatter,
    TellP,
    WindowCommand,
    WindowKey,
)

ByteArray = npt.NDArray[np.uint8]
IntArray = npt.NDArray[np.int64]
ToP = TransferRequest | Release | Abort | ErrorMessage | WindowEmptied
ToD = TransferDone | TransferFailed | ErrorMessage | Pong | WindowFilled
FillKey = tuple[Worker, Worker, str]  # (P worker, D worker, transfer id)
_P_BASE, _D_BASE, _WINDOW_BASE = 1 << 44, 1 << 45, 1 << 46


@dataclass(frozen=True, slots=True)
class Envelope:
    """One control message on the wire between D worker `d` and P worker `p`; `to` names the receiving side."""

    to: Literal["P", "D"]
    d: Worker
    p: Worker
    message: ToP | ToD
    seq: int


@dataclass(frozen=True, slots=True)
class Write:
    """A `Submit` that P worker `p` handed to the simulated transport and that has not completed yet (for a share
    written into D's window: its round `round`)."""

    p: Worker
    submit: Submit
    seq: int
    round: int = 0

    @property
    def d(self) -> Worker:
        return self.submit.dst.worker


@dataclass(frozen=True, slots=True)
class ScatterCopy:
    """A scatter of one round of D worker `d`'s window (`key`) into its blocks, not run yet."""

    d: Worker
    key: WindowKey
    command: Scatter
    seq: int


@dataclass(slots=True)
class _Fill:
    """P's write of one share into D's window: its rounds, and what the rounds so far moved."""

    window: FillingWindow
    submit: Submit
    nbytes: int = 0
    descriptors: int = 0


@dataclass(frozen=True, slots=True)
class ReportEntry:
    """One req_id that one worker reported: `finished_sending` (P), `finished` or `failed` (D)."""

    side: Literal["P", "D"]
    worker: Worker
    req_id: str
    outcome: Literal["finished_sending", "finished", "failed"]
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PairStatistics:
    in_flight: int
    held_back: int
    writes_pending: int
    writes_stalled: int
    delivered: int
    dropped: int
    duplicated: int
    writes_done: int
    writes_failed: int
    holds: int
    receives: int
    writes_staged: int = 0  # writes that went through the staging buffer
    descriptors: int = 0  # what the writes submitted (a staged write: one per run part)
    scatters: int = 0  # windows D scattered into its blocks
    windows_lent: int = 0  # windows lent now (0 when idle: anything else is a leak)
    scatters_pending: int = 0  # round scatters not run yet


@dataclass(slots=True)
class _Counts:
    delivered: int = 0
    dropped: int = 0
    duplicated: int = 0
    writes_done: int = 0
    writes_failed: int = 0
    writes_staged: int = 0
    descriptors: int = 0  # what the writes submitted: planned descriptors, or a staged write's run parts
    scatters: int = 0


class PeerPair:
    """One P engine and one D engine, every worker's protocol object, an in-memory wire and simulated KV pools.

    Typical use::

        pair = PeerPair(EngineSpec(tp_size=1), EngineSpec(tp_size=2))
        pair.start_send("p-req", "t1", [0, 1], num_tokens=7)
        pair.start_recv("d-req", "t1", [3, 4], num_tokens=7)
        pair.run_until_idle()
        pair.take_reports()
        pair.assert_received("t1")

    Faults (each None or a predicate; applied until reset): `drop`, `duplicate` and `hold_back` look at an
    `Envelope` when it is sent (a held-back one waits for `release_held`); `stall_write` and `fail_write` look at a
    `Write` when it would run (a stalled one waits for `finish_stalled`); `fail_scatter` at a `ScatterCopy`. Links
    between a D and a P worker break with `lose_connection` and come back with `reconnect`. `violations` lists every
    broken harness invariant: a report on either side while a write may still touch its blocks, a failed receive
    not marking all its blocks invalid.
    """

    def __init__(
        self,
        p: EngineSpec,
        d: EngineSpec,
        *,
        clock: FakeClock | None = None,
        sender: Callable[[], Sender] = Sender,
        receiver: Callable[[], Receiver] = Receiver,
        staging: StagingRule | None = None,
        staging_bytes: int = 1 << 20,
        windows: bool = False,
    ) -> None:
        """`staging`: stage the writes this rule picks, through a staging buffer of `staging_bytes` (in chunks of
        half of it, as the service does), instead of writing every planned descriptor. `windows`: each D worker
        also has a staging region of `staging_bytes` and lends windows of it (`plan_window`), which P fills and D
        scatters round by round (`kvsvc.windows`), as the services do: the round frames cross the wire, and each
        round's scatter is a step of its own."""
        self.clock = clock or FakeClock()
        self.staging, self.staging_bytes = staging, staging_bytes
        self.p = SimEngine("P", p, _P_BASE)
        self.d = SimEngine("D", d, _D_BASE)
        # D's windows: a region per D worker and its lent windows; P's writes into them.
        self._window_arenas: dict[Worker, ByteArray] = {}
        self._window_ranges: dict[Worker, RangeAllocator] = {}
        self._lent: dict[Worker, LentWindows] = {}
        self._fills: dict[FillKey, _Fill] = {}
        self.fill_timeout_s = 60.0  # P's wait for D to empty a half (the service's hold timeout)
        if windows and staging is None:
            raise ValueError("windows need a staging rule")
        if windows:
            for i, (w, meta) in enumerate(sorted(self.d.metas.items())):
                addr = _WINDOW_BASE + i * staging_bytes
                self.d.metas[w] = msgspec.structs.replace(meta, staging_addr=addr, staging_size=staging_bytes)
                self._window_arenas[w] = np.zeros(staging_bytes, dtype=np.uint8)
                self._window_ranges[w] = RangeAllocator(staging_bytes)
                self._lent[w] = LentWindows()
        if staging is not None:  # P publishes its region, as the service does: it gathers there
            for i, (w, meta) in enumerate(sorted(self.p.metas.items())):
                addr = _WINDOW_BASE - (i + 1) * staging_bytes
                self.p.metas[w] = msgspec.structs.replace(
                    meta, staging_addr=addr, staging_size=staging_bytes, accepts_windows=True
                )
        self.senders = {w: sender() for w in self.p.metas}
        self.receivers = {w: receiver() for w in self.d.metas}
        self._expected = {w: frozenset(expected_destinations(m, self.d.metas)) for w, m in self.p.metas.items()}
        self.drop: Callable[[Envelope], bool] | None = None
        self.duplicate: Callable[[Envelope], bool] | None = None
        self.hold_back: Callable[[Envelope], bool] | None = None
        self.stall_write: Callable[[Write], bool] | None = None
        self.fail_write: Callable[[Write], bool] | None = None
        self.fail_scatter: Callable[[ScatterCopy], bool] | None = None
        # With an rng, `step` picks any pending message; `fifo` keeps each link's messages in order in each
        # direction, as the control connection (TCP) does.
        self.fifo = False
        self.history: list[ReportEntry] = []
        self.violations: list[str] = []
        self.undeliverable: list[Reply] = []
        self.notices: list[Notice] = []  # what the protocol objects asked their drivers to log
        self._wire: list[Envelope] = []
        self._held: list[Envelope] = []
        self._writes: list[Write] = []
        self._stalled: list[Write] = []
        self._scatters: list[ScatterCopy] = []
        self._down: set[tuple[Worker, Worker]] = set()
        self._sends: dict[str, tuple[str, list[int], int]] = {}  # req_id -> (transfer_id, block ids, tokens)
        self._recvs: dict[str, tuple[str, list[int], int]] = {}
        self._write_counts = {w: np.zeros(a.size, dtype=np.uint16) for w, a in self.d.arenas.items()}
        self._seq = 0
        self._counts = _Counts()

    # -- the engines' calls ------------------------------------------------------------------------------------

    def start_send(
        self,
        req_id: str,
        transfer_id: str,
        block_ids: list[int],
        num_tokens: int,
        *,
        ready: bool = True,
        secret: str | None = None,
    ) -> None:
        """Every P worker writes the transfer's known KV pattern into `block_ids` and holds it; `ready=False`
        leaves the compute unfinished until `ready(transfer_id)`. `secret`: the hold's, `harness_secret` when
        None."""
        secret = harness_secret(transfer_id) if secret is None else secret
        self._sends[req_id] = (transfer_id, list(block_ids), num_tokens)
        for worker, sender in self.senders.items():
            meta = self.p.metas[worker]
            for layer in range(meta.start_layer, meta.end_layer):
                values = self._pattern(self.p, worker, transfer_id, layer, num_tokens)
                self.p.write_tokens(worker, layer, block_ids, num_tokens, values)
            self._run_p(
                worker, sender.hold(req_id, transfer_id, list(block_ids), num_tokens, self.clock(), secret=secret)
            )
        if ready:
            self.ready(transfer_id)

    def ready(self, transfer_id: str) -> None:
        """The compute that wrote `transfer_id`'s KV finished on every P worker."""
        for worker, sender in self.senders.items():
            self._run_p(worker, sender.ready(transfer_id))

    def start_recv(
        self, req_id: str, transfer_id: str, block_ids: list[int], num_tokens: int, *, secret: str | None = None
    ) -> None:
        """Every D worker starts receiving into `block_ids`; the handshake completes at once, so each sends its
        requests (and releases) on the links that are up. `secret`: what D presents, `harness_secret` when None."""
        secret = harness_secret(transfer_id) if secret is None else secret
        self._recvs[req_id] = (transfer_id, list(block_ids), num_tokens)
        for worker, receiver in self.receivers.items():
            meta = self.d.metas[worker]
            started = receiver.start(
                req_id, transfer_id, self.p.engine_id, list(block_ids), num_tokens, self.clock(), secret=secret
            )
            if not started:
                continue
            sources = sources_of(meta, self.p.metas)
            releases = [w for w, m in sorted(self.p.metas.items()) if release_notifier(m, self.d.metas) == worker]
            connected = {s for s in sources if (worker, s) not in self._down}
            self._run_d(worker, receiver.sources_known(transfer_id, sources, releases, connected))

    def abort_send(self, req_id: str) -> None:
        """P's engine aborts `req_id` on every P worker."""
        for worker, sender in self.senders.items():
            self._run_p(worker, sender.abort(req_id))

    def abort_recv(self, req_id: str) -> None:
        """D's engine aborts `req_id` on every D worker."""
        for worker, receiver in self.receivers.items():
            self._run_d(worker, receiver.abort(req_id, self.clock()))

    # -- time, links and delivery ------------------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Move the clock and apply every deadline that passed (as the service's timer does)."""
        self.clock.advance(seconds)
        self.expire()

    def expire(self) -> None:
        now = self.clock()
        for worker, sender in self.senders.items():
            self._run_p(worker, sender.expire(now))
        for worker, receiver in self.receivers.items():
            self._run_d(worker, receiver.expire(now))
        for key, fill in list(self._fills.items()):
            self._run_fill(key, fill.window.expire(now))

    def lose_connection(self, d: Worker, p: Worker) -> None:
        """The control connection between D worker `d` and P worker `p` breaks: its in-flight messages are lost,
        both sides learn it, and later messages on it are dropped until `reconnect`."""
        self._down.add((d, p))
        self._wire = [e for e in self._wire if (e.d, e.p) != (d, p)]
        self._held = [e for e in self._held if (e.d, e.p) != (d, p)]
        for key, fill in list(self._fills.items()):
            if key[:2] == (p, d):
                self._run_fill(key, fill.window.peer_lost(f"connection to D{d} lost"))
        self._run_p(p, self.senders[p].peer_lost(self.d.ref(d)))
        receiver, reason = self.receivers[d], f"connection to P{p} lost"
        self._run_d(d, receiver.peer_lost(self.p.engine_id, p, reason, self.clock(), self.p.incarnation))

    def reconnect(self, d: Worker, p: Worker) -> None:
        """The link comes back; D sends the requests that waited for it, and asks again the jobs the lost link
        left waiting (as `ReceivingRole` does on a new connection to the same start of P)."""
        self._down.discard((d, p))
        self._run_d(d, self.receivers[d].connected(self.p.engine_id, p))
        self._run_d(d, self.receivers[d].reconnected(self.p.engine_id, p, self.p.incarnation))

    def release_held(self, match: Callable[[Envelope], bool] | None = None) -> int:
        """Put held-back envelopes (those `match` accepts, or all) on the wire, in order; returns how many."""
        chosen = [e for e in self._held if match is None or match(e)]
        self._held = [e for e in self._held if not (match is None or match(e))]
        self._wire += chosen
        return len(chosen)

    def finish_stalled(self, error: str | None = None, match: Callable[[Write], bool] | None = None) -> int:
        """Complete stalled writes (those `match` accepts, or all): with `error` None their bytes land."""
        chosen = [w for w in self._stalled if match is None or match(w)]
        self._stalled = [w for w in self._stalled if w not in chosen]
        for write in chosen:
            self._complete(write, error)
        return len(chosen)

    @property
    def idle(self) -> bool:
        """Nothing is on the wire and no write or scatter can run (held-back messages and stalled writes may
        remain)."""
        return not self._wire and not self._writes and not self._scatters

    def step(self, rng: random.Random | None = None) -> bool:
        """Deliver one message, run one write or one scatter: the oldest, or a random one with `rng`. False when
        idle."""
        if self.idle:
            return False
        wire = self._wire
        if self.fifo and rng is not None:  # only the oldest message of each link and direction can be next
            heads: dict[tuple[str, Worker, Worker], Envelope] = {}
            for envelope in wire:
                heads.setdefault((envelope.to, envelope.d, envelope.p), envelope)
            wire = list(heads.values())
        pending: list[Envelope | Write | ScatterCopy] = [*wire, *self._writes, *self._scatters]
        item = rng.choice(pending) if rng is not None else min(pending, key=lambda x: x.seq)
        if isinstance(item, Envelope):
            self._wire.remove(item)
            self._deliver(item)
        elif isinstance(item, Write):
            self._writes.remove(item)
            self._run_write(item)
        else:
            self._scatters.remove(item)
            self._run_scatter(item)
        return True

    def run_until_idle(self, rng: random.Random | None = None, max_steps: int = 100_000) -> int:
        """`step` until idle; returns the steps taken.

        Raises:
            RuntimeError: still busy after `max_steps` (the peers keep talking forever).
        """
        for steps in range(max_steps):
            if not self.step(rng):
                return steps
        raise RuntimeError(f"pair still busy after {max_steps} steps: {self.statistics()}")

    # -- reports and checks ------------------------------------------------------------------------------------

    def take_reports(self) -> list[ReportEntry]:
        """Drain every worker's report (as `get_finished` does), append it to `history` and return it."""
        entries: list[ReportEntry] = []
        for worker, sender in self.senders.items():
            for req_id in sorted(sender.take_finished()):
                transfer_id = self._sends[req_id][0] if req_id in self._sends else None
                busy = [
                    w for w in [*self._writes, *self._stalled] if (w.p, w.submit.transfer_id) == (worker, transfer_id)
                ]
                if busy:
                    self.violations.append(f"P{worker} reported {req_id!r} while {len(busy)} write(s) may touch it")
                entries.append(ReportEntry("P", worker, req_id, "finished_sending"))
        for worker, receiver in self.receivers.items():
            report = receiver.take_report()
            if worker in self._lent:
                report = self._lent[worker].hold_back(report)
            for req_id in report.finished | report.failed:
                transfer_id = self._recvs[req_id][0] if req_id in self._recvs else None
                # A write into a window does not touch the blocks; the window's scatter does.
                touching: list[Write | ScatterCopy] = [
                    w
                    for w in [*self._writes, *self._stalled]
                    if (w.d, w.submit.transfer_id) == (worker, transfer_id) and not w.submit.window_bytes
                ]
                touching += [c for c in self._scatters if (c.d, c.key[0]) == (worker, transfer_id)]
                if touching:
                    self.violations.append(f"D{worker} reported {req_id!r} while {len(touching)} write(s) may touch it")
            entries += [ReportEntry("D", worker, r, "finished") for r in sorted(report.finished)]
            entries += [ReportEntry("D", worker, r, "failed", report.reasons[r]) for r in sorted(report.failed)]
            for req_id in report.failed:
                blocks = set(self._recvs[req_id][1]) if req_id in self._recvs else set()
                if not blocks <= report.invalid_block_ids:
                    self.violations.append(f"D{worker} failed {req_id!r} without marking all its blocks invalid")
        self.history += entries
        return entries

    def outcomes(self, req_id: str) -> dict[tuple[str, Worker], list[str]]:
        """Every report of `req_id` so far, by (side, worker), in order."""
        found: dict[tuple[str, Worker], list[str]] = {}
        for entry in self.history:
            if entry.req_id == req_id:
                found.setdefault((entry.side, entry.worker), []).append(entry.outcome)
        return found

    def assert_reported_once(self, send_req_ids: Iterable[str] = (), recv_req_ids: Iterable[str] = ()) -> None:
        """Every P worker reported each of `send_req_ids` exactly once, every D worker each of `recv_req_ids`.

        Raises:
            AssertionError: a worker missed or repeated a report (the message names it).
        """
        for req_id in send_req_ids:
            for worker in self.senders:
                got = [e for e in self.history if (e.side, e.worker, e.req_id) == ("P", worker, req_id)]
                assert len(got) == 1, f"P{worker} reported {req_id!r} {len(got)} times"
        for req_id in recv_req_ids:
            for worker in self.receivers:
                got = [e for e in self.history if (e.side, e.worker, e.req_id) == ("D", worker, req_id)]
                assert len(got) == 1, f"D{worker} reported {req_id!r} {len(got)} times: {got}"

    def assert_received(self, transfer_id: str, workers: Iterable[Worker] | None = None) -> None:
        """Every D worker (or those given) holds the transfer's KV byte for byte, in the blocks it received into.

        Raises:
            AssertionError: a byte differs (the message names worker, layer, token, half and head).
        """
        req = next((v for v in self._recvs.values() if v[0] == transfer_id), None)
        assert req is not None, f"no receive of {transfer_id!r} was started"
        _, block_ids, num_tokens = req
        for worker in self.d.metas if workers is None else workers:
            meta = self.d.metas[worker]
            for layer in range(meta.start_layer, meta.end_layer):
                got = self.d.tokens(worker, layer, block_ids, num_tokens)
                want = self._pattern(self.d, worker, transfer_id, layer, num_tokens)
                bad = np.argwhere(got != want)
                if bad.size:
                    token, half, head, _ = bad[0]
                    raise AssertionError(
                        f"D{worker} layer {layer}: {len(bad)} wrong bytes, first at token {token}, half {half}, "
                        f"local head {head}"
                    )

    def bytes_written_twice(self, worker: Worker) -> int:
        """Bytes of D worker `worker`'s pool that more than one write landed on."""
        return int(np.count_nonzero(self._write_counts[worker] > 1))

    def statistics(self) -> PairStatistics:
        c = self._counts
        return PairStatistics(
            in_flight=len(self._wire),
            held_back=len(self._held),
            writes_pending=len(self._writes),
            writes_stalled=len(self._stalled),
            delivered=c.delivered,
            dropped=c.dropped,
            duplicated=c.duplicated,
            writes_done=c.writes_done,
            writes_failed=c.writes_failed,
            holds=sum(s.statistics().holds for s in self.senders.values()),
            receives=sum(r.statistics().receives for r in self.receivers.values()),
            writes_staged=c.writes_staged,
            descriptors=c.descriptors,
            scatters=c.scatters,
            windows_lent=sum(len(lent) for lent in self._lent.values()),
            scatters_pending=len(self._scatters),
        )

    # -- internals ---------------------------------------------------------------------------------------------

    def _pattern(self, engine: SimEngine, worker: Worker, transfer_id: str, layer: int, num_tokens: int) -> ByteArray:
        geometry = block_geometry(engine.metas[worker])
        return kv_pattern(transfer_id, layer, engine.heads(worker), num_tokens, geometry.halves, geometry.element_bytes)

    def _post(self, to: Literal["P", "D"], d: Worker, p: Worker, message: ToP | ToD) -> None:
        if (d, p) in self._down:
            self._counts.dropped += 1
            return
        self._seq += 1
        envelope = Envelope(to, d, p, message, self._seq)
        if self.drop is not None and self.drop(envelope):
            self._counts.dropped += 1
            return
        copies = 1
        if self.duplicate is not None and self.duplicate(envelope):
            self._counts.duplicated += 1
            copies = 2
        for i in range(copies):
            if i:
                self._seq += 1
                envelope = Envelope(to, d, p, message, self._seq)
            held = self.hold_back is not None and self.hold_back(envelope)
            (self._held if held else self._wire).append(envelope)

    def _run_p(self, worker: Worker, commands: Sequence[SendCommand]) -> None:
        for command in commands:
            if isinstance(command, Notice):
                self.notices.append(command)
            elif isinstance(command, Submit):
                self._seq += 1
                self._writes.append(Write(worker, command, self._seq))
            elif (command.dst.engine_id, command.dst.incarnation) == (self.d.engine_id, self.d.incarnation):
                self._post("D", command.dst.worker, worker, command.message)
            else:
                self.undeliverable.append(command)

    def _run_d(self, worker: Worker, commands: Sequence[RecvCommand]) -> None:
        for command in commands:
            if isinstance(command, Notice):
                self.notices.append(command)
            elif isinstance(command.message, TransferRequest) and self._window_ranges:
                self._post("P", worker, command.src, self._windowed(worker, command.src, command.message))
            else:
                self._post("P", worker, command.src, command.message)
        self._tidy_windows(worker)

    def _windowed(self, d: Worker, p: Worker, request: TransferRequest) -> TransferRequest:
        """As the D service: a window for the share when the rule sends it through D and there is room."""
        key, lent = (request.transfer_id, self.p.engine_id, p), self._lent[d]
        window, req_id = lent.get(key), self.receivers[d].req_of(request.transfer_id)
        if window is None and req_id is not None:
            assert self.staging is not None
            args = (request.block_ids, request.num_tokens, request.first_token, self.staging, self.staging_bytes // 2)
            plan = plan_window(self.p.metas[p], self.d.metas[d], *args)
            offset = self._window_ranges[d].allocate(plan.window_bytes) if plan is not None else None
            if plan is None or offset is None:
                return request
            window = lent.lend(key, req_id, list(request.block_ids), self.d.metas[d].staging_addr + offset, plan)
        if window is None or window.req_id != req_id:
            return request
        return msgspec.structs.replace(
            request, window_addr=window.addr, window_bytes=window.plan.window_bytes, share_bytes=window.plan.nbytes
        )

    def _run_windows(self, d: Worker, key: WindowKey, commands: Sequence[WindowCommand]) -> None:
        """Carry out D worker `d`'s window commands, as the D service does."""
        for command in commands:
            if isinstance(command, Scatter):
                self._seq += 1
                self._scatters.append(ScatterCopy(d, key, command, self._seq))
            elif isinstance(command, TellP):
                self._post("P", d, key[2], command.message)
            elif isinstance(command, Deliver):
                self._counts.scatters += command.scattered
                self._run_d(d, self.receivers[d].receive(key[1], key[2], command.message))
            else:
                self.notices.append(command)

    def _run_scatter(self, copy: ScatterCopy) -> None:
        error = "injected scatter failure" if self.fail_scatter is not None and self.fail_scatter(copy) else None
        if error is None:
            self._scatter(copy.d, copy.command)
        self._run_windows(copy.d, copy.key, self._lent[copy.d].scattered(copy.key, error))
        self._tidy_windows(copy.d)

    def _scatter(self, d: Worker, command: Scatter) -> None:
        """D's copy of one round of a window into its blocks."""
        arena, base = self._window_arenas[d], self.d.metas[d].staging_addr
        for src, dst, n in zip(command.src.tolist(), command.dst.tolist(), command.length.tolist(), strict=True):
            span = self.d.span(d, dst, n)
            self.d.arenas[d][span] = arena[src - base : src - base + n]
            self._write_counts[d][span] += 1

    def _tidy_windows(self, d: Worker) -> None:
        lent = self._lent.get(d)
        if lent is None or not lent.busy:
            return
        receiver = self.receivers[d]
        for addr in lent.tidy(lambda key: receiver.waits_on(*key), receiver.ending):
            self._window_ranges[d].free(addr - self.d.metas[d].staging_addr)

    def _deliver(self, envelope: Envelope) -> None:
        """Hand a message to its protocol object, as the service's drivers do: P's write in rounds or its `Sender`;
        D's windows, which pass the rest on to its `Receiver`."""
        self._counts.delivered += 1
        message = envelope.message
        if isinstance(message, WindowEmptied):
            key = (envelope.p, envelope.d, message.transfer_id)
            fill = self._fills.get(key)
            if fill is None:
                self.notices.append(Notice(f"late WindowEmptied({message.round}) of {message.transfer_id!r}", "debug"))
                return
            waiting = fill.window.state is FillState.WAITING
            self._run_fill(key, fill.window.emptied(message.round))
            if waiting and fill.window.state is FillState.FILLING:
                self._next_round(key)
        elif isinstance(message, TransferRequest | Release | Abort) or envelope.to == "P":
            ref, meta = self.d.ref(envelope.d), self.d.metas[envelope.d]
            sender, expected = self.senders[envelope.p], self._expected[envelope.p]
            self._run_p(envelope.p, sender.receive(ref, meta, expected, message, self.clock()))
        elif envelope.d in self._lent:
            window_key = (getattr(message, "transfer_id", ""), self.p.engine_id, envelope.p)
            commands = self._lent[envelope.d].receive(self.p.engine_id, envelope.p, message)
            self._run_windows(envelope.d, window_key, commands)
        else:
            self._run_d(envelope.d, self.receivers[envelope.d].receive(self.p.engine_id, envelope.p, message))

    def _run_write(self, write: Write) -> None:
        if self.stall_write is not None and self.stall_write(write):
            self._stalled.append(write)
            return
        failed = self.fail_write is not None and self.fail_write(write)
        self._complete(write, "injected write failure" if failed else None)

    def _copy(self, write: Write, plan: list[Descriptor]) -> tuple[int, int]:
        """Move `plan`'s bytes from P's arena to D's, directly or through a staging buffer when the rule says so;
        returns (bytes, descriptors submitted)."""
        src_arena, dst_arena = self.p.arenas[write.p], self.d.arenas[write.d]
        src = np.fromiter((d.src_addr for d in plan), dtype=np.int64, count=len(plan))
        dst = np.fromiter((d.dst_addr for d in plan), dtype=np.int64, count=len(plan))
        length = np.fromiter((d.length for d in plan), dtype=np.int64, count=len(plan))
        nbytes = int(length.sum())
        regions = pool_regions(self.d.metas[write.d])
        region = region_ids(dst, [start for start, _ in regions])
        if self.staging is None or not self.staging.stage(len(plan), count_runs(dst, length, region), nbytes):
            for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
                span = self.d.span(write.d, d, n)
                dst_arena[span] = src_arena[self.p.span(write.p, s, n)]
                self._write_counts[write.d][span] += 1
            return nbytes, len(plan)
        self._counts.writes_staged += 1
        count = 0
        for chunk in plan_staged(src, dst, length, max(1, self.staging_bytes // 2), region):
            buffer = np.zeros(chunk.nbytes, dtype=np.uint8)
            gathers = zip(
                chunk.gather_src.tolist(), chunk.gather_offset.tolist(), chunk.gather_length.tolist(), strict=True
            )
            for s, o, n in gathers:
                buffer[o : o + n] = src_arena[self.p.span(write.p, s, n)]
            writes = zip(
                chunk.write_offset.tolist(), chunk.write_dst.tolist(), chunk.write_length.tolist(), strict=True
            )
            for o, d, n in writes:
                if not any(start <= d and d + n <= start + size for start, size in regions):
                    self.violations.append(f"staged write [{d:#x}, +{n}) crosses D{write.d}'s registered tensors")
                span = self.d.span(write.d, d, n)
                dst_arena[span] = buffer[o : o + n]
                self._write_counts[write.d][span] += 1
            count += chunk.write_dst.size
        return nbytes, count

    def _complete(self, write: Write, error: str | None) -> None:
        submit, key = write.submit, (write.p, write.d, write.submit.transfer_id)
        plan: list[Descriptor] = []
        if error is None and key not in self._fills:
            try:
                plan = plan_transfer(
                    self.p.metas[write.p],
                    self.d.metas[write.d],
                    submit.src_block_ids,
                    submit.dst_block_ids,
                    submit.num_tokens,
                    first_token=submit.first_token,
                )
            except (TopologyError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        if error is not None:
            fill = self._fills.pop(key, None)
            self._end_write(write, error, 0, fill.descriptors if fill is not None else 0)
        elif submit.window_bytes:
            self._write_round(write, plan)
        else:
            self._end_write(write, None, *self._copy(write, plan))

    def _end_write(self, write: Write, error: str | None, nbytes: int, count: int) -> None:
        if error is None:
            self._counts.descriptors += count
            self._counts.writes_done += 1
        else:
            self._counts.writes_failed += 1
        transfer_id = write.submit.transfer_id
        self._run_p(write.p, self.senders[write.p].write_result(transfer_id, write.d, error, nbytes, count))

    # -- P's writes into D's windows ---------------------------------------------------------------------------

    def _write_round(self, write: Write, plan: list[Descriptor]) -> None:
        """One round of P's write of its share into D's window, as `BlockWriter` does (a share that fits is one
        round): one descriptor per source run in the stream, or one per chunk when P's rule gathers it. The first
        round starts its `FillingWindow` from `plan`."""
        submit, key = write.submit, (write.p, write.d, write.submit.transfer_id)
        if key not in self._fills:
            src, dst, length = (np.fromiter((d[i] for d in plan), dtype=np.int64, count=len(plan)) for i in range(3))
            share, nbytes = submit.share_bytes or submit.window_bytes, int(length.sum())
            if nbytes != share:
                self.violations.append(f"D planned a share of {share} bytes, P writes {nbytes}")
                self._end_write(write, f"D planned a share of {share} bytes, P writes {nbytes}", 0, 0)
                return
            src_region = region_ids(src, [start for start, _ in pool_regions(self.p.metas[write.p])])
            stream = window_plan(src, dst, length, 0, src_region)
            window = FillingWindow(key[2], stream, submit.window_addr, submit.window_bytes, self.fill_timeout_s)
            if (write.d, write.p) in self._down:
                window.peer_lost(f"connection to D{write.d} lost")
            self._fills[key] = _Fill(window, submit)
        fill = self._fills[key]
        window = fill.window
        if (
            window.state is FillState.FILLING
            and window.next_round
            and not self.senders[write.p].writing(key[2], key[1])
        ):
            why = f"{key[2]!r} aborted after {window.next_round} of {window.rounds} rounds of D's window"
            self._run_fill(key, window.stop(why))
        if window.state is not FillState.FILLING:
            return
        fill.nbytes += self._fill_round(write, window)
        fill.descriptors += self._round_descriptors(window)
        self._run_fill(key, window.landed(self.clock()))
        if window.state is FillState.FILLING:
            self._next_round(key)
        elif window.state is FillState.FILLED:
            del self._fills[key]
            self._end_write(write, None, fill.nbytes, fill.descriptors)

    def _fill_round(self, write: Write, window: FillingWindow) -> int:
        """Copy round `window.next_round` from P's blocks into D's window; its bytes."""
        arena, base = self._window_arenas[write.d], self.d.metas[write.d].staging_addr
        r_src, r_dst, r_len = window.round_pieces(window.next_round)
        for s, w, n in zip(r_src.tolist(), r_dst.tolist(), r_len.tolist(), strict=True):
            if w < base or w + n > base + arena.size:
                self.violations.append(f"window write [{w - base}, +{n}) outside D{write.d}'s staging region")
                continue
            arena[w - base : w - base + n] = self.p.arenas[write.p][self.p.span(write.p, s, n)]
        return int(r_len.sum())

    def _round_descriptors(self, window: FillingWindow) -> int:
        """What a round costs the transport: its source runs, or one per chunk when P's rule gathers them."""
        assert self.staging is not None
        r_src, _, r_len = window.round_pieces(window.next_round)
        chunk, part = max(1, self.staging_bytes // 2), int(r_len.sum())
        if self.staging.stage(r_src.size, -(-part // chunk), part):
            self._counts.writes_staged += 1
            return -(-part // chunk)
        return int(r_src.size)

    def _next_round(self, key: FillKey) -> None:
        """Queue the write of the next round, as the service's write loop goes on."""
        fill = self._fills[key]
        self._seq += 1
        self._writes.append(Write(key[0], fill.submit, self._seq, fill.window.next_round))

    def _run_fill(self, key: FillKey, commands: Sequence[FillCommand]) -> None:
        """Carry out a `FillingWindow`'s commands, as the service's write loop does."""
        for command in commands:
            if isinstance(command, Announce):
                self._post("D", key[1], key[0], command.message)
            elif isinstance(command, Fail):
                fill = self._fills.pop(key)
                self._end_write(Write(key[0], fill.submit, 0), command.reason, 0, fill.descriptors)
            else:
                self.notices.append(command)
