"""`kvsvc.core.connector` under the name engines import it by (the connector base class and the multi-connector): part
of the engine-facing contract, whose import paths stay as the core moves (README.md, "Layout of the code")."""

from __future__ import annotations

from kvsvc.core.connector import *  # noqa: F403
from kvsvc.core.connector import __all__ as __all__
