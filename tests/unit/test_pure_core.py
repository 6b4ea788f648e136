"""The pure core does no I/O: importing it loads no asyncio, torch or mooncake (docs/design.md, "The house")."""

from __future__ import annotations

import subprocess
import sys

import pytest

PURE_CORE = [
    "kvsvc.errors",
    "kvsvc.topology",
    "kvsvc.layout",
    "kvsvc.coalesce",
    "kvsvc.planner",
    "kvsvc.staging",
    "kvsvc.messages",
    "kvsvc.jobs",
    "kvsvc.sender",
    "kvsvc.receiver",
    "kvsvc.outputs",
    "kvsvc.histogram",
    "kvsvc.handshake",
    "kvsvc.connector",
    "kvsvc.testing.clock",
    "kvsvc.testing.sim",
    "kvsvc.testing.pair",
]
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


def test_kvsvc_never_imports_workers() -> None:
    modules = "kvsvc.service, kvsvc.engine.admin, kvsvc.cli, kvsvc.testing.engines"
    probe = f"import sys, {modules}\nprint('workers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
