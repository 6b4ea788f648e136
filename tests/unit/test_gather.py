"""`TorchGather` on CPU tensors: the bytes it copies are the pieces asked for, in order, by either of its two ways
(row kernels per tensor, or any pieces), both ways round (gather and scatter), and a piece outside the registered
tensors is refused before any copy."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.service.gather import INLINE_KERNELS, TorchGather


def _row_kernels(gather: TorchGather, addrs: np.ndarray, length: np.ndarray, first: int) -> list | None:
    """The call's row kernels with the staging range at `first`, or None (not whole rows): what a first call runs."""
    tiled = first + np.concatenate(([0], np.cumsum(length)[:-1]))  # the staging range the pieces tile, in order
    plan = gather._row_plan(addrs, tiled, length)
    return None if plan is None else gather._kernels(plan, 0, first)


def _run(gather: TorchGather, src: list[int], dst: list[int], length: list[int], *, scatter: bool = False) -> None:
    arrays = (np.array(x, dtype=np.int64) for x in (src, dst, length))

    async def go() -> None:
        await (gather.scatter if scatter else gather)(*arrays)

    asyncio.run(go())


@pytest.mark.parametrize("inline_bytes", [0, 1 << 20], ids=["in a thread", "at the call"])
@pytest.mark.parametrize("lengths", [[64, 64, 64, 64], [64, 32, 128, 8]], ids=["rows", "any pieces"])
def test_the_pieces_land_in_order_in_the_staging_tensor(lengths: list[int], inline_bytes: int) -> None:
    pool = torch.arange(4096, dtype=torch.int32).view(torch.uint8)  # 16 KiB of distinct bytes
    other = torch.full((256,), 7, dtype=torch.uint8)
    staging = torch.zeros(1024, dtype=torch.uint8)
    gather = TorchGather([pool, other], staging, inline_bytes)
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


@st.composite
def _pieces(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int]]]:
    """(unit, pieces as (tensor, offset, length)): pieces that do not overlap, from three tensors, in any order;
    offsets and lengths are multiples of `unit`, which may be odd, so both the row kernels (of any word width) and
    the per-piece way are drawn."""
    unit = draw(st.sampled_from([1, 3, 8, 64, 96, 128]))
    slots = draw(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 15)), min_size=1, max_size=12, unique=True))
    pieces = [(t, slot * 4 * unit, unit * draw(st.integers(1, 4))) for t, slot in slots]
    return unit, pieces


@settings(max_examples=150, deadline=None)
@given(drawn=_pieces(), at=st.integers(0, 9))
def test_gather_then_scatter_moves_exactly_the_pieces(drawn: tuple[int, list[tuple[int, int, int]]], at: int) -> None:
    unit, pieces = drawn
    tensors = [torch.randint(0, 256, (64 * unit + 8,), dtype=torch.uint8) for _ in range(3)]
    staging = torch.zeros(64 * unit + 16, dtype=torch.uint8)
    gather = TorchGather(tensors, staging)
    src = [tensors[t].data_ptr() + off for t, off, _ in pieces]
    lengths = [n for _, _, n in pieces]
    dst = (staging.data_ptr() + at + np.concatenate(([0], np.cumsum(lengths)[:-1]))).tolist()
    _run(gather, src, dst, lengths)
    want = np.concatenate([tensors[t].numpy()[off : off + n] for t, off, n in pieces])
    assert np.array_equal(staging.numpy()[at : at + len(want)], want)

    before = [t.clone() for t in tensors]
    for t, off, n in pieces:
        tensors[t][off : off + n] = 0
    _run(gather, dst, src, lengths, scatter=True)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))


