"""`kvsvc scale` in miniature: one D engine fed by one and by two P engines, each on its own network host.

Checks what the measurement rests on, not how fast it runs: every request verifies, the D worker holds
connections per P engine, and the figures are read from a live
process. Skips where network namespaces cannot be made; CI runs as root.
"""

from __future__ import annotations

import json

import pytest

from kvsvc.engine.netns import skip_reason
from workers.commands import scale
from workers.scale import ScaleOptions, run_scale

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]


def test_d_holds_connections_per_p_engine() -> None:
    options = ScaleOptions(peers=(1, 2), requests_per_peer=4, tokens=40, layers=2, kv_heads=4, head_size=16)
    one, two = run_scale(options)
    for row in (one, two):
        assert row.errors == [] and row.verified == row.requests == 4 * row.peers
        assert row.d.fds > row.d.connections and row.d.threads > 1 and row.d.rss_mib > row.d_pool_mib
    for row in (one, two):
        # Per P engine, D holds at least its control connection and one Mooncake data connection; the P worker
        # holds the same pair towards its one D worker (Mooncake opens up to 4 data lanes as load needs them).
        assert row.d.connections >= 2 * row.peers
        assert 2 <= row.p.connections < 2 + row.d.connections


def test_the_command_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    code = scale.main(["--peers", "1", "--requests-per-peer", "2", "--tokens", "16", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["ok"] is True, result
    (row,) = result["rows"]
    assert row["peers"] == 1 and row["verified"] == 2 and row["d"]["connections"] > 0
