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
    Worker,
)
from kvsvc.planner import Descriptor, expected_destinations, plan_transfer, release_notifier, sources_of
from kvsvc.receiver import Receiver, RecvCommand
from kvsvc.sender import Reply, SendCommand, Sender, Submit
from kvsvc.staging import (
    RangeAllocator,
    StagingRule,
    WindowPlan,
    count_runs,
    plan_staged,
    plan_window,
    region_ids,
    stream_round,
    window_plan,
    window_round_bytes,
    window_rounds,
)
from kvsvc.testing.clock import FakeClock
from kvsvc.testing.sim import EngineSpec, SimEngine, kv_pattern

ByteArray = npt.NDArray[np.uint8]
IntArray = npt.NDArray[np.int64]
ToP = TransferRequest | Release | Abort | ErrorMessage
ToD = TransferDone | TransferFailed | ErrorMessage | Pong
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
    """A `Submit` that P worker `p` handed to the simulated transport and that has not completed yet."""

    p: Worker
    submit: Submit
    seq: int

    @property
    def d(self) -> Worker:
        return self.submit.dst.worker


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
    `Write` when it would run (a stalled one waits for `finish_stalled`). Links between a D and a P worker break
    with `lose_connection` and come back with `reconnect`. `violations` lists every broken harness invariant: a
    report on either side while a write may still touch its blocks, a failed receive not marking all its blocks
    invalid.
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
        also has a staging region of `staging_bytes` and lends windows of it (`plan_window`), scattered when P's
        done answer is delivered, as the D service does."""
        self.clock = clock or FakeClock()
        self.staging, self.staging_bytes = staging, staging_bytes
        self.p = SimEngine("P", p, _P_BASE)
        self.d = SimEngine("D", d, _D_BASE)
        # D's windows: a region per D worker, and the window lent per (transfer, D worker, P worker).
        self._window_arenas: dict[Worker, ByteArray] = {}
        self._window_ranges: dict[Worker, RangeAllocator] = {}
        self._windows: dict[tuple[str, Worker, Worker], tuple[int, WindowPlan]] = {}
        if windows and staging is None:
            raise ValueError("windows need a staging rule")
        if windows:
            for i, (w, meta) in enumerate(sorted(self.d.metas.items())):
                addr = _WINDOW_BASE + i * staging_bytes
                self.d.metas[w] = msgspec.structs.replace(meta, staging_addr=addr, staging_size=staging_bytes)
                self._window_arenas[w] = np.zeros(staging_bytes, dtype=np.uint8)
                self._window_ranges[w] = RangeAllocator(staging_bytes)
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
        self.history: list[ReportEntry] = []
        self.violations: list[str] = []
        self.undeliverable: list[Reply] = []
        self.notices: list[Notice] = []  # what the protocol objects asked their drivers to log
        self._wire: list[Envelope] = []
        self._held: list[Envelope] = []
        self._writes: list[Write] = []
        self._stalled: list[Write] = []
        self._down: set[tuple[Worker, Worker]] = set()
        self._sends: dict[str, tuple[str, list[int], int]] = {}  # req_id -> (transfer_id, block ids, tokens)
        self._recvs: dict[str, tuple[str, list[int], int]] = {}
        self._write_counts = {w: np.zeros(a.size, dtype=np.uint16) for w, a in self.d.arenas.items()}
        self._seq = 0
        self._counts = _Counts()

    # -- the engines' calls ------------------------------------------------------------------------------------

    def start_send(
        self, req_id: str, transfer_id: str, block_ids: list[int], num_tokens: int, *, ready: bool = True
    ) -> None:
        """Every P worker writes the transfer's known KV pattern into `block_ids` and holds it; `ready=False`
        leaves the compute unfinished until `ready(transfer_id)`."""
        self._sends[req_id] = (transfer_id, list(block_ids), num_tokens)
        for worker, sender in self.senders.items():
            meta = self.p.metas[worker]
            for layer in range(meta.start_layer, meta.end_layer):
                values = self._pattern(self.p, worker, transfer_id, layer, num_tokens)
                self.p.write_tokens(worker, layer, block_ids, num_tokens, values)
            self._run_p(worker, sender.hold(req_id, transfer_id, list(block_ids), num_tokens, self.clock()))
        if ready:
            self.ready(transfer_id)

    def ready(self, transfer_id: str) -> None:
        """The compute that wrote `transfer_id`'s KV finished on every P worker."""
        for worker, sender in self.senders.items():
            self._run_p(worker, sender.ready(transfer_id))

    def start_recv(self, req_id: str, transfer_id: str, block_ids: list[int], num_tokens: int) -> None:
        """Every D worker starts receiving into `block_ids`; the handshake completes at once, so each sends its
        requests (and releases) on the links that are up."""
        self._recvs[req_id] = (transfer_id, list(block_ids), num_tokens)
        for worker, receiver in self.receivers.items():
            meta = self.d.metas[worker]
            if not receiver.start(req_id, transfer_id, self.p.engine_id, list(block_ids), num_tokens, self.clock()):
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

    def lose_connection(self, d: Worker, p: Worker) -> None:
        """The control connection between D worker `d` and P worker `p` breaks: its in-flight messages are lost,
        both sides learn it, and later messages on it are dropped until `reconnect`."""
        self._down.add((d, p))
        self._wire = [e for e in self._wire if (e.d, e.p) != (d, p)]
        self._held = [e for e in self._held if (e.d, e.p) != (d, p)]
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
        """Nothing is on the wire and no write can run (held-back messages and stalled writes may remain)."""
        return not self._wire and not self._writes

    def step(self, rng: random.Random | None = None) -> bool:
        """Deliver one message or run one write: the oldest, or a random one with `rng`. False when idle."""
        if self.idle:
            return False
        pending: list[Envelope | Write] = [*self._wire, *self._writes]
        item = rng.choice(pending) if rng is not None else min(pending, key=lambda x: x.seq)
        if isinstance(item, Envelope):
            self._wire.remove(item)
            self._deliver(item)
        else:
            self._writes.remove(item)
            self._run_write(item)
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
            for req_id in report.finished | report.failed:
                transfer_id = self._recvs[req_id][0] if req_id in self._recvs else None
                busy = [
                    w for w in [*self._writes, *self._stalled] if (w.d, w.submit.transfer_id) == (worker, transfer_id)
                ]
                if busy:
                    self.violations.append(f"D{worker} reported {req_id!r} while {len(busy)} write(s) may touch it")
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
            windows_lent=len(self._windows),
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
        if self._windows:
            self._free_windows(worker)

    def _windowed(self, d: Worker, p: Worker, request: TransferRequest) -> TransferRequest:
        """As the D service: a window for the share when the rule sends it through D and there is room."""
        key = (request.transfer_id, d, p)
        if key not in self._windows:
            assert self.staging is not None
            args = (request.block_ids, request.num_tokens, request.first_token, self.staging, self.staging_bytes // 2)
            plan = plan_window(self.p.metas[p], self.d.metas[d], *args)
            offset = self._window_ranges[d].allocate(plan.window_bytes) if plan is not None else None
            if plan is None or offset is None:
                return request
            self._windows[key] = (self.d.metas[d].staging_addr + offset, plan)
        addr, plan = self._windows[key]
        return msgspec.structs.replace(
            request, window_addr=addr, window_bytes=plan.window_bytes, share_bytes=plan.nbytes
        )

    def _scatter(self, d: Worker, p: Worker, transfer_id: str, index: int | None = None) -> None:
        """D's scatter of round `index` of a window into its blocks (None: the last round, before P's done answer
        reaches the `Receiver`)."""
        window = self._windows.get((transfer_id, d, p))
        if window is None:
            return
        addr, plan = window
        size = window_round_bytes(plan.nbytes, plan.window_bytes)
        if index is None:
            index = -(-plan.nbytes // size) - 1
            self._counts.scatters += 1
        arena, base = self._window_arenas[d], self.d.metas[d].staging_addr
        at = addr - base + (index % 2) * size
        r_dst, r_offset, r_length = stream_round(plan.offset, plan.dst, plan.length, index, size)
        for o, dst, n in zip(r_offset.tolist(), r_dst.tolist(), r_length.tolist(), strict=True):
            span = self.d.span(d, dst, n)
            self.d.arenas[d][span] = arena[at + o : at + o + n]
            self._write_counts[d][span] += 1

    def _free_windows(self, d: Worker) -> None:
        for key, (addr, _) in list(self._windows.items()):
            if key[1] == d and not self.receivers[d].waits_on(key[0], self.p.engine_id, key[2]):
                del self._windows[key]
                self._window_ranges[d].free(addr - self.d.metas[d].staging_addr)

    def _deliver(self, envelope: Envelope) -> None:
        """Hand a message to its protocol object, as the service's drivers do: `Sender.receive`, `Receiver.receive`."""
        self._counts.delivered += 1
        if envelope.to == "P":
            ref, meta = self.d.ref(envelope.d), self.d.metas[envelope.d]
            sender, expected = self.senders[envelope.p], self._expected[envelope.p]
            self._run_p(envelope.p, sender.receive(ref, meta, expected, envelope.message, self.clock()))
        else:
            if isinstance(envelope.message, TransferDone):
                self._scatter(envelope.d, envelope.p, envelope.message.transfer_id)
            self._run_d(envelope.d, self.receivers[envelope.d].receive(self.p.engine_id, envelope.p, envelope.message))

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
        if write.submit.window_bytes:
            return self._copy_window(write, src, dst, length)
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

    def _copy_window(self, write: Write, src: IntArray, dst: IntArray, length: IntArray) -> tuple[int, int]:
        """P's write of its share into D's window, as `BlockWriter` does: one descriptor per source run in the
        stream, or one per chunk when P's rule gathers it; a share larger than the window in rounds, each but the
        last scattered by D at once (as if `WindowFilled` and `WindowEmptied` crossed the wire without delay)."""
        submit, nbytes = write.submit, int(length.sum())
        share = submit.share_bytes or submit.window_bytes
        if nbytes != share:
            self.violations.append(f"D planned a share of {share} bytes, P writes {nbytes}")
            return nbytes, 0
        src_region = region_ids(src, [start for start, _ in pool_regions(self.p.metas[write.p])])
        w_src, w_offset, w_len = window_plan(src, dst, length, 0, src_region)
        arena, base = self._window_arenas[write.d], self.d.metas[write.d].staging_addr
        size, rounds = window_round_bytes(share, submit.window_bytes), window_rounds(share, submit.window_bytes)
        assert self.staging is not None
        chunk, count = max(1, self.staging_bytes // 2), 0
        for index in range(rounds):
            r_src, r_offset, r_len = stream_round(w_offset, w_src, w_len, index, size)
            at = submit.window_addr - base + (index % 2) * size
            for s, o, n in zip(r_src.tolist(), r_offset.tolist(), r_len.tolist(), strict=True):
                if at + o < 0 or at + o + n > arena.size:
                    self.violations.append(f"window write [{at + o}, +{n}) outside D{write.d}'s staging region")
                    continue
                arena[at + o : at + o + n] = self.p.arenas[write.p][self.p.span(write.p, s, n)]
            part = int(r_len.sum())
            if self.staging.stage(r_src.size, -(-part // chunk), part):
                self._counts.writes_staged += 1
                count += -(-part // chunk)
            else:
                count += int(r_src.size)
            if index < rounds - 1:
                self._scatter(write.d, write.p, submit.transfer_id, index)
        return nbytes, count

    def _complete(self, write: Write, error: str | None) -> None:
        submit, nbytes, count = write.submit, 0, 0
        if error is None:
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
            else:
                nbytes, count = self._copy(write, plan)
                self._counts.descriptors += count
        if error is None:
            self._counts.writes_done += 1
        else:
            self._counts.writes_failed += 1
        self._run_p(write.p, self.senders[write.p].write_result(submit.transfer_id, write.d, error, nbytes, count))
