"""The engine-facing connector base class, what an engine builder subclasses to receive handshake metadata, and the
merge of the metadata each worker publishes into the engine's one view (`merge_handshake_metadata`).

Pure module: standard library only (no asyncio, torch, mooncake). Invariants: the PP-aware entry point is the
one the engine core calls; a connector that only knows the legacy `{tp_rank: m}` form keeps working through the
default, which refuses (never silently drops) metadata of PP stages other than 0. A merge never mutates its inputs;
every `(pp_rank, tp_rank)` key maps to exactly one metadata value, and two workers that disagree on a key are an
error, never a silent last-writer-wins.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping
from typing import Generic, TypeVar

M = TypeVar("M")


class KVConnectorBase(Generic[M]):
    """Base of every KV connector an engine embeds; `M` is the handshake metadata type (e.g. `WorkerMetadata`).

    Override `set_xfer_handshake_metadata_pp_aware` to accept PP-disaggregated engines; override only the
    legacy `set_xfer_handshake_metadata` for a connector that handles one PP stage.
    """

    def set_xfer_handshake_metadata(self, metadata: dict[int, M]) -> None:
        """Legacy, TP-only form: `{tp_rank: metadata}` of PP stage 0. The default ignores it. Raises nothing."""
        return None

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], M]) -> None:
        """Receive the engine's merged `{(pp_rank, tp_rank): metadata}` (see `merge_handshake_metadata`).

        The default accepts PP stage 0 only and hands `{tp_rank: metadata}` to `set_xfer_handshake_metadata`.

        Raises:
            ValueError: a key has pp_rank != 0 and this connector does not override this method; the message
                says it "does not support PP-disaggregated" handshake metadata and names the pp_ranks.
        """
        other_stages = sorted({pp_rank for pp_rank, _ in metadata if pp_rank != 0})
        if other_stages:
            raise ValueError(
                f"{type(self).__name__} does not support PP-disaggregated handshake metadata: got pp_ranks "
                f"{other_stages} besides 0; override set_xfer_handshake_metadata_pp_aware to accept them"
            )
        self.set_xfer_handshake_metadata({tp_rank: m for (_, tp_rank), m in metadata.items()})


class MultiConnector(KVConnectorBase[M]):
    """Several connectors behind one: every call is forwarded to each child, in the order given.

    Each child gets its own copy of the metadata dict, so a child that edits what it was handed cannot change
    what its siblings see. A child that overrides only the legacy method is reached through its default
    PP-aware method, so it still refuses PP stages other than 0.
    """

    def __init__(self, connectors: Iterable[KVConnectorBase[M]]) -> None:
        """Raises:
        ValueError: `connectors` is empty.
        """
        self._connectors = tuple(connectors)
        if not self._connectors:
            raise ValueError("MultiConnector needs at least one connector")

    @property
    def connectors(self) -> tuple[KVConnectorBase[M], ...]:
        """The children, in forwarding order."""
        return self._connectors

    def set_xfer_handshake_metadata(self, metadata: dict[int, M]) -> None:
        """Forward the legacy form to every child. Raises what a child raises (later children are skipped)."""
        for connector in self._connectors:
            connector.set_xfer_handshake_metadata(dict(metadata))

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], M]) -> None:
        """Forward the PP-aware form to every child.

        Raises:
            ValueError: a child refuses the metadata (e.g. it "does not support PP-disaggregated" stages); the
                children before it have already received it, the ones after it have not.
        """
        for connector in self._connectors:
            connector.set_xfer_handshake_metadata_pp_aware(dict(metadata))


# Metadata reprs (a `WorkerMetadata` lists one address per layer) can run to kilobytes; an error needs the gist.
_short = reprlib.Repr()
_short.maxstring = 200
_short.maxother = 200


def merge_handshake_metadata(
    per_worker: Iterable[Mapping[tuple[int, int], M] | None],
) -> dict[tuple[int, int], M]:
    """Merge the workers' `{(pp_rank, tp_rank): metadata}` dicts into one, ordered by key.

    A None entry (a worker with nothing to publish) is skipped. The same key published twice with equal
    metadata is fine (a worker may publish its own entry and its peers'); with different metadata it is an
    error, because the engine would otherwise serve remote engines a layout that some worker does not have.

    Raises:
        ValueError: two entries claim one `(pp_rank, tp_rank)` key with different metadata; the message names
            the key and the positions (in `per_worker`) of both entries.
    """
    merged: dict[tuple[int, int], M] = {}
    claimed_by: dict[tuple[int, int], int] = {}
    for position, metadata in enumerate(per_worker):
        if metadata is None:
            continue
        for key, value in metadata.items():
            if key not in merged:
                merged[key] = value
                claimed_by[key] = position
            elif merged[key] != value:
                raise ValueError(
                    f"conflicting handshake metadata for worker (pp_rank, tp_rank)={key}: entry "
                    f"{claimed_by[key]} published {_short.repr(merged[key])}, entry {position} published "
                    f"{_short.repr(value)}"
                )
    # Sorted so the served document and any log of it do not depend on which worker answered first.
    return {key: merged[key] for key in sorted(merged)}


__all__ = ["KVConnectorBase", "MultiConnector", "merge_handshake_metadata"]
