"""The worker side of the vLLM connector: one GPU (or CPU) worker's KV pool, its kvsvc service, and the reports
vLLM's scheduler may act on.

Imports torch and kvsvc's service and transport, never vllm (the adapter hands in plain values and tensors). Rules:
- The service runs on its own loop thread (`ServiceThread`); every hook hands it work and returns at once: starting
  a send or a receive waits neither for the network nor for the loop, and the step's report waits a bounded time.
  A busy loop delays reports, never the engine's step; only a loop that stops answering for `call_timeout_s` fails
  the step (`KVSvcTimeout`), since its transfers may still write into blocks vLLM would hand to other requests.
- What vLLM's scheduler may be told is `kvsvc.vllm.flow`'s to decide (`TransferReports`); this module feeds it.
  What work handed to the loop decides (a receive started, a send or receive refused) reaches it as `Outcome` values
  through a queue the loop appends to, whenever the loop gets to it; every id handed in gets one, whatever it raised.
- When a step's sends may read their KV is one `Readiness` value, made by the hook that learns it and turned into
  the loop's futures once, on the loop (`_on_loop`).
- On GPU a send waits for a CUDA event per layer recorded after that layer's attention wrote it (layer-wise sends);
  on CPU the forward is over when the hook runs, so the KV is ready at once. A pushing P on CPU starts the step's
  sends of at least `push_min_tokens` prompt tokens before the forward instead (`bind_step`: vLLM binds a step's
  metadata before its forward, and since 0.32 calls `start_load_kv` after it), each layer ready once `save_kv_layer`
  saw it written: D's fetch already waits at P, so the transfer runs beside the forward. Shorter ones go after the
  forward, as a pulling P's (`kvsvc.core.sender.streams_during_forward` decides). A step's per-layer state is reset
  at its bind, never later.
- The forward's time (from `bind_step` to `end_step` of steps that compute) is measured here, for D's report
  gathering (`kvsvc.core.receiver.ReportGather`): an idle step's report may wait a share of it for a burst's loads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from kvsvc.core.errors import KVSvcError, KVSvcTimeout
from kvsvc.core.messages import WorkerMetadata
from kvsvc.core.sender import streams_during_forward
from kvsvc.service.config import ServiceConfig
from kvsvc.service.gather import TorchGather
from kvsvc.service.service import ServiceThread
from kvsvc.service.staging_area import StagingArea, build_staging
from kvsvc.transport.base import Transport
from kvsvc.transport.mooncake import MooncakeConfig
from kvsvc.transport.routed import worker_transport
from kvsvc.transport.streams import completion_future
from kvsvc.vllm.config import ConnectorConfig
from kvsvc.vllm.flow import (
    Outcome,
    RecvRefused,
    RecvStarted,
    SendRefused,
    StepMetadata,
    TransferReports,
    TransferResults,
)
from kvsvc.vllm.kv_caches import WorkerIdentity, describe_kv_caches
from kvsvc.vllm.kv_layout import layer_index

log = logging.getLogger(__name__)

FORWARD_WEIGHT = 0.25  # weight of the newest forward in `forward_s`: steps differ in size, a burst's most of all
MAX_SAMPLES = 4096  # per-request samples a worker keeps for vLLM's next stats (each list of `take_stats`)


@dataclass(frozen=True, slots=True)
class Written:
    """The step's KV is written (on CPU, the forward is over)."""


@dataclass(frozen=True, slots=True)
class Failed:
    """The forward raised `error`: no layer it had not finished may be sent."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class AfterEvent:
    """The KV is written once the device passed `event`, a CUDA event after everything enqueued."""

    event: Any


@dataclass(frozen=True, slots=True)
class LayerEvents:
    """Layer i's KV is written once the device passed `events[i]` (recorded after each layer's attention)."""

    events: list[Any]


@dataclass(frozen=True, slots=True)
class LayerFutures:
    """Layer i's KV is written once `futures[i]` resolves (a pushing P on CPU, set by `save_kv_layer`)."""

    futures: list[concurrent.futures.Future[None]]


# When a step's sends may read their KV, as the hooks learn it; turned into the service's `ready` once, on its loop.
Readiness = Written | Failed | AfterEvent | LayerEvents | LayerFutures


