"""Engine-core side of kvsvc: the bootstrap (handshake) endpoint and, later, admin endpoints and aggregation."""

from __future__ import annotations
