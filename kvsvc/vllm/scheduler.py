"""The scheduler side of the vLLM connector, in vLLM's engine core: it feeds the sans-IO `SchedulerFlow` from
vLLM's request objects and serves this engine's workers' metadata on kvsvc's handshake endpoint.

Imports kvsvc's pure core, `kvsvc.engine` (endpoint, metadata checks) and the flow; never vllm itself (requests and
block objects are read by attribute). Rules: no decision is made here, only translated (`kvsvc.vllm.flow` decides);
the endpoint binds when the engine core hands over the merged worker metadata, before vLLM serves any request, and
answers 503 until then; a D request whose params cannot be used is logged with the reason and computed locally.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvsvc.core.auth import PARAMS_KEY, derive_key
from kvsvc.core.groups import FULL
from kvsvc.core.messages import WorkerMetadata
from kvsvc.engine.core_connector import check_engine_metadata
from kvsvc.engine.endpoint import BootstrapEndpoint
from kvsvc.vllm.config import ConnectorConfig
from kvsvc.vllm.flow import SchedulerFlow, StepMetadata
from kvsvc.vllm.params import ParamsError

log = logging.getLogger(__name__)

# vLLM's `RequestStatus` names of a request that ended by producing its output (NixlConnector reads them the same).
COMPLETED = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"})
_ENDPOINT_TIMEOUT_S = 10.0


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
    ) -> None:
        """`dp_rank`: this engine core's data-parallel rank (its endpoint's port, `bootstrap_port_of`);
        `group_kinds`: the kind of each of the model's KV cache groups (vLLM's hybrid KV cache manager gives each
        its own block list); `tp_size`: the engine's, which a pushing P announces; `dp_size`: its data-parallel
        size; `lookahead`: vLLM's `num_prefill_lookahead_tokens` (`SchedulerFlow.lookahead`).

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
            return
        try:
            self.flow.on_new_request(request.request_id, request.prompt_token_ids, params, max_tokens)
        except ParamsError as exc:
            log.error("request %s: kvsvc moves none of its KV, computing it locally: %s", request.request_id, exc)
            return
        except Exception:  # a bug of ours on params we did not foresee: vLLM's engine core must not die of it
            log.exception("request %s: kvsvc moves none of its KV, computing it locally", request.request_id)
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

    def build(self, scheduler_output: Any) -> StepMetadata:
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
        completed = getattr(request.status, "name", str(request.status)) in COMPLETED
        return self.flow.finished(request.request_id, groups, completed=completed)

    def connector_output(self, output: Any) -> None:
        self.flow.recvs_reported(output.finished_recving or ())


def _prompt_len(request: Any) -> int:
    """The prompt's length; vLLM asks about every request, and one given as embeddings has no token ids."""
    ids = request.prompt_token_ids
    return len(ids) if ids is not None else int(getattr(request, "num_prompt_tokens", 0))
