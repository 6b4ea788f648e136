"""A back-to-back P/D peer pair for protocol tests with no event loop: `Sender`s and `Receiver`s wired by lists.

Rules: `PeerPair` plays the asyncio service's part (docs/protocol.md) without I/O, through the same driver decisions the
service takes (`carry_out_p` and `PSide` in `kvsvc.core.sender`, `carry_out_d` and `DSide` in `kvsvc.core.receiver`, the
window decisions in `kvsvc.core.windows`): it turns `Reply`/`SendToSource` commands into envelopes on an in-memory wire
(`kvsvc.testing.faults`), delivers them as the other side's events, and carries out `Submit` by `plan_transfer` plus
memmove between simulated KV pools (`kvsvc.testing.dataplane`). Nothing happens until a test calls
`step`/`run_until_idle`/`advance`; faults are predicates the test sets. The pair checks the rule "never report a send
while a write may touch its blocks" as it goes. Pure: numpy and kvsvc's pure core only."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvsvc.core.auth import harness_secret
from kvsvc.core.data_planes import rule_on
from kvsvc.core.jobs import Notice
from kvsvc.core.layout import pool_regions
from kvsvc.core.messages import TransferRequest, WindowEmptied, Worker
from kvsvc.core.planner import Descriptor, expected_destinations, release_notifier, sources_of
from kvsvc.core.receiver import DCommand, LoadTimes, Receiver, RecvRequest, ToSource, carry_out_d, check_recv
from kvsvc.core.sender import Landed, PCommand, Reply, Sender, SendRequest, Submit, WriteFault, carry_out_p, check_send
from kvsvc.core.staging_plans import StagingRule, plan_window, region_ids, window_plan
from kvsvc.core.windows import (
    Announce,
    AwaitHalf,
    Deliver,
    Fail,
    FillingWindow,
    FillState,
    LendAt,
    LentWindow,
    LentWindows,
    RoundStep,
    Scatter,
    WindowKey,
    WriteRound,
    d_frame,
    lent_window,
    p_frame,
    round_step,
    share_refusal,
    window_choice,
    with_window,
)
from kvsvc.testing.clock import FakeClock
from kvsvc.testing.dataplane import Counts, ScatterCopy, SimPlane, Write
from kvsvc.testing.faults import Envelope, Faults
from kvsvc.testing.reports import PairStatistics, ReportEntry, Reports
from kvsvc.testing.sim import EngineSpec, SimEngine

FillKey = tuple[Worker, Worker, str]  # (P worker, D worker, transfer id)
_P_BASE, _D_BASE = 1 << 44, 1 << 45


@dataclass(slots=True)
class _Fill:
    """P's write of one share into D's window: its rounds, and what the rounds so far moved."""

    window: FillingWindow
    submit: Submit
    nbytes: int = 0
    descriptors: int = 0
    on_wire: bool = True  # a round's write is queued or running: no other round may start
    began: float = 0.0  # when P submitted the share


@dataclass(frozen=True, slots=True)
class _PWorker:
    """P worker `worker`'s driver in the pair (`kvsvc.core.sender.PSide`), as `SendingRole` is in the service."""

    pair: PeerPair
    worker: Worker

    def submit(self, command: Submit) -> None:
        self.pair._seq += 1
        self.pair._writes.append(Write(self.worker, command, self.pair._seq, began=self.pair.clock()))

    def reply(self, command: Reply) -> None:
        pair = self.pair
        if (command.dst.engine_id, command.dst.incarnation) == (pair.d.engine_id, pair.d.incarnation):
            pair._post("D", command.dst.worker, self.worker, command.message)
        else:
            pair.undeliverable.append(command)

    def announce(self, command: Announce) -> None:
        self.pair._post("D", command.dst.worker, self.worker, command.message)

    def log(self, notice: Notice) -> None:
        self.pair.notices.append(notice)


