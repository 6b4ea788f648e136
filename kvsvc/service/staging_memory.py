"""`build_staging`: a worker's staging region built the one way every worker builds it: the memory, the copies in and
out of it, and the `StagingArea` that lends it to the service; registered with the transport once all of that stood.

Used by the synthetic workers (`workers.process`), the loopback test engines (`kvsvc.testing.engines`) and the vLLM
worker (`kvsvc.vllm.worker`); what differs between them is only where the memory lives and which copies run (torch
kernels, or `memmove` in tests). Imports `kvsvc.service.staging_area` at module level; torch or numpy only at the call,
for the kind of memory asked. Rules: nothing is registered unless the area was built (a refusal leaves the transport
as it was); the caller keeps the memory alive while the service may use the area (a `TorchGather` holds its own).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvsvc.service.staging_area import Gather, StagingArea

if TYPE_CHECKING:
    from kvsvc.core.coalesce import Int64Array
    from kvsvc.transport.base import Region


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


__all__ = ["Copies", "build_staging"]
