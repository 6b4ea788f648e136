"""`PeerPair`'s simulated data plane: the bytes a transfer moves between P's and D's simulated KV pools.

Rules: `SimPlane` is a part of `kvsvc.testing.pair.PeerPair` (a mixin: the pair's state is its own); it moves bytes
as the transports and the staging region would (a planned write directly, or gathered through a staging buffer; a
round into D's window; a round's scatter into D's blocks) and counts what landed where, so a test can check the KV
byte for byte and find bytes written twice. It decides nothing about the protocol. Pure: numpy and kvsvc's pure core.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from kvsvc.core.errors import TopologyError
from kvsvc.core.layout import block_geometry, pool_regions
from kvsvc.core.messages import Worker
from kvsvc.core.planner import Descriptor, plan_transfer
from kvsvc.core.sender import Submit
from kvsvc.core.staging_plans import RangeAllocator, StagingRule, count_runs, plan_staged, region_ids
from kvsvc.core.windows import Scatter, WindowKey, WriteRound
from kvsvc.testing.sim import SimEngine, kv_pattern

ByteArray = npt.NDArray[np.uint8]
_WINDOW_BASE = 1 << 46  # D's staging regions from here up, P's from here down


@dataclass(frozen=True, slots=True)
class Write:
    """A `Submit` that P worker `p` handed to the simulated transport and that has not completed yet (for a share
    written into D's window: its round `round`)."""

    p: Worker
    submit: Submit
    seq: int
    round: int = 0
    began: float = 0.0  # when P submitted it, by the pair's clock (`Landed.write_s`)

    @property
    def d(self) -> Worker:
        return self.submit.dst.worker


@dataclass(frozen=True, slots=True)
class ScatterCopy:
    """A scatter of one round of D worker `d`'s window (`key`) into its blocks, not run yet."""

    d: Worker
    key: WindowKey
    command: Scatter
    seq: int


@dataclass(slots=True)
class Counts:
    """What the pair moved so far (`PeerPair.statistics`)."""

    delivered: int = 0
    dropped: int = 0
    duplicated: int = 0
    writes_done: int = 0
    writes_failed: int = 0
    writes_staged: int = 0
    descriptors: int = 0  # what the writes submitted: planned descriptors, or a staged write's run parts
    scatters: int = 0


class SimPlane:
    """The simulated pools, staging buffers and D's windows' regions of a `PeerPair` (module docstring)."""

    p: SimEngine
    d: SimEngine
    staging: StagingRule | None
    staging_bytes: int
    violations: list[str]
    _counts: Counts
    _recvs: dict[str, tuple[str, list[int], int]]

    def _set_up_plane(self, windows: bool) -> None:
        """Give each D worker a staging region it lends windows of (`windows`), and each P worker one it gathers
        in (any staging rule), published in their metadata as the services do."""
        self._window_arenas: dict[Worker, ByteArray] = {}
        self._window_ranges: dict[Worker, RangeAllocator] = {}
        if windows:
            for i, (w, meta) in enumerate(sorted(self.d.metas.items())):
                addr = _WINDOW_BASE + i * self.staging_bytes
                self.d.metas[w] = msgspec.structs.replace(meta, staging_addr=addr, staging_size=self.staging_bytes)
                self._window_arenas[w] = np.zeros(self.staging_bytes, dtype=np.uint8)
                self._window_ranges[w] = RangeAllocator(self.staging_bytes)
        if self.staging is not None:
            for i, (w, meta) in enumerate(sorted(self.p.metas.items())):
                addr = _WINDOW_BASE - (i + 1) * self.staging_bytes
                self.p.metas[w] = msgspec.structs.replace(
                    meta, staging_addr=addr, staging_size=self.staging_bytes, accepts_windows=True
                )
        self._write_counts = {w: np.zeros(a.size, dtype=np.uint16) for w, a in self.d.arenas.items()}

    # -- checks --------------------------------------------------------------------------------------------------

    def assert_received(self, transfer_id: str, workers: list[Worker] | None = None) -> None:
        """Every D worker (or those given) holds the transfer's KV byte for byte, in the blocks it received into.

        Raises:
            AssertionError: a byte differs (the message names worker, layer, token, half and head).
        """
        req = next((v for v in self._recvs.values() if v[0] == transfer_id), None)
        assert req is not None, f"no receive of {transfer_id!r} was started"
        _, block_ids, num_tokens = req
        for worker in self.d.metas if workers is None else workers:
            meta = self.d.metas[worker]
            for layer in range(meta.start_layer, meta.end_layer):
                got = self.d.tokens(worker, layer, block_ids, num_tokens)
                want = self._pattern(self.d, worker, transfer_id, layer, num_tokens)
                bad = np.argwhere(got != want)
                if bad.size:
                    token, half, head, _ = bad[0]
                    raise AssertionError(
                        f"D{worker} layer {layer}: {len(bad)} wrong bytes, first at token {token}, half {half}, "
                        f"local head {head}"
                    )

    def bytes_written_twice(self, worker: Worker) -> int:
        """Bytes of D worker `worker`'s pool that more than one write landed on."""
        return int(np.count_nonzero(self._write_counts[worker] > 1))

    def _pattern(self, engine: SimEngine, worker: Worker, transfer_id: str, layer: int, num_tokens: int) -> ByteArray:
        geometry = block_geometry(engine.metas[worker])
        return kv_pattern(transfer_id, layer, engine.heads(worker), num_tokens, geometry.halves, geometry.element_bytes)

    # -- moving bytes --------------------------------------------------------------------------------------------

    def _plan(self, write: Write) -> tuple[list[Descriptor], str | None]:
        """`write`'s descriptors (`plan_transfer`), or why it cannot be planned."""
        submit = write.submit
        try:
            plan = plan_transfer(
                self.p.metas[write.p],
                self.d.metas[write.d],
                submit.src_block_ids,
                submit.dst_block_ids,
                submit.num_tokens,
                first_token=submit.first_token,
            )
        except (TopologyError, ValueError) as exc:
            return [], f"{type(exc).__name__}: {exc}"
        return plan, None

    def _copy(self, write: Write, plan: list[Descriptor]) -> tuple[int, int]:
        """Move `plan`'s bytes from P's arena to D's, directly or through a staging buffer when the rule says so;
        returns (bytes, descriptors submitted)."""
        src_arena, dst_arena = self.p.arenas[write.p], self.d.arenas[write.d]
        src = np.fromiter((d.src_addr for d in plan), dtype=np.int64, count=len(plan))
        dst = np.fromiter((d.dst_addr for d in plan), dtype=np.int64, count=len(plan))
        length = np.fromiter((d.length for d in plan), dtype=np.int64, count=len(plan))
        nbytes = int(length.sum())
        regions = pool_regions(self.d.metas[write.d])
        region = region_ids(dst, [start for start, _ in regions])
        if self.staging is None or not self.staging.stage(len(plan), count_runs(dst, length, region), nbytes):
            for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
                span = self.d.span(write.d, d, n)
                dst_arena[span] = src_arena[self.p.span(write.p, s, n)]
                self._write_counts[write.d][span] += 1
            return nbytes, len(plan)
        self._counts.writes_staged += 1
        count = 0
        for chunk in plan_staged(src, dst, length, max(1, self.staging_bytes // 2), region):
            buffer = np.zeros(chunk.nbytes, dtype=np.uint8)
            gathers = zip(
                chunk.gather_src.tolist(), chunk.gather_offset.tolist(), chunk.gather_length.tolist(), strict=True
            )
            for s, o, n in gathers:
                buffer[o : o + n] = src_arena[self.p.span(write.p, s, n)]
            writes = zip(
                chunk.write_offset.tolist(), chunk.write_dst.tolist(), chunk.write_length.tolist(), strict=True
            )
            for o, d, n in writes:
                if not any(start <= d and d + n <= start + size for start, size in regions):
                    self.violations.append(f"staged write [{d:#x}, +{n}) crosses D{write.d}'s registered tensors")
                span = self.d.span(write.d, d, n)
                dst_arena[span] = buffer[o : o + n]
                self._write_counts[write.d][span] += 1
            count += chunk.write_dst.size
        return nbytes, count

    def _scatter(self, d: Worker, command: Scatter) -> None:
        """D's copy of one round of a window into its blocks."""
        arena, base = self._window_arenas[d], self.d.metas[d].staging_addr
        for src, dst, n in zip(command.src.tolist(), command.dst.tolist(), command.length.tolist(), strict=True):
            span = self.d.span(d, dst, n)
            self.d.arenas[d][span] = arena[src - base : src - base + n]
            self._write_counts[d][span] += 1

    def _fill_round(self, p: Worker, d: Worker, step: WriteRound) -> int:
        """Copy round `step` from P's blocks into D's window; its bytes."""
        arena, base = self._window_arenas[d], self.d.metas[d].staging_addr
        for s, w, n in zip(step.src.tolist(), step.dst.tolist(), step.length.tolist(), strict=True):
            if w < base or w + n > base + arena.size:
                self.violations.append(f"window write [{w - base}, +{n}) outside D{d}'s staging region")
                continue
            arena[w - base : w - base + n] = self.p.arenas[p][self.p.span(p, s, n)]
        return int(step.length.sum())

    def _round_descriptors(self, step: WriteRound) -> int:
        """What a round costs the transport: its source runs, or one per chunk when P's rule gathers them."""
        assert self.staging is not None
        chunk, part = max(1, self.staging_bytes // 2), int(step.length.sum())
        if self.staging.stage(step.src.size, -(-part // chunk), part):
            self._counts.writes_staged += 1
            return -(-part // chunk)
        return int(step.src.size)


__all__ = ["Counts", "ScatterCopy", "SimPlane", "Write"]