def test_merged_pieces_of_whole_heads_take_one_row_kernel_in_machine_words() -> None:
    """The planner merges adjacent heads, so a call's lengths are multiples of one run, not one length: they are
    still rows (of the common run), seen as 8-byte words, since per-byte index kernels are ten times slower. On CPU
    the rows are numpy views of the same memory (numpy's kernels)."""
    pool = torch.zeros(1 << 16, dtype=torch.uint8)
    staging = torch.zeros(1 << 15, dtype=torch.uint8)
    gather = TorchGather([pool], staging)
    addrs = pool.data_ptr() + np.array([0, 8192, 4096 * 5], dtype=np.int64)
    rows = _row_kernels(gather, addrs, np.array([4096, 8192, 4096], dtype=np.int64), 0)
    assert rows is not None and len(rows) == 1
    ((table, index, window),) = rows
    assert table.dtype == np.uint64 and table.shape[1] == 512
    assert table.ctypes.data == pool.data_ptr()
    assert index.tolist() == [0, 2, 3, 5]
    assert window.shape == (4, 512)
    # Rows of 1 byte are below MIN_ROW_BYTES: the general way.
    assert _row_kernels(gather, addrs + 1, np.array([4096, 8192, 4096], dtype=np.int64), 0) is None
    # Whole rows, but a staging range at an odd offset: rows of bytes, not words.
    narrow = _row_kernels(gather, addrs, np.array([4096, 8192, 4096], dtype=np.int64), 1)
    assert narrow is not None and narrow[0][0].dtype == np.uint8 and narrow[0][0].shape[1] == 4096


def test_a_call_over_many_tensors_is_one_row_kernel_per_run_of_pieces_in_one_tensor() -> None:
    """A share reads every layer's tensor: one kernel per run of pieces in one tensor, the rows of each indexed in
    its own tensor, and the staging rows in call order."""
    layers = [torch.arange(1024 * i, 1024 * (i + 1), dtype=torch.int64).view(torch.uint8) for i in range(3)]
    staging = torch.zeros(8 * 1024, dtype=torch.uint8)
    gather = TorchGather(layers, staging)
    pieces = [(0, 2), (0, 5), (2, 1), (1, 0), (1, 6)]  # (tensor, row of 512 bytes): tensor 0 twice, 2, then 1 twice
    src = np.array([layers[t].data_ptr() + 512 * r for t, r in pieces], dtype=np.int64)
    lengths = np.full(len(pieces), 512, dtype=np.int64)
    rows = _row_kernels(gather, src, lengths, 1024)
    assert rows is not None
    assert [index.tolist() for _, index, _ in rows] == [[2, 5], [1], [0, 6]]
    assert [window.ctypes.data - staging.data_ptr() for _, _, window in rows] == [1024, 2048, 2560]
    _run(gather, src.tolist(), (staging.data_ptr() + 1024 + 512 * np.arange(5)).tolist(), lengths.tolist())
    want = np.concatenate([layers[t].numpy()[512 * r : 512 * (r + 1)] for t, r in pieces])
    assert np.array_equal(staging.numpy()[1024 : 1024 + 5 * 512], want)


def test_a_call_with_one_bad_piece_copies_nothing() -> None:
    """Every piece is checked before any kernel runs: D's blocks are never half scattered by a refused window."""
    a = torch.zeros(1024, dtype=torch.uint8)
    b = torch.zeros(1024, dtype=torch.uint8)
    staging = torch.full((256,), 9, dtype=torch.uint8)
    gather = TorchGather([a, b], staging)
    with pytest.raises(ValueError, match="outside the registered tensors"):
        _run(
            gather,
            [staging.data_ptr(), staging.data_ptr() + 64],
            [a.data_ptr(), b.data_ptr() + 1000],
            [64, 64],
            scatter=True,
        )
    assert not a.any() and not b.any()


@pytest.mark.parametrize("where", ["past the end of a tensor", "below the first tensor"])
def test_whole_rows_outside_the_tensors_are_refused_before_any_copy(where: str) -> None:
    """Pieces at the row size (the row kernels' case) that leave the registered tensors are refused by name, and a
    gather that holds one copies none of the others."""
    a = torch.arange(256, dtype=torch.int32).view(torch.uint8)  # 1 KiB
    b = torch.arange(256, 512, dtype=torch.int32).view(torch.uint8)
    staging = torch.zeros(512, dtype=torch.uint8)
    gather = TorchGather([a, b], staging)
    first = min(a.data_ptr(), b.data_ptr())
    last = max(a.data_ptr(), b.data_ptr())
    bad = last + 1024 if where == "past the end of a tensor" else first - 4096
    src = [a.data_ptr(), bad]
    with pytest.raises(ValueError, match="outside the registered tensors"):
        _run(gather, src, [staging.data_ptr(), staging.data_ptr() + 256], [256, 256])
    assert not staging.any()


