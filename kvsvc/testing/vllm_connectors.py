"""vLLM connectors for tests beside kvsvc's: `PipelineExampleConnector`, vLLM's `ExampleConnector` (KV saved to and
loaded from files) made to start in a pipeline-parallel engine, as a sibling of kvsvc under vLLM's `MultiConnector`.

`MultiConnector` forwards the engine's PP-aware handshake metadata (`set_xfer_handshake_metadata_pp_aware`) to every
child, and vLLM's base class refuses metadata of a PP rank above 0 unless a connector overrides it; vLLM's own
connectors, NixlConnector aside, do not. The example connector uses no handshake, so this one takes the metadata
and ignores it; nothing else changes. Imports vllm at module level: vLLM loads it by its dotted path
(`kv_connector_module_path`), never kvsvc itself.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class PipelineExampleConnector(ExampleConnector):
    """vLLM's `ExampleConnector`, which takes (and, needing no handshake, ignores) PP-aware handshake metadata."""

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        return None
