"""The pure core does no I/O: it is the package kvsvc/core/, whose modules import no asyncio, torch, mooncake, socket,
os or logging, nor the service, transport, engine side or vLLM (docs/design.md, "The house"). A new module there is
checked without anyone remembering to list it; the engine-facing contract keeps its import paths."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "kvsvc"
CORE = ROOT / "core"
# kvsvc.testing's pure parts: the harness for protocol tests with no event loop.
PURE_TESTING = [
    "kvsvc.testing.clock",
    "kvsvc.testing.sim",
    "kvsvc.testing.pair",
    "kvsvc.testing.dataplane",
    "kvsvc.testing.faults",
    "kvsvc.testing.reports",
]
PURE_CORE = sorted(f"kvsvc.core.{p.stem}" for p in CORE.glob("*.py") if p.stem != "__init__") + PURE_TESTING
FORBIDDEN = ("asyncio", "torch", "mooncake", "aiohttp", "uvloop", "workers")
# What no core module names in an import statement, even one that some other import already loaded.
NEVER_IMPORTED = (*FORBIDDEN, "socket", "os", "logging", "subprocess", "threading", "selectors", "kvsvc.service")
# The engine-facing contract's modules, and the core module behind each.
PUBLIC = {"connector": "connector", "outputs": "outputs", "topology": "topology", "handshake": "connector"}


@pytest.mark.parametrize("module", PURE_CORE)
def test_a_pure_core_module_imports_no_event_loop_torch_or_mooncake(module: str) -> None:
    probe = (
        f"import sys, {module}\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"{module} pulls in {out}"


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.stem)
def test_no_core_module_imports_io_or_the_layers_above(path: Path) -> None:
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            named.add(node.module)
    bad = sorted(n for n in named if any(n == x or n.startswith(f"{x}.") for x in NEVER_IMPORTED))
    assert not bad, f"kvsvc/core/{path.name} imports {bad}"
    above = sorted(n for n in named if n.startswith("kvsvc.") and not n.startswith("kvsvc.core"))
    assert not above, f"kvsvc/core/{path.name} imports {above}: the core imports only itself"


def test_the_core_holds_the_protocols_decisions_and_kvsvc_itself_only_the_contracts_names() -> None:
    for module in ("kvsvc.core.hello", "kvsvc.core.windows", "kvsvc.core.planner", "kvsvc.core.sender"):
        assert module in PURE_CORE
    top = sorted(p.stem for p in ROOT.glob("*.py") if p.stem != "__init__")
    assert top == sorted(PUBLIC), f"kvsvc/ holds modules of its own: {top}"


@pytest.mark.parametrize("name", PUBLIC)
def test_the_engine_facing_contract_keeps_its_import_paths(name: str) -> None:
    probe = (
        f"import kvsvc.{name} as public, kvsvc.core.{PUBLIC[name]} as core\n"
        "assert public.__all__ and set(public.__all__) <= set(core.__all__)\n"
        "print(all(getattr(public, n) is getattr(core, n) for n in public.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "True"


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


# Each layer and what it may import of kvsvc's packages: only the layers below it (docs/design.md, "The house").
BELOW = {
    "transport": ("core",),
    "service": ("core", "transport"),
    "engine": ("core", "transport", "service"),
    "vllm": ("core", "transport", "service", "engine"),
}


@pytest.mark.parametrize("layer", sorted(BELOW))
def test_the_layers_import_only_downward(layer: str) -> None:
    allowed = {"kvsvc", *(f"kvsvc.{below}" for below in BELOW[layer]), f"kvsvc.{layer}", "kvsvc.connector"}
    allowed |= {f"kvsvc.{name}" for name in PUBLIC}
    upward = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "kvsvc" and ".".join(parts[:2]) not in allowed:
                    upward.append(f"{path.relative_to(ROOT.parent)}: {name}")
    assert not upward, upward


def test_the_runtime_never_imports_the_test_harness() -> None:
    """workers/ (the standalone runtime, its benches and the vLLM engine harness) stands on the library alone:
    kvsvc.testing is for tests, and the harness's secrets and hosts live beside what they serve."""
    workers = ROOT.parent / "workers"
    found = []
    for path in sorted(workers.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            found += [f"{path.relative_to(ROOT.parent)}: {n}" for n in names if n.startswith("kvsvc.testing")]
    assert not found, found
