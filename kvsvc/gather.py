"""`TorchGather`: the `Gather` a staged write calls, as torch copies from a worker's KV tensors into its staging
tensor; on GPU on a side CUDA stream whose event completes the returned future, on CPU in a worker thread.

Imports torch lazily (at construction), `kvsvc.streams` for the CUDA completion future. Rules: every source piece
lies inside one of the registered tensors given (an address outside them is a `ValueError` before any copy); a
call's pieces tile one range of the staging tensor in order, which one `index_select` fills when the pieces are
rows of one length (the layouts' usual case), else one `torch.cat`, so a chunk costs one kernel (GPU) or one call
(CPU) whatever its piece count; the loop is never blocked by a copy.
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
        loop = asyncio.get_running_loop()
        if self._stream is None:
            return loop.run_in_executor(None, self._copy, src, dst, length)
        try:
            with self._torch.cuda.stream(self._stream):
                self._copy(src, dst, length)
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
        first = int(dst[0]) - self._staging_addr
        total = int(length.sum())
        ends = dst[:-1] + length[:-1]
        if first < 0 or first + total > self._staging.numel() or bool(np.any(ends != dst[1:])):
            raise ValueError(f"gather pieces must tile one range of the staging tensor in order, from {first}")
        if self._gather_rows(src, length, first, total):
            return
        pieces = []
        for addr, n in zip(src.tolist(), length.tolist(), strict=True):
            i = bisect_right(self._starts, addr) - 1
            view = self._bytes[i] if i >= 0 else None
            offset = addr - self._starts[i] if i >= 0 else -1
            if view is None or offset < 0 or offset + n > view.numel():
                raise ValueError(f"gather source [{addr:#x}, +{n}) lies outside the registered tensors")
            pieces.append(view[offset : offset + n])
        self._torch.cat(pieces, out=self._staging[first : first + total])

    def _gather_rows(self, src: Int64Array, length: Int64Array, first: int, total: int) -> bool:
        """The common case in one kernel: pieces of one length `n` inside one source tensor, each starting at a
        multiple of `n` from its start, are rows of that tensor seen as `(-1, n)`: one `index_select`. False, having
        copied nothing, when the pieces are not so."""
        n = int(length[0])
        if bool(np.any(length != n)):
            return False
        i = bisect_right(self._starts, int(src.min())) - 1
        if i < 0:
            return False
        offsets = src - self._starts[i]
        view = self._bytes[i]
        rows = view.numel() // n
        if bool(np.any(offsets % n)) or int(offsets.max()) + n > rows * n:
            return False
        table = view[: rows * n].view(rows, n)
        index = self._torch.from_numpy(offsets // n).to(table.device, non_blocking=True)
        out = self._staging[first : first + total].view(-1, n)
        self._torch.index_select(table, 0, index, out=out)
        return True


__all__ = ["TorchGather"]
