"""Specification of kvsvc.core.outputs: the per-worker KV report, the model runner output and its empty singleton,
and the aggregator that combines all workers' reports (docs/design.md, "Public API")."""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.core.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    KVConnectorOutput,
    KVOutputAggregator,
    ModelRunnerOutput,
)


def out(kv: KVConnectorOutput | None = None, req_ids: list[str] | None = None) -> ModelRunnerOutput:
    ids = req_ids or []
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, kv_connector_output=kv)


def kv(
    sending: set[str] | None = None,
    recving: set[str] | None = None,
    failed: set[str] | None = None,
    blocks: set[int] | None = None,
    stats: object | None = None,
    expected: int = 0,
) -> KVConnectorOutput:
    return KVConnectorOutput(
        finished_sending=sending,
        finished_recving=recving,
        failed_recving=failed,
        invalid_block_ids=blocks or set(),
        kv_connector_stats=stats,
        expected_finished_count=expected,
    )


def agg_kv(result: ModelRunnerOutput | None) -> KVConnectorOutput:
    assert result is not None
    assert result.kv_connector_output is not None
    return result.kv_connector_output


# --- KVConnectorOutput ---------------------------------------------------------------------------------------


def test_kv_connector_output_defaults_carry_nothing() -> None:
    report = KVConnectorOutput()
    assert report.finished_sending is None
    assert report.finished_recving is None
    assert report.failed_recving is None
    assert report.invalid_block_ids == set()
    assert report.kv_connector_stats is None
    assert report.expected_finished_count == 0
    assert report.is_empty()


def test_kv_connector_output_default_block_sets_are_not_shared() -> None:
    first, second = KVConnectorOutput(), KVConnectorOutput()
    first.invalid_block_ids.add(7)
    assert second.invalid_block_ids == set()


def test_kv_connector_output_with_only_empty_sets_is_empty() -> None:
    report = KVConnectorOutput(finished_sending=set(), finished_recving=set(), failed_recving=set())
    assert report.is_empty()


@pytest.mark.parametrize(
    "field_values",
    [
        {"finished_sending": {"r"}},
        {"finished_recving": {"r"}},
        {"failed_recving": {"r"}},
        {"invalid_block_ids": {3}},
        {"kv_connector_stats": {"bytes": 1}},
        {"expected_finished_count": 1},
    ],
    ids=lambda values: next(iter(values)),
)
def test_kv_connector_output_is_not_empty_when_any_field_carries_something(field_values: dict[str, Any]) -> None:
    assert not KVConnectorOutput(**field_values).is_empty()


def test_kv_connector_output_rejects_negative_expected_finished_count() -> None:
    with pytest.raises(ValueError, match="-1"):
        KVConnectorOutput(expected_finished_count=-1)


# --- ModelRunnerOutput and the empty singleton ----------------------------------------------------------------


def test_empty_model_runner_output_has_no_requests_and_no_kv_report() -> None:
    assert EMPTY_MODEL_RUNNER_OUTPUT.req_ids == []
    assert EMPTY_MODEL_RUNNER_OUTPUT.req_id_to_index == {}
    assert EMPTY_MODEL_RUNNER_OUTPUT.sampled_token_ids == []
    assert EMPTY_MODEL_RUNNER_OUTPUT.kv_connector_output is None


@pytest.mark.parametrize(
    "report", [None, KVConnectorOutput(), KVConnectorOutput(finished_sending=set(), invalid_block_ids=set())]
)
def test_with_kv_conn_output_only_returns_the_singleton_itself_for_none_or_empty(
    report: KVConnectorOutput | None,
) -> None:
    assert ModelRunnerOutput.with_kv_conn_output_only(report) is EMPTY_MODEL_RUNNER_OUTPUT


