"""`TorchGather` on a GPU (skipped without one): the copies run on the side CUDA stream, and the awaitable resolves
only once their bytes landed, so what is read after it, on another stream or the host, is the pieces asked for."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.service.gather import TorchGather
from tests.unit.test_gather import _pieces, _run

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@settings(max_examples=60, deadline=None)
@given(drawn=_pieces(), at=st.integers(0, 9))
def test_gather_then_scatter_on_the_gpu_moves_exactly_the_pieces(
    drawn: tuple[int, list[tuple[int, int, int]]], at: int
) -> None:
    unit, pieces = drawn
    tensors = [torch.randint(0, 256, (64 * unit + 8,), dtype=torch.uint8, device="cuda") for _ in range(3)]
    staging = torch.zeros(64 * unit + 16, dtype=torch.uint8, device="cuda")
    gather = TorchGather(tensors, staging)
    assert gather._stream is not None  # the GPU way, not numpy's
    torch.cuda.synchronize()  # the fills ran on the default stream, which the side stream does not wait for
    src = [tensors[t].data_ptr() + off for t, off, _ in pieces]
    lengths = [n for _, _, n in pieces]
    dst = (staging.data_ptr() + at + np.concatenate(([0], np.cumsum(lengths)[:-1]))).tolist()
    _run(gather, src, dst, lengths)
    host = [t.cpu().numpy() for t in tensors]
    want = np.concatenate([host[t][off : off + n] for t, off, n in pieces])
    assert np.array_equal(staging.cpu().numpy()[at : at + len(want)], want)

    before = [t.clone() for t in tensors]
    for t, off, n in pieces:
        tensors[t][off : off + n] = 0
    torch.cuda.synchronize()  # the zeroing ran on the default stream; the side stream must see it done
    _run(gather, dst, src, lengths, scatter=True)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))


def test_the_awaitable_resolves_only_after_a_large_gather_landed() -> None:
    """256 MiB of 64 KiB rows from two tensors, in a shuffled order: long enough on the side stream that a future
    resolved at submission would be read before the copy ended."""
    row = 64 << 10
    rows = 2048
    tensors = [
        torch.arange(rows * row // 4, dtype=torch.int32, device="cuda").view(torch.uint8).add_(i) for i in range(2)
    ]
    staging = torch.zeros(2 * rows * row, dtype=torch.uint8, device="cuda")
    gather = TorchGather(tensors, staging)
    order = np.random.default_rng(7).permutation(rows)
    pieces = [(i, int(r)) for r in order for i in range(2)]
    src = [tensors[i].data_ptr() + r * row for i, r in pieces]
    dst = [staging.data_ptr() + k * row for k in range(len(pieces))]
    torch.cuda.synchronize()
    _run(gather, src, dst, [row] * len(pieces))
    got = staging.view(len(pieces), row)
    want = torch.stack([tensors[i].view(rows, row)[r] for i, r in pieces])
    assert torch.equal(got, want)


def test_a_reused_shape_copies_its_index_to_the_device_once_and_lands_each_calls_rows() -> None:
    """Calls of one shape at other rows (forward and back) reuse the plan's device index: one copy to the device
    for all of them, each call's own bytes in the staging tensor."""
    pool = torch.arange(8192, dtype=torch.int32, device="cuda").view(torch.uint8)
    staging = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    gather = TorchGather([pool], staging)
    flat, base, at = pool.cpu().numpy(), pool.data_ptr(), staging.data_ptr()
    rows = np.array([20, 22, 24, 26], dtype=np.int64)
    dst = (at + 1024 * np.arange(4)).tolist()
    for shift in (0, 5, -17):
        _run(gather, (base + 1024 * (rows + shift)).tolist(), dst, [1024] * 4)
        want = np.concatenate([flat[1024 * r : 1024 * (r + 1)] for r in rows + shift])
        assert np.array_equal(staging.cpu().numpy(), want), shift
    (plan,) = gather._shapes.values()
    assert gather.shapes_reused == 2 and len(plan.device_index) == 1
