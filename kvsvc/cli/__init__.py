"""The `kvsvc` command: one subcommand per module, built in or plugged in.

Built-in subcommands live in this package: `plan`, and `tables`, which prints every transition table of the protocol
as docs/protocol.md shows them (a test keeps the two the same). Commands that need the standalone engine runtime
(`demo`, `serve`, `bench`, `chaos`) live in `workers.commands` and plug in through the `kvsvc.commands` entry-point
group, so `kvsvc` never imports `workers`. Each command module exposes `register(subparsers)`, which adds its parser
and sets `func` to a callable taking the parsed namespace and returning an exit code. Heavy imports (torch, mooncake)
happen inside `func`, so `kvsvc --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from kvsvc.cli import plan

ENTRY_POINT_GROUP = "kvsvc.commands"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsvc", description="KV-cache transfer service for disaggregated serving")
    subparsers = parser.add_subparsers(dest="command", required=True)
    plan.register(subparsers)
    tables = subparsers.add_parser("tables", help="print the protocol's transition tables as markdown")
    tables.set_defaults(func=_print_tables)
    for entry in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            register = entry.load()
        except ImportError as exc:
            # A broken plug-in must not take the other commands down with it: it explains itself when run.
            _register_unavailable(subparsers, entry.name, f"{type(exc).__name__}: {exc}")
            continue
        register(subparsers)
    return parser


def _print_tables(_: argparse.Namespace) -> int:
    from kvsvc.core.jobs import RECV_TABLE, SEND_TABLE, table_markdown
    from kvsvc.core.windows import FILL_TABLE, SCATTER_TABLE

    print(f"Send job (P):\n\n{table_markdown(SEND_TABLE)}\n")
    print(f"Receive job (D):\n\n{table_markdown(RECV_TABLE)}\n")
    print(f"Filling a window (P):\n\n{table_markdown(FILL_TABLE)}\n")
    print(f"A lent window (D):\n\n{table_markdown(SCATTER_TABLE)}")
    return 0


def _register_unavailable(subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str, why: str) -> None:
    parser = subparsers.add_parser(name, help=f"(unavailable: {why})", add_help=False)
    parser.add_argument("rest", nargs=argparse.REMAINDER)

    def fail(_: argparse.Namespace) -> int:
        print(f"kvsvc {name}: unavailable: {why}", file=sys.stderr)
        return 2

    parser.set_defaults(func=fail)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