@pytest.mark.parametrize(
    "report",
    [KVConnectorOutput(finished_sending={"r"}), KVConnectorOutput(expected_finished_count=2)],
    ids=["ids", "expected_count_only"],
)
def test_with_kv_conn_output_only_returns_an_empty_copy_carrying_a_non_empty_report(
    report: KVConnectorOutput,
) -> None:
    result = ModelRunnerOutput.with_kv_conn_output_only(report)
    assert result is not EMPTY_MODEL_RUNNER_OUTPUT
    assert result.kv_connector_output is report
    assert result.req_ids == [] and result.req_id_to_index == {} and result.sampled_token_ids == []
    assert EMPTY_MODEL_RUNNER_OUTPUT.kv_connector_output is None


def test_copies_of_the_empty_output_own_fresh_mutable_containers() -> None:
    first = ModelRunnerOutput.with_kv_conn_output_only(kv(sending={"a"}))
    second = ModelRunnerOutput.with_kv_conn_output_only(kv(sending={"b"}))
    first.req_ids.append("x")
    first.req_id_to_index["x"] = 0
    assert second.req_ids == [] and second.req_id_to_index == {}
    assert EMPTY_MODEL_RUNNER_OUTPUT.req_ids == [] and EMPTY_MODEL_RUNNER_OUTPUT.req_id_to_index == {}


def test_model_runner_output_attributes_cannot_be_reassigned() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        EMPTY_MODEL_RUNNER_OUTPUT.kv_connector_output = KVConnectorOutput(finished_sending={"r"})  # type: ignore[misc]
    assert EMPTY_MODEL_RUNNER_OUTPUT.kv_connector_output is None


_LIST_MUTATIONS: list[Callable[[Any], object]] = [
    lambda c: c.append("x"),
    lambda c: c.extend(["x"]),
    lambda c: c.insert(0, "x"),
    lambda c: c.__setitem__(slice(0, 0), ["x"]),
    lambda c: c.__iadd__(["x"]),
    lambda c: c.__imul__(2),
    lambda c: c.clear(),
]
_DICT_MUTATIONS: list[Callable[[Any], object]] = [
    lambda c: c.__setitem__("x", 0),
    lambda c: c.update({"x": 0}),
    lambda c: c.setdefault("x", 0),
    lambda c: c.__ior__({"x": 0}),
    lambda c: c.clear(),
]


@pytest.mark.parametrize("mutate", _LIST_MUTATIONS)
@pytest.mark.parametrize("name", ["req_ids", "sampled_token_ids"])
def test_empty_singleton_lists_refuse_mutation(name: str, mutate: Callable[[Any], object]) -> None:
    container = getattr(EMPTY_MODEL_RUNNER_OUTPUT, name)
    with pytest.raises(TypeError, match="read-only"):
        mutate(container)
    assert container == [] and isinstance(container, list)


@pytest.mark.parametrize("mutate", _DICT_MUTATIONS)
def test_empty_singleton_index_refuses_mutation(mutate: Callable[[Any], object]) -> None:
    with pytest.raises(TypeError, match="read-only"):
        mutate(EMPTY_MODEL_RUNNER_OUTPUT.req_id_to_index)
    assert EMPTY_MODEL_RUNNER_OUTPUT.req_id_to_index == {}


# --- KVOutputAggregator: arguments and Nones ---------------------------------------------------------------------


@pytest.mark.parametrize("expected", [0, -1])
def test_aggregator_rejects_an_expected_count_below_one(expected: int) -> None:
    with pytest.raises(ValueError, match="expected_finished_count"):
        KVOutputAggregator(expected)


def test_aggregator_rejects_negative_completed_memory() -> None:
    with pytest.raises(ValueError, match="completed_memory"):
        KVOutputAggregator(1, completed_memory=-1)


def test_aggregate_returns_none_when_the_output_rank_output_is_none() -> None:
    aggregator = KVOutputAggregator(2)
    assert aggregator.aggregate([None, out()]) is None
    assert aggregator.aggregate([out(), None], output_rank=1) is None


def test_aggregate_returns_none_when_every_output_is_none() -> None:
    assert KVOutputAggregator(3).aggregate([None, None, None], output_rank=1) is None


