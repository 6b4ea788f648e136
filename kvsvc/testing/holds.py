"""The transfer secrets of kvsvc's harnesses and synthetic runtime, which stand in for both engines and the router.

A real deployment draws each transfer's secret at random on P (`kvsvc.service.new_transfer_secret`, or vLLM's
producer params) and hands it to D with the transfer id. The harnesses (`PeerPair`, `LoopbackEngine`) and the
synthetic runtime (`workers/`) derive it from the transfer id instead, so that a D started before its P, or in
another process, finds it without a router. Anyone who knows the id can derive it: tests, demos and benchmarks only.
Pure module: standard library only.
"""

from __future__ import annotations

import hashlib


def harness_secret(transfer_id: str) -> str:
    """The secret the harnesses use for `transfer_id` (32 hex digits). Raises nothing."""
    return hashlib.blake2b(
        transfer_id.encode("utf-8", "surrogatepass"), digest_size=16, person=b"kvsvc-harness"
    ).hexdigest()
