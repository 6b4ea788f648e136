"""Engine-core side of kvsvc: the handshake endpoint, the engine-core connector, the scheduler view, admin, metrics."""

from __future__ import annotations