@pytest.mark.parametrize(("outputs_none", "named"), [((1,), "[1]"), ((2,), "[2]"), ((1, 2), "[1, 2]")])
def test_aggregate_raises_value_error_naming_a_none_at_another_rank(outputs_none: tuple[int, ...], named: str) -> None:
    outputs = [None if i in outputs_none else out() for i in range(3)]
    with pytest.raises(ValueError, match=re.escape(f"index {named}")):
        KVOutputAggregator(3).aggregate(outputs)


@pytest.mark.parametrize("output_rank", [-1, 2, 5])
def test_aggregate_rejects_an_output_rank_that_is_not_a_worker_index(output_rank: int) -> None:
    with pytest.raises(ValueError, match="output_rank"):
        KVOutputAggregator(2).aggregate([out(), out()], output_rank=output_rank)


def test_aggregate_rejects_an_empty_list_of_outputs() -> None:
    with pytest.raises(ValueError, match="none"):
        KVOutputAggregator(1).aggregate([])


def test_aggregate_rejects_an_expected_count_larger_than_the_worker_count() -> None:
    with pytest.raises(ValueError, match="exceeds the 2 workers"):
        KVOutputAggregator(3).aggregate([out(), out()])
    with pytest.raises(ValueError, match="expected_finished_count 3 exceeds"):
        KVOutputAggregator(2).aggregate([out(kv(expected=3)), out()])


def test_aggregate_rejects_a_report_whose_expected_count_was_set_negative_after_construction() -> None:
    report = kv(sending={"a"})
    report.expected_finished_count = -2
    with pytest.raises(ValueError, match=r"worker 1 .* -2"):
        KVOutputAggregator(2).aggregate([out(), out(report)])


def test_a_call_that_raises_counts_nothing() -> None:
    aggregator = KVOutputAggregator(2)
    with pytest.raises(ValueError):
        aggregator.aggregate([out(kv(sending={"a"}, blocks={1})), None])
    assert aggregator.statistics().pending_sending == 0
    # Worker 0's report in the refused call was not counted: worker 1 alone does not finish "a".
    result = agg_kv(aggregator.aggregate([out(), out(kv(sending={"a"}))]))
    assert result.finished_sending is None
    assert result.invalid_block_ids == set()


# --- KVOutputAggregator: counting ----------------------------------------------------------------------------------


def test_a_send_finishes_only_when_every_expected_worker_reported_it() -> None:
    aggregator = KVOutputAggregator(3)
    first = agg_kv(aggregator.aggregate([out(kv(sending={"a"})), out(kv(sending={"a"})), out()]))
    assert first.finished_sending is None
    second = agg_kv(aggregator.aggregate([out(), out(), out(kv(sending={"a"}))]))
    assert second.finished_sending == {"a"}


def test_a_recv_finishes_only_when_every_expected_worker_reported_it() -> None:
    aggregator = KVOutputAggregator(2)
    assert agg_kv(aggregator.aggregate([out(kv(recving={"a"})), out()])).finished_recving is None
    assert agg_kv(aggregator.aggregate([out(), out(kv(recving={"a"}))])).finished_recving == {"a"}


def test_a_worker_repeating_an_id_counts_once() -> None:
    aggregator = KVOutputAggregator(2)
    for _ in range(3):
        result = agg_kv(aggregator.aggregate([out(kv(sending={"a"}, recving={"b"})), out()]))
        assert result.finished_sending is None and result.finished_recving is None
    assert aggregator.statistics().pending_sending == 1
    assert aggregator.statistics().pending_recving == 1


def test_counts_persist_across_calls_and_unfinished_ids_stay_pending() -> None:
    aggregator = KVOutputAggregator(4)
    for worker in range(3):
        outputs = [out(kv(sending={"a"})) if i == worker else out() for i in range(4)]
        assert agg_kv(aggregator.aggregate(outputs)).finished_sending is None
    assert aggregator.statistics().pending_sending == 1
    last = [out(), out(), out(), out(kv(sending={"a"}))]
    assert agg_kv(aggregator.aggregate(last)).finished_sending == {"a"}
    assert aggregator.statistics().pending_sending == 0


