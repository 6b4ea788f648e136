"""The standalone engine runtime: worker processes with torch KV pools, a synthetic model, engines of pp x tp workers.

Used by `kvsvc serve|demo|bench` and the end-to-end tests. Imports `kvsvc` (never the reverse). Invariants: every
KV byte a synthetic engine writes is a known function of (request seed, layer, K/V half, head, token, dim), so a
decode engine can check every byte it received; every child process an executor starts is reaped by `close()`.
"""

from __future__ import annotations
