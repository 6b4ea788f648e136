"""`kvsvc.core.outputs` under the name engines import it by (workers' reports and the aggregator that combines them):
part of the engine-facing contract, whose import paths stay as the core moves (README.md, "Layout of the code")."""

from __future__ import annotations

from kvsvc.core.outputs import *  # noqa: F403
from kvsvc.core.outputs import __all__ as __all__
