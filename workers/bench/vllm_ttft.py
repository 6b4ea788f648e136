"""The `ttft` workload of `kvsvc bench --vllm`: a user's time to first token through disaggregation, and how much of
the transfer it exposes, per connector.

The bench process plays the router's pull flow (vLLM's toy proxy and vllm-router without push): it sends a prompt to P
with `max_tokens` 1, and once P answered, to D with P's params; and for a pushing P, vllm-router's push flow
(`push_one_at_a_time`): D first with the router's params, P at once after, both named from one router request id.
End-to-end TTFT runs from P's submission to D's first token; exposed transfer is that minus a single engine's TTFT on
the same prompt (no connector, the same model), which is what disaggregation adds. Prompts go one at a time, so neither
engine batches them; the `ttft_concurrent` workload sends them all at once (`together`, `push_together`), against a
single engine given them all at once. CPU seconds per request are each engine's processes' user and system time
(`/proc`), over the prompts of one run. A pushing P's run also says where its time went, from kvsvc's own figures
of its layer-wise writes (`layer_figures`): a layer's compute, a layer's copy, and what followed the last layer.

Pure arithmetic and `/proc` reads; the engines are `workers.vllm.engines.VllmEngine`s that the caller starts.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from workers.vllm.engines import Output

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


class Engine(Protocol):
    """What this module needs of a `VllmEngine`."""

    @property
    def pid(self) -> int: ...

    def worker_pids(self) -> list[int]: ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        params: Sequence[Any] | None = None,
        names: Sequence[str] | None = None,
    ) -> list[Output]: ...

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        params: Sequence[Any] | None = None,
        names: Sequence[str] | None = None,
    ) -> int: ...

    def result(self, call_id: int, timeout_s: float = ...) -> list[Output]: ...

    def settle(self, timeout_s: float = ...) -> dict[str, Any]: ...

    def stats(self, timeout_s: float = ..., *, workers: bool = ...) -> dict[str, Any]: ...


@dataclass
class TtftRun:
    """One connector, one repetition: per prompt, end-to-end TTFT and P's part of it (ms); CPU seconds per request
    of P's and D's engine processes."""

    ttft_ms: list[float]
    p_ms: list[float]
    p_cpu_s: float
    d_cpu_s: float
    layers: dict[str, tuple[int, float]] = field(default_factory=dict)  # `layer_figures` over the run (push)


# kvsvc's figures of P's layer-wise writes (`kvsvc.service.ServiceStatistics`) and the summary's name for each mean.
LAYER_FIGURES: Final = (
    ("layer_compute", "compute_ms_per_layer"),
    ("layer_copy", "copy_ms_per_layer"),
    ("after_last_layer", "after_last_layer_ms"),
)


def layer_figures(p: Engine) -> dict[str, tuple[int, float]]:
    """P's layer-wise figures so far, its workers' summed: per figure, how many and their total seconds; {} for an
    engine without kvsvc. Asked between generations (a multiprocess engine's workers answer only then)."""
    workers = p.stats(workers=True).get("workers") or []
    out: dict[str, tuple[int, float]] = {}
    for key, _ in LAYER_FIGURES:
        hists = [w[key] for w in workers if isinstance(w.get(key), dict)]
        if hists:
            out[key] = (sum(sum(h["counts"]) for h in hists), sum(float(h["total"]) for h in hists))
    return out


def _since(before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]]) -> dict[str, tuple[int, float]]:
    zero = (0, 0.0)
    return {k: (n - before.get(k, zero)[0], t - before.get(k, zero)[1]) for k, (n, t) in after.items()}


def cpu_seconds(engine: Engine) -> float:
    """User and system CPU seconds of `engine`'s process and its worker processes so far.

    Raises:
        OSError: a process is gone.
    """
    total = 0
    for pid in (engine.pid, *engine.worker_pids()):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    return total * _TICK_S


def completion_name(router_id: str) -> str:
    """The request name vLLM's OpenAI server gives a completion whose `X-Request-Id` is `router_id`: what P and D
    must both be given in vllm-router's push flow."""
    return f"cmpl-{router_id}-0"


def single_engine_ms(base: Engine, prompts: Sequence[Sequence[int]]) -> list[float]:
    """A single engine's TTFT (ms) for each prompt, one at a time."""
    out = []
    for prompt in prompts:
        (o,) = base.generate([prompt], max_tokens=1)
        out.append((o.ttft_s or 0.0) * 1e3)
    return out


