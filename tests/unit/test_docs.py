"""The docs say what the code does: the protocol tables in docs/protocol.md are the tables of `kvsvc.jobs` and
`kvsvc.windows`, and the module lists (README.md's layout of the code, kvsvc's docstring) name every module."""

from __future__ import annotations

import re
from pathlib import Path

import kvsvc
from kvsvc.jobs import RECV_TABLE, SEND_TABLE, table_markdown
from kvsvc.windows import FILL_TABLE, SCATTER_TABLE

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_protocol_doc_shows_the_job_tables_as_the_code_has_them() -> None:
    text = (DOCS / "protocol.md").read_text()
    tables = {
        "SEND_TABLE": SEND_TABLE,
        "RECV_TABLE": RECV_TABLE,
        "FILL_TABLE": FILL_TABLE,
        "SCATTER_TABLE": SCATTER_TABLE,
    }
    for name, table in tables.items():
        assert table_markdown(table) in text, f"docs/protocol.md is stale: paste `python -m kvsvc.tables` ({name})"


def test_no_doc_cites_a_file_outside_the_repository() -> None:
    root = DOCS.parent
    for path in [*DOCS.glob("*.md"), root / "README.md"]:
        text = path.read_text()
        for foreign in ("DESIGN.md", "MOONCAKE.md", "STYLE.md"):
            assert foreign not in text, f"{path.name} cites {foreign}, which is not in the repository"


def test_the_module_lists_name_every_module() -> None:
    """README's "Layout of the code" names every module of kvsvc (a top-level one, or one in a subpackage by its
    stem), and kvsvc's own docstring every top-level one: a module added or renamed without them fails here."""
    root = DOCS.parent
    readme = root.joinpath("README.md").read_text()
    layout = readme[readme.index("## Layout of the code") :]
    layout = layout[: layout.index("\n```\n", layout.index("```") + 3)]
    listed = set(re.findall(r"\w+", layout))
    package = root / "kvsvc"
    modules = sorted(p for p in package.rglob("*.py") if p.stem not in ("__init__", "__main__"))
    missing = [str(p.relative_to(root)) for p in modules if p.stem not in listed]
    assert not missing, f"README.md's layout of the code does not name {missing}"
    docstring = kvsvc.__doc__ or ""
    top = [p.stem for p in modules if p.parent == package and not re.search(rf"\b{p.stem}\b", docstring)]
    assert not top, f"kvsvc/__init__.py's docstring does not name {top}"
