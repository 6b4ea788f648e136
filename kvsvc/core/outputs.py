"""What workers report to the engine core each step, and the aggregator that combines those reports.

Pure module: standard library only (no asyncio, torch, mooncake). Invariants: `EMPTY_MODEL_RUNNER_OUTPUT`
is never mutated (its class is frozen, its containers refuse writes); `KVOutputAggregator.aggregate` never
mutates its inputs, validates a call completely before it changes any state, and reports each id finished at
most once per direction (sending / recving) while the id is remembered (see `KVOutputAggregator`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final, NoReturn, TypeGuard, TypeVar

_T = TypeVar("_T")
_K = TypeVar("_K")
_V = TypeVar("_V")

# How many completed ids per direction the aggregator remembers to drop late repeats; about a day of a busy
# engine's requests would be far more, but repeats arrive within a few steps of completion, not hours later.
DEFAULT_COMPLETED_MEMORY: Final = 65_536


# Keys of a worker's `kv_connector_stats` beside its counters' deltas: one count per failed receive by cause
# (`LOAD_FAILED` + one of `kvsvc.core.messages.FAILURE_CAUSES`), and each landed receive's phases as a list of
# [total_s, handshake_s, queue_s, write_s, bytes] (`kvsvc.core.receiver.LoadTimes`).
LOAD_FAILED: Final = "load_failed_"
LOADS: Final = "loads"


@dataclass
class KVConnectorOutput:
    """One worker's KV-transfer report for one step (or the engine-wide aggregate of all workers' reports).

    `finished_sending`: ids whose KV this worker no longer needs to hold.
    `finished_recving`: ids whose KV landed (or, in the aggregate, whose receive ended, failed ones included).
    `failed_recving`: ids whose receive failed; a worker may list a failed id here only or in both sets, and
    the aggregate lists a failed id in both. `invalid_block_ids`: local blocks that must be recomputed.
    `kv_connector_stats`: opaque telemetry (in a dict, the aggregator sums numbers and concatenates lists).
    `expected_finished_count`: 0 means "no opinion"; a positive value tells the aggregator how many distinct
    workers must report each id first seen from now on.

    Raises:
        ValueError: `expected_finished_count` is negative.
    """

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    failed_recving: set[str] | None = None
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_stats: object | None = None
    expected_finished_count: int = 0

    def __post_init__(self) -> None:
        if self.expected_finished_count < 0:
            raise ValueError(f"expected_finished_count must be >= 0, got {self.expected_finished_count}")

    def is_empty(self) -> bool:
        """True when nothing here needs the engine core: no ids, blocks, stats or expectation change."""
        return not (
            self.finished_sending
            or self.finished_recving
            or self.failed_recving
            or self.invalid_block_ids
            or self.kv_connector_stats
            or self.expected_finished_count > 0
        )


def _refuse(self: object, *args: object, **kwargs: object) -> NoReturn:
    raise TypeError(f"{type(self).__name__} of EMPTY_MODEL_RUNNER_OUTPUT is shared and read-only; build your own")


class _ReadOnlyList(list[_T]):
    """A list that refuses writes: the containers of the shared empty output. Still `== []` and a `list`."""

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse


class _ReadOnlyDict(dict[_K, _V]):
    """A dict that refuses writes: the containers of the shared empty output. Still `== {}` and a `dict`."""

    pop = popitem = clear = update = setdefault = _refuse
    __setitem__ = __delitem__ = __ior__ = _refuse


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What one worker returns from a step: the requests it ran, their sampled tokens, and its KV report.

    Frozen: build a changed copy with `dataclasses.replace`, as the aggregator does, so that no output (above
    all the shared `EMPTY_MODEL_RUNNER_OUTPUT`) changes under a reader's feet.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    kv_connector_output: KVConnectorOutput | None = None
    # After the contract's three fields, so positional construction keeps the order docs/design.md gives.
    sampled_token_ids: list[list[int]] = field(default_factory=list)

    @staticmethod
    def with_kv_conn_output_only(kv_connector_output: KVConnectorOutput | None) -> ModelRunnerOutput:
        """The output of a worker that ran no requests this step (a non-last PP stage) but has a KV report.

        Returns `EMPTY_MODEL_RUNNER_OUTPUT` itself when the report is None or empty, else a new empty output
        that carries the report (the report object itself, not a copy). Raises nothing.
        """
        if kv_connector_output is None or kv_connector_output.is_empty():
            return EMPTY_MODEL_RUNNER_OUTPUT
        # Fresh containers: a copy must not share the singleton's read-only lists with its new owner.
        return ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=kv_connector_output)


EMPTY_MODEL_RUNNER_OUTPUT: Final = ModelRunnerOutput(
    req_ids=_ReadOnlyList(),
    req_id_to_index=_ReadOnlyDict(),
    sampled_token_ids=_ReadOnlyList(),
    kv_connector_output=None,
)


@dataclass(frozen=True)
class AggregatorStatistics:
    """A snapshot of a `KVOutputAggregator`'s tables (see `KVOutputAggregator.statistics`)."""

    expected_finished_count: int
    pending_sending: int
    pending_recving: int
    held_for_next_output: int
    remembered_completed: int
    late_reports_ignored: int


