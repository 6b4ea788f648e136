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


def test_text_a_peer_chose_cannot_forge_a_line_nor_a_traceback_flood(caplog: pytest.LogCaptureFixture) -> None:
    """A newline in a pre-auth engine id would start a line of its own; a bug a peer reaches once per connection
    would log a traceback each."""
    peer_log = PeerLog(lambda: 0.0, burst=2, window_s=60.0)
    with caplog.at_level(logging.WARNING, logger="kvsvc.service"):
        peer_log.warning("hello refused", "refusing hello from %s: %s", "127.0.0.1:5", "d\nERROR kvsvc: forged\x1b[2J")
        for _ in range(200):
            try:
                raise RuntimeError("a bug on\nERROR kvsvc: forged too")  # an exception quoting a peer's text
            except RuntimeError:
                peer_log.exception("connection failed", "control connection from %s failed", "127.0.0.1:6")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "refusing hello from 127.0.0.1:5: d\\x0aERROR kvsvc: forged\\x1b[2J"
    assert not [line for m in messages for line in m.splitlines() if line.startswith("ERROR kvsvc")]
    tracebacks = [m for m in messages if "RuntimeError: a bug on\\x0aERROR kvsvc: forged too" in m]
    assert len(tracebacks) == 2 and "test_peer_log.py" in tracebacks[0]  # the burst, not 200, with its frames
