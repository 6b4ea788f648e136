"""Contract tests of `kvsvc.core.topology` (docs/design.md, "Public API"): vLLM's TP ratio semantics and per-stage
registration."""

from __future__ import annotations

import dataclasses

import pytest

from kvsvc.core.errors import TopologyError
from kvsvc.core.topology import EngineTransferInfo, TransferTopology


def topo(tp_rank: int = 0, tp_size: int = 2, heads: int = 8, mla: bool = False) -> TransferTopology:
    return TransferTopology(
        tp_rank=tp_rank, tp_size=tp_size, block_size=16, engine_id="D", is_mla=mla, total_num_kv_heads=heads
    )


def test_engine_transfer_info_is_frozen_with_positional_order_and_defaults() -> None:
    info = EngineTransferInfo(4, 1024, 16, 1)
    assert (info.remote_tp_size, info.remote_block_len, info.remote_block_size) == (4, 1024, 16)
    assert info.remote_physical_blocks_per_logical == 1
    assert (info.remote_pp_rank, info.start_layer, info.end_layer) == (0, 0, 0)
    assert EngineTransferInfo(4, 1024, 16, 1, 2, 8, 16).end_layer == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.remote_tp_size = 2  # type: ignore[misc]


@pytest.mark.parametrize(("local", "remote", "ratio"), [(4, 2, 2), (4, 4, 1), (2, 4, -2), (1, 8, -8), (8, 1, 8)])
def test_tp_ratio_is_positive_when_local_is_larger_and_negative_otherwise(local: int, remote: int, ratio: int) -> None:
    assert topo(tp_size=local).tp_ratio(remote) == ratio


@pytest.mark.parametrize(("local", "remote"), [(4, 3), (3, 4), (6, 4)])
def test_non_divisible_tp_sizes_raise_topology_error_naming_both(local: int, remote: int) -> None:
    with pytest.raises(TopologyError, match=rf"(?s)(?=.*\b{local}\b)(?=.*\b{remote}\b)"):
        topo(tp_size=local).tp_ratio(remote)


def test_handshake_target_ranks_follow_vllm() -> None:
    assert topo(tp_rank=3, tp_size=4).handshake_target_ranks(2) == [1]
    assert topo(tp_rank=1, tp_size=2).handshake_target_ranks(8) == [4, 5, 6, 7]
    assert topo(tp_rank=0, tp_size=1).handshake_target_ranks(1) == [0]


def test_first_registration_of_a_key_wins_and_is_returned() -> None:
    t = topo()
    first = EngineTransferInfo(4, 100, 16, 1, remote_pp_rank=1)
    assert t.register_remote_engine("P", first) is first
    assert t.register_remote_engine("P", EngineTransferInfo(2, 200, 32, 1, remote_pp_rank=1)) is first
    assert t.get_engine_info("P", 1) is first
    other_stage = EngineTransferInfo(2, 200, 32, 1)
    assert t.register_remote_engine("P", other_stage) is other_stage
    assert t.get_engine_info("P") is other_stage
    assert t.registered_engines() == [("P", 0), ("P", 1)]


def test_registering_the_local_engine_raises_value_error() -> None:
    with pytest.raises(ValueError, match="local"):
        topo().register_remote_engine("D", EngineTransferInfo(2, 1, 16, 1))


def test_registering_a_non_divisible_tp_raises_at_handshake() -> None:
    t = topo(tp_size=4)
    with pytest.raises(TopologyError):
        t.register_remote_engine("P", EngineTransferInfo(3, 1, 16, 1))
    with pytest.raises(KeyError):
        t.get_engine_info("P")


def test_unknown_engine_raises_key_error() -> None:
    t = topo()
    with pytest.raises(KeyError):
        t.get_engine_info("P")
    with pytest.raises(KeyError):
        t.target_remote_ranks("P")
    with pytest.raises(KeyError):
        t.describe("P", 1)


def test_target_remote_ranks_use_the_registered_stage() -> None:
    t = topo(tp_rank=1, tp_size=2)
    t.register_remote_engine("P", EngineTransferInfo(4, 1, 16, 1))
    t.register_remote_engine("P", EngineTransferInfo(1, 1, 16, 1, remote_pp_rank=1))
    assert t.target_remote_ranks("P") == [2, 3]
    assert t.target_remote_ranks("P", 1) == [0]


def test_replication_follows_remote_tp_against_kv_heads() -> None:
    t = topo(heads=4)
    t.register_remote_engine("P", EngineTransferInfo(8, 1, 16, 1))
    t.register_remote_engine("Q", EngineTransferInfo(4, 1, 16, 1))
    assert t.is_kv_replicated("P") and t.replicates_kv_cache("P")
    assert not t.is_kv_replicated("Q") and not t.replicates_kv_cache("Q")
    mla = topo(mla=True)
    mla.register_remote_engine("Q", EngineTransferInfo(1, 1, 16, 1))
    assert mla.replicates_kv_cache("Q") and not mla.is_kv_replicated("Q")


def test_local_replicates_kv_cache_for_mla_or_more_ranks_than_heads() -> None:
    assert topo(tp_size=8, heads=4).local_replicates_kv_cache
    assert topo(mla=True).local_replicates_kv_cache
    assert not topo(tp_size=4, heads=4).local_replicates_kv_cache


def test_unregister_forgets_every_stage_and_is_idempotent() -> None:
    t = topo()
    t.register_remote_engine("P", EngineTransferInfo(2, 1, 16, 1))
    t.register_remote_engine("P", EngineTransferInfo(2, 1, 16, 1, remote_pp_rank=1))
    t.unregister_remote_engine("P")
    t.unregister_remote_engine("P")
    assert t.registered_engines() == []


def test_describe_names_tp_ratio_and_remote_pp() -> None:
    t = topo(tp_size=2)
    t.register_remote_engine("P", EngineTransferInfo(4, 1, 16, 1, remote_pp_rank=3))
    line = t.describe("P", 3)
    assert "tp_ratio=-2" in line and "remote_pp=3" in line


def test_invalid_local_identity_raises_value_error() -> None:
    with pytest.raises(ValueError):
        topo(tp_rank=2, tp_size=2)
    with pytest.raises(ValueError):
        topo(tp_size=0)