@dataclass
class _Pending:
    """An id some but not yet enough workers reported: who did, how many must, and whether any said failed."""

    expected: int
    workers: set[int] = field(default_factory=set)
    failed: bool = False


class _CompletionTable:
    """Counts the distinct workers that reported each id of one direction, and remembers completed ids.

    An id is finished when its `expected` distinct workers reported it. A report for an id among the last
    `memory` completed ones is ignored (and counted), so a worker reporting late or twice cannot resurrect it.
    """

    def __init__(self, memory: int) -> None:
        self.pending: dict[str, _Pending] = {}
        self._completed: OrderedDict[str, None] = OrderedDict()
        self._memory = memory
        self.late_reports = 0

    @property
    def remembered(self) -> int:
        return len(self._completed)

    def report(self, req_id: str, worker: int, failed: bool, expected: int) -> _Pending | None:
        """Record one worker's report; return the finished entry when this report completed the id."""
        if req_id in self._completed:
            self.late_reports += 1
            return None
        entry = self.pending.get(req_id)
        if entry is None:
            # The expectation is fixed when the id is first seen, so a later change never strands it.
            entry = self.pending[req_id] = _Pending(expected=expected)
        entry.workers.add(worker)
        entry.failed = entry.failed or failed
        if len(entry.workers) < entry.expected:
            return None
        del self.pending[req_id]
        self._completed[req_id] = None
        if len(self._completed) > self._memory:
            self._completed.popitem(last=False)
        return entry


def _is_stats_dict(stats: object) -> TypeGuard[dict[object, int | float | list[object]]]:
    # bool is an int subclass, but summing flags is meaningless: such stats are not "numbers" here.
    return isinstance(stats, dict) and all(
        isinstance(v, list) or (isinstance(v, int | float) and not isinstance(v, bool)) for v in stats.values()
    )


def _merge_stats(all_stats: Sequence[object], own_stats: object | None) -> object | None:
    """Merge dicts of numbers and lists key by key (numbers summed, lists, such as per-request samples,
    concatenated); anything else, or a key that is a number in one and a list in another, keeps the output rank's
    stats untouched."""
    if not all_stats:
        return None
    dicts = [s for s in all_stats if _is_stats_dict(s)]
    if len(dicts) != len(all_stats):
        return own_stats
    merged: dict[object, int | float | list[object]] = {}
    for stats in dicts:
        for key, value in stats.items():
            known = merged.get(key)
            if known is None:
                merged[key] = list(value) if isinstance(value, list) else value
            elif isinstance(known, list) and isinstance(value, list):
                known.extend(value)
            elif not isinstance(known, list) and not isinstance(value, list):
                merged[key] = known + value
            else:
                return own_stats
    return merged


