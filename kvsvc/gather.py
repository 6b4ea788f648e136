"""`TorchGather`: the `Gather` a staged write calls, as torch copies from a worker's KV tensors into its staging
tensor, and its inverse `scatter`, from a window of the staging tensor into the KV tensors; on GPU on a side CUDA
stream whose event completes the returned future, on CPU in a worker thread.

Imports torch lazily (at construction), `kvsvc.streams` for the CUDA completion future. Rules: every source piece
lies inside one of the registered tensors given (an address outside them is a `ValueError` before any copy); a
call's pieces tile one range of the staging tensor in order, which one `index_select` fills when the pieces are
rows of one length (the layouts' usual case), else one `torch.cat`, so a chunk costs one kernel (GPU) or one call
(CPU) whatever its piece count; a scatter is the same with the roles swapped (`index_copy_` for rows, else one
copy per piece, which are few: a window's pieces are D's contiguous runs); the loop is never blocked by a copy.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_right
from collections.abc import Awaitable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvsvc.streams import completion_future

Int64Array = npt.NDArray[np.int64]


class TorchGather:
    """Copies pieces of `sources` (tensors whose memory is registered) into `staging` (a 1-D uint8 tensor).

    Raises (constructor):
        ValueError: `staging` is not a contiguous 1-D uint8 tensor, or a source is not contiguous.
    """

    def __init__(self, sources: Sequence[Any], staging: Any) -> None:
        import torch

        if staging.dtype != torch.uint8 or staging.dim() != 1 or not staging.is_contiguous():
            raise ValueError(
                f"the staging tensor must be contiguous 1-D uint8, not {staging.dtype} {tuple(staging.shape)}"
            )
        if any(not t.is_contiguous() for t in sources):
            raise ValueError("every source tensor must be contiguous")
        flat = sorted(((t.data_ptr(), t.reshape(-1).view(torch.uint8)) for t in sources), key=lambda p: p[0])
        self._starts = [addr for addr, _ in flat]
        self._bytes = [view for _, view in flat]
        self._staging = staging
        self._staging_addr = staging.data_ptr()
        self._torch = torch
        self._cuda = staging.is_cuda
        self._stream = torch.cuda.Stream(device=staging.device) if self._cuda else None  # type: ignore[no-untyped-call]

    def __call__(self, src: Int64Array, dst: Int64Array, length: Int64Array) -> Awaitable[None]:
        """Copy each `(src, dst, length)` piece; resolves once every byte landed in the staging tensor.

        Raises (in the awaitable):
            ValueError: a piece lies outside the sources or the staging tensor, or the pieces do not tile one range
                in order.
        """
        return self._launch(self._copy, src, dst, length)

    def scatter(self, src: Int64Array, dst: Int64Array, length: Int64Array) -> Awaitable[None]:
        """Copy each `(src, dst, length)` piece from the staging tensor (the pieces tile one range of it, in order)
        into the registered tensors; resolves once every byte landed.

        Raises (in the awaitable):
            ValueError: a piece lies outside the tensors or the staging tensor, or the pieces do not tile one range
                of it in order.
        """
        return self._launch(self._scatter, src, dst, length)

    def _launch(self, copy: Any, src: Int64Array, dst: Int64Array, length: Int64Array) -> Awaitable[None]:
        loop = asyncio.get_running_loop()
        if self._stream is None:
            return loop.run_in_executor(None, copy, src, dst, length)
        try:
            with self._torch.cuda.stream(self._stream):
                copy(src, dst, length)
                event = self._torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._stream)
        except Exception as exc:  # raised in the awaitable, as on CPU
            failed: asyncio.Future[None] = loop.create_future()
            failed.set_exception(exc)
            return failed
        return completion_future(event)

    def _copy(self, src: Int64Array, dst: Int64Array, length: Int64Array) -> None:
        if src.size == 0:
            return
        first, total = self._tiled(dst, length, "gather")
        if self._gather_rows(src, length, first, total):
            return
        pieces = [self._piece(addr, n, "gather source") for addr, n in zip(src.tolist(), length.tolist(), strict=True)]
        self._torch.cat(pieces, out=self._staging[first : first + total])

    def _scatter(self, src: Int64Array, dst: Int64Array, length: Int64Array) -> None:
        if src.size == 0:
            return
        first, total = self._tiled(src, length, "scatter")
        if self._scatter_rows(dst, length, first, total):
            return
        where = zip(dst.tolist(), length.tolist(), strict=True)
        pieces = [self._piece(addr, n, "scatter destination") for addr, n in where]
        at = first
        for piece in pieces:
            piece.copy_(self._staging[at : at + piece.numel()])
            at += piece.numel()

    def _tiled(self, addrs: Int64Array, length: Int64Array, what: str) -> tuple[int, int]:
        """(offset, bytes) of the staging range the pieces at `addrs` tile in order.

        Raises:
            ValueError: they do not.
        """
        first = int(addrs[0]) - self._staging_addr
        total = int(length.sum())
        ends = addrs[:-1] + length[:-1]
        if first < 0 or first + total > self._staging.numel() or bool(np.any(ends != addrs[1:])):
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

    def _gather_rows(self, src: Int64Array, length: Int64Array, first: int, total: int) -> bool:
        """The common case in one kernel: pieces of one length `n` inside one source tensor, each starting at a
        multiple of `n` from its start, are rows of that tensor seen as `(-1, n)`: one `index_select`. False, having
        copied nothing, when the pieces are not so."""
        rows = self._rows(src, length)
        if rows is None:
            return False
        table, index, n = rows
        self._torch.index_select(table, 0, index, out=self._staging[first : first + total].view(-1, n))
        return True

    def _scatter_rows(self, dst: Int64Array, length: Int64Array, first: int, total: int) -> bool:
        """`_gather_rows` the other way: one `index_copy_` into the rows of one tensor."""
        rows = self._rows(dst, length)
        if rows is None:
            return False
        table, index, n = rows
        table.index_copy_(0, index, self._staging[first : first + total].view(-1, n))
        return True

    def _rows(self, addrs: Int64Array, length: Int64Array) -> tuple[Any, Any, int] | None:
        """(the tensor as rows of `n` bytes, the row index of each piece, `n`) when the pieces at `addrs` are whole
        rows of one tensor; None otherwise."""
        n = int(length[0])
        if bool(np.any(length != n)):
            return None
        i = bisect_right(self._starts, int(addrs.min())) - 1
        if i < 0:
            return None
        offsets = addrs - self._starts[i]
        view = self._bytes[i]
        rows = view.numel() // n
        if bool(np.any(offsets % n)) or int(offsets.max()) + n > rows * n:
            return None
        table = view[: rows * n].view(rows, n)
        return table, self._torch.from_numpy(offsets // n).to(table.device, non_blocking=True), n


__all__ = ["TorchGather"]
