"""The synthetic model writes KV that `verify` accepts, and `verify` notices any element that differs."""

from __future__ import annotations

import pytest
import torch

from kvsvc.core.layout import heads_of_rank
from workers.kv_pool import KVPool, WorkerShape, engine_shapes
from workers.synthetic import expected_kv, fill, ready_after_fill, verify


def _pool(tp_rank: int = 0, tp_size: int = 1, layout: str = "HND", dtype: str = "bfloat16", bs: int = 4) -> KVPool:
    shape = engine_shapes(
        engine_id="e",
        num_layers=3,
        num_kv_heads=4,
        head_size=8,
        block_size=bs,
        num_blocks=16,
        tp_size=tp_size,
        dtype=dtype,
        layout=layout,
    )[tp_rank]
    return KVPool(shape, "inc")


def test_pool_is_one_contiguous_region_with_one_address_per_layer() -> None:
    pool = _pool()
    ((addr, length),) = pool.regions()
    assert addr == pool.meta.base_addrs[0]
    assert length == 3 * 16 * 2 * 4 * 4 * 8 * 2
    assert pool.layers[0].shape == (16, 2, 4, 4, 8)
    assert pool.meta.base_addrs[1] - pool.meta.base_addrs[0] == length // 3


@pytest.mark.parametrize("layout", ["HND", "NHD", "KV_HND", "KV_NHD", "HNC", "NHC", "HND_FUSED"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_filled_request_verifies_including_a_partial_last_block(layout: str, dtype: str) -> None:
    pool = _pool(layout=layout, dtype=dtype)
    blocks = [5, 6, 2, 9]  # runs and a jump; 14 tokens leave the last block half full
    fill(pool.layers, pool.meta, 7, blocks, 14)
    result = verify(pool.layers, pool.meta, 7, blocks, 14)
    assert result.ok and result.mismatches == 0
    assert result.checked == 3 * 2 * 4 * 14 * 8


def test_values_are_small_integers_and_depend_on_token_not_on_block_layout() -> None:
    small, large = _pool(bs=2), _pool(bs=8)
    fill(small.layers, small.meta, 3, list(range(8)), 15)
    fill(large.layers, large.meta, 3, [4, 5], 15)
    want = expected_kv(3, 1, range(4), 15, 8, torch.bfloat16)
    assert torch.equal(want, want.round()) and want.abs().max() <= 125
    got_small = small.layers[1][:8].permute(1, 2, 0, 3, 4).reshape(2, 4, 16, 8)[:, :, :15]
    got_large = large.layers[1][4:6].permute(1, 2, 0, 3, 4).reshape(2, 4, 16, 8)[:, :, :15]
    assert torch.equal(got_small, want) and torch.equal(got_large, want)


def test_a_corrupted_element_is_found_with_its_location() -> None:
    pool = _pool(tp_rank=1, tp_size=2)
    blocks = [3, 4, 8]
    fill(pool.layers, pool.meta, 11, blocks, 10)
    # Layer 2 (global), V half, second local head, token 9 (block 8, slot 1), dim 5.
    pool.layers[2][8, 1, 1, 1, 5] += 1
    result = verify(pool.layers, pool.meta, 11, blocks, 10)
    assert not result.ok and result.mismatches == 1
    assert result.first is not None
    heads = list(heads_of_rank(1, 2, 4))
    assert (result.first.layer, result.first.half, result.first.head, result.first.token, result.first.dim) == (
        2,
        1,
        heads[1],
        9,
        5,
    )
    assert result.first.actual == result.first.expected + 1


def test_one_flipped_byte_is_found() -> None:
    pool = _pool()
    fill(pool.layers, pool.meta, 1, [0, 1], 8)
    raw = pool.layers[0].view(torch.uint8).view(-1)
    raw[37] ^= 0x01  # the low byte of a bf16: a tiny change of value
    assert verify(pool.layers, pool.meta, 1, [0, 1], 8).mismatches == 1


def test_another_seed_or_stale_blocks_fail_verification() -> None:
    pool = _pool()
    fill(pool.layers, pool.meta, 1, [0, 1, 2], 12)
    assert not verify(pool.layers, pool.meta, 2, [0, 1, 2], 12).ok
    assert not verify(pool.layers, pool.meta, 1, [3, 4, 5], 12).ok  # never written: zeros


def test_slots_past_num_tokens_are_not_checked() -> None:
    pool = _pool()
    fill(pool.layers, pool.meta, 4, [0, 1], 6)
    pool.layers[0][1, :, :, 2:] = 0  # tokens 6 and 7: past the request's end
    assert verify(pool.layers, pool.meta, 4, [0, 1], 6).ok


def test_blocks_that_cannot_hold_the_tokens_are_refused() -> None:
    pool = _pool()
    with pytest.raises(ValueError, match="do not fit"):
        fill(pool.layers, pool.meta, 1, [0], 5)
    with pytest.raises(ValueError, match="outside the pool"):
        verify(pool.layers, pool.meta, 1, [16], 1)


def test_worker_shapes_follow_the_engine_split() -> None:
    shapes = engine_shapes(
        engine_id="e", num_layers=5, num_kv_heads=4, head_size=8, block_size=4, num_blocks=8, pp_size=2, tp_size=2
    )
    assert [(s.pp_rank, s.tp_rank, s.start_layer, s.end_layer) for s in shapes] == [
        (0, 0, 0, 3),
        (0, 1, 0, 3),
        (1, 0, 3, 5),
        (1, 1, 3, 5),
    ]
    assert isinstance(shapes[0], WorkerShape)


def test_kv_written_on_the_cpu_is_ready_at_once() -> None:
    assert ready_after_fill(torch.device("cpu")) is None
