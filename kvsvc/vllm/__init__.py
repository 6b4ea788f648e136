"""kvsvc as a vLLM KV connector: `KvsvcConnector`, loaded by vLLM with `kv_connector="KvsvcConnector"` and
`kv_connector_module_path="kvsvc.vllm"` (docs/vllm.md).

Only `kvsvc.vllm.connector` imports vllm, and only when `KvsvcConnector` is first looked up here: the pure parts
(`flow`, `params`, `config`, `kv_layout`) and the worker side import without vllm installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvsvcConnector"]


def __getattr__(name: str) -> Any:
    if name in ("KvsvcConnector", "KvsvcStats", "KvsvcMetadata"):
        from kvsvc.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvsvc.vllm' has no attribute {name!r}")
