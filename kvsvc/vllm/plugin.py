"""kvsvc as a vLLM general plugin: `register` makes `KvsvcConnector` a connector vLLM knows by name, so a
`--kv-transfer-config '{"kv_connector": "KvsvcConnector", ...}'` needs no `kv_connector_module_path`, as vLLM's own
connectors do not.

vLLM calls `register` in each of its processes (engine core and workers) through the `vllm.general_plugins` entry
point in kvsvc's package metadata. Imports vllm inside `register` only, and the connector lazily (vLLM's factory
imports `kvsvc.vllm` when an engine asks for the connector). Rules: registering twice is a no-op; the module path keeps
working beside it.
"""

from __future__ import annotations

import contextlib

NAME = "KvsvcConnector"


def register() -> None:
    """Register `KvsvcConnector` with vLLM's `KVConnectorFactory` (once per process; later calls do nothing)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # "already registered": another call in this process came first
        KVConnectorFactory.register_connector(NAME, "kvsvc.vllm", "KvsvcConnector")