def test_a_recv_reported_failed_by_any_worker_is_listed_finished_and_failed() -> None:
    aggregator = KVOutputAggregator(3)
    result = agg_kv(
        aggregator.aggregate(
            [out(kv(recving={"a", "b"})), out(kv(recving={"b"}, failed={"a"})), out(kv(recving={"a", "b"}))]
        )
    )
    assert result.finished_recving == {"a", "b"}
    assert result.failed_recving == {"a"}


def test_a_failed_only_report_counts_as_that_workers_report() -> None:
    aggregator = KVOutputAggregator(2)
    result = agg_kv(aggregator.aggregate([out(kv(failed={"a"})), out(kv(failed={"a"}))]))
    assert result.finished_recving == {"a"}
    assert result.failed_recving == {"a"}


def test_a_recv_finished_without_failures_has_no_failed_set() -> None:
    result = agg_kv(KVOutputAggregator(1).aggregate([out(kv(recving={"a"}))]))
    assert result.finished_recving == {"a"}
    assert result.failed_recving is None


def test_a_worker_reporting_finished_then_failed_counts_once_and_the_failure_sticks() -> None:
    aggregator = KVOutputAggregator(2)
    assert agg_kv(aggregator.aggregate([out(kv(recving={"a"})), out()])).finished_recving is None
    # Same worker again, now failed: still one worker, so nothing finishes yet.
    assert agg_kv(aggregator.aggregate([out(kv(failed={"a"})), out()])).finished_recving is None
    result = agg_kv(aggregator.aggregate([out(), out(kv(recving={"a"}))]))
    assert result.finished_recving == {"a"}
    assert result.failed_recving == {"a"}


def test_one_id_sending_and_recving_is_counted_separately_per_direction() -> None:
    aggregator = KVOutputAggregator(2)
    first = agg_kv(aggregator.aggregate([out(kv(sending={"a"})), out(kv(recving={"a"}))]))
    assert first.finished_sending is None and first.finished_recving is None
    second = agg_kv(aggregator.aggregate([out(kv(recving={"a"})), out(kv(sending={"a"}))]))
    assert second.finished_sending == {"a"}
    assert second.finished_recving == {"a"}


def test_a_late_repeat_after_completion_is_ignored_and_counted() -> None:
    aggregator = KVOutputAggregator(2)
    done = agg_kv(aggregator.aggregate([out(kv(sending={"a"}, recving={"b"})), out(kv(sending={"a"}, recving={"b"}))]))
    assert done.finished_sending == {"a"} and done.finished_recving == {"b"}
    for _ in range(2):
        again = agg_kv(
            aggregator.aggregate([out(kv(sending={"a"}, failed={"b"})), out(kv(sending={"a"}, failed={"b"}))])
        )
        assert again.finished_sending is None
        assert again.finished_recving is None and again.failed_recving is None
    stats = aggregator.statistics()
    assert stats.late_reports_ignored == 8
    assert stats.pending_sending == 0 and stats.pending_recving == 0


def test_an_id_forgotten_from_the_bounded_completed_memory_counts_afresh() -> None:
    aggregator = KVOutputAggregator(1, completed_memory=2)
    for req_id in ("a", "b", "c"):
        assert agg_kv(aggregator.aggregate([out(kv(sending={req_id}))])).finished_sending == {req_id}
    assert aggregator.statistics().remembered_completed == 2
    # "b" and "c" are remembered and ignored; "a" was evicted first, so it finishes again.
    assert agg_kv(aggregator.aggregate([out(kv(sending={"b", "c"}))])).finished_sending is None
    assert agg_kv(aggregator.aggregate([out(kv(sending={"a"}))])).finished_sending == {"a"}


def test_completed_memory_stays_bounded_per_direction() -> None:
    aggregator = KVOutputAggregator(1, completed_memory=10)
    for i in range(100):
        aggregator.aggregate([out(kv(sending={f"s{i}"}, recving={f"r{i}"}))])
    assert aggregator.statistics().remembered_completed == 20


