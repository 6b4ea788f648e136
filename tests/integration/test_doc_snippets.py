"""Every Python snippet in the docs runs as written, in a fresh project: a directory of its own with no
configuration, where only the installed kvsvc (and its pytest plugin) is there to help. A snippet that defines
tests runs under pytest; any other runs as a script."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPETS = [
    (f"{page.name}#{i}", code)
    for page in PAGES
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL))
]


@pytest.mark.parametrize(("where", "code"), SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_the_snippet_runs_as_written_in_a_fresh_project(where: str, code: str, tmp_path: Path) -> None:
    is_test = re.search(r"^(async )?def test_", code, flags=re.MULTILINE) is not None
    script = tmp_path / ("test_snippet.py" if is_test else "snippet.py")
    script.write_text(code)
    command = (
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", script.name]
        if is_test
        else [
            sys.executable,
            script.name,
        ]
    )
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{where} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_the_docs_have_snippets_to_run() -> None:
    assert len(SNIPPETS) >= 2
