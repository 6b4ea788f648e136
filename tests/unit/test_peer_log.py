"""`PeerLog`: the log lines a peer's input triggers, at most a burst of each kind per window, the rest counted."""

from __future__ import annotations

import logging

import pytest

from kvsvc.service.context import PeerLog


def test_a_kind_logs_a_burst_per_window_and_the_next_line_names_what_was_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    peer_log = PeerLog(lambda: now[0], burst=3, window_s=10.0)
    with caplog.at_level(logging.WARNING, logger="kvsvc.service"):
        for i in range(8):
            peer_log.warning("hello refused", "refusing hello %d", i)
            peer_log.warning("malformed frame", "bad frame %d", i)  # another kind has a budget of its own
        now[0] = 10.0  # the first burst leaves the window
        peer_log.warning("hello refused", "refusing hello %d", 8)
    lines = [r.getMessage() for r in caplog.records]
    assert [m for m in lines if m.startswith("refusing")] == [
        "refusing hello 0",
        "refusing hello 1",
        "refusing hello 2",
        "refusing hello 8 (and 5 more of these in the last 10 s)",
    ]
    assert [m for m in lines if m.startswith("bad frame")] == ["bad frame 0", "bad frame 1", "bad frame 2"]
