"""`KvsvcConnector`: kvsvc as a vLLM KV connector (`KVConnectorBase_V1`), loaded through `kv_connector_module_path`.

The only module of kvsvc that imports vllm. A thin adapter: vLLM's hooks go to `SchedulerSide` (engine core) or
`WorkerSide` (each worker) by role, and the decisions are `kvsvc.vllm.flow`'s. Rules: every hook returns at once
(the transfers run on each worker's kvsvc thread); what vLLM's scheduler is told follows its reporting rules
(`kvsvc.vllm.flow.TransferReports`); stats reach vLLM as `KvsvcStats` and its Prometheus endpoint under kvsvc's
metric names.

`SchedulerSide` feeds the sans-IO `SchedulerFlow` from vLLM's request objects (read by attribute, so it runs against
any object of their shape) and serves this engine's workers' metadata on kvsvc's handshake endpoint. It binds the
endpoint when the engine core hands over the merged worker metadata, before vLLM serves any request, and answers 503
until then; a D request whose params cannot be used is logged with the reason and computed locally. It also times,
per D request, the share of its time to first token spent waiting for its KV (`TTFT_KV_SHARE`): from the request
reaching D (vLLM's `arrival_time`) to vLLM learning its KV landed, over the time until this side first sees an output
token of it (at the end of a step, or the start of the next: within a step of the token), and counts the D requests
vLLM computes itself.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.platforms import current_platform

from kvsvc.core.auth import PARAMS_KEY, derive_key
from kvsvc.core.groups import FULL
from kvsvc.core.messages import FAILURE_CAUSES, KVGroup, WorkerMetadata
from kvsvc.core.outputs import LOAD_FAILED, LOADS
from kvsvc.engine.core_connector import check_engine_metadata
from kvsvc.engine.endpoint import BootstrapEndpoint
from kvsvc.engine.metrics import COUNTERS
from kvsvc.vllm.config import ConnectorConfig, parse_config, version_note
from kvsvc.vllm.flow import ParamsError, SchedulerFlow, StepMetadata, wants_remote_prefill
from kvsvc.vllm.kv_caches import published_cache_dtype
from kvsvc.vllm.kv_layout import GroupView, check_pipeline, kv_groups_of
from kvsvc.vllm.worker import WorkerIdentity, WorkerSide

log = logging.getLogger(__name__)

# vLLM's `RequestStatus` names of a request that ended by producing its output (NixlConnector reads them the same).
COMPLETED = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"})
_ENDPOINT_TIMEOUT_S = 10.0
# Keys of the engine core's stats (`take_stats`), beside the workers' (`KvsvcStats`): D requests whose params were
# refused (counted as a load failure of this cause), requests computed locally, and each loaded request's share.
REFUSED_PARAMS = "refused_params"
COMPUTED_LOCALLY = "computed_locally"
TTFT_KV_SHARE = "ttft_kv_share"
_MAX_SHARES = 4096  # samples kept between two of vLLM's stats calls (it asks every step)


@dataclasses.dataclass(slots=True)
class _Wait:
    """One D request's load, for its time-to-first-token share: wall-clock times, as vLLM's `arrival_time`."""

    request: Any  # vLLM's, whose `num_output_tokens` tells when its first token came
    arrival: float
    landed: float | None = None  # when vLLM was told its KV landed


class SchedulerSide:
    """One engine core's part of the connector (see module docstring).

    `kv_cache_manager` is vLLM's, bound after construction (`bind`): P looks up a request's blocks there in the
    step that computes its prompt.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        engine_id: str,
        block_size: int,
        dp_rank: int = 0,
        group_kinds: tuple[str, ...] = (FULL,),
        tp_size: int = 1,
        dp_size: int = 1,
        lookahead: int = 0,
        recompute: bool = False,
    ) -> None:
        """`dp_rank`: this engine core's data-parallel rank (its endpoint's port, `bootstrap_port_of`);
        `group_kinds`: the kind of each of the model's KV cache groups (vLLM's hybrid KV cache manager gives each
        its own block list); `tp_size`: the engine's, which a pushing P announces; `dp_size`: its data-parallel
        size; `lookahead`: vLLM's `num_prefill_lookahead_tokens` (`SchedulerFlow.lookahead`); `recompute`: vLLM
        recomputes a failed load (its `kv_load_failure_policy` is "recompute"), which then counts as computed locally.

        Raises:
            ValueError: as `ConnectorConfig.bootstrap_port_of` and `read_control_token`. OSError: the token file
                cannot be read.
        """
        self._config = config
        self._endpoint = BootstrapEndpoint(config.bootstrap_host, config.bootstrap_port_of(dp_rank), dp_rank=dp_rank)
        if config.mode == "push" and dp_size > 1:
            log.warning(
                "kvsvc: mode push needs data parallel size 1 (a router names P's endpoint to D before P's server "
                "picks a rank); this engine, at data parallel size %d, runs the pull flow",
                dp_size,
            )
        key = derive_key(config.read_control_token(), PARAMS_KEY)
        self.flow = SchedulerFlow(
            engine_id,
            "",
            block_size,
            group_kinds,
            params_key=key,
            # vllm-router names P's endpoint to D before P's server picks a data-parallel rank: D would wait at
            # another rank's endpoint. A P at DP > 1 runs the pull flow (logged below).
            push=config.mode == "push" and dp_size == 1,
            push_peers=frozenset(config.push_peers),
            tp_size=tp_size,
            lookahead=lookahead,
        )
        self._requests: dict[str, Any] = {}  # P requests held from their prefill step, until it is scheduled
        self._kv_cache_manager: Any = None
        self.metadata: dict[tuple[int, int], WorkerMetadata] = {}
        self._engine_untold = False  # the workers have not been handed the merged metadata yet
        self._recompute = recompute
        self._waits: dict[str, _Wait] = {}  # D requests loading, until their share is known
        self._stats: dict[str, Any] = {}

    def bind(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager

    # -- the handshake -----------------------------------------------------------------------------------------

    def publish(self, metadata: Mapping[tuple[int, int], Any]) -> None:
        """Check the engine's merged worker metadata and serve it; D engines fetch it from the address P's
        params carry.

        Raises:
            ValueError: it is not one engine start's complete worker set (`check_engine_metadata`), or a value is
                not kvsvc's `WorkerMetadata` (another connector's workers).
            OSError: the endpoint's port cannot be bound.
        """
        if not metadata:
            log.warning("no kvsvc worker metadata to publish: D engines cannot fetch from this engine")
            return
        wrong = sorted(key for key, meta in metadata.items() if not isinstance(meta, WorkerMetadata))
        if wrong:
            kinds = sorted({type(metadata[key]).__name__ for key in wrong})
            raise ValueError(f"workers {wrong[:8]} published {kinds}, not kvsvc WorkerMetadata")
        metas: dict[tuple[int, int], WorkerMetadata] = dict(metadata)
        check_engine_metadata(metas)
        url = self._endpoint.serve(metas, _ENDPOINT_TIMEOUT_S)
        port = url.rsplit(":", 1)[1]
        self.flow.bootstrap_addr = f"http://{self._config.advertised_host}:{port}"
        self.metadata = metas
        self._engine_untold = True
        first = next(iter(metas.values()))
        log.info(
            "kvsvc: engine %r (incarnation %s) serves %d workers' metadata at %s",
            first.engine_id,
            first.incarnation,
            len(metas),
            self.flow.bootstrap_addr,
        )

    def close(self) -> None:
        self._endpoint.close(_ENDPOINT_TIMEOUT_S)

    # -- requests ----------------------------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        sampling = getattr(request, "sampling_params", None)
        max_tokens = getattr(sampling, "max_tokens", None)
        if request.prompt_token_ids is None:  # a prompt given as embeddings: no tokens to hash, bound or move
            log.error("request %s: kvsvc moves no KV of a prompt given as embeddings; computing it locally",
                      request.request_id)  # fmt: skip
            if wants_remote_prefill(params):
                self._count(COMPUTED_LOCALLY)
            return
        try:
            self.flow.on_new_request(request.request_id, request.prompt_token_ids, params, max_tokens)
        except ParamsError as exc:
            log.error("request %s: kvsvc moves none of its KV, computing it locally: %s", request.request_id, exc)
            if wants_remote_prefill(params):
                self._count(LOAD_FAILED + REFUSED_PARAMS, COMPUTED_LOCALLY)
            return
        except Exception:  # a bug of ours on params we did not foresee: vLLM's engine core must not die of it
            log.exception("request %s: kvsvc moves none of its KV, computing it locally", request.request_id)
            if wants_remote_prefill(params):
                self._count(LOAD_FAILED + REFUSED_PARAMS, COMPUTED_LOCALLY)
            return
        dropped = self.flow.dropped_tokens(request.request_id)
        if dropped:
            # P prefills the prompt without the tokens D computes (`SchedulerFlow.held_back`), then stops.
            del request.prompt_token_ids[-dropped:]
            del request._all_token_ids[-dropped:]
            request.num_prompt_tokens -= dropped
            request.max_tokens = 1
        if self.flow.wants_blocks(request.request_id):
            self._requests[request.request_id] = request

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.flow.matched_tokens(request.request_id, _prompt_len(request), num_computed_tokens)

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        groups = blocks.get_block_ids() if num_external_tokens > 0 else [[] for _ in self.flow.group_kinds]
        self.flow.after_alloc(request.request_id, groups, num_external_tokens, _prompt_len(request))
        if num_external_tokens > 0 and len(self._waits) < _MAX_SHARES:
            self._waits[request.request_id] = _Wait(request, float(getattr(request, "arrival_time", 0) or time.time()))

    def build(self, scheduler_output: Any) -> StepMetadata:
        self._first_tokens()
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            groups = self._kv_cache_manager.get_block_ids(req_id)
            self.flow.scheduled(req_id, request.num_computed_tokens, num_scheduled, groups)
            if not self.flow.wants_blocks(req_id):
                del self._requests[req_id]
        step = self.flow.build()
        if not scheduler_output.total_num_scheduled_tokens:
            step = dataclasses.replace(step, idle=True)
        if self._engine_untold:  # D workers of a PP engine need their own engine's layer split
            self._engine_untold = False
            step = dataclasses.replace(step, engine=dict(self.metadata))
        return step

    def finished(self, request: Any, groups: Sequence[Sequence[int]]) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished(_all_groups)`: `groups` holds one block list per KV cache group."""
        self._requests.pop(request.request_id, None)
        wait = self._waits.pop(request.request_id, None)
        if wait is not None and _has_output(request):
            self._share(wait, time.time())
        completed = getattr(request.status, "name", str(request.status)) in COMPLETED
        return self.flow.finished(request.request_id, groups, completed=completed)

    def connector_output(self, output: Any) -> None:
        self.flow.recvs_reported(output.finished_recving or ())
        now, failed = time.time(), getattr(output, "failed_recving", None) or set()
        for req_id in output.finished_recving or ():
            wait = self._waits.get(req_id)
            if wait is None:
                continue
            if req_id in failed:
                del self._waits[req_id]
                if self._recompute:
                    self._count(COMPUTED_LOCALLY)
            else:
                wait.landed = now
        self._first_tokens()  # vLLM appended this step's tokens before it called here

    def take_stats(self) -> dict[str, Any] | None:
        """The engine core's stats since the last call (module docstring), or None."""
        stats, self._stats = self._stats, {}
        return stats or None

    def _first_tokens(self) -> None:
        """Loaded requests that have an output token now have had their first token since the last look."""
        now = time.time()
        for req_id, wait in list(self._waits.items()):
            if wait.landed is not None and _has_output(wait.request):
                del self._waits[req_id]
                self._share(wait, now)

    def _share(self, wait: _Wait, now: float) -> None:
        if wait.landed is None or now <= wait.arrival:
            return
        shares = self._stats.setdefault(TTFT_KV_SHARE, [])
        if len(shares) < _MAX_SHARES:
            shares.append(min(1.0, max(0.0, (wait.landed - wait.arrival) / (now - wait.arrival))))

    def _count(self, *keys: str) -> None:
        for key in keys:
            self._stats[key] = self._stats.get(key, 0) + 1


def _has_output(request: Any) -> bool:
    return int(getattr(request, "num_output_tokens", 0) or 0) > 0


def _prompt_len(request: Any) -> int:
    """The prompt's length; vLLM asks about every request, and one given as embeddings has no token ids."""
    ids = request.prompt_token_ids
    return len(ids) if ids is not None else int(getattr(request, "num_prompt_tokens", 0))


if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


# kvsvc's stat keys (`KVTransferService.get_finished` deltas, plus the worker's receive counts) -> metric names.
STAT_METRICS = {
    "bytes": "kvsvc_sent_bytes",
    "descriptors": "kvsvc_sent_descriptors",
    "transfers": "kvsvc_sent_transfers",
    "write_failures": "kvsvc_write_failures",
    "protocol_errors": "kvsvc_protocol_errors",
    "reconnects": "kvsvc_reconnects",
    "received": "kvsvc_received_transfers",
    "receive_failures": "kvsvc_receive_failures",
    "early_served": "kvsvc_early_served",
}


class KvsvcMetadata(KVConnectorMetadata):
    """One step's `StepMetadata`, as vLLM carries it from the scheduler to the workers."""

    def __init__(self, step: StepMetadata) -> None:
        self.step = step


class KvsvcStats(KVConnectorStats):
    """One interval's counters (bytes and descriptors sent, receives, failures by cause...), summed over workers and
    steps, and its per-request samples (`LOADS`, `TTFT_KV_SHARE`), concatenated."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if isinstance(value, list):
                self.data.setdefault(key, []).extend(value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """What vLLM's interval log line shows: the counters, and the loads' count and mean time."""
        reduced: dict[str, int | float] = {k: v for k, v in self.data.items() if not isinstance(v, list)}
        loads = self.data.get(LOADS) or []
        if loads:
            reduced["loads"] = len(loads)
            reduced["mean load ms"] = round(1000 * sum(load[0] for load in loads) / len(loads), 3)
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data.values())


# The phases of a `LOADS` sample, in its order ([total_s, handshake_s, queue_s, write_s, bytes]).
LOAD_PHASES = ("total", "handshake", "queue", "write")
_SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
_BYTES_BUCKETS = [float(1 << k) for k in range(16, 37, 2)]  # 64 KiB .. 64 GiB
_GBPS_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
_SHARE_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


class KvsvcPromMetrics(KVConnectorPromMetrics):
    """kvsvc's counters on vLLM's `/metrics`, named as kvsvc's own endpoint names them (`kvsvc_sent_bytes_total`...),
    and each load's phases: `kvsvc_load_seconds{phase}` (one observation per D worker that loaded a share of a
    request: one per request at TP 1), `kvsvc_load_bytes`, `kvsvc_load_gbps` (bytes over P's write),
    `kvsvc_ttft_kv_share` (per request, on D's engine core: the share of its time to first token it waited for its
    KV), `kvsvc_load_failures_total{cause}` and `kvsvc_computed_locally_total`. Every label is from a fixed set:
    the series are bounded."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        helps = {name: text for name, text, _ in COUNTERS}
        engines = per_engine_labelvalues
        self._counters: dict[str, dict[int, Any]] = {}
        for key, name in STAT_METRICS.items():
            counter = self._counter_cls(name=name, documentation=helps.get(name, name), labelnames=labelnames)
            self._counters[key] = {engine: counter.labels(*values) for engine, values in engines.items()}
        failures = self._counter_cls(
            name="kvsvc_load_failures",
            documentation="D: loads that failed, by cause (the reason is in the log line of each)",
            labelnames=[*labelnames, "cause"],
        )
        for cause in (*FAILURE_CAUSES, REFUSED_PARAMS):
            self._counters[f"{LOAD_FAILED}{cause}"] = {e: failures.labels(*v, cause) for e, v in engines.items()}
        local = self._counter_cls(
            name="kvsvc_computed_locally",
            documentation="D: requests with kvsvc params whose prompt vLLM computed itself (refused params, "
            "embeddings, a failed load under kv_load_failure_policy recompute)",
            labelnames=labelnames,
        )
        self._counters[COMPUTED_LOCALLY] = {e: local.labels(*v) for e, v in engines.items()}
        histogram: Any = self._histogram_cls  # vLLM types its metric classes as a union of the three
        phases = histogram(
            name="kvsvc_load_seconds",
            documentation="D: one load, by phase: total (start to landing), handshake (P's metadata and hello), "
            "queue (waiting at P and the round trip), write (P's write)",
            labelnames=[*labelnames, "phase"],
            buckets=_SECONDS_BUCKETS,
        )
        self._phases: list[dict[int, Any]] = [
            {e: phases.labels(*v, phase) for e, v in engines.items()} for phase in LOAD_PHASES
        ]
        self._bytes = self._histograms("kvsvc_load_bytes", "D: the bytes of one load", _BYTES_BUCKETS)
        self._gbps = self._histograms("kvsvc_load_gbps", "D: one load's bytes over P's write time, GB/s", _GBPS_BUCKETS)
        self._share = self._histograms(
            "kvsvc_ttft_kv_share",
            "D: per request, the share of its time to first token (from reaching D) spent waiting for its KV",
            _SHARE_BUCKETS,
        )

    def _histograms(self, name: str, documentation: str, buckets: list[float]) -> dict[int, Any]:
        histogram: Any = self._histogram_cls
        family = histogram(name=name, documentation=documentation, labelnames=self._labelnames, buckets=buckets)
        return {e: family.labels(*v) for e, v in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            children = self._counters.get(key)
            if children is not None and engine_idx in children and value and not isinstance(value, list):
                children[engine_idx].inc(value)
        if engine_idx not in self._bytes:
            return
        for load in transfer_stats_data.get(LOADS) or ():
            if not isinstance(load, list | tuple) or len(load) != len(LOAD_PHASES) + 1:
                continue  # not kvsvc's sample: vLLM's output handler must not fail on it
            for phase, seconds in zip(self._phases, load[:4], strict=True):
                phase[engine_idx].observe(seconds)
            nbytes, write_s = load[4], load[3]
            self._bytes[engine_idx].observe(nbytes)
            if write_s > 0:
                self._gbps[engine_idx].observe(nbytes / write_s / 1e9)
        for share in transfer_stats_data.get(TTFT_KV_SHARE) or ():
            self._share[engine_idx].observe(share)


def log_through_vllm() -> None:
    """Send kvsvc's log records where vLLM sends its own, at vLLM's level. vLLM configures only its "vllm" logger
    (handler, format, level, no propagation), so under `vllm serve` kvsvc's records would reach only Python's
    last-resort handler: warnings, and no route or startup lines. Does nothing when kvsvc's logger or the root logger
    has a handler (the operator configured logging) or vLLM's has none (`VLLM_CONFIGURE_LOGGING=0`)."""
    ours, theirs = logging.getLogger("kvsvc"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:  # a level the operator set stays
        ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


class KvsvcConnector(KVConnectorBase_V1, SupportsHMA):
    """kvsvc's vLLM connector (see module docstring and docs/vllm.md). It supports vLLM's hybrid KV cache manager:
    every hook sees one block list per KV cache group, and each group moves what D needs of it.

    Raises (constructor): ValueError for a `kv_connector_extra_config` key that is unknown or malformed, or a
    control port beyond loopback without a token; TopologyError for a KV cache group kvsvc cannot move (Mamba
    state...), named with its layers.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        log_through_vllm()
        transfer = self._kv_transfer_config
        self._config: ConnectorConfig = parse_config(transfer.kv_connector_extra_config)
        engine_id = str(transfer.engine_id)
        block_size = int(vllm_config.cache_config.block_size)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        groups = _kv_groups(vllm_config, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            log.log(*version_note(vllm.__version__))
            # With data parallelism each rank's engine core is an engine of its own: vLLM has made its engine id
            # `<id>_dp<rank>`, and its handshake endpoint gets a port of its own.
            dp_rank = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
            kinds = tuple(group.kind for group in groups) or (FULL,)
            tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
            dp_size = int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1)
            lookahead = int(vllm_config.num_prefill_lookahead_tokens)
            recompute = getattr(transfer, "kv_load_failure_policy", "fail") == "recompute"
            self._scheduler = SchedulerSide(
                self._config, engine_id, block_size, dp_rank, kinds, tp_size, dp_size, lookahead, recompute
            )
            return
        parallel, model = vllm_config.parallel_config, vllm_config.model_config
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        identity = WorkerIdentity(
            engine_id=engine_id,
            incarnation=str(vllm_config.instance_id),
            pp_rank=get_pp_group().rank_in_group,
            pp_size=parallel.pipeline_parallel_size,
            tp_rank=get_tp_group().rank_in_group,
            tp_size=parallel.tensor_parallel_size,
            total_kv_heads=model.get_total_num_kv_heads(),
            head_size=model.get_head_size(),
            is_mla=bool(model.use_mla),
            block_size=block_size,
            kv_groups=tuple(groups),
            num_layers=_num_layers(vllm_config),
            cache_dtype=published_cache_dtype(
                str(vllm_config.cache_config.cache_dtype), str(current_platform.fp8_dtype())
            ),
        )
        token = self._config.read_control_token()
        self._worker = WorkerSide(self._config, self._config.service_config(token), identity)

    # -- worker side -------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches, _kv_scales(self._vllm_config, kv_caches))

    def get_handshake_metadata(self) -> Any:
        return self._worker_side().metadata

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:  # vLLM binds before every forward: the one hook that surely precedes it
            self._worker.bind_step(self._step())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker_side().begin_step(self._step())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # a receive lands whole before vLLM schedules the request: nothing to wait for per layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker_side().layer_saved(layer_name, self._step())

    def wait_for_save(self) -> None:
        # vLLM calls this from a `finally`: an exception in flight here is the forward's, whose KV is not all written.
        self._worker_side().end_step(self._step(), failed=sys.exc_info()[1])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Called from the same `finally` as `wait_for_save`, which vLLM defers past it with drafts on: an exception
        # in flight here is the forward's.
        worker = self._worker_side()
        results = worker.transfer_results(finished_req_ids, idle=self._step().idle, failed=sys.exc_info()[1])
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # vLLM asks both sides: the workers' stats ride each step's output, the scheduler's join them.
        side = self._worker if self._worker is not None else self._scheduler
        stats = side.take_stats() if side is not None else None
        return KvsvcStats(data=dict(stats)) if stats else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler side ----------------------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler_side().bind(kv_cache_manager)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self._scheduler_side().publish(metadata)

    def on_new_request(self, request: Request) -> None:
        self._scheduler_side().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler_side().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KvsvcMetadata(self._scheduler_side().build(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_side().connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().finished(request, [block_ids])

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().finished(request, block_ids)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """vLLM 0.33's question, asked when `enable_sleep_mode` is set: no. Sleep remaps the KV cache onto other
        pages, and kvsvc does not follow (its Mooncake registrations and the addresses it published on one host
        would name the old pages), so vLLM refuses to start such an engine rather than move stale bytes."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Heads outermost inside a block (`LBHNC`, kvsvc's `HNC`; the CPU backend's only layout): a head split
        between P and D of different TP sizes is then one run per (block, head range), not one per token. MLA has
        one latent per token: any layout."""
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            return None
        return "LBHNC"

    # -- stats -------------------------------------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvsvcStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvsvcPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- internals ---------------------------------------------------------------------------------------------

    def _step(self) -> StepMetadata:
        meta = self._connector_metadata
        return meta.step if isinstance(meta, KvsvcMetadata) else StepMetadata()

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side hook was called on the scheduler-side kvsvc connector")
        return self._worker

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side hook was called on the worker-side kvsvc connector")
        return self._scheduler


def _kv_scales(vllm_config: VllmConfig, names: Iterable[str]) -> dict[str, tuple[float, float]]:
    """Each layer's (k_scale, v_scale) by name, as vLLM's attention layer holds them once the weights loaded, for
    an fp8 cache; none for a cache stored unquantized."""
    if not str(vllm_config.cache_config.cache_dtype).startswith("fp8"):
        return {}
    context = vllm_config.compilation_config.static_forward_context
    found = {}
    for name in names:
        layer = context.get(name)
        k, v = getattr(layer, "_k_scale_float", None), getattr(layer, "_v_scale_float", None)
        if k is not None and v is not None:
            found[name] = (float(k), float(v))
    return found


def _num_layers(vllm_config: VllmConfig) -> int:
    """The target model's layer count over all PP stages, after which a draft model's layers are numbered."""
    return int(vllm_config.model_config.get_total_num_hidden_layers())


def _mla_variant(spec: Any) -> str:
    """What sets vLLM's MLA `spec` apart from plain MLA, in words (`GroupView.variant`): a cache role other than the
    attention's own (DeepSeek V3.2's sparse-attention indexer), a model version (DeepSeek V4), several tokens per
    state; empty for plain MLA and for other specs."""
    if not hasattr(spec, "cache_role"):  # only MLA specs have one; other specs may not define tokens_per_state
        return ""
    role = str(getattr(spec.cache_role, "value", spec.cache_role))
    out = [f"cache role {role}"] if role != "sparse" else []
    if getattr(spec, "model_version", None):
        out.append(f"model version {spec.model_version}")
    if getattr(spec, "tokens_per_state", 1) != 1:
        out.append(f"{spec.tokens_per_state} tokens per state")
    return ", ".join(out)


def _kv_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> list[KVGroup]:
    """The model's KV cache groups (`kv_groups_of`); none known (an older vLLM): one group of full attention.

    Raises:
        TopologyError: as `kv_groups_of`.
    """
    if kv_cache_config is None:
        return []
    hf_config = vllm_config.model_config.hf_config
    n_groups = next((int(getattr(hf_config, k)) for k in ("mamba_n_groups", "n_groups") if hasattr(hf_config, k)), 0)
    # Qwen3.5 keeps its language model's fields in a text config; Qwen3-Next in the top one (the same object).
    text_config = getattr(vllm_config.model_config, "hf_text_config", hf_config)
    gdn_keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    gdn_dims = (
        tuple(int(getattr(text_config, k)) for k in gdn_keys) if all(hasattr(text_config, k) for k in gdn_keys) else ()
    )
    views = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        view = GroupView(
            type(spec).__name__,
            tuple(group.layer_names),
            int(getattr(spec, "sliding_window", 0) or 0),
            int(getattr(spec, "attention_chunk_size", 0) or 0),
            variant=_mla_variant(spec),
        )
        if hasattr(spec, "mamba_type"):
            mamba: Any = spec  # vLLM's MambaSpec
            from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

            view = dataclasses.replace(
                view,
                mamba_type=str(getattr(mamba.mamba_type, "name", mamba.mamba_type)),
                shapes=tuple(tuple(shape) for shape in mamba.shapes),
                dtypes=tuple(str(dtype).removeprefix("torch.") for dtype in mamba.dtypes),
                n_groups=n_groups,
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                conv_layout=get_conv_state_layout(),
                gdn_dims=gdn_dims,
                tp_replicated=bool(getattr(mamba, "tp_replicated", False)),
            )
        views.append(view)
    groups = kv_groups_of(views, _num_layers(vllm_config))
    check_pipeline(groups, vllm_config.parallel_config.pipeline_parallel_size)
    if groups:
        log.info(
            "kvsvc: %d KV cache groups: %s",
            len(groups),
            [(g.kind, g.layers, g.sliding_window or g.attention_chunk) for g in groups],
        )
    return groups
