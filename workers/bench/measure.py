"""The arithmetic of `kvsvc bench`: the peers' descriptor split, the descriptor bound, run orders, paired ratios,
the CPUs' busy ticks and the memcpy baseline. No engines, no processes: `workers.bench.runner` calls these.
Percentiles are `workers.stats.percentile`, the demo's too, so both report a p99 the same way.
"""

from __future__ import annotations

import random
import statistics
import time
from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from kvsvc.core.layout import block_geometry
from kvsvc.core.messages import WorkerMetadata
from workers.bench.worker import RAW_SAMEHOST, Desc

RAW_METHODS = ("submit_poll", "batch")  # raw Mooncake, the two ways docs/mooncake.md allows
GB = 1e9


def split_per_half(descs: Sequence[Desc], src: WorkerMetadata, dst: WorkerMetadata) -> list[Desc]:
    """Cut a plan into one descriptor per (layer, block, K/V half), as a planner that never merges would emit.

    K/V halves tile each layer tensor (or the cross-layer pool) from its start, so cuts fall every `half_stride`
    bytes from the tensor's base, on either side.
    """
    s_bases, s_half = sorted(src.base_addrs), block_geometry(src).half_stride
    d_bases, d_half = sorted(dst.base_addrs), block_geometry(dst).half_stride
    out: list[Desc] = []
    for s, d, length in descs:
        end = s + length
        while s < end:
            step = min(end - s, _to_cut(s, s_bases, s_half), _to_cut(d, d_bases, d_half))
            out.append((s, d, step))
            s, d = s + step, d + step
    return out


def _to_cut(addr: int, bases: Sequence[int], half: int) -> int:
    """Bytes from `addr` to the next K/V-half boundary of the tensor that holds it."""
    base = bases[bisect_right(bases, addr) - 1]
    return half - (addr - base) % half


def run_bound(blocks: Sequence[int], layers: int) -> int:
    """Contiguous block runs times layers: the descriptor count the target allows per request."""
    runs = sum(1 for i, b in enumerate(blocks) if i == 0 or b != blocks[i - 1] + 1)
    return runs * layers


def memcpy_gbps(nbytes: int, reps: int) -> float:
    """One-thread memcpy of `nbytes` (numpy's copyto), both buffers touched first; median of `reps`."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    spans = []
    for _ in range(max(reps, 3)):
        start = time.perf_counter()
        np.copyto(dst, src)
        spans.append(time.perf_counter() - start)
    return nbytes / GB / statistics.median(spans)


def run_orders(reps: int, seed: int) -> list[list[str]]:
    """The order of kvsvc and the baselines in each repetition: a fresh seeded shuffle each time, so that no run
    always follows the same one (the runs share each worker's engine, and a rotation would keep kvsvc right after
    the peers' 10 threads); the first starts with kvsvc, whose bytes are verified before a baseline overwrites them."""
    rng = random.Random(seed)
    orders = []
    for rep in range(reps):
        runs = [*RAW_METHODS, RAW_SAMEHOST, "peer"]
        rng.shuffle(runs)
        runs.insert(0 if rep == 0 else rng.randrange(len(runs) + 1), "kvsvc")
        orders.append(runs)
    return orders


def paired_ratio(baseline_spans: Sequence[float], kvsvc_spans: Sequence[float]) -> float:
    """Median over repetitions of kvsvc's speed over the baseline's, for the same bytes: baseline span / kvsvc span."""
    return statistics.median(b / k for b, k in zip(baseline_spans, kvsvc_spans, strict=True))


def cpu_jiffies(proc_stat: str, cpus: set[int]) -> tuple[int, int]:
    """(busy, all) clock ticks of the CPUs `cpus` in the text of `/proc/stat`: all is every field of a `cpuN` line
    but guest time (already counted in user and nice), busy is all but idle and iowait. Steal time counts as busy:
    on a VM it is time the host gave to others while the CPU was wanted here, so not the bench's to use.

    Raises:
        ValueError: a `cpuN` line whose fields are not integers.
    """
    busy = total = 0
    for line in proc_stat.splitlines():
        name, _, fields = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        ticks = [int(x) for x in fields.split()[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


__all__ = [
    "GB",
    "RAW_METHODS",
    "RAW_SAMEHOST",
    "cpu_jiffies",
    "memcpy_gbps",
    "paired_ratio",
    "run_bound",
    "run_orders",
    "split_per_half",
]