@dataclass(frozen=True, slots=True)
class _DWorker:
    """D worker `worker`'s driver in the pair (`kvsvc.core.receiver.DSide`), as `ReceivingRole` is in the service."""

    pair: PeerPair
    worker: Worker

    def tell_p(self, engine_id: str, src: Worker, message: ToSource | WindowEmptied) -> None:
        if isinstance(message, TransferRequest):  # as the service, which times a receive's handshake to here
            self.pair.receivers[self.worker].asked(message.transfer_id, self.pair.clock())
        self.pair._post("P", self.worker, src, message)

    def windowed(self, engine_id: str, src: Worker, request: TransferRequest) -> TransferRequest:
        return self.pair._windowed(self.worker, src, request)

    def scatter(self, key: WindowKey, command: Scatter) -> None:
        self.pair._seq += 1
        self.pair._scatters.append(ScatterCopy(self.worker, key, command, self.pair._seq))

    def deliver(self, key: WindowKey, command: Deliver) -> None:
        pair = self.pair
        pair._counts.scatters += command.scattered
        pair._run_d(self.worker, pair.receivers[self.worker].receive(key[1], key[2], command.message))

    def log(self, notice: Notice) -> None:
        self.pair.notices.append(notice)


class PeerPair(Reports, SimPlane, Faults):
    """One P engine and one D engine, every worker's protocol object, an in-memory wire and simulated KV pools.

    Typical use::

        pair = PeerPair(EngineSpec(tp_size=1), EngineSpec(tp_size=2))
        pair.start_send("p-req", "t1", [0, 1], num_tokens=7)
        pair.start_recv("d-req", "t1", [3, 4], num_tokens=7)
        pair.run_until_idle()
        pair.take_reports()
        pair.assert_received("t1")

    Faults: predicates a test sets (`kvsvc.testing.faults`); links between a D and a P worker break with
    `lose_connection` and come back with `reconnect`. `violations` lists every broken harness invariant
    (`kvsvc.testing.reports`).
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
        scatters round by round (`kvsvc.core.windows`), as the services do: the round frames cross the wire, and each
        round's scatter is a step of its own."""
        self.clock = clock or FakeClock()
        self.staging, self.staging_bytes = staging, staging_bytes
        self.p = SimEngine("P", p, _P_BASE)
        self.d = SimEngine("D", d, _D_BASE)
        if windows and staging is None:
            raise ValueError("windows need a staging rule")
        self._set_up_plane(windows)
        self._set_up_faults()
        # Every D worker's windows (none lent without `windows`: every frame still passes them, as in the service).
        self._lent = {w: LentWindows() for w in self.d.metas}
        self._fills: dict[FillKey, _Fill] = {}
        self.fill_timeout_s = 60.0  # P's wait for D to empty a half (the service's hold timeout)
        self.senders = {w: sender() for w in self.p.metas}
        self.receivers = {w: receiver() for w in self.d.metas}
        self._expected = {w: frozenset(expected_destinations(m, self.d.metas)) for w, m in self.p.metas.items()}
        # With an rng, `step` picks any pending message; `fifo` keeps each link's messages in order in each
        # direction, as the control connection (TCP) does.
        self.fifo = False
        self.history: list[ReportEntry] = []
        self.violations: list[str] = []
        self.undeliverable: list[Reply] = []
        self.notices: list[Notice] = []  # what the protocol objects asked their drivers to log
        self.loads: list[tuple[Worker, LoadTimes]] = []  # each D worker's landed receives, timed (`take_landed`)
        self._writes: list[Write] = []
        self._scatters: list[ScatterCopy] = []
        self._sends: dict[str, tuple[str, list[int], int]] = {}  # req_id -> (transfer_id, block ids, tokens)
        self._recvs: dict[str, tuple[str, list[int], int]] = {}
        self._counts = Counts()

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
            request = SendRequest(req_id, transfer_id, tuple(block_ids), num_tokens, secret)
            check_send(meta, request)  # as the service's edge does
            self._run_p(worker, sender.hold(request, self.clock()))
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
            args = (req_id, transfer_id, self.p.engine_id, "", tuple(block_ids), num_tokens, 0, secret)
            request = RecvRequest(*args)
            check_recv(meta, request)  # as the service's edge does
            started = receiver.start(request, self.clock(), receive=f"receive-{req_id}")
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
            self._run_p(key[0], fill.window.expire(now))
            self._go_on(key)

    def lose_connection(self, d: Worker, p: Worker) -> None:
        """The control connection between D worker `d` and P worker `p` breaks: its in-flight messages are lost,
        both sides learn it, and later messages on it are dropped until `reconnect`."""
        self._down.add((d, p))
        self._wire = [e for e in self._wire if (e.d, e.p) != (d, p)]
        self._held = [e for e in self._held if (e.d, e.p) != (d, p)]
        for key, fill in list(self._fills.items()):
            if key[:2] == (p, d):
                self._run_p(key[0], fill.window.peer_lost(f"connection to D{d} lost"))
                self._go_on(key)
        self._run_p(p, self.senders[p].peer_lost(self.d.ref(d)))
        receiver, reason = self.receivers[d], f"connection to P{p} lost"
        self._run_d(d, receiver.peer_lost(self.p.engine_id, p, reason, self.clock(), self.p.incarnation))

    def reconnect(self, d: Worker, p: Worker) -> None:
        """The link comes back; D sends the requests that waited for it, and asks again the jobs the lost link
        left waiting (as `ReceivingRole` does on a new connection to the same start of P)."""
        self._down.discard((d, p))
        self._run_d(d, self.receivers[d].connected(self.p.engine_id, p))
        self._run_d(d, self.receivers[d].reconnected(self.p.engine_id, p, self.p.incarnation))

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

    # -- internals ---------------------------------------------------------------------------------------------

    def _run_p(self, worker: Worker, commands: Sequence[PCommand]) -> None:
        carry_out_p(commands, _PWorker(self, worker))

    def _run_d(self, worker: Worker, commands: Sequence[DCommand], key: WindowKey | None = None) -> None:
        carry_out_d(commands, _DWorker(self, worker), key)
        self._tidy_windows(worker)
        # As the service, which times the receives that landed here.
        self.loads += [(worker, times) for times in self.receivers[worker].take_landed(self.clock())]

    def _windowed(self, d: Worker, p: Worker, request: TransferRequest) -> TransferRequest:
        """As the D service (`kvsvc.core.windows.lent_window`): a window when the rule on Mooncake sends the share
        through D and there is room now (the pair never waits for room, so never holds a request back)."""
        if not self._window_ranges:
            return request
        key, lent = (request.transfer_id, self.p.engine_id, p), self._lent[d]
        req_id = self.receivers[d].req_of(request.transfer_id)
        window = lent_window(lent, key, req_id)
        if window == "lend":
            assert self.staging is not None and req_id is not None
            rule = rule_on("mooncake", self.staging)
            args = (request.block_ids, request.num_tokens, request.first_token, rule, self.staging_bytes // 2)
            plan = plan_window(self.p.metas[p], self.d.metas[d], *args)
            offset = self._window_ranges[d].allocate(plan.window_bytes) if plan is not None else None
            addr = self.d.metas[d].staging_addr + offset if offset is not None else None
            choice = window_choice(plan is not None, addr, 0.0)  # the pair never waits for room
            if not isinstance(choice, LendAt):
                return request
            assert plan is not None
            window = lent.lend(key, req_id, list(request.block_ids), choice.addr, plan, request.receive)
        return with_window(request, window) if isinstance(window, LentWindow) else request

    def _run_scatter(self, copy: ScatterCopy) -> None:
        error = self._scatter_fails(copy)
        if error is None:
            self._scatter(copy.d, copy.command)
        self._run_d(copy.d, self._lent[copy.d].scattered(copy.key, error), copy.key)

    def _tidy_windows(self, d: Worker) -> None:
        lent = self._lent[d]
        if not lent.busy:
            return
        receiver = self.receivers[d]
        for addr in lent.tidy(lambda key: receiver.waits_on(*key), receiver.ending):
            self._window_ranges[d].free(addr - self.d.metas[d].staging_addr)

    def _deliver(self, envelope: Envelope) -> None:
        """Hand a message to its protocol object, as the service's drivers do (`p_frame`, `d_frame`): at P, a write in
        rounds or the `Sender`; at D, the windows, which pass the rest on to the `Receiver`."""
        self._counts.delivered += 1
        message, d, p = envelope.message, envelope.d, envelope.p
        if envelope.to == "D":
            window, window_commands = d_frame(self._lent[d], self.p.engine_id, p, message)
            self._run_d(d, window_commands, window)
            return
        fills = {key[2]: fill.window for key, fill in self._fills.items() if key[:2] == (p, d)}
        commands = p_frame(message, fills, f"D{d}")
        if commands is None:
            sender, ref, meta = self.senders[p], self.d.ref(d), self.d.metas[d]
            self._run_p(p, sender.receive(ref, meta, self._expected[p], message, self.clock()))
            return
        key = (p, d, getattr(message, "transfer_id", ""))
        self._run_p(p, commands)
        self._go_on(key)

    def _complete(self, write: Write, error: str | None) -> None:
        submit, key = write.submit, (write.p, write.d, write.submit.transfer_id)
        plan: list[Descriptor] = []
        if error is None and key not in self._fills:
            plan, error = self._plan(write)
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
        end = Landed(nbytes, count, self.clock() - write.began) if error is None else WriteFault(error, count)
        self._run_p(write.p, self.senders[write.p].write_ended(transfer_id, write.d, end))

    # -- P's writes into D's windows, as the service's write loop (`BlockWriter._write_rounds`) -------------------

    def _write_round(self, write: Write, plan: list[Descriptor]) -> None:
        """A write into D's window runs: its first round starts the `FillingWindow` from `plan` (a share that fits
        is one round); each round is one descriptor per source run in the stream, or one per chunk when P's rule
        gathers it."""
        submit, key = write.submit, (write.p, write.d, write.submit.transfer_id)
        if key not in self._fills:
            src, dst, length = (np.fromiter((d[i] for d in plan), dtype=np.int64, count=len(plan)) for i in range(3))
            refused = share_refusal(submit, int(length.sum()))
            if refused is not None:
                self.violations.append(refused)
                self._end_write(write, refused, 0, 0)
                return
            src_region = region_ids(src, [start for start, _ in pool_regions(self.p.metas[write.p])])
            stream = window_plan(src, dst, length, 0, src_region)
            window = FillingWindow(
                key[2], stream, submit.window_addr, submit.window_bytes, self.fill_timeout_s, dst=submit.dst
            )
            if (write.d, write.p) in self._down:
                window.peer_lost(f"connection to D{write.d} lost")
            self._fills[key] = _Fill(window, submit, began=write.began)
        fill = self._fills[key]
        fill.on_wire = False
        step = round_step(fill.window, lambda: self.senders[key[0]].writing(key[2], key[1]))
        if not isinstance(step, WriteRound):
            self._rounds_end(key, step)
            return
        fill.nbytes += self._fill_round(key[0], key[1], step)
        fill.descriptors += self._round_descriptors(step)
        self._run_p(key[0], fill.window.landed(self.clock()))
        self._go_on(key)

    def _go_on(self, key: FillKey) -> None:
        """No round of the write is on the wire: queue the next round (`round_step` decides when its write runs),
        or wait, or end the write, as `round_step` says."""
        fill = self._fills.get(key)
        if fill is None or fill.on_wire:
            return
        if fill.window.state is FillState.FILLING:
            self._seq += 1
            self._writes.append(Write(key[0], fill.submit, self._seq, fill.window.next_round, fill.began))
            fill.on_wire = True
            return
        self._rounds_end(key, round_step(fill.window, lambda: self.senders[key[0]].writing(key[2], key[1])))

    def _rounds_end(self, key: FillKey, step: RoundStep) -> None:
        """End the write in rounds as `step` says (a `Fail`, or all rounds filled); nothing while it waits."""
        if isinstance(step, AwaitHalf | WriteRound):
            return
        fill = self._fills.pop(key)
        error = step.reason if isinstance(step, Fail) else None
        nbytes = fill.nbytes if error is None else 0
        self._end_write(Write(key[0], fill.submit, 0, began=fill.began), error, nbytes, fill.descriptors)


__all__ = ["Envelope", "PairStatistics", "PeerPair", "ReportEntry", "ScatterCopy", "Write"]