def _on_loop(readiness: Readiness) -> Any:
    """`readiness` as `start_send` takes it on the service's loop: None, an awaitable, or one per layer."""
    match readiness:
        case Written():
            return None
        case Failed(error):
            failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            failed.set_exception(error)
            return failed
        case AfterEvent(event):
            return completion_future(event)
        case LayerEvents(events):
            return [completion_future(e) for e in events]
        case LayerFutures(futures):
            return [asyncio.wrap_future(f) for f in futures]


class WorkerSide:
    """One vLLM worker's part of the connector (see module docstring)."""

    def __init__(self, config: ConnectorConfig, service_config: ServiceConfig, identity: WorkerIdentity) -> None:
        self._config = config
        self._service_config = service_config
        self._identity = identity
        self._thread: ServiceThread | None = None
        self._layer_of: dict[str, int] = {}
        self._device = "cpu"
        self.reports = TransferReports()
        # What the service's loop decided of a step's sends and receives, as events for `reports`: a `call` that
        # timed out still runs there later (the deque's append and popleft are safe across threads).
        self._outcomes: deque[Outcome] = deque()
        self._stats: dict[str, Any] = {}  # counters, and per-request samples as lists (`KVTransferService.LOADS`)
        # Ids this worker reported to vLLM, over its life: a test checks that every worker of every PP stage reports.
        self.reported_sending = 0
        self.reported_recving = 0
        # Layers a pushing P on CPU saw written while their sends were already started: the proof that it streams.
        self.streamed_layers = 0
        self._events: dict[int, Any] = {}  # this step's CUDA events per local layer, for layer-wise sends
        # A pushing P on CPU: this step's sends started before the forward, one future per local layer that
        # `layer_saved` resolves (and `end_step` for any layer it never saw).
        self._layers_ready: list[concurrent.futures.Future[None]] = []
        # A bound step whose sends wait for its `wait_for_save` (or, where vLLM never calls it, the next bind); for a
        # pushing P on CPU, the sends of the step `_split` names that it writes after the forward (short prompts).
        self._unstarted: StepMetadata | None = None
        self._split: StepMetadata | None = None
        self._forward_started: float | None = None  # `bind_step` of a step that computes, until its `end_step`
        self.forward_s = 0.0  # moving average of the forward's time (0: none measured yet)

    # -- start and stop ----------------------------------------------------------------------------------------

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], scales: Mapping[str, tuple[float, float]] | None = None
    ) -> WorkerMetadata:
        """Describe vLLM's KV tensors (with each layer's KV scales by name, for a quantized cache), register them
        with a Mooncake engine, start the service; returns the metadata this worker publishes.

        Raises:
            UnknownKVLayout, TopologyError, ValueError: as `describe_kv_caches` (the engine does not start).
            TransportError, OSError: Mooncake or the control server could not start.
        """
        draft, regions = describe_kv_caches(kv_caches, self._identity, scales)
        self._layer_of = {name: layer_index(name, self._identity.num_layers) - draft.start_layer for name in kv_caches}
        self._device = next(iter(kv_caches.values())).device.type
        mooncake = MooncakeConfig(
            host=self._config.transport_host, protocol=self._config.protocol, device_name=self._config.device_name
        )

        staging, staging_region = self._staging_area(kv_caches)

        def transport() -> Transport:
            engine = worker_transport(mooncake, self._device, self._service_config.transport)
            engine.register(regions + staging_region)
            return engine

        thread = ServiceThread(
            draft, transport, self._service_config, call_timeout_s=self._config.call_timeout_s, staging=staging
        )
        meta = thread.start()
        self._thread = thread
        log.info(
            "kvsvc worker (pp %d, tp %d) of %r: layers [%d, %d), layout %s, %d blocks of %d tokens, control %s, "
            "transfer engine %s",
            meta.pp_rank,
            meta.tp_rank,
            meta.engine_id,
            meta.start_layer,
            meta.end_layer,
            meta.layout,
            meta.num_blocks,
            meta.block_size,
            meta.control_addr,
            meta.transport_addr or "started when a pair needs it",
        )
        return meta

    def _staging_area(self, kv_caches: Mapping[str, torch.Tensor]) -> tuple[StagingArea | None, list[tuple[int, int]]]:
        """The worker's staging region on the KV cache's device, and the region to register; none when the config
        asks for none or a KV tensor is not contiguous (the gather reads whole tensors as bytes)."""
        if not self._config.staging_bytes:
            return None, []
        tensors = list({t.data_ptr(): t for t in kv_caches.values()}.values())
        try:
            # Registered by the caller, with the KV tensors, in the service's thread.
            _, area = build_staging(self._config.staging_bytes, partial(TorchGather, tensors), device=tensors[0].device)
        except ValueError as exc:
            log.warning("kvsvc: no staging region, every write goes direct: %s", exc)
            return None, []
        return area, [(area.addr, area.size)]

    @property
    def metadata(self) -> WorkerMetadata | None:
        """What this worker publishes, once `register_kv_caches` started its service."""
        return self._thread.metadata if self._thread is not None else None

    def set_engine_metadata(self, metas: dict[tuple[int, int], WorkerMetadata]) -> None:
        """This worker's whole engine (needed by D workers of engines with several PP stages).

        Raises:
            ValueError: it lacks this worker.
        """
        self._service().set_engine_metadata(metas)

    def close(self) -> None:
        """Close the service: writes in flight drain first (bounded), what D waits for is answered failed."""
        if self._thread is not None:
            self._thread.close()

    # -- each step ---------------------------------------------------------------------------------------------

    def bind_step(self, step: StepMetadata) -> None:
        """`bind_connector_metadata`, before the step's forward: the step's sends are owed a report from here on,
        whichever of vLLM's later hooks comes first; a pushing P on CPU starts them here, each layer ready once the
        forward wrote it (`layer_saved`). The last step's sends, if its `wait_for_save` never came (vLLM skips it
        on a PP rank that is not the last when drafts are on), start here: that forward is over.

        Raises:
            ServiceClosed: the service's loop is not running (the sends are not handed in, nor owed a report).
        """
        self._start_unstarted()
        self._events.clear()
        self._forward_started = None if step.idle else time.monotonic()
        if not step.sends:
            return
        self.reports.sends_handed(spec.req_id for spec in step.sends)
        if self._device == "cpu" and self._config.mode == "push":
            least = self._config.push_min_tokens
            streamed = tuple(spec for spec in step.sends if streams_during_forward(spec.num_tokens, least))
            after = tuple(spec for spec in step.sends if not streams_during_forward(spec.num_tokens, least))
            self._split = step
            self._unstarted = dataclasses.replace(step, sends=after) if after else None
            if streamed:
                self._layers_ready = [concurrent.futures.Future() for _ in range(len(self._layer_of))]
                self._start_sends(dataclasses.replace(step, sends=streamed), LayerFutures(list(self._layers_ready)))
        else:
            self._unstarted = step

    def _start_unstarted(self) -> None:
        """Start what the last step bound and never saw written: its sends (one CUDA event after everything
        enqueued so far on GPU), and the layers of a pushing P's started sends that `save_kv_layer` never named."""
        for ready in self._layers_ready:
            if not ready.done():
                ready.set_result(None)
        self._layers_ready = []
        step, self._unstarted = self._unstarted, None
        if step is not None:
            self._start_sends(step, self._written_now())

    def begin_step(self, step: StepMetadata) -> None:
        """`start_load_kv` (after the forward since vLLM 0.32, before it earlier): start this step's receives and
        carry out its aborts."""
        if step.engine is None and not (step.recvs or step.aborts or step.withdrawn):
            return

        def run(service: Any) -> None:
            if step.engine is not None:
                try:
                    service.set_engine_metadata(dict(step.engine))
                except ValueError as exc:  # the scheduler's view of the engine lacks this worker: its receives fail
                    log.error("kvsvc: this step's engine metadata is unusable: %s", exc)
            for req_id in step.aborts:
                service.abort(req_id)
            for gone in step.withdrawn:
                try:
                    service.withdraw(gone.transfer_id, gone.secret, gone.reason)
                except ValueError as exc:  # a secret no hold could have had: nothing waits for it
                    log.error("kvsvc: withdrawal of transfer %r refused: %s", gone.transfer_id, exc)
            for spec in step.recvs:
                try:
                    service.recv(spec)
                except Exception as exc:  # blocks outside the pool, a repeated transfer id, a defect: it fails alone
                    log.error("receive of %s (transfer %r) could not start: %s", spec.req_id, spec.transfer_id, exc)
                    self._outcomes.append(RecvRefused(spec.req_id, tuple(spec.block_ids)))
                else:
                    self._outcomes.append(RecvStarted(spec.req_id, tuple(spec.block_ids), spec.push))

        self._service().post(run)

    def layer_saved(self, layer_name: str, step: StepMetadata) -> None:
        """`save_kv_layer`: mark where this layer's KV is written, for this step's layer-wise sends (a CUDA event
        on GPU; on CPU, where the write is done, the layer's future of a pushing P)."""
        if self._layers_ready:
            index = self._layer_of.get(layer_name)
            if index is not None and not self._layers_ready[index].done():
                self._layers_ready[index].set_result(None)
                self.streamed_layers += 1
            return
        if not step.sends or self._device != "cuda":
            return
        layer = self._layer_of.get(layer_name)
        if layer is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            self._events[layer] = event

    def end_step(self, step: StepMetadata, failed: BaseException | None = None) -> None:
        """`wait_for_save`: start this step's sends (their forward is over on CPU, enqueued on GPU); for sends a
        pushing P started before the forward, every layer is written now. `failed`: the forward raised it (vLLM
        calls the hook from a `finally`), so no layer it had not finished may be sent: those sends' holds end
        aborted and D's fetches fail, never taking unwritten blocks as loaded. vLLM may call it before or after
        `get_transfer_results` (after, when drafts are on, so that the draft's KV is written too): either way each
        send is reported once."""
        if self._forward_started is not None:
            sample, self._forward_started = time.monotonic() - self._forward_started, None
            self.forward_s = (
                sample if not self.forward_s else self.forward_s + FORWARD_WEIGHT * (sample - self.forward_s)
            )
        if self._layers_ready:
            for ready in self._layers_ready:
                if ready.done():
                    continue
                if failed is None:  # a layer `save_kv_layer` never named (a state layer): written all the same
                    ready.set_result(None)
                else:
                    ready.set_exception(failed)
            self._layers_ready = []
        if self._split is step:  # a pushing P: what is left are the short prompts it writes after the forward
            self._split = None
            deferred, self._unstarted = self._unstarted, None
            if deferred is None:
                return
            step = deferred
        elif self._unstarted is step:
            self._unstarted = None
        if not step.sends:
            return
        readiness: Readiness
        if failed is not None:
            readiness = Failed(failed)
        elif self._device == "cuda" and len(self._events) == len(self._layer_of):
            readiness = LayerEvents([self._events[i] for i in range(len(self._layer_of))])
        else:
            readiness = self._written_now()
        self.reports.sends_handed(spec.req_id for spec in step.sends)
        self._start_sends(step, readiness)

    def _written_now(self) -> Written | AfterEvent:
        """What marks the KV written by everything enqueued so far: on CPU, it is written; on GPU, where no
        per-layer events were recorded (a CUDA graph replayed the layers, the KV was computed in an earlier step),
        one event after all of it, so no byte is read before the forward wrote it."""
        if self._device != "cuda":
            return Written()
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return AfterEvent(event)

    def _start_sends(self, step: StepMetadata, readiness: Readiness) -> None:
        """Hand the step's sends to the service, each ready as `readiness` says (turned into the loop's futures
        there, per send: each send awaits its own)."""

        def run(service: Any) -> None:
            for spec in step.sends:
                ready = _on_loop(readiness)
                try:
                    service.send(spec, ready)
                except Exception as exc:  # as for receives: the send fails alone, and is reported so
                    log.error("send of %s could not start: %s", spec.req_id, exc)
                    self._outcomes.append(SendRefused(spec.req_id))

        try:
            self._service().post(run)
        except BaseException:  # a closed loop: sends never handed in are never owed a report
            self.reports.sends_dropped(spec.req_id for spec in step.sends)
            raise

    def _fail_unstarted(self, failed: BaseException) -> None:
        """The forward raised `failed` before `wait_for_save` (deferred with drafts on, so vLLM's `finally` skips
        it): no layer it had not finished may be sent, as `end_step` rules for a failed forward."""
        for ready in self._layers_ready:
            if not ready.done():
                ready.set_exception(failed)
        self._layers_ready = []
        step, self._unstarted = self._unstarted, None
        if step is not None:
            self._start_sends(step, Failed(failed))

    def transfer_results(
        self, finished_req_ids: set[str], *, idle: bool = False, failed: BaseException | None = None
    ) -> TransferResults:
        """`get_transfer_results`: what ended since the last call, as `TransferReports` lets vLLM be told it. An
        `idle` step (nothing computed) waits up to `idle_wait_s` for the service's news while a receive is owed, and
        up to `push_idle_wait_s` while each waits for a pushing P's prefill (`TransferReports.idle_wait`): vLLM
        would otherwise spin through empty steps on the cores a prefill needs. An idle step's report may also wait a
        share of the forward's time for receives about to land (`KVTransferService.get_finished`).

        `failed`: the step's forward raised it, and this step's sends not started yet never will be as written.

        Raises:
            KVSvcTimeout: the service's loop has not answered for `call_timeout_s` (`ServiceThread.get_finished`).
            ServiceClosed: the service's loop is not running.
        """
        if failed is not None:
            self._fail_unstarted(failed)
        config = self._config
        wait = 0.0
        if idle and not self._outcomes:
            wait = self.reports.idle_wait(finished_req_ids, config.idle_wait_s, config.push_idle_wait_s)
        report = self._service().get_finished(wait, self.forward_s if idle else 0.0)
        while self._outcomes:  # drained after the report: a receive it names was queued as started before it
            self.reports.decided(self._outcomes.popleft())
        results = self.reports.report(
            finished_req_ids,
            report.finished_sending or (),
            report.finished_recving or (),
            report.failed_recving or (),
            report.invalid_block_ids,
        )
        if results.service_failures:
            self._log_failures(results.service_failures)
        self._count(report.kv_connector_stats, results)
        self.reported_sending += len(results.finished_sending)
        self.reported_recving += len(results.finished_recving)
        return results

    def load_errors(self) -> set[int]:
        """`get_block_ids_with_load_errors`: blocks of failed receives since the last call (`TransferReports`)."""
        return self.reports.take_load_errors(hybrid=bool(self._identity.kv_groups))

    def take_stats(self) -> dict[str, Any] | None:
        """Counters and per-request samples since the last call (None when nothing moved)."""
        stats, self._stats = self._stats, {}
        return stats or None

    def statistics(self) -> Any:
        """The service's `ServiceStatistics` (holds, receives, peers...), for tests and diagnostics."""
        return self._service().statistics()

    # -- internals ---------------------------------------------------------------------------------------------

    def _service(self) -> ServiceThread:
        if self._thread is None:
            raise KVSvcError("the kvsvc worker service is not started: vLLM has not registered its KV caches")
        return self._thread

    def _log_failures(self, req_ids: set[str]) -> None:
        """One warning per failed receive with the service's reason: vLLM itself only sees the blocks invalid, and
        recomputes them (or fails the request) without saying why."""
        try:
            reasons = self._service().call(lambda service: {r: service.failure_reason(r) for r in req_ids})
        except KVSvcTimeout:  # a busy loop: the failures are reported all the same, only their reasons are lost
            reasons = {}
        for req_id in sorted(req_ids):
            why = reasons.get(req_id) or "the service no longer remembers why"
            log.warning("kvsvc: receive of %s failed, its blocks are reported invalid: %s", req_id, why)

    def _count(self, deltas: object, results: TransferResults) -> None:
        if isinstance(deltas, Mapping):
            for key, value in deltas.items():
                if isinstance(value, list):
                    samples = self._stats.setdefault(key, [])
                    samples.extend(value)
                    del samples[: max(0, len(samples) - MAX_SAMPLES)]  # vLLM takes them every step: never reached
                else:
                    self._stats[key] = self._stats.get(key, 0) + int(value)
        received = len(results.finished_recving - results.failed_recving)
        for key, value in (("received", received), ("receive_failures", len(results.failed_recving))):
            if value:
                self._stats[key] = self._stats.get(key, 0) + value


__all__ = ["TransferResults", "WorkerIdentity", "WorkerSide", "describe_kv_caches"]
