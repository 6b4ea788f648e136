"""The docs say what the code does: the protocol tables in docs/protocol.md are the tables of `kvsvc.core.jobs` and
`kvsvc.core.windows`, and the module lists (README.md's layout of the code, kvsvc's docstring) name every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import kvsvc
from kvsvc.cli import main
from kvsvc.core.jobs import RECV_TABLE, SEND_TABLE, table_markdown
from kvsvc.core.windows import FILL_TABLE, SCATTER_TABLE

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
        assert table_markdown(table) in text, f"docs/protocol.md is stale: paste `kvsvc tables` ({name})"


def test_kvsvc_tables_prints_every_table_the_protocol_doc_shows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tables"]) == 0
    printed = capsys.readouterr().out
    for table in (SEND_TABLE, RECV_TABLE, FILL_TABLE, SCATTER_TABLE):
        assert table_markdown(table) in printed


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


# The route tables of docs/contributing.md: `| file | function | what it decides |`, one row per hop.
ROUTE_HEADER = "| file | function | what it decides |"


def _definitions(path: Path) -> set[str]:
    """The names `path` defines: top-level functions and classes, and `Class.method` for each method."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {
                f"{node.name}.{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    return names


def route_tables(text: str) -> list[list[tuple[str, list[str]]]]:
    """Each route table of `text` as its rows: (the file cited, the function names cited), in order."""
    return [[(file, functions) for file, functions, _ in rows] for rows in _route_rows(text)]


def _route_rows(text: str) -> list[list[tuple[str, list[str], str]]]:
    """Each route table of `text` as its rows: (the file cited, the function names cited, what it decides)."""
    tables: list[list[tuple[str, list[str], str]]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() != ROUTE_HEADER:
            continue
        rows: list[tuple[str, list[str], str]] = []
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
            assert len(cells) == 3, f"docs/contributing.md: a route row has {len(cells)} cells: {row}"
            files = re.findall(r"`([^`]+)`", cells[0])
            functions = re.findall(r"`([^`]+)`", cells[1])
            assert len(files) == 1 and functions, f"docs/contributing.md: a route row names no file or function: {row}"
            rows.append((files[0], functions, cells[2]))
        tables.append(rows)
    return tables


def test_every_function_the_route_cites_is_defined_in_the_file_it_names() -> None:
    """Each row of the route tables in docs/contributing.md names a file of the repository and functions defined
    there (`name` at the top level, `Class.method` in a class): a renamed or misspelled hop fails here."""
    root = DOCS.parent
    tables = route_tables((DOCS / "contributing.md").read_text())
    assert len(tables) >= 2, "docs/contributing.md lost its route tables"
    wrong = []
    for rows in tables:
        for file, functions in rows:
            path = root / file
            assert path.is_file(), f"docs/contributing.md cites {file}, which does not exist"
            defined = _definitions(path)
            wrong += [f"{file}: {name}" for name in functions if name not in defined]
    assert not wrong, f"docs/contributing.md cites functions its files do not define: {wrong}"


def test_every_hop_of_the_route_decides_something() -> None:
    """A row whose decision is empty or a mark ("·") is a hop that only passes the request on: either it decides
    something the table says, or the hop goes (from the code, then from the table)."""
    rows = [row for table in _route_rows((DOCS / "contributing.md").read_text()) for row in table]
    passing = [f"{file}: {', '.join(functions)}" for file, functions, decides in rows if len(decides.strip("·( )")) < 8]
    assert not passing, f"docs/contributing.md has hops that decide nothing: {passing}"


def test_the_first_route_is_the_one_host_route_and_names_its_plane() -> None:
    """The first table is a transfer on one host: its write goes through the same-host plane, not Mooncake."""
    direct = route_tables((DOCS / "contributing.md").read_text())[0]
    files = {file for file, _ in direct}
    assert "kvsvc/transport/samehost.py" in files and "kvsvc/transport/mooncake.py" not in files


def test_the_route_says_how_many_files_the_direct_path_crosses() -> None:
    text = (DOCS / "contributing.md").read_text()
    direct = route_tables(text)[0]
    said = re.search(r"one direct transfer crosses (\d+) files", text, re.IGNORECASE)
    assert said is not None, "docs/contributing.md no longer says how many files one direct transfer crosses"
    assert int(said.group(1)) == len({file for file, _ in direct})


def _members() -> dict[str, set[str]]:
    """Every class of kvsvc by name, with what it defines: methods, class fields and attributes set on `self`."""
    members: dict[str, set[str]] = {}
    for path in (DOCS.parent / "kvsvc").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            names = members.setdefault(node.name, set())
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
            for sub in ast.walk(node):  # attributes a method sets on `self`
                if isinstance(sub, ast.Assign | ast.AnnAssign):
                    targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                    names |= {t.attr for t in targets if isinstance(t, ast.Attribute) and _on_self(t)}
    return members


def _on_self(target: ast.Attribute) -> bool:
    return isinstance(target.value, ast.Name) and target.value.id == "self"


def test_every_class_member_contributing_md_names_exists() -> None:
    """Beside the tables, the prose and the ownership table of docs/contributing.md name `Class.member`s: each is
    a method, field or attribute of a kvsvc class of that name."""
    members = _members()
    text = (DOCS / "contributing.md").read_text()
    cited = set(re.findall(r"`([A-Z]\w*)\.(\w+)(?:\(\))?`", text))
    missing = sorted(f"{cls}.{name}" for cls, name in cited if name not in members.get(cls, set()))
    assert not missing, f"docs/contributing.md names members no kvsvc class has: {missing}"