def test_invalid_block_ids_are_the_union_over_workers() -> None:
    aggregator = KVOutputAggregator(3)
    result = agg_kv(aggregator.aggregate([out(kv(blocks={1, 2})), out(kv(blocks={2, 3})), out(kv(failed={"x"}))]))
    assert result.invalid_block_ids == {1, 2, 3}
    assert agg_kv(aggregator.aggregate([out(), out(), out()])).invalid_block_ids == set()


def test_an_aggregate_with_nothing_finished_has_none_sets_and_the_current_expected_count() -> None:
    result = agg_kv(KVOutputAggregator(2).aggregate([out(), out()]))
    assert result.finished_sending is None
    assert result.finished_recving is None
    assert result.failed_recving is None
    assert result.invalid_block_ids == set()
    assert result.kv_connector_stats is None
    assert result.expected_finished_count == 2


# --- KVOutputAggregator: expected_finished_count changes -----------------------------------------------------------


def test_a_new_expected_count_applies_to_ids_first_seen_in_and_after_that_report() -> None:
    aggregator = KVOutputAggregator(2)
    # "x" is first seen by worker 0, before worker 1 lowers the expectation: it still needs 2 workers.
    # "y" is first seen in worker 1's report that carries the new expectation: 1 worker is enough.
    result = agg_kv(aggregator.aggregate([out(kv(sending={"x"})), out(kv(sending={"y"}, expected=1))]))
    assert result.finished_sending == {"y"}
    assert result.expected_finished_count == 1
    assert aggregator.expected_finished_count == 1
    # The change persists: "z" needs one worker; "x" still waits for a second one.
    later = agg_kv(aggregator.aggregate([out(kv(sending={"z", "x"})), out()]))
    assert later.finished_sending == {"z"}
    final = agg_kv(aggregator.aggregate([out(), out(kv(sending={"x"}))]))
    assert final.finished_sending == {"x"}


def test_a_raised_expected_count_keeps_pending_ids_at_their_first_seen_expectation() -> None:
    aggregator = KVOutputAggregator(2)
    assert agg_kv(aggregator.aggregate([out(kv(recving={"a"})), out(), out()])).finished_recving is None
    agg_kv(aggregator.aggregate([out(kv(expected=3)), out(), out()]))
    # "a" was first seen when 2 were expected: the second worker finishes it. "b" now needs all 3.
    result = agg_kv(aggregator.aggregate([out(kv(recving={"b"})), out(kv(recving={"a", "b"})), out()]))
    assert result.finished_recving == {"a"}
    assert result.expected_finished_count == 3


def test_late_reports_after_a_lowered_expectation_are_ignored() -> None:
    aggregator = KVOutputAggregator(3)
    first = agg_kv(aggregator.aggregate([out(kv(sending={"a"}, expected=1)), out(), out()]))
    assert first.finished_sending == {"a"}
    second = agg_kv(aggregator.aggregate([out(), out(kv(sending={"a"})), out(kv(sending={"a"}))]))
    assert second.finished_sending is None
    assert aggregator.statistics().late_reports_ignored == 2


def test_a_zero_expected_count_in_a_report_changes_nothing() -> None:
    aggregator = KVOutputAggregator(2)
    result = agg_kv(aggregator.aggregate([out(kv(sending={"a"}, expected=0)), out()]))
    assert result.finished_sending is None
    assert result.expected_finished_count == 2


# --- KVOutputAggregator: the returned output ------------------------------------------------------------------------


def test_the_result_is_the_output_rank_output_with_the_aggregate_and_inputs_are_untouched() -> None:
    own_report = kv(sending={"a"}, blocks={5}, stats={"bytes": 1})
    outputs = [
        out(kv(sending={"a"}, blocks={4}, stats={"bytes": 2}), req_ids=["r0"]),
        out(own_report, req_ids=["r1", "r2"]),
    ]
    before = copy.deepcopy(outputs)
    result = KVOutputAggregator(2).aggregate(outputs, output_rank=1)
    assert result is not None and result is not outputs[1]
    assert result.req_ids == ["r1", "r2"]
    assert result.req_id_to_index == {"r1": 0, "r2": 1}
    assert result.kv_connector_output is not own_report
    assert outputs == before
    assert outputs[1].kv_connector_output is own_report
    assert agg_kv(result).finished_sending == {"a"}
    assert agg_kv(result).invalid_block_ids == {4, 5}


