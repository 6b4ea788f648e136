"""KV shapes of real models for `kvsvc bench`, importable without torch (the command line lists them).

A shape is what one engine holds, all TP ranks together, in bf16. It matters to the comparison with the peers' way,
which moves one descriptor of `block_size * kv_heads_per_rank * head_size * 2` bytes per (layer, block, K/V half):
on Mooncake's TCP transport a descriptor costs a fixed 30-35 us, so small descriptors leave it far behind kvsvc's
block runs, and 32 KiB ones bring it within about 1.5x of the engine's ceiling (docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass
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


__all__ = ["DEFAULT_MODEL", "MODELS", "ModelShape"]
