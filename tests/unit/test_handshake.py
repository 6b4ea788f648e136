"""Specification of kvsvc.core.connector.merge_handshake_metadata: the engine core's merge of the workers'
`{(pp_rank, tp_rank): metadata}` dicts (docs/design.md, docs/protocol.md §1)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsvc.core.connector import merge_handshake_metadata
from kvsvc.core.messages import WorkerMetadata


def meta(pp_rank: int, tp_rank: int, **overrides: object) -> WorkerMetadata:
    fields: dict[str, object] = {
        "engine_id": "P",
        "incarnation": "i0",
        "pp_rank": pp_rank,
        "pp_size": 2,
        "tp_rank": tp_rank,
        "tp_size": 2,
        "start_layer": 0,
        "end_layer": 2,
        "num_kv_heads": 4,
        "head_size": 64,
        "dtype": "bfloat16",
        "block_size": 16,
        "num_blocks": 8,
        "layout": "HND",
        "is_mla": False,
        "base_addrs": [0x1000 * (pp_rank * 2 + tp_rank + 1), 0x2000 * (pp_rank * 2 + tp_rank + 1)],
    }
    fields.update(overrides)
    return WorkerMetadata(**fields)  # type: ignore[arg-type]


def test_merges_every_workers_entries_into_one_dict() -> None:
    workers = [{(pp, tp): meta(pp, tp)} for pp in range(2) for tp in range(2)]
    merged = merge_handshake_metadata(workers)
    assert merged == {(pp, tp): meta(pp, tp) for pp in range(2) for tp in range(2)}


def test_none_entries_are_skipped() -> None:
    merged = merge_handshake_metadata([None, {(0, 0): meta(0, 0)}, None, {(0, 1): meta(0, 1)}])
    assert merged == {(0, 0): meta(0, 0), (0, 1): meta(0, 1)}


@pytest.mark.parametrize("per_worker", [[], [None, None], [{}, None]], ids=["nothing", "all_none", "empty"])
def test_no_metadata_merges_to_an_empty_dict(per_worker: list[dict[tuple[int, int], WorkerMetadata] | None]) -> None:
    assert merge_handshake_metadata(per_worker) == {}


def test_one_worker_may_publish_several_keys() -> None:
    merged = merge_handshake_metadata([{(0, 0): meta(0, 0), (1, 0): meta(1, 0)}, {(0, 1): meta(0, 1)}])
    assert set(merged) == {(0, 0), (1, 0), (0, 1)}


def test_equal_metadata_claimed_twice_for_one_key_is_accepted() -> None:
    merged = merge_handshake_metadata([{(0, 0): meta(0, 0)}, {(0, 0): meta(0, 0)}, {(0, 0): copy.deepcopy(meta(0, 0))}])
    assert merged == {(0, 0): meta(0, 0)}


def test_different_metadata_for_one_key_is_a_value_error_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"\(1, 0\)") as caught:
        merge_handshake_metadata([{(0, 0): meta(0, 0)}, {(1, 0): meta(1, 0)}, {(1, 0): meta(1, 0, num_blocks=9)}])
    assert "entry 1" in str(caught.value) and "entry 2" in str(caught.value)


def test_a_conflict_message_stays_short_for_huge_metadata() -> None:
    big = meta(0, 0, base_addrs=list(range(10_000)))
    with pytest.raises(ValueError) as caught:
        merge_handshake_metadata([{(0, 0): big}, {(0, 0): meta(0, 0)}])
    assert len(str(caught.value)) < 1_000


def test_the_merge_is_ordered_by_key_and_does_not_mutate_inputs() -> None:
    workers = [{(1, 1): meta(1, 1)}, {(0, 1): meta(0, 1)}, {(1, 0): meta(1, 0), (0, 0): meta(0, 0)}]
    before = copy.deepcopy(workers)
    merged = merge_handshake_metadata(workers)
    assert list(merged) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert workers == before
    assert all(merged is not w for w in workers)


def test_accepts_any_iterable_and_any_metadata_type() -> None:
    merged = merge_handshake_metadata(iter([{(0, 0): "a"}, None, {(0, 1): "b"}]))
    assert merged == {(0, 0): "a", (0, 1): "b"}


_keys = st.tuples(st.integers(0, 2), st.integers(0, 3))


@given(st.lists(st.none() | st.dictionaries(_keys, st.integers(0, 2), max_size=4), max_size=6))
def test_property_merge_succeeds_exactly_when_no_key_has_two_values(
    per_worker: list[dict[tuple[int, int], int] | None],
) -> None:
    values: dict[tuple[int, int], set[int]] = {}
    for worker in per_worker:
        for key, value in (worker or {}).items():
            values.setdefault(key, set()).add(value)
    conflicts = {key for key, seen in values.items() if len(seen) > 1}
    if conflicts:
        with pytest.raises(ValueError, match="conflicting") as caught:
            merge_handshake_metadata(per_worker)
        assert any(str(key) in str(caught.value) for key in conflicts)
    else:
        assert merge_handshake_metadata(per_worker) == {key: seen.pop() for key, seen in values.items()}