def test_aggregating_with_kv_conn_output_only_outputs_never_mutates_the_singleton() -> None:
    aggregator = KVOutputAggregator(2)
    outputs = [ModelRunnerOutput.with_kv_conn_output_only(None), out(kv(sending={"a"}), req_ids=["a"])]
    assert outputs[0] is EMPTY_MODEL_RUNNER_OUTPUT
    result = aggregator.aggregate(outputs, output_rank=0)
    assert result is not EMPTY_MODEL_RUNNER_OUTPUT
    assert agg_kv(result).expected_finished_count == 2
    assert EMPTY_MODEL_RUNNER_OUTPUT.kv_connector_output is None


def test_reports_of_a_pp_pipeline_finish_through_the_last_stage_output() -> None:
    # pp=2, tp=1: stage 0 reports through with_kv_conn_output_only, stage 1 (output rank) runs the requests.
    aggregator = KVOutputAggregator(2)
    stage0 = ModelRunnerOutput.with_kv_conn_output_only(kv(sending={"a"}))
    stage1 = out(kv(sending={"a"}), req_ids=["a"])
    result = aggregator.aggregate([stage0, stage1], output_rank=1)
    assert result is not None and result.req_ids == ["a"]
    assert agg_kv(result).finished_sending == {"a"}


# --- KVOutputAggregator: stats --------------------------------------------------------------------------------------


def test_dict_stats_of_numbers_are_summed_key_by_key() -> None:
    outputs = [out(kv(stats={"bytes": 10, "ms": 1.5})), out(), out(kv(stats={"bytes": 5, "descriptors": 2}))]
    result = agg_kv(KVOutputAggregator(3).aggregate(outputs))
    assert result.kv_connector_stats == {"bytes": 15, "ms": 1.5, "descriptors": 2}


def test_dict_stats_lists_are_concatenated_and_a_key_both_number_and_list_keeps_the_output_rank_stats() -> None:
    outputs = [out(kv(stats={"loads": [[0.1]], "bytes": 1})), out(kv(stats={"loads": [[0.2], [0.3]]}))]
    result = agg_kv(KVOutputAggregator(2).aggregate(outputs))
    assert result.kv_connector_stats == {"loads": [[0.1], [0.2], [0.3]], "bytes": 1}
    assert outputs[0].kv_connector_output is not None
    assert outputs[0].kv_connector_output.kv_connector_stats == {"loads": [[0.1]], "bytes": 1}  # not extended
    own = {"loads": 2}
    mixed = [out(kv(stats={"loads": [[0.1]]})), out(kv(stats=own))]
    assert agg_kv(KVOutputAggregator(2).aggregate(mixed, output_rank=1)).kv_connector_stats == own


@pytest.mark.parametrize(
    "other_stats",
    [["not", "a", "dict"], {"nested": {"bytes": 1}}, {"flag": True}, "text"],
    ids=["list", "nested", "bool", "str"],
)
def test_stats_that_are_not_all_dicts_of_numbers_keep_the_output_rank_stats(other_stats: object) -> None:
    own = {"bytes": 1}
    result = agg_kv(KVOutputAggregator(2).aggregate([out(kv(stats=other_stats)), out(kv(stats=own))], output_rank=1))
    assert result.kv_connector_stats == own


def test_non_mergeable_stats_at_a_rank_without_its_own_stats_give_none() -> None:
    result = agg_kv(KVOutputAggregator(2).aggregate([out(kv(stats=object())), out()], output_rank=1))
    assert result.kv_connector_stats is None


# --- KVOutputAggregator: output rank None and statistics ------------------------------------------------------------


