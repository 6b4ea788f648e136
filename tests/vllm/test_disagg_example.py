"""`examples/vllm_disagg/run.py` as a user runs it: two vLLM OpenAI servers with the connector, the proxy, and every
answer checked against a single engine (the script exits non-zero on any difference)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "vllm_disagg" / "run.py"


def test_the_disaggregated_serving_example_answers_like_a_single_engine(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=840
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "OK: 8 answers through P and D equal a single engine's" in done.stdout
    assert "D received 8 transfers" in done.stdout


def test_the_example_notices_when_d_gets_the_kv_of_another_model(tmp_path: Path) -> None:
    """The negative control: P serves other weights, so the KV D receives is wrong and so are its answers."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--workdir", str(tmp_path), "--prefill-seed", "1"],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode != 0
    assert done.stdout.count("MISMATCH") >= 6, done.stdout[-4000:]  # every prompt of more than one token
