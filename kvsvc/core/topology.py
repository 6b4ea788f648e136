"""TP/PP identity of one local worker and what it learned about remote engines at handshake (vLLM semantics).

Pure module: imports only the standard library and `kvsvc.core.errors`. Invariants: remote engines are keyed
`(engine_id, remote_pp_rank)` and the first registration of a key wins; non-divisible TP sizes are a
`TopologyError` here, at handshake, never per request; the local engine is never registered as a remote.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsvc.core.errors import TopologyError


@dataclass(frozen=True)
class EngineTransferInfo:
    """Per remote `(engine_id, pp_rank)` transfer state, computed once at handshake."""

    remote_tp_size: int
    remote_block_len: int  # bytes of one remote block of one layer
    remote_block_size: int  # tokens per remote block
    remote_physical_blocks_per_logical: int
    remote_pp_rank: int = 0
    start_layer: int = 0  # first global layer the remote stage owns
    end_layer: int = 0  # exclusive


class TransferTopology:
    """The local worker's TP/PP position, and the remote engine stages it transfers with."""

    def __init__(
        self,
        *,
        tp_rank: int,
        tp_size: int,
        block_size: int,
        engine_id: str,
        is_mla: bool,
        total_num_kv_heads: int,
        pp_rank: int = 0,
        pp_size: int = 1,
        start_layer: int = 0,
        end_layer: int = 0,
    ) -> None:
        """Raises:
        ValueError: a size below 1 or a rank outside its size.
        """
        if tp_size < 1 or pp_size < 1 or block_size < 1 or total_num_kv_heads < 1:
            raise ValueError(
                f"tp_size {tp_size}, pp_size {pp_size}, block_size {block_size} and "
                f"total_num_kv_heads {total_num_kv_heads} must all be >= 1"
            )
        if not 0 <= tp_rank < tp_size or not 0 <= pp_rank < pp_size:
            raise ValueError(f"rank (pp {pp_rank}, tp {tp_rank}) outside sizes (pp {pp_size}, tp {tp_size})")
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.block_size = block_size
        self.engine_id = engine_id
        self.is_mla = is_mla
        self.total_num_kv_heads = total_num_kv_heads
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.start_layer = start_layer
        self.end_layer = end_layer
        self._engines: dict[tuple[str, int], EngineTransferInfo] = {}

    def register_remote_engine(self, remote_engine_id: str, info: EngineTransferInfo) -> EngineTransferInfo:
        """Store `info` under `(remote_engine_id, info.remote_pp_rank)`; an existing entry wins and is returned.

        Raises:
            ValueError: `remote_engine_id` is the local engine's id.
            TopologyError: the remote TP size and the local one do not divide one another.
        """
        if remote_engine_id == self.engine_id:
            raise ValueError(f"cannot register the local engine {self.engine_id!r} as a remote engine")
        key = (remote_engine_id, info.remote_pp_rank)
        existing = self._engines.get(key)
        if existing is not None:
            return existing
        self.tp_ratio(info.remote_tp_size)
        self._engines[key] = info
        return info

    def get_engine_info(self, remote_engine_id: str, remote_pp_rank: int = 0) -> EngineTransferInfo:
        """Raises:
        KeyError: no engine stage registered under that key.
        """
        return self._engines[(remote_engine_id, remote_pp_rank)]

    def unregister_remote_engine(self, remote_engine_id: str) -> None:
        """Forget every stage of a remote engine (a new incarnation of it is a new peer); idempotent."""
        for key in [k for k in self._engines if k[0] == remote_engine_id]:
            del self._engines[key]

    def registered_engines(self) -> list[tuple[str, int]]:
        """The `(engine_id, remote_pp_rank)` keys registered so far, sorted."""
        return sorted(self._engines)

    def tp_ratio(self, remote_tp_size: int) -> int:
        """`tp // remote` when the local TP is at least the remote one, else `-(remote // tp)`.

        Raises:
            TopologyError: the larger size is not a multiple of the smaller (both named), or a size below 1.
        """
        if remote_tp_size < 1:
            raise TopologyError(f"remote tp_size {remote_tp_size} must be >= 1 (local tp_size {self.tp_size})")
        if self.tp_size >= remote_tp_size:
            if self.tp_size % remote_tp_size:
                raise TopologyError(f"local tp_size {self.tp_size} is not divisible by remote tp_size {remote_tp_size}")
            return self.tp_size // remote_tp_size
        if remote_tp_size % self.tp_size:
            raise TopologyError(f"remote tp_size {remote_tp_size} is not divisible by local tp_size {self.tp_size}")
        return -(remote_tp_size // self.tp_size)

    def handshake_target_ranks(self, remote_tp_size: int) -> list[int]:
        """Remote TP ranks this rank handshakes with, from the sizes alone (before registration).

        Raises:
            TopologyError: the TP sizes do not divide one another.
        """
        ratio = self.tp_ratio(remote_tp_size)
        if ratio > 0:
            return [self.tp_rank // ratio]
        return [self.tp_rank * -ratio + i for i in range(-ratio)]

    def target_remote_ranks(self, remote_engine_id: str, remote_pp_rank: int = 0) -> list[int]:
        """`handshake_target_ranks` for a registered remote engine stage.

        Raises:
            KeyError: the stage is not registered.
        """
        return self.handshake_target_ranks(self.get_engine_info(remote_engine_id, remote_pp_rank).remote_tp_size)

    def is_kv_replicated(self, remote_engine_id: str, remote_pp_rank: int = 0) -> bool:
        """Whether the remote stage replicates KV heads (its TP exceeds the number of KV heads).

        Raises:
            KeyError: the stage is not registered.
        """
        return self.get_engine_info(remote_engine_id, remote_pp_rank).remote_tp_size > self.total_num_kv_heads

    def replicates_kv_cache(self, remote_engine_id: str, remote_pp_rank: int = 0) -> bool:
        """MLA (one latent every rank holds) or replicated KV heads on the remote stage.

        Raises:
            KeyError: the stage is not registered.
        """
        return self.is_mla or self.is_kv_replicated(remote_engine_id, remote_pp_rank)

    @property
    def local_replicates_kv_cache(self) -> bool:
        """MLA, or the local TP exceeds the number of KV heads."""
        return self.is_mla or self.tp_size > self.total_num_kv_heads

    def describe(self, remote_engine_id: str, remote_pp_rank: int = 0) -> str:
        """One line for logs about the transfer set-up with a registered remote stage.

        Raises:
            KeyError: the stage is not registered.
        """
        info = self.get_engine_info(remote_engine_id, remote_pp_rank)
        return (
            f"TransferTopology(engine={self.engine_id}, remote_engine={remote_engine_id}, "
            f"tp_ratio={self.tp_ratio(info.remote_tp_size)}, "
            f"num_kv_heads={1 if self.is_mla else self.total_num_kv_heads}, is_mla={self.is_mla}, "
            f"local_tp={self.tp_size}, remote_tp={info.remote_tp_size}, local_pp={self.pp_rank}, "
            f"remote_pp={remote_pp_rank}, local_rank={self.tp_rank}, block_size={self.block_size}, "
            f"remote_block_size={info.remote_block_size}, remote_block_len={info.remote_block_len}, "
            f"remote_layers=[{info.start_layer}, {info.end_layer}))"
        )


__all__ = ["EngineTransferInfo", "TransferTopology"]