def test_reports_counted_while_the_output_rank_is_none_are_delivered_with_the_next_output() -> None:
    aggregator = KVOutputAggregator(2)
    aggregator.aggregate([out(kv(sending={"a"})), out()])
    assert aggregator.aggregate([None, out(kv(sending={"a"}, blocks={9}, stats={"bytes": 3}))]) is None
    assert aggregator.statistics().held_for_next_output == 1
    result = agg_kv(aggregator.aggregate([out(kv(stats={"bytes": 1})), out()]))
    assert result.finished_sending == {"a"}
    assert result.invalid_block_ids == {9}
    assert result.kv_connector_stats == {"bytes": 4}
    assert aggregator.statistics().held_for_next_output == 0
    assert agg_kv(aggregator.aggregate([out(), out()])).finished_sending is None


def test_statistics_report_pending_ids_per_direction() -> None:
    aggregator = KVOutputAggregator(2)
    aggregator.aggregate([out(kv(sending={"a", "b"}, recving={"c"}, failed={"d"})), out(kv(sending={"b"}))])
    stats = aggregator.statistics()
    assert stats.pending_sending == 1
    assert stats.pending_recving == 2
    assert stats.remembered_completed == 1
    assert stats.expected_finished_count == 2
    assert stats.late_reports_ignored == 0


# --- Property: the aggregator against a sequential model ------------------------------------------------------------

_IDS = ["a", "b", "c", "d", "e"]


@st.composite
def _report(draw: st.DrawFn, n: int, vary_expected: bool) -> KVConnectorOutput:
    ids = st.sets(st.sampled_from(_IDS), max_size=3)
    expected = draw(st.sampled_from([0, 0, 0, *range(1, n + 1)])) if vary_expected else 0
    return KVConnectorOutput(
        finished_sending=draw(st.none() | ids),
        finished_recving=draw(st.none() | ids),
        failed_recving=draw(st.none() | st.sets(st.sampled_from(_IDS), max_size=2)),
        invalid_block_ids=draw(st.sets(st.integers(0, 30), max_size=3)),
        expected_finished_count=expected,
    )


@st.composite
def _scenario(draw: st.DrawFn, vary_expected: bool) -> tuple[int, int, list[list[KVConnectorOutput | None]]]:
    """Worker count, output rank, and steps; in a step a None is that worker returning no output."""
    n = draw(st.integers(1, 4))
    output_rank = draw(st.integers(0, n - 1))
    steps: list[list[KVConnectorOutput | None]] = []
    for _ in range(draw(st.integers(1, 10))):
        step: list[KVConnectorOutput | None] = [draw(_report(n, vary_expected)) for _ in range(n)]
        kind = draw(st.sampled_from(["all", "all", "all", "none_elsewhere", "none_at_rank"]))
        if kind == "none_elsewhere" and n > 1:
            step[draw(st.sampled_from([i for i in range(n) if i != output_rank]))] = None
        elif kind == "none_at_rank":
            step[output_rank] = None
        steps.append(step)
    return n, output_rank, steps


