"""`kvsvc.core.topology` under the name engines import it by (a worker's TP/PP identity and what it learned of remote
engines): part of the engine-facing contract, whose import paths stay as the core moves (README.md, "Layout of the
code")."""

from __future__ import annotations

from kvsvc.core.topology import *  # noqa: F403
from kvsvc.core.topology import __all__ as __all__
