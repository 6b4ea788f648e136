"""Descriptor tables in the transport contract (`kvsvc.transport.base`): a table is checked whole and agrees with
the row by row check on every input, naming the same first offending descriptor; tuples and tables convert both
ways without losing a row."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsvc.core.errors import InvalidDescriptor
from kvsvc.core.planner import (
    ROWS_CHECKED_ONE_BY_ONE,
    AddressRanges,
    as_rows,
    as_table,
    check_descriptors,
    check_table,
    checked_table,
)

LOCAL = AddressRanges([(1000, 500), (4000, 1000)])
REMOTE = AddressRanges([(100_000, 2000), (200_000, 64)])

rows = st.tuples(
    st.sampled_from([990, 1000, 1200, 1499, 4000, 4900, 5000, 7000]),
    st.sampled_from([99_990, 100_000, 101_000, 101_999, 200_000, 200_060, 300_000]),
    st.sampled_from([-1, 0, 1, 4, 64, 100, 600]),
)


def outcome(check: object, *args: object) -> tuple[str, object]:
    try:
        return "ok", check(*args)  # type: ignore[operator]
    except InvalidDescriptor as exc:
        return "refused", (str(exc), exc.code)


@given(st.lists(rows, max_size=3 * ROWS_CHECKED_ONE_BY_ONE), st.booleans())
def test_a_table_is_checked_as_its_rows_are(descriptors: list[tuple[int, int, int]], known: bool) -> None:
    remote = REMOTE if known else None
    table = np.array(descriptors, dtype=np.int64).reshape(-1, 3)
    expected = outcome(check_descriptors, descriptors, LOCAL, remote, "d")
    assert outcome(check_table, table, LOCAL, remote, "d") == expected
    assert outcome(lambda *a: checked_table(*a)[1], table, LOCAL, remote, "d") == expected
    assert outcome(lambda *a: checked_table(*a)[1], descriptors, LOCAL, remote, "d") == expected


def test_a_long_table_names_its_first_bad_row() -> None:
    good = [(1000 + i, 100_000 + 10 * i, 4) for i in range(2 * ROWS_CHECKED_ONE_BY_ONE)]
    bad = [*good[:70], (1000, 200_060, 8), *good[70:]]
    with pytest.raises(InvalidDescriptor, match=r"descriptor 70 to d: destination \[0x30d7c, \+8\)"):
        check_table(as_table(bad), LOCAL, REMOTE, "d")
    assert check_table(as_table(good), LOCAL, REMOTE, "d") == 4 * len(good)


def test_tables_and_tuples_convert_both_ways() -> None:
    descriptors = [(1, 2, 3), (4, 5, 6)]
    table = as_table(descriptors)
    assert table.shape == (2, 3) and table.dtype == np.int64
    assert np.shares_memory(as_table(table), table)  # a table is not copied
    assert as_rows(table) == descriptors and all(type(x) is int for row in as_rows(table) for x in row)
    assert as_rows(descriptors) is descriptors
    assert as_table([]).shape == (0, 3)
    with pytest.raises(InvalidDescriptor, match="rows of integers"):
        as_table([(1, 2)])
