"""`PeerPair`'s fault injection: the in-memory wire between D and P workers, and the faults a test puts on it and on
the writes.

Rules: `Faults` is a part of `kvsvc.testing.pair.PeerPair` (a mixin: the pair's state is its own). Each fault is None
or a predicate the test sets and that applies until reset: `drop`, `duplicate` and `hold_back` look at an `Envelope`
when it is posted (a held-back one waits for `release_held`); `stall_write` and `fail_write` at a `Write` when it would
run (a stalled one waits for `finish_stalled`); `fail_scatter` at a `ScatterCopy`. A link that is down
(`PeerPair.lose_connection`) drops what is posted on it. Faults decide nothing about the protocol. Pure: standard
library and kvsvc's pure core only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvsvc.core.messages import (
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
from kvsvc.testing.dataplane import Counts, ScatterCopy, Write

ToP = TransferRequest | Release | Abort | ErrorMessage | WindowEmptied
ToD = TransferDone | TransferFailed | ErrorMessage | Pong | WindowFilled


@dataclass(frozen=True, slots=True)
class Envelope:
    """One control message on the wire between D worker `d` and P worker `p`; `to` names the receiving side."""

    to: Literal["P", "D"]
    d: Worker
    p: Worker
    message: ToP | ToD
    seq: int


class Faults:
    """The wire, the held-back messages and the stalled writes of a `PeerPair` (module docstring)."""

    _counts: Counts

    def _set_up_faults(self) -> None:
        self.drop: Callable[[Envelope], bool] | None = None
        self.duplicate: Callable[[Envelope], bool] | None = None
        self.hold_back: Callable[[Envelope], bool] | None = None
        self.stall_write: Callable[[Write], bool] | None = None
        self.fail_write: Callable[[Write], bool] | None = None
        self.fail_scatter: Callable[[ScatterCopy], bool] | None = None
        self._wire: list[Envelope] = []
        self._held: list[Envelope] = []
        self._stalled: list[Write] = []
        self._down: set[tuple[Worker, Worker]] = set()  # (D worker, P worker) links that are down
        self._seq = 0  # the order of everything pending: envelopes, writes, scatters

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

    def _complete(self, write: Write, error: str | None) -> None:
        """The write ended (`error` None: its bytes land); the pair carries it out."""
        raise NotImplementedError

    def _post(self, to: Literal["P", "D"], d: Worker, p: Worker, message: ToP | ToD) -> None:
        """Put `message` on the link between D worker `d` and P worker `p`, as the faults let it."""
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

    def _run_write(self, write: Write) -> None:
        """Run a write the transport took: stalled, failed or landed, as the faults say."""
        if self.stall_write is not None and self.stall_write(write):
            self._stalled.append(write)
            return
        failed = self.fail_write is not None and self.fail_write(write)
        self._complete(write, "injected write failure" if failed else None)

    def _scatter_fails(self, copy: ScatterCopy) -> str | None:
        return "injected scatter failure" if self.fail_scatter is not None and self.fail_scatter(copy) else None


__all__ = ["Envelope", "Faults", "ToD", "ToP"]
