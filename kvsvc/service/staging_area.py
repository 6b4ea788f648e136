"""A worker's staging region: where P gathers a staged write's pieces before one descriptor per destination run goes
out, and where D lends windows that P writes a share into and D scatters from.

Rules: the region is registered with the transport by whoever owns its memory (the embedder), before the first
write; the service only lends ranges of it (`kvsvc.core.staging_plans.RangeAllocator`) and calls the injected `Gather`.
Ranges are lent first come, first served, so a large chunk is never starved by small ones; a wait for room has a
deadline and fails the write (never the service) when it passes. A range goes back only once nothing can still read it:
its gather ended and its write finished or drained. D's windows wait in the same line, for `window_wait_s` at most
(then the request goes without one, and P writes the blocks). Cancellation (only `close` cancels writes) leaves the
ranges of the cancelled writes lent: the region is not used after close. Every kind of worker (synthetic, loopback,
vLLM) builds its region one way (`build_staging`): the memory, the copies in and out of it, the area, and only then
its registration, so a refusal leaves the transport as it was; torch or numpy are imported only at that call.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvsvc.core.errors import Busy
from kvsvc.core.formats import Conversion
from kvsvc.core.layout import Int64Array
from kvsvc.core.staging_plans import RangeAllocator, StagingRule


class StagingFull(Busy):
    """No room in the staging region within the deadline (writes ahead of this one hold it)."""


class Gather(Protocol):
    """Copies pieces of this worker's registered memory into its staging region. The service calls it only for KV
    whose compute has finished (the send job awaited it), so the copy needs no ordering of its own."""

    def __call__(self, src: Int64Array, dst: Int64Array, length: Int64Array) -> Awaitable[None]:
        """Copy `length[i]` bytes from address `src[i]` to staging address `dst[i]`, for every i; the awaitable
        resolves once every byte landed (on GPU: once the copy stream passed the copies). Raises what the copy
        raises; cancelling the awaitable does not stop a copy already running (the range stays lent)."""
        ...


class Convert(Protocol):
    """Copies pieces of this worker's float KV into its staging region converted into a peer's quantized format
    (`kvsvc.core.formats.Conversion`): the pieces are planned in the peer's bytes (`kvsvc.core.formats.as_written`)."""

    def __call__(self, conversion: Conversion, src: Int64Array, dst: Int64Array, length: Int64Array) -> Awaitable[None]:
        """Convert each piece of `length[i]` planned bytes at `src[i]` into staging address `dst[i]`; as `Gather`."""
        ...