def test_many_small_kernels_run_off_the_loop_and_land_the_same() -> None:
    """A call of more than `INLINE_KERNELS` kernels (pieces alternating between tensors) goes to a thread."""
    tensors = [torch.arange(64 * i, 64 * i + 4096, dtype=torch.int32).view(torch.uint8) for i in range(2)]
    staging = torch.zeros(2 * INLINE_KERNELS * 128, dtype=torch.uint8)
    gather = TorchGather(tensors, staging)
    pieces = [(tensors[i % 2].data_ptr() + 128 * (i // 2), 128) for i in range(2 * INLINE_KERNELS)]
    dst = [staging.data_ptr() + 128 * i for i in range(len(pieces))]
    _run(gather, [a for a, _ in pieces], dst, [n for _, n in pieces])
    want = np.concatenate([tensors[i % 2].numpy()[128 * (i // 2) : 128 * (i // 2 + 1)] for i in range(len(pieces))])
    assert np.array_equal(staging.numpy(), want)


@settings(max_examples=100, deadline=None)
@given(drawn=_pieces(), shift=st.integers(-40, 40), at=st.integers(0, 9), again=st.integers(0, 9))
def test_a_call_of_an_earlier_calls_shape_copies_its_own_pieces_or_is_refused_whole(
    drawn: tuple[int, list[tuple[int, int, int]]], shift: int, at: int, again: int
) -> None:
    """A cached plan's chunk comes back shifted to other blocks: its rows are reused only where the shifted pieces
    stay whole rows inside their tensors. Either way the bytes copied are the shifted pieces, in order, or nothing
    (with the same refusal a fresh gather gives). Pieces are shifted by multiples of the unit, so some shifts keep
    whole rows and some leave a tensor."""
    unit, pieces = drawn
    tensors = [torch.randint(0, 256, (64 * unit + 8,), dtype=torch.uint8) for _ in range(3)]
    staging = torch.zeros(128 * unit + 32, dtype=torch.uint8)
    gather = TorchGather(tensors, staging)
    lengths = [n for _, _, n in pieces]
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    src = [tensors[t].data_ptr() + off for t, off, _ in pieces]
    _run(gather, src, (staging.data_ptr() + at + offsets).tolist(), lengths)

    shifted_src = [a + shift * unit for a in src]
    # Where each shifted piece lies: in one of the tensors (maybe another one than before) or outside them all.
    holders = [
        [x for x in tensors if x.data_ptr() <= a and a + n <= x.data_ptr() + x.numel()]
        for a, n in zip(shifted_src, lengths, strict=True)
    ]
    staging.zero_()
    base = 64 * unit + 16 + again  # another staging range, as a second chunk would be lent
    if not all(holders):
        with pytest.raises(ValueError, match="outside the registered tensors"):
            _run(gather, shifted_src, (staging.data_ptr() + base + offsets).tolist(), lengths)
        assert not staging.any()
        return
    _run(gather, shifted_src, (staging.data_ptr() + base + offsets).tolist(), lengths)
    want = np.concatenate(
        [
            held[0].numpy()[a - held[0].data_ptr() : a - held[0].data_ptr() + n]
            for held, a, n in zip(holders, shifted_src, lengths, strict=True)
        ]
    )
    assert np.array_equal(staging.numpy()[base : base + len(want)], want)
    assert not staging.numpy()[:base].any()


def test_a_chunk_shifted_to_other_blocks_reuses_the_rows_of_the_first() -> None:
    """Requests of one cached plan at other blocks: the second call reuses the first's row index, shifted, and its
    bytes are its own pieces; a shift that takes a piece past its tensor's end is not reused but refused by name."""
    pool = torch.arange(16384, dtype=torch.int32).view(torch.uint8)  # 64 KiB of distinct bytes, rows of 1 KiB
    staging = torch.zeros(16384, dtype=torch.uint8)
    gather = TorchGather([pool], staging)
    rows = np.array([0, 2, 4, 6], dtype=np.int64)  # every other row, as a head split takes half of each block
    lengths = [1024] * 4
    dst = (staging.data_ptr() + 1024 * np.arange(4)).tolist()
    _run(gather, (pool.data_ptr() + 1024 * rows).tolist(), dst, lengths)
    assert gather.shapes_reused == 0
    _run(gather, (pool.data_ptr() + 1024 * (rows + 9)).tolist(), (np.array(dst) + 8192).tolist(), lengths)
    assert gather.shapes_reused == 1
    flat = pool.numpy()
    want = np.concatenate([flat[1024 * r : 1024 * (r + 1)] for r in rows + 9])
    assert np.array_equal(staging.numpy()[8192 : 8192 + 4096], want)
    staging.zero_()
    with pytest.raises(ValueError, match="outside the registered tensors"):  # row 62 + 6 is past the 64 KiB
        _run(gather, (pool.data_ptr() + 1024 * (rows + 62)).tolist(), dst, lengths)
    assert gather.shapes_reused == 1 and not staging.any()
    with pytest.raises(ValueError, match="tile one range of the staging tensor"):  # a staging range past its end
        _run(gather, (pool.data_ptr() + 1024 * (rows + 1)).tolist(), (np.array(dst) + 14336).tolist(), lengths)
    assert not staging.any()


def test_a_repeat_call_hits_only_its_own_shape_and_lands_its_own_bytes() -> None:
    """What must not reuse an earlier call's rows: a shift by part of a row, other lengths, staging pieces that do
    not tile one range (refused, as on a first call); what may: a scatter of the same shape (the roles swapped)."""
    pool = torch.arange(8192, dtype=torch.int32).view(torch.uint8)  # 32 KiB of distinct bytes
    staging = torch.zeros(8192, dtype=torch.uint8)
    gather = TorchGather([pool], staging)
    flat, base, at = pool.numpy(), pool.data_ptr(), staging.data_ptr()
    src = base + np.array([0, 2048, 4096], dtype=np.int64)
    _run(gather, src.tolist(), [at, at + 1024, at + 2048], [1024] * 3)

    _run(gather, (src + 512).tolist(), [at, at + 1024, at + 2048], [1024] * 3)  # half a row on
    assert gather.shapes_reused == 0
    assert np.array_equal(staging.numpy()[:3072], np.concatenate([flat[o + 512 : o + 1536] for o in (0, 2048, 4096)]))

    _run(gather, src.tolist(), [at, at + 512, at + 1024], [512, 512, 1024])  # other lengths
    assert gather.shapes_reused == 0
    assert np.array_equal(staging.numpy()[:2048], np.concatenate([flat[:512], flat[2048:2560], flat[4096:5120]]))

    staging.zero_()
    _run(gather, (src + 8192).tolist(), [at, at + 1024, at + 2048], [1024, 1024, 512])  # only the last length differs
    assert gather.shapes_reused == 0
    assert np.array_equal(
        staging.numpy()[:2560], np.concatenate([flat[8192:9216], flat[10240:11264], flat[12288:12800]])
    )
    assert not staging.numpy()[2560:].any()

    staging.zero_()
    with pytest.raises(ValueError, match="tile one range of the staging tensor"):  # a gap in the staging range
        _run(gather, src.tolist(), [at, at + 1024, at + 4096], [1024] * 3)
    assert gather.shapes_reused == 0 and not staging.any()

    staging.copy_(torch.arange(8192, dtype=torch.int16)[:4096].view(torch.uint8))
    window = staging.numpy()[:3072].copy()
    for offset in (8192, 16384):  # the second scatter reuses the first's rows
        _run(gather, [at, at + 1024, at + 2048], (src + offset).tolist(), [1024] * 3, scatter=True)
    assert gather.shapes_reused == 1
    for i, o in enumerate((0, 2048, 4096)):
        assert np.array_equal(flat[16384 + o : 16384 + o + 1024], window[1024 * i : 1024 * (i + 1)])


def test_a_piece_of_no_bytes_takes_no_row() -> None:
    """A zero-length piece among whole rows copies nothing and moves the pieces after it nowhere."""
    pool = torch.arange(1024, dtype=torch.int32).view(torch.uint8)
    staging = torch.zeros(512, dtype=torch.uint8)
    gather = TorchGather([pool], staging)
    at, base = staging.data_ptr(), pool.data_ptr()
    _run(gather, [base, base + 256, base + 512], [at, at + 64, at + 64], [64, 0, 64])
    flat = pool.numpy()
    assert np.array_equal(staging.numpy()[:128], np.concatenate([flat[:64], flat[512:576]]))
    assert not staging.numpy()[128:].any()


def test_where_registered_tensors_overlap_a_repeat_call_is_refused_as_a_first_call_would_be() -> None:
    """A view registered beside its tensor owns the bytes from its start on (the last tensor starting at or below a
    piece): a shifted call whose pieces now fall in the view, past its end, is refused, not copied from the tensor."""
    big = torch.arange(1024, dtype=torch.int32).view(torch.uint8)  # 4 KiB
    sub = big[1024:2048]
    staging = torch.zeros(2048, dtype=torch.uint8)
    gather = TorchGather([big, sub], staging)
    _run(gather, [big.data_ptr()], [staging.data_ptr()], [768])
    staging.zero_()
    with pytest.raises(ValueError, match="outside the registered tensors"):
        _run(gather, [big.data_ptr() + 1536], [staging.data_ptr()], [768])
    assert gather.shapes_reused == 0 and not staging.any()


def test_a_shape_that_agrees_only_where_the_key_looks_is_planned_afresh() -> None:
    """The shape key reads a few pieces; a call that differs elsewhere (here the third piece's source) shares the key
    but not the rows: it is planned afresh and lands its own bytes."""
    pool = torch.arange(8192, dtype=torch.int32).view(torch.uint8)  # 32 KiB, rows of 1 KiB
    staging = torch.zeros(16384, dtype=torch.uint8)
    gather = TorchGather([pool], staging)
    flat, base, at = pool.numpy(), pool.data_ptr(), staging.data_ptr()
    rows = np.arange(10, dtype=np.int64) * 2
    dst = (at + 1024 * np.arange(10)).tolist()
    _run(gather, (base + 1024 * rows).tolist(), dst, [1024] * 10)
    other = rows.copy()
    other[2] = 5  # piece 2 is no probe of the key
    _run(gather, (base + 1024 * other).tolist(), dst, [1024] * 10)
    assert gather.shapes_reused == 0
    want = np.concatenate([flat[1024 * r : 1024 * (r + 1)] for r in other])
    assert np.array_equal(staging.numpy()[:10240], want)


def test_a_shape_reused_at_lower_rows_lands_those_rows() -> None:
    """The first call of a shape at high rows, the next lower: the reused index moves back (a shift forward is a
    view of the tensor instead)."""
    pool = torch.arange(8192, dtype=torch.int32).view(torch.uint8)
    staging = torch.zeros(4096, dtype=torch.uint8)
    gather = TorchGather([pool], staging)
    flat, base, at = pool.numpy(), pool.data_ptr(), staging.data_ptr()
    rows = np.array([20, 22, 24, 26], dtype=np.int64)
    dst = (at + 1024 * np.arange(4)).tolist()
    for shift in (0, -17, 3):
        _run(gather, (base + 1024 * (rows + shift)).tolist(), dst, [1024] * 4)
        want = np.concatenate([flat[1024 * r : 1024 * (r + 1)] for r in rows + shift])
        assert np.array_equal(staging.numpy(), want), shift
    assert gather.shapes_reused == 2
