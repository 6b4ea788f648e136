"""The scheduler's view of KV transfers: which requests wait for remote KV (D), which hold KV for sending (P).

Pure module: standard library and kvsvc.core.outputs only (no asyncio, torch, mooncake). Invariants: each tracked id
leaves the tracker exactly once, in exactly one of finished / runnable / failed; `update` never raises on what a
report says (ids it does not track are returned as unknown) and never mutates the report; a receive whose blocks
were reported invalid is failed, never runnable, even if a worker called it finished.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvsvc.core.outputs import KVConnectorOutput

BlockIds = tuple[int, ...]


@dataclass(frozen=True)
class SchedulerUpdate:
    """What one aggregated `KVConnectorOutput` means for the scheduler.

    `sends_finished`: P requests whose blocks can be freed now (their KV was fetched, released or expired).
    `recvs_finished`: D requests whose KV landed in their blocks: runnable, blocks kept.
    `recvs_failed`: D requests whose receive failed (reported failed, or some of their blocks invalid); their
    blocks must be recomputed. `recompute_block_ids`: every block to recompute: the failed requests' blocks and
    every block the report called invalid (including blocks of receives still in flight, which will fail).
    `unknown_sending` / `unknown_recving`: ids the report names that this tracker does not hold (never
    tracked, or already reported): a bug or a late repeat upstream, for the engine to log.
    """

    sends_finished: Mapping[str, BlockIds] = field(default_factory=dict)
    recvs_finished: Mapping[str, BlockIds] = field(default_factory=dict)
    recvs_failed: Mapping[str, BlockIds] = field(default_factory=dict)
    recompute_block_ids: frozenset[int] = frozenset()
    unknown_sending: frozenset[str] = frozenset()
    unknown_recving: frozenset[str] = frozenset()

    def is_empty(self) -> bool:
        """True when the report changed nothing and named nothing unknown."""
        return not (
            self.sends_finished
            or self.recvs_finished
            or self.recvs_failed
            or self.recompute_block_ids
            or self.unknown_sending
            or self.unknown_recving
        )


@dataclass(frozen=True)
class TrackerStatistics:
    """How many requests the tracker holds, for metrics and admin endpoints."""

    sending: int
    receiving: int
    receiving_tainted: int


class RequestTracker:
    """Tracks the requests of one engine that wait on kvsvc, and turns each aggregated report into a
    `SchedulerUpdate`.

    Feed it the output of `KVOutputAggregator.aggregate` (one per step): ids there are already engine-wide,
    each finished at most once. An id may be tracked as a send and as a receive at once (a worker plays both
    roles); the two tables are independent, as the report's directions are.
    """

    def __init__(self) -> None:
        self._sending: dict[str, BlockIds] = {}
        self._receiving: dict[str, BlockIds] = {}
        # Receives in flight some of whose blocks were already reported invalid (by a worker that failed early).
        self._tainted: set[str] = set()

    def track_send(self, req_id: str, block_ids: Iterable[int]) -> None:
        """P: `req_id`'s KV in `block_ids` is held for a D engine; it is freed when the report says so.

        A repeat with the same blocks is a no-op.

        Raises:
            ValueError: `req_id` is already tracked as a send with other blocks.
        """
        self._track(self._sending, "send", req_id, tuple(block_ids))

    def track_recv(self, req_id: str, block_ids: Iterable[int]) -> None:
        """D: `req_id` waits for remote KV into `block_ids`; it becomes runnable (or failed) when reported.

        A repeat with the same blocks is a no-op.

        Raises:
            ValueError: `req_id` is already tracked as a receive with other blocks.
        """
        self._track(self._receiving, "receive", req_id, tuple(block_ids))

    def sending(self) -> Mapping[str, BlockIds]:
        """The P requests held now, with their blocks (a copy)."""
        return dict(self._sending)

    def receiving(self) -> Mapping[str, BlockIds]:
        """The D requests waiting now, with their blocks (a copy)."""
        return dict(self._receiving)

    def statistics(self) -> TrackerStatistics:
        return TrackerStatistics(
            sending=len(self._sending), receiving=len(self._receiving), receiving_tainted=len(self._tainted)
        )

    def update(self, kv: KVConnectorOutput | None) -> SchedulerUpdate:
        """Apply one aggregated report: the requests it ends leave the tracker. Raises nothing.

        A receive named in `failed_recving` (with or without `finished_recving`) fails; one named only in
        `finished_recving` is runnable unless some of its blocks were reported invalid, in this report or an
        earlier one (then it fails: its KV is partly missing).
        """
        if kv is None:
            return SchedulerUpdate()
        invalid = frozenset(kv.invalid_block_ids)
        if invalid:
            for req_id, held in self._receiving.items():
                if not invalid.isdisjoint(held):
                    self._tainted.add(req_id)

        sends_finished: dict[str, BlockIds] = {}
        unknown_sending: set[str] = set()
        for req_id in kv.finished_sending or ():
            freed: BlockIds | None = self._sending.pop(req_id, None)
            if freed is None:
                unknown_sending.add(req_id)
            else:
                sends_finished[req_id] = freed

        failed_ids = set(kv.failed_recving or ())
        recvs_finished: dict[str, BlockIds] = {}
        recvs_failed: dict[str, BlockIds] = {}
        unknown_recving: set[str] = set()
        for req_id in set(kv.finished_recving or ()) | failed_ids:
            got: BlockIds | None = self._receiving.pop(req_id, None)
            if got is None:
                unknown_recving.add(req_id)
            elif req_id in failed_ids or req_id in self._tainted:
                recvs_failed[req_id] = got
            else:
                recvs_finished[req_id] = got
            self._tainted.discard(req_id)

        recompute = set(invalid)
        for blocks in recvs_failed.values():
            recompute.update(blocks)
        return SchedulerUpdate(
            sends_finished=sends_finished,
            recvs_finished=recvs_finished,
            recvs_failed=recvs_failed,
            recompute_block_ids=frozenset(recompute),
            unknown_sending=frozenset(unknown_sending),
            unknown_recving=frozenset(unknown_recving),
        )

    @staticmethod
    def _track(table: dict[str, BlockIds], what: str, req_id: str, blocks: BlockIds) -> None:
        held = table.get(req_id)
        if held is None:
            table[req_id] = blocks
        elif held != blocks:
            raise ValueError(
                f"request {req_id!r} is already tracked as a {what} with blocks {list(held)[:8]},"
                f" not {list(blocks)[:8]}"
            )


__all__ = ["BlockIds", "RequestTracker", "SchedulerUpdate", "TrackerStatistics"]
