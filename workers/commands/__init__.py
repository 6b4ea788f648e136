"""`kvsvc` subcommands that run the standalone engine runtime (plugged in via the `kvsvc.commands` entry points)."""

from __future__ import annotations
