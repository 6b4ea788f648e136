"""kvsvc: move the KV cache of LLM requests from a prefill engine to a decode engine.

The pure core makes every protocol decision and does no I/O, importing no asyncio, torch or mooncake (every module
directly in kvsvc/ but the four below; tests/unit/test_pure_core.py holds it to that): topology, layout, groups,
planner, coalesce, formats, staging_plans, data_planes, messages, hello, auth, bounds, jobs, sender, receiver, windows,
deadlines, driver, backoff, outputs, handshake, connector, errors, histogram, tables. Beside it: staging_memory (a
worker's staging region built), gather (its torch copies), streams (completion futures from CUDA events) and netns
(joining a network namespace). The packages drive the core: service (the asyncio service of one worker), transport
(the data planes), engine (the engine-core side), vllm (the vLLM connector), testing (the harness) and cli (the
`kvsvc` command). README.md's "Layout of the code" says what each module holds.
"""

from __future__ import annotations

__version__ = "0.1.0"