class _Model:
    """The contract read literally, one report event at a time in (step, worker) order."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.first_expectation: dict[tuple[str, str], int] = {}
        self.reporters: dict[tuple[str, str], set[int]] = {}
        self.failed: set[str] = set()
        self.done: set[tuple[str, str]] = set()
        self.undelivered: dict[str, set[Any]] = {"send": set(), "recv": set(), "failed": set(), "blocks": set()}

    def step(self, reports: list[KVConnectorOutput | None]) -> None:
        for worker, report in enumerate(reports):
            if report is None:
                continue
            if report.expected_finished_count:
                self.expected = report.expected_finished_count
            failed = report.failed_recving or set()
            events = [("send", r, False) for r in report.finished_sending or ()]
            events += [("recv", r, r in failed) for r in (report.finished_recving or set()) | failed]
            for direction, req_id, is_failure in events:
                key = (direction, req_id)
                if key in self.done:
                    continue
                self.first_expectation.setdefault(key, self.expected)
                self.reporters.setdefault(key, set()).add(worker)
                if is_failure:
                    self.failed.add(req_id)
                if len(self.reporters[key]) == self.first_expectation[key]:
                    self.done.add(key)
                    self.undelivered[direction].add(req_id)
                    if direction == "recv" and req_id in self.failed:
                        self.undelivered["failed"].add(req_id)
            self.undelivered["blocks"] |= report.invalid_block_ids

    def deliver(self) -> dict[str, set[Any]]:
        delivered = self.undelivered
        self.undelivered = {"send": set(), "recv": set(), "failed": set(), "blocks": set()}
        return delivered

    def pending(self, direction: str) -> int:
        return sum(1 for key in self.reporters if key[0] == direction and key not in self.done)


def _check_against_model(n: int, output_rank: int, steps: list[list[KVConnectorOutput | None]]) -> None:
    aggregator = KVOutputAggregator(n)
    model = _Model(n)
    emitted: dict[str, list[str]] = {"send": [], "recv": []}
    flush: list[KVConnectorOutput | None] = [KVConnectorOutput() for _ in range(n)]
    for step in [*steps, flush]:  # the final clean step delivers ids held while the output rank was None
        outputs = [None if report is None else out(report) for report in step]
        if outputs[output_rank] is not None and any(o is None for o in outputs):
            with pytest.raises(ValueError, match="index"):
                aggregator.aggregate(outputs, output_rank)
            continue  # the model skips the refused step too: nothing of it may have been counted
        result = aggregator.aggregate(outputs, output_rank)
        model.step(step)
        if result is None:
            assert outputs[output_rank] is None
            continue
        expected = model.deliver()
        report = agg_kv(result)
        assert (report.finished_sending or set()) == expected["send"]
        assert (report.finished_recving or set()) == expected["recv"]
        assert (report.failed_recving or set()) == expected["failed"]
        assert report.invalid_block_ids == expected["blocks"]
        assert report.expected_finished_count == model.expected
        emitted["send"] += sorted(report.finished_sending or ())
        emitted["recv"] += sorted(report.finished_recving or ())
        stats = aggregator.statistics()
        assert stats.pending_sending == model.pending("send")
        assert stats.pending_recving == model.pending("recv")
    for direction in ("send", "recv"):
        assert len(emitted[direction]) == len(set(emitted[direction])), "an id was reported finished twice"


@settings(max_examples=300, deadline=None)
@given(_scenario(vary_expected=False))
def test_property_each_id_finishes_exactly_once_when_its_nth_distinct_worker_reports(
    scenario: tuple[int, int, list[list[KVConnectorOutput | None]]],
) -> None:
    _check_against_model(*scenario)


@settings(max_examples=300, deadline=None)
@given(_scenario(vary_expected=True))
def test_property_expected_count_changes_apply_to_ids_first_seen_after_them(
    scenario: tuple[int, int, list[list[KVConnectorOutput | None]]],
) -> None:
    _check_against_model(*scenario)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5), data=st.data())
def test_property_any_arrival_order_of_distinct_workers_finishes_an_id_on_the_last_one(
    n: int, data: st.DataObject
) -> None:
    order = data.draw(st.permutations(range(n)))
    repeats = data.draw(st.lists(st.sampled_from(order[:-1]), max_size=4)) if n > 1 else []
    aggregator = KVOutputAggregator(n)
    arrivals = [*order[:-1], *repeats, order[-1]]
    for position, worker in enumerate(arrivals):
        outputs = [out(kv(recving={"r"})) if i == worker else out() for i in range(n)]
        finished = agg_kv(aggregator.aggregate(outputs)).finished_recving
        assert (finished == {"r"}) == (position == len(arrivals) - 1)


def test_model_runner_output_keeps_the_contracts_positional_order() -> None:
    kv = KVConnectorOutput(finished_sending={"r"})
    output = ModelRunnerOutput(["r"], {"r": 0}, kv)
    assert output.kv_connector_output is kv and output.sampled_token_ids == []
