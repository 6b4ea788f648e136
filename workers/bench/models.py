"""KV shapes of real models and the sizes of each scenario for `kvsvc bench`, importable without torch (the command
line lists them).

A shape is what one engine holds, all TP ranks together, in bf16. It matters to the comparison with the peers' way,
which moves one descriptor of `block_size * kv_heads_per_rank * head_size * 2` bytes per (layer, block, K/V half):
on Mooncake's TCP transport a descriptor costs a fixed 30-35 us, so small descriptors leave it far behind kvsvc's
block runs, and 32 KiB ones bring it within about 1.5x of the engine's ceiling (docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final


@dataclass(frozen=True)
class ModelShape:
    """The KV geometry of the bench's per-layer HND engines (large, heterogeneous TP, layer-wise)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int = 16  # bf16 throughout

    def block_bytes(self, tp_size: int = 1) -> int:
        """Bytes of one block, every layer, K and V, on one of `tp_size` ranks."""
        return self.num_layers * 2 * self.block_size * (self.num_kv_heads // tp_size) * self.head_size * 2


# Default: the model of vLLM's MooncakeConnector usage guide (Qwen/Qwen2.5-7B-Instruct).
MODELS: Final[dict[str, ModelShape]] = {
    m.name: m
    for m in (
        ModelShape("qwen2.5-7b", num_layers=28, num_kv_heads=4, head_size=128),  # 16 KiB per K/V half
        ModelShape("llama3-8b", num_layers=32, num_kv_heads=8, head_size=128),  # 32 KiB per K/V half
        ModelShape("llama3-70b", num_layers=80, num_kv_heads=8, head_size=128),
    )
}
DEFAULT_MODEL: Final = "qwen2.5-7b"


@dataclass(frozen=True)
class Sizes:
    """How big each scenario is; `quick` keeps the whole run near a minute on 2 cores. Request sizes are targets in
    bytes, rounded down to whole blocks of the model (at least one)."""

    reps: int  # of the large scenario, the one the ratio_to_raw target is read on (a repetition is under a second)
    small_reps: int
    hetero_reps: int
    large_requests: int
    large_request_bytes: int
    hetero_requests: int
    hetero_request_bytes: int
    small_requests: int
    layerwise_iterations: int
    layer_time_s: float
    model: ModelShape = MODELS[DEFAULT_MODEL]
    # the small scenario's own cross-layer model: 64 KiB one-block requests (8 layers, 2 heads of 64, block 16)
    small_layers: int = 8
    small_kv_heads: int = 2
    small_head_size: int = 64
    small_block_size: int = 16

    @property
    def large_blocks(self) -> int:
        return max(1, self.large_request_bytes // self.model.block_bytes())

    @property
    def hetero_blocks(self) -> int:
        return max(1, self.hetero_request_bytes // self.model.block_bytes())


MiB = 1 << 20
QUICK = Sizes(
    reps=15,
    small_reps=5,
    hetero_reps=9,
    large_requests=4,
    large_request_bytes=16 * MiB,
    hetero_requests=8,
    hetero_request_bytes=4 * MiB,
    small_requests=2000,
    layerwise_iterations=3,
    layer_time_s=0.004,
)
FULL = Sizes(
    reps=15,
    small_reps=7,
    hetero_reps=11,
    large_requests=8,
    large_request_bytes=32 * MiB,
    hetero_requests=16,
    hetero_request_bytes=4 * MiB,
    small_requests=10000,
    layerwise_iterations=5,
    layer_time_s=0.004,
)
_TINY_MODEL = ModelShape("tiny", num_layers=2, num_kv_heads=2, head_size=16, block_size=4)
TINY = Sizes(  # the test's sizes: every code path, seconds of work
    reps=1,
    small_reps=1,
    hetero_reps=1,
    large_requests=2,
    large_request_bytes=2 * _TINY_MODEL.block_bytes(),
    hetero_requests=2,
    hetero_request_bytes=2 * _TINY_MODEL.block_bytes(),
    small_requests=20,
    layerwise_iterations=1,
    layer_time_s=0.001,
    model=_TINY_MODEL,
    small_layers=2,
    small_head_size=16,
    small_block_size=4,
)


GPU_LARGE_FACTOR: Final = 32
GPU_LARGE_REQUESTS: Final = 8
GPU_REPS: Final = 5
GPU_HETERO_FACTOR: Final = 8


def gpu_sizes(sizes: Sizes) -> Sizes:
    """`sizes` for a run with the KV on a GPU: large requests `GPU_LARGE_FACTOR` times bigger and `GPU_LARGE_REQUESTS`
    of them (4 GiB a repetition from quick's 16 MiB), since a device copy moves 16 MiB in about 11 us, far under
    what a request's control path costs; `GPU_REPS` repetitions, each a fraction of a second; the layout
    scenarios' requests `GPU_HETERO_FACTOR` times bigger (32 MiB from 4: a request of about 600 tokens of the
    default model), for the same reason."""
    return replace(
        sizes,
        large_request_bytes=sizes.large_request_bytes * GPU_LARGE_FACTOR,
        hetero_request_bytes=sizes.hetero_request_bytes * GPU_HETERO_FACTOR,
        large_requests=GPU_LARGE_REQUESTS,
        reps=min(sizes.reps, GPU_REPS),
    )


__all__ = ["DEFAULT_MODEL", "FULL", "GPU_LARGE_FACTOR", "MODELS", "QUICK", "TINY", "ModelShape", "Sizes", "gpu_sizes"]
