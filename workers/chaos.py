"""`ChaosRun`: load with random aborts and injected faults through a prefill and a decode engine, fully audited.

Imports `workers.engine`, `workers.executor`, `workers.process`, `workers.chaos_spec` (options and results, re-exported
here) and `kvsvc` (admin app, test hosts). Drives a P engine and a D engine (separate worker processes, real
Mooncake over loopback, or over a link between two network hosts with `hosts="netns"`) from one thread, the way an
engine core would: submit, step, abort. Every request is tracked until both engines reported it; the audit at the
end checks the reliability contract: every finished receive verified byte for byte on every D worker, every failed
one reported with all its blocks invalid, no request lost (each reported exactly once per engine), both block
allocators full again, no hold left on any worker.

Faults (one per phase, injected once half the phase's requests were submitted, after `probes` parked receives were
started: receives of transfers P never holds, so each fault has requests it must fail):

- `kill`: SIGKILL P worker `fault_worker`; D fails what waits on it; then the P engine restarts (new incarnation).
- `freeze`: SIGSTOP P worker `fault_worker` for `freeze_s`, then SIGCONT; D expires what waits on it.
- `restart`: the whole P engine restarts (new incarnation) while load is in flight.
- `cut`: D's control connections to P are cut through the admin endpoint `POST /v1/peers/{engine}/forget`
  (bearer token); the next receive reconnects.

Link faults, on the P host's link (`hosts="netns"`):

- `partition`: every packet to and from P dropped for `outage_s`, then healed (no reset reaches either side).
- `loss1`, `loss5`: 1 % or 5 % of the packets both ways dropped for `loss_s` while load goes on.
- `linkdown`: P's link down for `outage_s`, then up.
- `hostgone`: P's host drops off the network for good and its workers die; D fails what waited on it and the run
  goes on with a new P engine (another engine id) on a third host.

Nothing here sleeps on a fixed schedule except the freeze; every wait has a deadline and is recorded, never
asserted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import json
import random
import secrets
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from kvsvc.engine.admin import build_admin_app, random_token
from kvsvc.engine.netns import NetnsHosts, in_netns
from workers.chaos_spec import FAULTS, NET_FAULTS, ChaosOptions, ChaosResult, PhaseResult, default_service
from workers.engine import DecodeEngine, DecodeRequest, PrefillEngine, PrefillRequest
from workers.executor import Executor, start_all
from workers.view import ExecutorView

_IDLE_SLEEP_S: Final = 0.001
T = TypeVar("T")


@dataclass
class _Track:
    transfer_id: str
    phase: PhaseResult
    d_req: DecodeRequest
    p_req: PrefillRequest | None  # None: a parked probe that P never holds
    abort_side: str = ""  # "p" or "d" once an abort was issued
    affected_at: float | None = None  # when a fault hit it in flight
    after_fault_at: float | None = None  # the fault that was over when it was submitted


class ChaosRun:
    """Runs `options` on two started engines (see module docstring); one thread, not reentrant."""

    def __init__(
        self,
        options: ChaosOptions,
        prefill: PrefillEngine,
        decode: DecodeEngine,
        *,
        admin_url: str = "",
        admin_token: str = "",
        on_progress: Callable[[ChaosResult], None] | None = None,
        net: NetnsHosts | None = None,
    ) -> None:
        """`net`: the hosts the engines run on (`start_chaos_engines`); needed by the link faults.

        Raises:
            ValueError: `options` asks for link faults and `net` is None.
        """
        if net is None and any(f in NET_FAULTS for f in options.faults):
            raise ValueError(f"faults {options.faults} need the engines on network hosts (net=NetnsHosts)")
        self.net = net
        self._p_host = "prefill"
        self.options = options
        self.prefill, self.decode = prefill, decode
        self.admin_url, self.admin_token = admin_url, admin_token
        self.result = ChaosResult(options)
        self._rng = random.Random(options.seed)
        self._by_d: dict[str, _Track] = {}  # D req_id -> track, until D reported it
        self._by_p: dict[str, _Track] = {}  # P req_id -> track, until P reported it (or lost it in a restart)
        self._aborts: list[tuple[float, int, str]] = []  # (when, tiebreak, transfer id)
        self._tracks: dict[str, _Track] = {}
        self._p_up = True
        self._count = 0
        # Transfer ids are unique per P engine start (P answers a repeat with the outcome it remembers): runs on the
        # same engines must not reuse each other's.
        self._run_tag = secrets.token_hex(4)
        self._deadline = time.monotonic() + options.timeout_s
        self._on_progress = on_progress

    # -- the run -------------------------------------------------------------------------------------------------

    def run(self) -> ChaosResult:
        """Every phase, then the settle and the audit. Never raises for what the engines do wrong: it is recorded
        in `errors`; a worker command that fails (`WorkerError`) still propagates."""
        started = time.monotonic()
        names = ["load", *self.options.faults]
        share, extra = divmod(self.options.requests, len(names))
        for i, name in enumerate(names):
            self._phase(name, share + (1 if i < extra else 0))
        self._settle()
        self._audit()
        self.result.seconds = time.monotonic() - started
        return self.result

    def _phase(self, name: str, count: int) -> None:
        phase = PhaseResult(name)
        self.result.phases.append(phase)
        begin = time.monotonic()
        fault_at: float | None = None
        while phase.requests < count or any(t.phase is phase for t in self._by_d.values()):
            if self._expired(f"phase {name}"):
                break
            if name != "load" and fault_at is None and phase.requests >= count // 2:
                fault_at = self._inject(phase, count)
            while phase.requests < count and self._can_submit():
                self._submit(phase, fault_at)
            if not self._pump():
                time.sleep(_IDLE_SLEEP_S)
        phase.seconds = time.monotonic() - begin

    def _inject(self, phase: PhaseResult, count: int) -> float:
        fault, opts = phase.name, self.options
        phase.bound_s = opts.fault_bound_s(fault)
        for _ in range(opts.probes):
            self._probe(phase)
        self._pump_for(0.05)  # the probes' requests reach P
        at = time.monotonic()
        for track in self._by_d.values():
            track.affected_at = at
            track.phase.affected += 1
        p_exec = self.prefill.executor
        if fault == "kill":
            p_exec.kill(opts.fault_worker)
            self._p_up = False
            self._wait_affected(at + phase.bound_s)
            self._restart_p(phase)
        elif fault == "freeze":
            p_exec.stop(opts.fault_worker)
            self._p_up = False
            try:
                self._pump_for(opts.freeze_s)
            finally:
                p_exec.cont(opts.fault_worker)
            self._p_up = True
        elif fault == "restart":
            self._p_up = False
            self._restart_p(phase)
        elif fault == "cut":
            self._forget_p()
        elif fault in NET_FAULTS:
            self._inject_net(phase, fault, at, count)
        return at

    def _inject_net(self, phase: PhaseResult, fault: str, at: float, count: int) -> None:
        net, opts, host = self.net, self.options, self._p_host
        assert net is not None  # checked in __init__
        if fault == "partition":
            net.partition(host)
            sent = net.link_bytes(host)[1]
            try:
                self._pump_for(opts.outage_s)
                phase.link_bytes_during = net.link_bytes(host)[1] - sent
                phase.packets_dropped = net.dropped(host)
            finally:
                net.heal(host)
        elif fault == "linkdown":
            net.link(host, up=False)
            sent = net.link_bytes(host)[1]
            try:
                self._pump_for(opts.outage_s)
                phase.link_bytes_during = net.link_bytes(host)[1] - sent
            finally:
                net.link(host, up=True)
        elif fault in ("loss1", "loss5"):
            net.loss(host, 0.01 if fault == "loss1" else 0.05)
            try:
                self._load_for(phase, opts.loss_s, at, (count - phase.requests) // 2)
                phase.packets_dropped = net.dropped(host)
            finally:
                net.heal(host)
        elif fault == "hostgone":
            net.partition(host)  # never healed: the host is gone
            old = self.prefill.executor
            for index in range(old.num_workers):
                old.kill(index)
            self._p_up = False
            self._wait_affected(at + opts.fault_bound_s(fault))
            old.close()
            self._lost_with_p(list(self.prefill.requests.values()))
            self._replace_p(net)

    def _load_for(self, phase: PhaseResult, seconds: float, at: float, most: int) -> None:
        """Keep submitting (at most `most` requests, each counted as hit by the fault at `at`) for `seconds`."""
        until, submitted = time.monotonic() + seconds, 0
        while time.monotonic() < until:
            while submitted < most and self._can_submit():
                track = self._submit(phase, None)
                track.affected_at = at
                phase.affected += 1
                submitted += 1
            if not self._pump():
                time.sleep(_IDLE_SLEEP_S)

    def _replace_p(self, net: NetnsHosts) -> None:
        """Start a P engine with a new engine id on the spare host, D stepped meanwhile; the run goes on with it."""
        self._p_host = "spare"
        config = dataclasses.replace(self.prefill.executor.config, engine_id="chaos-p-spare")
        executor = Executor(config.on_host(net.address("spare"), net.netns("spare")))
        from workers.commands.common import sigint_ignored_by_children

        with sigint_ignored_by_children():
            executor.launch()  # Ctrl-C reaches the parent only, which stops the workers in order
        self._while_stepping_d(executor.start, "chaos-spare")
        self.prefill = PrefillEngine(executor)
        self._p_up = True

    def _restart_p(self, phase: PhaseResult) -> None:
        """Restart the P engine in a thread while D keeps being stepped (D must notice by itself)."""
        self._lost_with_p(self._while_stepping_d(self.prefill.restart, "chaos-restart"))
        self._p_up = True

    def _while_stepping_d(self, work: Callable[[], T], name: str) -> T:
        """`work()` in a thread named `name` while D keeps being stepped; its result, or what it raised."""
        outcome: list[T] = []
        errors: list[BaseException] = []

        def run() -> None:
            try:
                outcome.append(work())
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        while thread.is_alive():
            self._pump_d()
            thread.join(0.01)
        if errors:
            raise errors[0]
        return outcome[0]

    def _lost_with_p(self, lost: Iterable[PrefillRequest]) -> None:
        """Count the requests a P engine held when it went away (a restart, a host gone) as lost with it."""
        for req in lost:
            track = self._by_p.pop(req.req_id, None)
            if track is not None:
                track.phase.p_lost_in_restart += 1

    def _forget_p(self) -> None:
        """Cut D's control connections to P through the admin endpoint (or the worker command without one)."""
        p_id = self.prefill.executor.engine_id
        if not self.admin_url:
            from workers.process import ForgetEngine

            self.decode.executor.broadcast(ForgetEngine(p_id))
            return
        request = urllib.request.Request(
            f"{self.admin_url}/v1/peers/{p_id}/forget",
            method="POST",
            headers={"Authorization": f"Bearer {self.admin_token}"},
        )
        timeout_s = self.decode.executor.config.call_timeout_s

        def call() -> object:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read())

        # The admin endpoint listens on D's host: reach it from there.
        netns = self.decode.executor.config.netns
        answer: Any = call() if netns is None else in_netns(netns, call, timeout_s + 5)
        if answer.get("forgotten") != p_id:
            self.result.errors.append(f"forget answered {answer}")

    # -- requests ------------------------------------------------------------------------------------------------

    def _can_submit(self) -> bool:
        opts = self.options
        if not self._p_up or len(self._by_d) >= opts.concurrency:
            return False
        worst_p = -(-opts.max_tokens // opts.prefill_block_size)
        worst_d = -(-opts.max_tokens // opts.decode_block_size)
        return self.prefill.allocator.num_free >= worst_p and self.decode.allocator.num_free >= worst_d

    def _submit(self, phase: PhaseResult, fault_at: float | None) -> _Track:
        opts, rng = self.options, self._rng
        tokens, seed = rng.randint(1, opts.max_tokens), rng.randrange(1 << 30)
        transfer_id = f"{phase.name}-{self._run_tag}-{self._count}"
        self._count += 1
        p_exec = self.prefill.executor
        p_req = self.prefill.submit(transfer_id, tokens, seed)
        d_req = self.decode.submit(transfer_id, p_exec.engine_id, p_exec.url, tokens, seed)
        track = _Track(transfer_id, phase, d_req, p_req, after_fault_at=fault_at)
        self._register(track)
        phase.requests += 1
        if fault_at is not None:
            phase.after_fault += 1
        if rng.random() < opts.abort_rate:
            when = time.monotonic() + rng.uniform(0, opts.abort_window_s)
            heapq.heappush(self._aborts, (when, self._count, transfer_id))
        return track

    def _probe(self, phase: PhaseResult) -> None:
        """A receive of a transfer P never holds: it waits on P until the fault (or P's early-request timeout)."""
        transfer_id = f"{phase.name}-probe-{self._run_tag}-{self._count}"
        self._count += 1
        p_exec = self.prefill.executor
        d_req = self.decode.submit(transfer_id, p_exec.engine_id, p_exec.url, 1 + self._count % 8, None)
        self._register(_Track(transfer_id, phase, d_req, None))
        phase.probes += 1

    def _register(self, track: _Track) -> None:
        self._tracks[track.transfer_id] = track
        self._by_d[track.d_req.req_id] = track
        if track.p_req is not None:
            self._by_p[track.p_req.req_id] = track

    def _issue_aborts(self) -> None:
        now = time.monotonic()
        while self._aborts and self._aborts[0][0] <= now:
            _, tiebreak, transfer_id = heapq.heappop(self._aborts)
            track = self._tracks.get(transfer_id)
            if track is None:
                continue
            side = "p" if tiebreak % 2 else "d"
            if side == "p" and (not self._p_up or track.p_req is None):
                side = "d"
            if side == "p" and track.p_req is not None and track.p_req.req_id in self._by_p:
                self.prefill.abort(track.p_req)
            elif side == "d" and track.d_req.req_id in self._by_d:
                self.decode.abort(track.d_req)
            else:
                continue
            track.abort_side = side
            if side == "p":
                track.phase.aborted_p += 1
            else:
                track.phase.aborted_d += 1

    # -- stepping ------------------------------------------------------------------------------------------------

    def _pump(self) -> bool:
        """Issue due aborts, step both engines (P only while it runs); True when something was reported."""
        if self._p_up:
            self._issue_aborts()
        progressed = self._pump_d()
        if self._p_up:
            for req in self.prefill.step():
                if self._by_p.pop(req.req_id, None) is None:
                    self.result.duplicate_reports += 1
                progressed = True
        self._forget_ended()
        return progressed

    def _pump_d(self) -> bool:
        now = time.monotonic()
        ended = self.decode.step(verify=True)
        for req in ended:
            track = self._by_d.pop(req.req_id, None)
            if track is None:
                self.result.duplicate_reports += 1
                continue
            self._d_ended(track, req, now)
        if ended and self._on_progress is not None:
            self._on_progress(self.result)
        return bool(ended)

    def _d_ended(self, track: _Track, req: DecodeRequest, now: float) -> None:
        phase = track.phase
        if req.state == "finished":
            phase.finished += 1
            if track.p_req is None:
                self.result.errors.append(f"{track.transfer_id}: a probe finished, but P never held it")
            elif not req.verified_ok:
                bad = next((v for v in req.verified if not v.ok), None)
                self.result.errors.append(f"{track.transfer_id}: finished but not verified on every D worker: {bad}")
            else:
                phase.verified += 1
                if track.after_fault_at is not None:
                    phase.after_fault_finished += 1
                    since = now - track.after_fault_at
                    phase.recovery_s = since if phase.recovery_s is None else min(phase.recovery_s, since)
            return
        phase.failed += 1
        if req.invalid_block_ids != set(req.block_ids):
            missing = sorted(set(req.block_ids) - req.invalid_block_ids)[:8]
            self.result.errors.append(f"{track.transfer_id}: failed without all its blocks invalid ({missing} not)")
        if track.p_req is None:
            phase.probes_failed += 1
        if track.affected_at is not None:
            phase.affected_failed += 1
            if not track.abort_side and track.p_req is not None:
                phase.hit_failed_not_aborted += 1
                reason = req.reason.replace(track.transfer_id, "<id>")
                if reason in phase.reasons or len(phase.reasons) < 5:
                    phase.reasons[reason] = phase.reasons.get(reason, 0) + 1
            took = now - track.affected_at
            phase.fail_s = took if phase.fail_s is None else max(phase.fail_s, took)
        elif not track.abort_side:
            self.result.errors.append(f"{track.transfer_id}: failed with no abort and no fault")

    def _forget_ended(self) -> None:
        for transfer_id in [t for t, tr in self._tracks.items() if tr.d_req.req_id not in self._by_d]:
            track = self._tracks[transfer_id]
            if track.p_req is None or track.p_req.req_id not in self._by_p:
                del self._tracks[transfer_id]

    def _pump_for(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            if not (self._pump() if self._p_up else self._pump_d()):
                time.sleep(_IDLE_SLEEP_S)

    def _wait_affected(self, deadline: float) -> None:
        while any(t.affected_at is not None for t in self._by_d.values()) and time.monotonic() < deadline:
            if not self._pump_d():
                time.sleep(_IDLE_SLEEP_S)

    def _expired(self, what: str) -> bool:
        if time.monotonic() < self._deadline:
            return False
        self.result.errors.append(f"{what}: not done after {self.options.timeout_s:g} s")
        return True

    # -- the end -------------------------------------------------------------------------------------------------

    def _settle(self) -> None:
        """Wait (bounded by the hold deadline) for P to report every send and for every worker to drop its holds."""
        service = self.options.service
        bound = max(service.hold_timeout_s, service.early_request_timeout_s, service.abort_grace_s) + 30.0
        deadline = min(self._deadline, time.monotonic() + bound)
        while (self._by_d or self._by_p) and time.monotonic() < deadline:
            if not self._pump():
                time.sleep(0.01)
        while self._holds() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _holds(self) -> int:
        return sum(int(s["holds"]) for e in (self.prefill.executor, self.decode.executor) for s in e.statistics())

    def _audit(self) -> None:
        result = self.result
        result.requests_lost = len(self._by_d) + len(self._by_p)
        for track in list(self._by_d.values())[:5]:
            result.errors.append(f"{track.transfer_id}: D never reported it")
        for track in list(self._by_p.values())[:5]:
            result.errors.append(f"{track.transfer_id}: P never reported it")
        result.holds_leaked = self._holds()
        result.p_blocks_leaked = self.prefill.executor.config.num_blocks - self.prefill.allocator.num_free
        result.d_blocks_leaked = self.decode.executor.config.num_blocks - self.decode.allocator.num_free
        result.late_reports_ignored = sum(
            e.aggregator_statistics().late_reports_ignored for e in (self.prefill.executor, self.decode.executor)
        )
        for phase in result.phases:
            if phase.name == "load":
                continue
            if phase.probes_failed != phase.probes:
                result.errors.append(f"{phase.name}: {phase.probes - phase.probes_failed} probes did not fail")
            if phase.fail_s is not None and phase.bound_s is not None and phase.fail_s > phase.bound_s:
                result.errors.append(f"{phase.name}: failures took {phase.fail_s:.1f} s, bound {phase.bound_s:g} s")
            if phase.after_fault and phase.after_fault_finished == 0:
                result.errors.append(f"{phase.name}: no request finished after the fault (D did not recover)")


def chaos_hosts() -> NetnsHosts:
    """The network hosts of a `hosts="netns"` run: the P engine's, the D engine's and a spare for `hostgone`.
    Not entered yet (a context manager)."""
    return NetnsHosts(["prefill", "decode", "spare"])


def start_chaos_engines(
    options: ChaosOptions, net: NetnsHosts | None = None
) -> tuple[PrefillEngine, DecodeEngine, str, str]:
    """Start the P engine and the D engine (D's endpoint also serves the admin app, with a fresh token). With `net`
    (entered `chaos_hosts()`), each engine runs on its own host, every listener on its address, with a control
    token shared by the engines.

    Returns (prefill, decode, D admin URL, token).

    Raises:
        WorkerError: an engine failed to start (both are closed then). ValueError: `options.hosts` is "netns" and
            `net` is None.
    """
    from workers.commands.common import sigint_ignored_by_children

    p_config, d_config = options.engine_configs()
    if options.hosts == "netns":
        if net is None:
            raise ValueError("hosts='netns' needs the hosts: start_chaos_engines(options, net=chaos_hosts())")
        service = dataclasses.replace(options.service, control_token=random_token())
        p_config = dataclasses.replace(p_config, service=service).on_host(net.address("prefill"), net.netns("prefill"))
        d_config = dataclasses.replace(d_config, service=service).on_host(net.address("decode"), net.netns("decode"))
    p_exec, d_exec = Executor(p_config), Executor(d_config)
    try:
        with sigint_ignored_by_children():
            p_exec.launch()
            d_exec.launch()
        token = random_token()
        d_exec.serve_app(build_admin_app(ExecutorView(d_exec), token=token))
        start_all([p_exec, d_exec])
    except BaseException:
        p_exec.close()
        d_exec.close()
        raise
    return PrefillEngine(p_exec), DecodeEngine(d_exec), d_exec.url, token


def run_chaos(options: ChaosOptions, on_progress: Callable[[ChaosResult], None] | None = None) -> ChaosResult:
    """Start both engines, run `options`, close them (every process reaped, every namespace removed, also on
    errors).

    Raises:
        WorkerError: an engine failed to start or a worker failed a command. HostsError: `hosts="netns"` and the
            namespaces cannot be made here (the reason), or a fault's command failed.
    """
    from kvsvc.engine.netns import HostsError, skip_reason

    if options.hosts == "netns" and (why := skip_reason()) is not None:
        raise HostsError(f"hosts netns: {why}")
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(chaos_hosts()) if options.hosts == "netns" else None
        prefill, decode, url, token = start_chaos_engines(options, net)
        run: ChaosRun | None = None
        try:
            run = ChaosRun(options, prefill, decode, admin_url=url, admin_token=token, on_progress=on_progress, net=net)
            run.result.startup_seconds = time.monotonic() - started
            return run.run()
        finally:
            decode.executor.close()
            prefill.executor.close()
            if run is not None and run.prefill is not prefill:
                run.prefill.executor.close()


__all__ = [
    "FAULTS",
    "NET_FAULTS",
    "ChaosOptions",
    "ChaosResult",
    "ChaosRun",
    "PhaseResult",
    "chaos_hosts",
    "default_service",
    "run_chaos",
    "start_chaos_engines",
]
