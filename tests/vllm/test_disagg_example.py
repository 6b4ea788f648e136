"""`examples/vllm_disagg/run.py` as a user runs it: vLLM OpenAI servers with the connector, a router, and every
answer checked against a single engine (the script exits non-zero on any difference): one P and one D server behind
vLLM's production router (vllm-router) in push mode; a P at data parallel 2 behind the example's proxy; and the
negative control, a P with other weights behind vllm-router in pull mode. (The hybrids are proven between engines in
tests/vllm; `run.py --model gdn` serves one as an operator would.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvsvc.vllm.config import PROVEN_VLLM

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def installed_vllm() -> str:
    import vllm

    return str(vllm.__version__).split("+", 1)[0]


SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "vllm_disagg" / "run.py"


def test_the_example_answers_like_a_single_engine_behind_vllm_router_in_push_mode(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--workdir", str(tmp_path), "--router", "vllm-router", "--mode", "push"],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "OK: 8 answers through P and D equal a single engine's" in done.stdout
    assert "D received 8 transfers" in done.stdout
    # vLLM's own /metrics endpoint on D timed each load (one D worker: one load a request); the bytes are proven
    # exact between engines (tests/vllm/test_vllm_connector.py), where P's counters are read once P settled.
    timed = re.search(r"D's /metrics timed (\d+) loads of ([\d,]+) bytes", done.stdout)
    assert timed is not None and int(timed.group(1)) == 8, done.stdout[-2000:]
    assert int(timed.group(2).replace(",", "")) > 0, done.stdout[-2000:]
    # The router learned from P's first answer that P pushes, then asked D at once: D's fetches reached P first.
    first = re.search(r"P served (\d+) fetches that reached it before its prefill ended", done.stdout)
    assert first is not None and int(first.group(1)) >= 1, done.stdout[-2000:]
    # kvsvc's INFO lines reach the server's log through vLLM's handler: P's choice of plane for its D worker.
    p_log = (tmp_path / "prefill0.log").read_text(errors="replace")
    assert "go over the same-host plane" in p_log
    assert f"vLLM {installed_vllm()}, which kvsvc's tests prove {PROVEN_VLLM[installed_vllm()]}" in p_log
    assert "VllmPDRouter" in (tmp_path / "proxy.log").read_text(errors="replace")  # vllm-router's, not proxy.py


def test_the_example_answers_like_a_single_engine_with_p_at_dp2(tmp_path: Path) -> None:
    layouts = ["--prefill", "dp2", "--decode", "pp1"]
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


def test_the_example_notices_when_d_gets_the_kv_of_another_model(tmp_path: Path) -> None:
    """The negative control: P serves other weights, so the KV D receives is wrong and so are its answers. Behind
    vllm-router's pull flow, which passes P's params to D unchanged: the mismatches show they arrived."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--workdir", str(tmp_path), "--prefill-seed", "1", "--router", "vllm-router"],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode != 0
    assert done.stdout.count("MISMATCH") >= 6, done.stdout[-4000:]  # every prompt of more than one token