def one_at_a_time(
    p: Engine,
    d: Engine,
    prompts: Sequence[Sequence[int]],
    p_params: Callable[[int], list[dict[str, Any]]],
    d_params: Callable[[list[Output], int], list[dict[str, Any]]],
) -> TtftRun:
    """Each prompt through P then D, as a router's pull flow sends it; the figures of `TtftRun`. `p_params(k)` and
    `d_params(p_outputs, k)` make prompt k's params for P and D.

    Raises:
        EngineError: an engine failed or did not answer.
    """
    ttft, p_part = [], []
    p_cpu, d_cpu = cpu_seconds(p), cpu_seconds(d)
    for k, prompt in enumerate(prompts):
        started = time.monotonic()
        p_out = p.generate([prompt], max_tokens=1, params=p_params(k))
        handed = time.monotonic()
        call = d.submit([prompt], max_tokens=1, params=d_params(p_out, k))
        p.settle(timeout_s=300)  # vLLM's connectors (NIXL without its progress thread) need P to step until D fetched
        (d_out,) = d.result(call, timeout_s=300)
        # D's TTFT runs from its own call's start: add the time until D was asked.
        ttft.append((handed - started + (d_out.ttft_s or 0.0)) * 1e3)
        p_part.append((handed - started) * 1e3)
    n = len(prompts)
    return TtftRun(ttft, p_part, (cpu_seconds(p) - p_cpu) / n, (cpu_seconds(d) - d_cpu) / n)


def push_one_at_a_time(
    p: Engine,
    d: Engine,
    prompts: Sequence[Sequence[int]],
    router_params: Callable[[str], dict[str, Any]],
    tag: str,
) -> TtftRun:
    """Each prompt as vllm-router's push flow sends it: to D with the router's params and to P at once, both named
    from one router request id (`completion_name`); the figures of `TtftRun`,
    P's part being P's own answer time.

    Raises:
        EngineError: an engine failed or did not answer.
    """
    ttft, p_part = [], []
    p_cpu, d_cpu, layers = cpu_seconds(p), cpu_seconds(d), layer_figures(p)
    for k, prompt in enumerate(prompts):
        router_id = f"{tag}-{k}"
        name = [completion_name(router_id)]
        started = time.monotonic()
        d_call = d.submit([prompt], max_tokens=1, params=[router_params(router_id)], names=name)
        asked = time.monotonic()
        p_call = p.submit([prompt], max_tokens=1, params=[{"do_remote_decode": True}], names=name)
        p.result(p_call, timeout_s=300)
        p_part.append((time.monotonic() - started) * 1e3)
        (d_out,) = d.result(d_call, timeout_s=300)
        ttft.append((asked - started + (d_out.ttft_s or 0.0)) * 1e3)
    n = len(prompts)
    p_cpu_s, d_cpu_s = (cpu_seconds(p) - p_cpu) / n, (cpu_seconds(d) - d_cpu) / n
    return TtftRun(ttft, p_part, p_cpu_s, d_cpu_s, _since(layers, layer_figures(p)))


def single_engine_together_ms(base: Engine, prompts: Sequence[Sequence[int]]) -> list[float]:
    """A single engine's TTFT (ms) for each prompt, all asked at once."""
    return [(o.ttft_s or 0.0) * 1e3 for o in base.generate(prompts, max_tokens=1)]


def together(
    p: Engine,
    d: Engine,
    prompts: Sequence[Sequence[int]],
    p_params: Callable[[int], list[dict[str, Any]]],
    d_params: Callable[[list[Output], int], list[dict[str, Any]]],
) -> TtftRun:
    """Every prompt at once through P, then each to D with its params, as a router's pull flow sends a few
    concurrent requests; the figures of `TtftRun`. P's call answers once its last request finished, where a router
    hands each to D as it finishes: so a prompt's TTFT is its own first token on P (from P's call start) plus its
    first token on D, D's requests all asked together.

    Raises:
        EngineError: an engine failed or did not answer.
    """
    n = len(prompts)
    p_cpu, d_cpu = cpu_seconds(p), cpu_seconds(d)
    p_outs = p.generate(prompts, max_tokens=1, params=[p_params(k)[0] for k in range(n)])
    call = d.submit(prompts, max_tokens=1, params=[d_params([o], k)[0] for k, o in enumerate(p_outs)])
    p.settle(timeout_s=300)
    d_outs = d.result(call, timeout_s=300)
    p_part = [(o.ttft_s or 0.0) * 1e3 for o in p_outs]
    ttft = [mine + (o.ttft_s or 0.0) * 1e3 for mine, o in zip(p_part, d_outs, strict=True)]
    return TtftRun(ttft, p_part, (cpu_seconds(p) - p_cpu) / n, (cpu_seconds(d) - d_cpu) / n)


def push_together(
    p: Engine,
    d: Engine,
    prompts: Sequence[Sequence[int]],
    router_params: Callable[[str], dict[str, Any]],
    tag: str,
) -> TtftRun:
    """Every prompt at once as vllm-router's push flow sends it: all to D with the router's params, then all to P
    (`push_one_at_a_time`'s naming); the figures of `TtftRun`.

    Raises:
        EngineError: an engine failed or did not answer.
    """
    n = len(prompts)
    ids = [f"{tag}-{k}" for k in range(n)]
    names = [completion_name(router_id) for router_id in ids]
    p_cpu, d_cpu, layers = cpu_seconds(p), cpu_seconds(d), layer_figures(p)
    started = time.monotonic()
    d_call = d.submit(prompts, max_tokens=1, params=[router_params(i) for i in ids], names=names)
    asked = time.monotonic()
    p_call = p.submit(prompts, max_tokens=1, params=[{"do_remote_decode": True}] * n, names=names)
    p_outs = p.result(p_call, timeout_s=300)
    d_outs = d.result(d_call, timeout_s=300)
    lead = (asked - started) * 1e3
    p_part = [lead + (o.ttft_s or 0.0) * 1e3 for o in p_outs]
    ttft = [lead + (o.ttft_s or 0.0) * 1e3 for o in d_outs]  # as `push_one_at_a_time`: D's asking time counted
    p_cpu_s, d_cpu_s = (cpu_seconds(p) - p_cpu) / n, (cpu_seconds(d) - d_cpu) / n
    return TtftRun(ttft, p_part, p_cpu_s, d_cpu_s, _since(layers, layer_figures(p)))


