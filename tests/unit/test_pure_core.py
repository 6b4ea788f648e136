"""The pure core does no I/O: importing it loads no asyncio, torch or mooncake, nor the service, transport or vLLM
(docs/design.md, "The house"). Every module directly in kvsvc/ counts as pure core unless it is named, with why, in
`NOT_PURE`: a new module is checked without anyone remembering to list it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "kvsvc"
# Every module directly in kvsvc/ is pure core unless it is named here, with why it may not be.
NOT_PURE = {
    "kvsvc.streams": "completion futures from CUDA events: asyncio and torch",
    "kvsvc.gather": "the torch copies of staged writes",
    "kvsvc.staging_memory": "builds a worker's staging region: the service's StagingArea, torch or numpy memory",
    "kvsvc.netns": "joins a network namespace (a system call), for tests and the demo",
}
# kvsvc.testing's pure parts: the harness for protocol tests with no event loop.
PURE_TESTING = [
    "kvsvc.testing.clock",
    "kvsvc.testing.sim",
    "kvsvc.testing.pair",
    "kvsvc.testing.dataplane",
    "kvsvc.testing.faults",
    "kvsvc.testing.reports",
]
PURE_CORE = (
    sorted({f"kvsvc.{p.stem}" for p in ROOT.glob("*.py") if p.stem != "__init__"} - NOT_PURE.keys()) + PURE_TESTING
)
FORBIDDEN = ("asyncio", "torch", "mooncake", "aiohttp", "uvloop", "workers")


@pytest.mark.parametrize("module", PURE_CORE)
def test_a_pure_core_module_imports_no_event_loop_torch_or_mooncake(module: str) -> None:
    probe = (
        f"import sys, {module}\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"{module} pulls in {out}"


def test_the_pure_core_is_every_module_but_the_ones_named_and_names_only_real_ones() -> None:
    modules = {f"kvsvc.{p.stem}" for p in ROOT.glob("*.py")}
    assert NOT_PURE.keys() <= modules, f"NOT_PURE names modules that do not exist: {NOT_PURE.keys() - modules}"
    for module in ("kvsvc.hello", "kvsvc.windows", "kvsvc.planner", "kvsvc.sender", "kvsvc.receiver"):
        assert module in PURE_CORE


def test_the_pure_core_imports_neither_the_service_nor_the_transport_nor_vllm() -> None:
    probe = (
        f"import sys\nfor m in {PURE_CORE!r}: __import__(m)\n"
        "layers = ('kvsvc.service', 'kvsvc.transport', 'kvsvc.vllm', 'kvsvc.engine', 'vllm')\n"
        "bad = sorted(m for m in sys.modules if any(m == x or m.startswith(x + '.') for x in layers))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"the pure core pulls in {out}"


def test_kvsvc_never_imports_workers() -> None:
    modules = "kvsvc.service, kvsvc.engine.admin, kvsvc.cli, kvsvc.testing.engines"
    probe = f"import sys, {modules}\nprint('workers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