class StagingArea:
    """The staging region of one worker: `size` bytes at `addr`, lent first fit; P fills it by `gather`, D empties
    windows by `scatter` (the same kind of copy, from the region into the KV tensors; None: D lends no windows);
    `convert` fills it with KV converted into a peer's format (None: this worker converts for no peer).

    Raises (constructor):
        ValueError: `size` < 2 (a chunk is half the region) or `addr` <= 0.
    """

    def __init__(
        self,
        addr: int,
        size: int,
        gather: Gather,
        rule: StagingRule | None = None,
        scatter: Gather | None = None,
        convert: Convert | None = None,
    ) -> None:
        if size < 2 or addr <= 0:
            raise ValueError(f"a staging region needs an address and at least 2 bytes, got {addr:#x}, {size}")
        self.addr, self.size, self.gather, self.scatter, self.convert = addr, size, gather, scatter, convert
        self.rule = rule or StagingRule()
        # Half the region per chunk, so a large write can gather one chunk while another is on the wire.
        self.chunk_bytes = size // 2
        self._ranges = RangeAllocator(size)
        self._waiters: deque[tuple[int, asyncio.Future[int]]] = deque()
        self.lent_max = 0  # the most bytes lent at once, for statistics
        self.waits = 0  # lends that had to wait for room

    @property
    def in_use(self) -> int:
        return self._ranges.in_use

    async def lend(self, size: int, timeout_s: float) -> int:
        """The address of `size` bytes of the region, lent to the caller until `give_back`.

        Raises:
            ValueError: `size` exceeds `chunk_bytes`.
            StagingFull: no room within `timeout_s`.

        Cancellation withdraws the request: nothing is lent then.
        """
        if not 0 < size <= self.chunk_bytes:
            raise ValueError(f"a staged chunk of {size} bytes exceeds the chunk size {self.chunk_bytes}")
        if not self._waiters:
            offset = self._ranges.allocate(size)
            if offset is not None:
                return self._lent(offset)
        self.waits += 1
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append((size, waiter))
        try:
            async with asyncio.timeout(timeout_s):
                offset = await asyncio.shield(waiter)
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._release(waiter.result())  # granted just as this caller gave up
            else:
                waiter.cancel()
                self._grant()  # it may have blocked the ones behind it
            if isinstance(exc, TimeoutError):
                raise StagingFull(
                    f"no room for {size} bytes in the staging region of {self.size} within {timeout_s:g} s "
                    f"({self._ranges.in_use} bytes lent)"
                ) from None
            raise
        return self._lent(offset)

    def try_lend(self, size: int) -> int | None:
        """The address of `size` bytes lent now, or None (no room without waiting, or writes wait ahead of it).

        Raises:
            ValueError: `size` exceeds `chunk_bytes`.
        """
        if not 0 < size <= self.chunk_bytes:
            raise ValueError(f"a window of {size} bytes exceeds the chunk size {self.chunk_bytes}")
        if self._waiters:
            return None
        offset = self._ranges.allocate(size)
        return None if offset is None else self._lent(offset)

    def give_back(self, addr: int) -> None:
        """Return the range lent at `addr`; the waiters next in line get room.

        Raises:
            KeyError: nothing is lent at `addr`.
        """
        self._release(addr - self.addr)

    def _lent(self, offset: int) -> int:
        self.lent_max = max(self.lent_max, self._ranges.in_use)
        return self.addr + offset

    def _release(self, offset: int) -> None:
        self._ranges.free(offset)
        self._grant()

    def _grant(self) -> None:
        """Lend to the waiters at the head of the line while they fit, in order."""
        while self._waiters:
            size, waiter = self._waiters[0]
            if waiter.done():  # withdrawn
                self._waiters.popleft()
                continue
            granted = self._ranges.allocate(size)
            if granted is None:
                return
            self._waiters.popleft()
            waiter.set_result(granted)


if TYPE_CHECKING:
    from kvsvc.core.layout import Int64Array
    from kvsvc.core.planner import Region


class Copies(Gather, Protocol):
    """A staging region's gather (`__call__`, into the region) with its inverse `scatter` (out of it), as
    `kvsvc.service.gather.TorchGather` and `kvsvc.testing.engines.MemmoveCopies` are."""

    def scatter(self, src: Int64Array, dst: Int64Array, length: Int64Array) -> Awaitable[None]: ...


def build_staging(
    nbytes: int,
    copies: Callable[[Any], Copies],
    *,
    device: Any = None,
    register: Callable[[Sequence[Region]], None] | None = None,
) -> tuple[Any, StagingArea]:
    """(memory, area): `nbytes` of staging memory and the `StagingArea` over it, whose gathers and scatters are
    `copies(memory)` (and its conversions, where the copies have a `convert`: `TorchGather`'s). The memory is a
    torch uint8 tensor on `device`, or without one a zeroed numpy array in host memory (torch is not imported then).
    `register`, when given, gets the region's `(addr, nbytes)` last.

    Raises:
        ValueError: `copies` refuses the memory (a `TorchGather` whose sources are not contiguous), or `nbytes` < 2.
        What `register` raises (`TransportError`).
    """
    if device is None:
        import numpy as np

        memory: Any = np.zeros(nbytes, dtype=np.uint8)
        addr = int(memory.ctypes.data)
    else:
        import torch

        memory = torch.empty(nbytes, dtype=torch.uint8, device=device)
        addr = memory.data_ptr()
    both = copies(memory)
    area = StagingArea(addr, nbytes, both, scatter=both.scatter, convert=getattr(both, "convert", None))
    if register is not None:
        register([(addr, nbytes)])
    return memory, area


__all__ = ["Copies", "Gather", "StagingArea", "StagingFull", "build_staging"]
