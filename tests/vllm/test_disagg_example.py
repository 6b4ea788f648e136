"""`examples/vllm_disagg/run.py` as a user runs it: vLLM OpenAI servers with the connector, the proxy, and every
answer checked against a single engine (the script exits non-zero on any difference): one P and one D server; then P
servers at pipeline parallel 2 and data parallel 2 beside each other and two D servers, taken in turn by the proxy."""

from __future__ import annotations

import re
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
    # kvsvc's INFO lines reach the server's log through vLLM's handler: P's choice of plane for its D worker.
    assert "go over the same-host plane" in (tmp_path / "prefill0.log").read_text(errors="replace")


def test_the_example_answers_like_a_single_engine_with_p_at_pp2_and_dp2_and_two_d_servers(tmp_path: Path) -> None:
    layouts = ["--prefill", "pp2", "--prefill", "dp2", "--decode", "pp1", "--decode", "pp1"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--workdir", str(tmp_path), *layouts], capture_output=True, text=True, timeout=840
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "OK: 8 answers through P and D equal a single engine's" in done.stdout
    assert "D received 8 transfers" in done.stdout
    assert "chat" in done.stdout  # some answers came through /v1/chat/completions
    # Each data-parallel rank of the DP 2 server is an engine of its own, and both served prefills.
    served = set(re.findall(r"P engine (\S+?)\)", (tmp_path / "proxy.log").read_text()))
    assert any(e.endswith("_dp0") for e in served) and any(e.endswith("_dp1") for e in served), served
    assert any("_dp" not in e for e in served), served  # the PP 2 server


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


@pytest.mark.parametrize(("model", "transfers"), [("sliding", 8), ("granite", 7)])
def test_the_example_serves_hybrid_models_with_the_hybrid_manager_on(
    tmp_path: Path, model: str, transfers: int
) -> None:
    """A sliding-window hybrid and a Mamba2 hybrid, served as an operator starts them. The Mamba model's one-token
    prompt moves nothing (no state before its last token): P returns no params and D computes it."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--workdir", str(tmp_path), "--model", model],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "OK: 8 answers through P and D equal a single engine's" in done.stdout
    assert f"D received {transfers} transfers" in done.stdout
    for log in ("prefill0.log", "decode0.log"):
        text = (tmp_path / log).read_text(errors="replace")
        assert "Turning off hybrid kv cache manager" not in text, log
        assert re.search(r"kv cache group sizes \(\d+, \d+\)", text), log  # vLLM keeps both groups
