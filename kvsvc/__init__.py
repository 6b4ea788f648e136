"""kvsvc: move the KV cache of LLM requests from a prefill engine to a decode engine.

The pure core, kvsvc/core/, makes every protocol decision and does no I/O, importing no asyncio, torch, mooncake,
socket, os or logging (tests/unit/test_pure_core.py holds it to that): topology, layout, groups, planner, formats,
staging_plans, data_planes, messages, hello, auth, bounds, jobs, sender, receiver, windows, deadlines, driver,
outputs, connector, errors, histogram. The engine-facing contract keeps its names here:
connector, outputs, topology and handshake are the core's modules under the paths engines import. The packages drive
the core: service (the asyncio service of one worker, with its staging copies), transport (the data planes), engine
(the engine-core side), vllm (the vLLM connector), testing (the harness) and cli (the `kvsvc` command). README.md's
"Layout of the code" says what each module holds.
"""

from __future__ import annotations

__version__ = "0.1.0"
