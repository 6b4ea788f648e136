"""pytest plugin entry point of `kvsvc.testing` (registered under the `pytest11` entry point)."""

from __future__ import annotations
