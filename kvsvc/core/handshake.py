"""Engine-core side of the handshake: merge the metadata each worker publishes into the engine's one view.

Pure module: standard library only (no asyncio, torch, mooncake). Invariants: a merge never mutates its
inputs; every `(pp_rank, tp_rank)` key maps to exactly one metadata value, and two workers that disagree on a
key are an error, never a silent last-writer-wins.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping
from typing import TypeVar

M = TypeVar("M")

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


__all__ = ["merge_handshake_metadata"]
