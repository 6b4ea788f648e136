"""`EngineCoreConnector`: the engine-core connector of kvsvc, which checks and publishes the engine's handshake
metadata.

Imports: aiohttp (for the application it publishes on) and kvsvc's pure core and bootstrap module; no asyncio
work happens here. Invariants: what it publishes is one engine start's complete worker set (one engine_id and
incarnation, every `(pp_rank, tp_rank)` of `pp_size * tp_size`, each key equal to its worker, one layer range
per stage); anything else is refused before the served document changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from aiohttp import web

from kvsvc.core.connector import KVConnectorBase, merge_handshake_metadata
from kvsvc.core.messages import Worker, WorkerMetadata
from kvsvc.engine.bootstrap import publish_metadata


def check_engine_metadata(metadata: Mapping[Worker, WorkerMetadata]) -> None:
    """Check that `metadata` is the complete worker set of one engine start.

    Raises:
        ValueError: it is empty; a key is not its worker's `(pp_rank, tp_rank)`; workers name several engine ids,
            incarnations, pp_sizes or tp_sizes (each value and its workers named); workers of `pp_size * tp_size`
            are missing (named) or out of range; the workers of one stage disagree on its layer range.
    """
    if not metadata:
        raise ValueError("no handshake metadata: the engine has no workers to publish")
    wrong_keys = [(key, m.worker) for key, m in sorted(metadata.items()) if key != m.worker]
    if wrong_keys:
        raise ValueError(f"handshake metadata keys do not match their workers (key, worker): {wrong_keys[:8]}")
    for attribute in ("engine_id", "incarnation", "pp_size", "tp_size"):
        values: dict[object, list[Worker]] = {}
        for key, m in sorted(metadata.items()):
            values.setdefault(getattr(m, attribute), []).append(key)
        if len(values) > 1:
            detail = "; ".join(f"{value!r}: workers {workers[:8]}" for value, workers in values.items())
            raise ValueError(f"handshake metadata mixes several {attribute} values, one engine start has one: {detail}")
    first = next(iter(metadata.values()))
    pp_size, tp_size = first.pp_size, first.tp_size
    expected = {(pp, tp) for pp in range(pp_size) for tp in range(tp_size)}
    missing = sorted(expected - metadata.keys())
    extra = sorted(metadata.keys() - expected)
    if missing or extra:
        raise ValueError(
            f"handshake metadata of engine {first.engine_id!r} (incarnation {first.incarnation}) must cover"
            f" pp_size {pp_size} x tp_size {tp_size} workers: missing (pp_rank, tp_rank) {missing[:16]}"
            f"{f', out of range {extra[:16]}' if extra else ''}"
        )
    for pp in range(pp_size):
        ranges = {(metadata[(pp, tp)].start_layer, metadata[(pp, tp)].end_layer) for tp in range(tp_size)}
        if len(ranges) > 1:
            raise ValueError(f"workers of PP stage {pp} disagree on its layer range: {sorted(ranges)}")


class EngineCoreConnector(KVConnectorBase[WorkerMetadata]):
    """kvsvc's connector in the engine core: PP-aware, and publishes what it receives on the bootstrap endpoint.

    `app` is the engine's aiohttp application that serves `bootstrap.METADATA_PATH` (the one `build_admin_app`
    or `BootstrapServer` made). `engine_id`, when given, is checked against the metadata. Once published, the
    metadata may be published again only for the same engine start (a restart builds a new connector).
    """

    def __init__(self, app: web.Application, *, engine_id: str | None = None) -> None:
        self._app = app
        self._engine_id = engine_id
        self._metadata: dict[Worker, WorkerMetadata] | None = None

    @property
    def metadata(self) -> dict[Worker, WorkerMetadata]:
        """The published `{(pp_rank, tp_rank): WorkerMetadata}` (a copy); empty before publication."""
        return dict(self._metadata or {})

    @property
    def published(self) -> bool:
        """True once metadata was checked and published."""
        return self._metadata is not None

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[Worker, WorkerMetadata]) -> None:
        """Check the engine's merged metadata, keep it, and publish it on the bootstrap endpoint.

        Raises:
            ValueError: as `check_engine_metadata`; it belongs to another engine than `engine_id`; or another
                engine start was published before. Nothing is published then.
        """
        check_engine_metadata(metadata)
        first = next(iter(metadata.values()))
        if self._engine_id is not None and first.engine_id != self._engine_id:
            raise ValueError(
                f"handshake metadata is of engine {first.engine_id!r}, this connector serves {self._engine_id!r}"
            )
        if self._metadata is not None:
            old = next(iter(self._metadata.values()))
            if (old.engine_id, old.incarnation) != (first.engine_id, first.incarnation):
                raise ValueError(
                    f"engine {old.engine_id!r} incarnation {old.incarnation} is already published; metadata of"
                    f" {first.engine_id!r} incarnation {first.incarnation} needs a new connector (a new start)"
                )
        # Sorted, so the served document does not depend on the order the engine core collected workers in.
        self._metadata = {key: metadata[key] for key in sorted(metadata)}
        publish_metadata(self._app, self._metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[int, WorkerMetadata]) -> None:
        """Legacy form `{tp_rank: metadata}` of a PP-less engine: converted to `{(0, tp_rank): ...}` and published.

        Raises:
            ValueError: a worker's pp_rank is not 0 or its tp_rank is not its key; else as the PP-aware form.
        """
        wrong = sorted(tp for tp, m in metadata.items() if m.worker != (0, tp))
        if wrong:
            raise ValueError(
                f"legacy handshake metadata must be {{tp_rank: metadata}} of PP stage 0; keys {wrong[:8]} hold"
                f" workers {[metadata[tp].worker for tp in wrong[:8]]}; use set_xfer_handshake_metadata_pp_aware"
            )
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): m for tp, m in metadata.items()})

    def publish_workers(self, per_worker: Iterable[Mapping[Worker, WorkerMetadata] | None]) -> None:
        """Merge what each worker published (`merge_handshake_metadata`) and publish it.

        Raises:
            ValueError: two workers disagree on a key, or as `set_xfer_handshake_metadata_pp_aware`.
        """
        self.set_xfer_handshake_metadata_pp_aware(merge_handshake_metadata(per_worker))


__all__ = ["EngineCoreConnector", "check_engine_metadata"]
