"""The merge of the engine's handshake metadata (`kvsvc.core.connector.merge_handshake_metadata`) under the name
engines import it by: part of the engine-facing contract, whose import paths stay as the core moves (README.md,
"Layout of the code")."""

from __future__ import annotations

from kvsvc.core.connector import merge_handshake_metadata

__all__ = ["merge_handshake_metadata"]
