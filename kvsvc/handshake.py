"""`kvsvc.core.handshake` under the name engines import it by (the merged handshake metadata): part of the engine-facing
contract, whose import paths stay as the core moves (README.md, "Layout of the code")."""

from __future__ import annotations

from kvsvc.core.handshake import *  # noqa: F403
from kvsvc.core.handshake import __all__ as __all__
