"""The scheduler side of the vLLM connector, in vLLM's engine core: it feeds the sans-IO `SchedulerFlow` from
vLLM's request objects and serves this engine's workers' metadata on kvsvc's handshake endpoint.

Imports kvsvc's pure core, `kvsvc.engine` (endpoint, metadata checks) and the flow; never vllm itself (requests and
block objects are read by attribute). Rules: no decision is made here, only translated (`kvsvc.vllm.flow` decides);
the endpoint binds when the engine core hands over the merged worker metadata, before vLLM serves any request, and
answers 503 until then; a D request whose params cannot be used is logged with the reason and computed locally.
It also times, per D request, the share of its time to first token spent waiting for its KV (`TTFT_KV_SHARE`): from
the request reaching D (vLLM's `arrival_time`) to vLLM learning its KV landed, over the time until this side first
sees an output token of it (at the end of a step, or the start of the next: within a step of the token), and counts
the D requests vLLM computes itself.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvsvc.core.auth import PARAMS_KEY, derive_key
from kvsvc.core.groups import FULL
from kvsvc.core.messages import WorkerMetadata
from kvsvc.core.outputs import LOAD_FAILED
from kvsvc.engine.core_connector import check_engine_metadata
from kvsvc.engine.endpoint import BootstrapEndpoint
from kvsvc.vllm.config import ConnectorConfig
from kvsvc.vllm.flow import SchedulerFlow, StepMetadata
from kvsvc.vllm.params import ParamsError, wants_remote_prefill

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
