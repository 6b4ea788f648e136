"""`TorchGather` on CPU tensors: the bytes it copies are the pieces asked for, in order, by either of its two ways
(rows of one length, or any pieces), and a piece outside the registered tensors is refused before any copy."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from kvsvc.gather import TorchGather


def _run(gather: TorchGather, src: list[int], dst: list[int], length: list[int]) -> None:
    arrays = (np.array(x, dtype=np.int64) for x in (src, dst, length))

    async def go() -> None:
        await gather(*arrays)

    asyncio.run(go())


@pytest.mark.parametrize("lengths", [[64, 64, 64, 64], [64, 32, 128, 8]], ids=["rows", "any pieces"])
def test_the_pieces_land_in_order_in_the_staging_tensor(lengths: list[int]) -> None:
    pool = torch.arange(4096, dtype=torch.int32).view(torch.uint8)  # 16 KiB of distinct bytes
    other = torch.full((256,), 7, dtype=torch.uint8)
    staging = torch.zeros(1024, dtype=torch.uint8)
    gather = TorchGather([pool, other], staging)
    base = pool.data_ptr()
    offsets = [3 * 64, 0, 10 * 64, 5 * 64]
    dst = staging.data_ptr() + 100 + np.concatenate(([0], np.cumsum(lengths)[:-1]))
    _run(gather, [base + o for o in offsets], dst.tolist(), lengths)
    flat = pool.numpy()
    want = np.concatenate([flat[o : o + n] for o, n in zip(offsets, lengths, strict=True)])
    got = staging.numpy()[100 : 100 + sum(lengths)]
    assert np.array_equal(got, want)
    assert not staging.numpy()[:100].any()


def test_a_piece_outside_the_registered_tensors_is_refused() -> None:
    pool = torch.zeros(1024, dtype=torch.uint8)
    staging = torch.zeros(256, dtype=torch.uint8)
    gather = TorchGather([pool], staging)
    with pytest.raises(ValueError, match="outside the registered tensors"):
        _run(gather, [pool.data_ptr() + 1000], [staging.data_ptr()], [64])
    with pytest.raises(ValueError, match="tile one range"):
        _run(gather, [pool.data_ptr()], [staging.data_ptr() + 250], [64])
    with pytest.raises(ValueError, match="1-D uint8"):
        TorchGather([pool], torch.zeros(4, dtype=torch.float32))


def test_pieces_from_two_tensors_and_at_odd_offsets_take_the_general_way() -> None:
    first = torch.arange(256, dtype=torch.int32).view(torch.uint8)  # 1 KiB
    second = torch.arange(1000, 1256, dtype=torch.int32).view(torch.uint8)
    staging = torch.zeros(256, dtype=torch.uint8)
    gather = TorchGather([first, second], staging)
    pieces = [(first.data_ptr() + 3, 64), (second.data_ptr() + 64, 64), (first.data_ptr() + 200, 64)]
    dst = [staging.data_ptr() + 64 * i for i in range(3)]
    _run(gather, [a for a, _ in pieces], dst, [n for _, n in pieces])
    want = np.concatenate([first.numpy()[3:67], second.numpy()[64:128], first.numpy()[200:264]])
    assert np.array_equal(staging.numpy()[:192], want)