# Push mode's targets, each read in one run: (key, kvsvc's connector, the baseline, the figure, the bound of
# kvsvc's figure as a multiple of the baseline's). Across hosts is kvsvc forced to Mooncake against NIXL over TCP.
PUSH_TARGETS: Final = (
    ("push_exposed_at_most_a_third_of_pull", "kvsvc_push", "kvsvc", "exposed_ms_p50", 1 / 3),
    ("push_ttft_at_most_nixl_one_host", "kvsvc_push", "nixl", "ttft_ms_p50", 1.0),
    ("push_ttft_at_most_0_8_nixl_across_hosts", "kvsvc_mooncake_push", "nixl_tcp", "ttft_ms_p50", 0.8),
)


def push_targets(entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each of `PUSH_TARGETS` whose two connectors ran in `entry` (a `summarize_ttft` result): both figures, their
    ratio (None when the baseline's is not positive: a pull flow can expose nothing, or less than nothing, over
    a single engine's noise) and `met` (kvsvc's figure at most the bound times the baseline's)."""
    out: dict[str, dict[str, Any]] = {}
    for key, ours, theirs, figure, bound in PUSH_TARGETS:
        if not isinstance(entry.get(ours), dict) or not isinstance(entry.get(theirs), dict):
            continue
        mine, base = entry[ours][figure], entry[theirs][figure]
        out[key] = {
            ours: mine,
            theirs: base,
            "ratio": mine / base if base > 0 else None,
            "bound": bound,
            "met": mine <= bound * base,
        }
    return out


def layer_means(reps: Sequence[TtftRun]) -> dict[str, float | None]:
    """The mean of each of P's layer-wise figures over every repetition (ms), None where none was taken: a layer's
    compute (between two layers a write waited for), a layer's copy, what followed the last layer."""
    out: dict[str, float | None] = {}
    for key, name in LAYER_FIGURES:
        count = sum(run.layers.get(key, (0, 0.0))[0] for run in reps)
        total = sum(run.layers.get(key, (0, 0.0))[1] for run in reps)
        out[name] = total / count * 1e3 if count else None
    return out


def summarize_ttft(runs: dict[str, list[TtftRun]], single: list[list[float]]) -> dict[str, Any]:
    """Per connector, medians over every prompt of every repetition: `ttft_ms_p50`, `exposed_ms_p50` (each prompt's
    TTFT minus the single engine's in the same repetition), P's part (`p_ms_p50`) and D's (`d_ms_p50`), and CPU
    seconds per request of P and D, and a pushing P's `layer_wise` means (`layer_means`); the single engine's
    `single_ttft_ms_p50`; and `targets` (`push_targets`).

    Raises:
        ValueError: a connector's repetitions are not as many as the single engine's.
    """
    out: dict[str, Any] = {
        "kind": "ttft",
        "requests": len(single[0]) if single else 0,
        "single_ttft_ms_p50": statistics.median(x for rep in single for x in rep) if single else None,
    }
    for name, reps in runs.items():
        if len(reps) != len(single):
            raise ValueError(f"{name}: {len(reps)} repetitions of ttft against the single engine's {len(single)}")
        exposed = [
            t - s for run, base in zip(reps, single, strict=True) for t, s in zip(run.ttft_ms, base, strict=True)
        ]
        out[name] = {
            "ttft_ms_p50": statistics.median(x for run in reps for x in run.ttft_ms),
            "exposed_ms_p50": statistics.median(exposed),
            "p_ms_p50": statistics.median(x for run in reps for x in run.p_ms),
            # D's part: from P's answer to D's first token, the transfer and D's step without P's prefill, whose
            # spread on a shared host is larger than a transfer.
            "d_ms_p50": statistics.median(t - p for run in reps for t, p in zip(run.ttft_ms, run.p_ms, strict=True)),
            "p_cpu_s_per_request": statistics.median(run.p_cpu_s for run in reps),
            "d_cpu_s_per_request": statistics.median(run.d_cpu_s for run in reps),
        }
        if any(run.layers for run in reps):
            out[name]["layer_wise"] = layer_means(reps)
    out["targets"] = push_targets(out)
    return out


__all__ = [
    "LAYER_FIGURES",
    "TtftRun",
    "completion_name",
    "cpu_seconds",
    "layer_figures",
    "layer_means",
    "one_at_a_time",
    "push_one_at_a_time",
    "push_targets",
    "push_together",
    "single_engine_ms",
    "single_engine_together_ms",
    "summarize_ttft",
    "together",
]
