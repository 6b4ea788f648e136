"""`PeerPair`'s reports and checks: what each worker reported (as `get_finished` would), and the harness invariants
checked as they come.

Rules: `Reports` is a part of `kvsvc.testing.pair.PeerPair` (a mixin: the pair's state is its own). It drains the
protocol objects' reports and checks them against what the simulated plane still has pending: no report on either side
while a write may touch its blocks, a failed receive marks all its blocks invalid. A broken invariant goes into
`violations`, named; nothing here changes the protocol's course. Pure: standard library and kvsvc's pure core only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from kvsvc.core.messages import Worker
from kvsvc.core.receiver import Receiver
from kvsvc.core.sender import Sender
from kvsvc.core.windows import LentWindows
from kvsvc.testing.clock import FakeClock
from kvsvc.testing.dataplane import Counts, ScatterCopy, Write
from kvsvc.testing.faults import Envelope


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


class Reports:
    """The reports and statistics of a `PeerPair` (module docstring)."""

    senders: dict[Worker, Sender]
    receivers: dict[Worker, Receiver]
    clock: FakeClock
    history: list[ReportEntry]
    violations: list[str]
    _sends: dict[str, tuple[str, list[int], int]]
    _recvs: dict[str, tuple[str, list[int], int]]
    _lent: dict[Worker, LentWindows]
    _counts: Counts
    _wire: list[Envelope]
    _held: list[Envelope]
    _writes: list[Write]
    _stalled: list[Write]
    _scatters: list[ScatterCopy]

    def take_reports(self, step_s: float = 0.0) -> list[ReportEntry]:
        """Drain every worker's report (as `get_finished(step_s)` does), append it to `history` and return it."""
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
            report = receiver.take_report(self.clock(), step_s)
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


__all__ = ["PairStatistics", "ReportEntry", "Reports"]
