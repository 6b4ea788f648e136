"""`staging_area`, the one way a worker's staging region is built: the memory where it was asked, the copies over
it, the area that lends it, and the region registered last, so that a refusal registers nothing."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

from kvsvc.service.gather import TorchGather
from kvsvc.service.staging_area import build_staging
from kvsvc.testing.engines import MemmoveCopies


def test_without_a_device_the_region_is_zeroed_host_memory_with_the_given_copies_registered_last() -> None:
    copies = MemmoveCopies()
    seen: list[Any] = []
    registered: list[Sequence[tuple[int, int]]] = []

    def copies_over(memory: Any) -> MemmoveCopies:
        seen.append(memory)
        return copies

    memory, area = build_staging(4096, copies_over, register=registered.append)
    assert isinstance(memory, np.ndarray) and memory.dtype == np.uint8 and not memory.any()
    assert seen == [memory]
    assert (area.addr, area.size) == (memory.ctypes.data, 4096)
    assert area.gather is copies and area.scatter == copies.scatter
    assert registered == [[(area.addr, 4096)]]


def test_on_a_torch_device_the_region_is_a_uint8_tensor_there_with_a_torch_gather_over_it() -> None:
    pool = torch.zeros(1024, dtype=torch.uint8)
    memory, area = build_staging(2048, partial(TorchGather, [pool]), device=pool.device)
    assert isinstance(memory, torch.Tensor) and memory.dtype == torch.uint8 and memory.device == pool.device
    assert (area.addr, area.size, area.chunk_bytes) == (memory.data_ptr(), 2048, 1024)
    assert isinstance(area.gather, TorchGather) and area.scatter is not None


def test_copies_that_refuse_the_region_register_nothing() -> None:
    registered: list[Sequence[tuple[int, int]]] = []
    not_contiguous = torch.zeros(8, 8, dtype=torch.uint8).t()
    with pytest.raises(ValueError, match="contiguous"):
        build_staging(64, partial(TorchGather, [not_contiguous]), device="cpu", register=registered.append)
    with pytest.raises(ValueError, match="at least 2 bytes"):
        build_staging(1, lambda _: MemmoveCopies(), register=registered.append)
    assert registered == []
