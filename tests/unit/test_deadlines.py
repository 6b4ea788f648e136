"""`kvsvc.core.jobs.Deadlines` against the pass over the whole table it replaces: for any sequence of deadlines
set, moved and dropped, the earliest live deadline and the keys due are the same as scanning the table."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.core.jobs import Deadlines

KEYS = st.sampled_from([f"t{i}" for i in range(12)])
TIMES = st.integers(min_value=0, max_value=50).map(float)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), KEYS, TIMES),  # a new entry, or its deadline moved either way
        st.tuples(st.just("drop"), KEYS, TIMES),  # the entry left the table (ended)
        st.tuples(st.just("due"), KEYS, TIMES),  # the clock reads this: what is due is handled and dropped
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_earliest_and_due_match_a_scan_of_the_table(ops: list[tuple[str, str, float]]) -> None:
    table: dict[str, float] = {}
    heap = Deadlines(table.get)
    for op, key, value in ops:
        if op == "set":
            table[key] = value
            heap.set(key, value)
        elif op == "drop":
            table.pop(key, None)
        else:
            want = sorted((d, k) for k, d in table.items() if d <= value)
            got = list(heap.due(value))
            assert sorted(got) == sorted(k for _, k in want)
            assert [table[k] for k in got] == sorted(table[k] for k in got), "earliest first"
            for k in got:
                del table[k]
        assert heap.earliest() == min(table.values(), default=None)


def test_stale_entries_do_not_pile_up() -> None:
    """A table where entries end long before their deadlines (transfers served in milliseconds, holds of a minute)
    keeps the heap near the live entries, not near every entry ever set."""
    table: dict[str, float] = {}
    heap = Deadlines(table.get)
    anchor = "long-lived"
    table[anchor] = 0.0  # the earliest deadline never leaves, so stale entries are never popped from the top
    heap.set(anchor, 0.0)
    for i in range(100_000):
        key = f"t{i}"
        table[key] = 60.0 + i
        heap.set(key, 60.0 + i)
        del table[key]
    assert len(heap) < 3000
    assert heap.earliest() == 0.0


def test_a_caller_that_raises_leaves_the_key_it_handled_and_the_rest_due() -> None:
    """As a pass over the table would: what was not handled is found again by the next call."""
    table = {"a": 1.0, "b": 2.0, "c": 3.0}
    heap = Deadlines(table.get)
    for key, deadline in table.items():
        heap.set(key, deadline)
    handled = []
    try:
        for key in heap.due(5.0):
            if key == "b":
                raise RuntimeError("a bug while expiring b")
            handled.append(key)
            del table[key]
    except RuntimeError:
        pass
    assert handled == ["a"]
    assert list(heap.due(5.0)) == ["b", "c"]