class KVOutputAggregator:
    """Combines the per-worker `ModelRunnerOutput`s of each step into the one the engine core consumes.

    Worker identity is the index in `outputs`. An id is finished once `expected` distinct workers reported it
    (finished or failed; a repeat by the same worker counts once); counts persist across calls, and each id's
    expectation is the one current when it was first seen. A finished recv id is listed in `finished_recving`,
    and also in `failed_recving` when any worker reported it failed, even if that worker said finished before.
    Sending and recving are counted separately, so one id may do both.

    After an id finished, the aggregator remembers it (the last `completed_memory` ids per direction) and
    ignores further reports of it, a late "failed" included: they are counted in
    `statistics().late_reports_ignored` and the id is never reported again. An id reported after it left that
    memory starts a new count, so ids must be unique per direction.

    When `outputs[output_rank]` is None, `aggregate` returns None but still counts the other workers' reports
    (they were drained from the workers and would otherwise be lost); ids, blocks and stats completed in such
    a call are held and delivered with the next output that is returned.
    """

    def __init__(self, expected_finished_count: int, *, completed_memory: int = DEFAULT_COMPLETED_MEMORY) -> None:
        """Raises:
        ValueError: `expected_finished_count` < 1 or `completed_memory` < 0.
        """
        if expected_finished_count < 1:
            raise ValueError(f"expected_finished_count must be >= 1, got {expected_finished_count}")
        if completed_memory < 0:
            raise ValueError(f"completed_memory must be >= 0, got {completed_memory}")
        self._expected = expected_finished_count
        self._sending = _CompletionTable(completed_memory)
        self._recving = _CompletionTable(completed_memory)
        # What this call (and earlier calls that returned None) completed, for the next output returned.
        self._held_sending: set[str] = set()
        self._held_recving: set[str] = set()
        self._held_failed: set[str] = set()
        self._held_blocks: set[int] = set()
        self._held_stats: list[object] = []

    @property
    def expected_finished_count(self) -> int:
        """How many distinct workers must report an id first seen from now on."""
        return self._expected

    def statistics(self) -> AggregatorStatistics:
        """Pending counts and memory use, for metrics and admin endpoints.

        `pending_sending` / `pending_recving`: ids some, but not yet enough, workers reported.
        `held_for_next_output`: finished ids waiting for a call whose output rank is not None.
        `remembered_completed`: completed ids kept to drop late repeats (both directions; bounded).
        `late_reports_ignored`: reports of already completed ids dropped so far (cumulative).
        """
        return AggregatorStatistics(
            expected_finished_count=self._expected,
            pending_sending=len(self._sending.pending),
            pending_recving=len(self._recving.pending),
            held_for_next_output=len(self._held_sending) + len(self._held_recving),
            remembered_completed=self._sending.remembered + self._recving.remembered,
            late_reports_ignored=self._sending.late_reports + self._recving.late_reports,
        )

    def aggregate(self, outputs: Sequence[ModelRunnerOutput | None], output_rank: int = 0) -> ModelRunnerOutput | None:
        """Count this step's reports of every worker; return `outputs[output_rank]` carrying the aggregate.

        The returned output is a copy (inputs are never mutated) whose `kv_connector_output` lists the ids
        that finished in this call (None for an empty set), the union of all `invalid_block_ids`, the merged
        stats (summed when every worker's stats are dicts of numbers, else the output rank's own), and the
        current `expected_finished_count`. A positive `expected_finished_count` in worker i's report applies
        to ids first seen in worker i's report and after it (workers are read in index order).

        Returns None when `outputs[output_rank]` is None (the other workers' reports are still counted).

        Raises:
            ValueError: `outputs` is empty; `output_rank` is not an index of it; an output other than the
                output rank's is None while the output rank's is not (the index is named); a report's
                `expected_finished_count` is negative; or an expectation exceeds the number of workers, so
                no id could ever finish. Nothing is counted when it raises.
        """
        self._validate(outputs, output_rank)
        for worker, output in enumerate(outputs):
            kv = output.kv_connector_output if output is not None else None
            if kv is not None:
                self._count(worker, kv)

        own = outputs[output_rank]
        if own is None:
            return None
        own_kv = own.kv_connector_output
        aggregate = KVConnectorOutput(
            finished_sending=self._held_sending or None,
            finished_recving=self._held_recving or None,
            failed_recving=self._held_failed or None,
            invalid_block_ids=self._held_blocks,
            kv_connector_stats=_merge_stats(self._held_stats, own_kv.kv_connector_stats if own_kv else None),
            expected_finished_count=self._expected,
        )
        # New containers, not clear(): the aggregate above now owns the old ones.
        self._held_sending, self._held_recving, self._held_failed = set(), set(), set()
        self._held_blocks, self._held_stats = set(), []
        return replace(own, kv_connector_output=aggregate)

    def _validate(self, outputs: Sequence[ModelRunnerOutput | None], output_rank: int) -> None:
        if not outputs:
            raise ValueError("aggregate() needs one output per worker, got none")
        if not 0 <= output_rank < len(outputs):
            raise ValueError(f"output_rank {output_rank} is not a worker index of the {len(outputs)} outputs")
        if outputs[output_rank] is not None:
            missing = [i for i, output in enumerate(outputs) if output is None]
            if missing:
                raise ValueError(
                    f"worker output(s) at index {missing} are None while output rank {output_rank}'s is not;"
                    " every worker must return an output each step"
                )
        expectations = [self._expected]
        for i, output in enumerate(outputs):
            kv = output.kv_connector_output if output is not None else None
            if kv is None:
                continue
            if kv.expected_finished_count < 0:
                raise ValueError(f"worker {i} reports expected_finished_count {kv.expected_finished_count} < 0")
            if kv.expected_finished_count > 0:
                expectations.append(kv.expected_finished_count)
        if max(expectations) > len(outputs):
            raise ValueError(
                f"expected_finished_count {max(expectations)} exceeds the {len(outputs)} workers reporting;"
                " no id could ever finish"
            )

    def _count(self, worker: int, kv: KVConnectorOutput) -> None:
        if kv.expected_finished_count > 0:
            self._expected = kv.expected_finished_count
        for req_id in kv.finished_sending or ():
            if self._sending.report(req_id, worker, False, self._expected) is not None:
                self._held_sending.add(req_id)
        failed = kv.failed_recving or set()
        for req_id in set(kv.finished_recving or ()) | failed:
            entry = self._recving.report(req_id, worker, req_id in failed, self._expected)
            if entry is not None:
                self._held_recving.add(req_id)
                if entry.failed:
                    self._held_failed.add(req_id)
        self._held_blocks |= kv.invalid_block_ids
        if kv.kv_connector_stats is not None:
            self._held_stats.append(kv.kv_connector_stats)


__all__ = [
    "EMPTY_MODEL_RUNNER_OUTPUT",
    "AggregatorStatistics",
    "KVConnectorOutput",
    "KVOutputAggregator",
    "ModelRunnerOutput",
]
