"""kvsvc: move the KV cache of LLM requests from a prefill engine to a decode engine.

The pure core (topology, layout, planner, messages, outputs, handshake, jobs, errors) does no I/O and imports
no asyncio, torch or mooncake; the service, transport, streams and engine modules drive it.
"""

from __future__ import annotations

__version__ = "0.1.0"
