"""The docs say what the code does: the protocol tables in docs/protocol.md are the tables of `kvsvc.jobs` and
`kvsvc.windows`."""

from __future__ import annotations

from pathlib import Path

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
