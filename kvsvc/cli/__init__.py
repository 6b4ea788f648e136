"""The `kvsvc` command: one subcommand per module in this package.

Each subcommand module exposes `register(subparsers)`, which adds its parser and sets `func` to a callable taking
the parsed namespace and returning an exit code. Heavy imports (torch, mooncake) happen inside `func`, so
`kvsvc --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvsvc.cli import plan

_SUBCOMMANDS = [plan]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsvc", description="KV-cache transfer service for disaggregated serving")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in _SUBCOMMANDS:
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
