"""`kvsvc plan`: show the descriptors and bytes the planner produces for a P/D layout pair, without any I/O.

Imports the pure core (layout, planner) and rich; no torch, asyncio or mooncake. Invariants: synthetic engines
never overlap in address space and are deterministic for the same arguments; an incompatible pair prints one
line on stderr and exits 2; with `--json` the only output is one JSON object on one line. When either side uses
the cross-layer pool, every pair is also planned with per-layer HND tensors on both sides, for comparison.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec
from msgspec.structs import replace

from kvsvc.core.errors import TopologyError
from kvsvc.core.layout import (
    CROSS_LAYER,
    LAYOUTS,
    block_geometry,
    check_kv_heads,
    check_layer_split,
    even_layer_split,
    heads_of_rank,
    is_cross_layer,
    layer_bytes,
    pool_bytes,
    pool_regions,
)
from kvsvc.core.messages import Worker, WorkerMetadata
from kvsvc.core.planner import plan_transfer_arrays, source_heads, unmerged_run_count
from kvsvc.core.staging_plans import StagingRule, Way, count_runs, region_ids, window_plan

_ALIGN = 2 * 1024 * 1024
P_BASE = 0x7F00_0000_0000
D_BASE = 0x7E00_0000_0000


def synthetic_engine(
    engine_id: str,
    *,
    pp_size: int,
    tp_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    num_blocks: int,
    dtype: str = "bfloat16",
    layout: str = "HND",
    is_mla: bool = False,
    layer_split: Sequence[tuple[int, int]] | None = None,
    base_addr: int = P_BASE,
    layer_gap: int = _ALIGN,
) -> dict[Worker, WorkerMetadata]:
    """Metadata of every worker of a fake engine: each KV tensor follows the previous one after `layer_gap`.

    A per-layer layout gets one tensor per layer; `CROSS_LAYER` one pool per worker (MLA included).

    Raises:
        ValueError: the layer split does not tile `[0, num_layers)`, or fewer layers than stages.
        TopologyError: unknown dtype or layout, or K does not divide over tp.
    """
    split = list(layer_split) if layer_split is not None else even_layer_split(num_layers, pp_size)
    if len(split) != pp_size:
        raise ValueError(f"layer split {split} has {len(split)} stages, pp_size is {pp_size}")
    check_layer_split(split, num_layers)
    engine: dict[Worker, WorkerMetadata] = {}
    addr = base_addr
    for pp_rank, (start, end) in enumerate(split):
        for tp_rank in range(tp_size):
            meta = WorkerMetadata(
                engine_id=engine_id,
                incarnation=f"{engine_id}-synthetic",
                pp_rank=pp_rank,
                pp_size=pp_size,
                tp_rank=tp_rank,
                tp_size=tp_size,
                start_layer=start,
                end_layer=end,
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                dtype=dtype,
                block_size=block_size,
                num_blocks=num_blocks,
                layout=layout,
                is_mla=is_mla,
                base_addrs=[],
            )
            if is_cross_layer(meta):
                bases = [addr]
                addr += pool_bytes(meta) + layer_gap
            else:
                size = layer_bytes(meta)
                bases = [addr + i * (size + layer_gap) for i in range(end - start)]
                addr = bases[-1] + size + layer_gap
            engine[(pp_rank, tp_rank)] = msgspec.structs.replace(meta, base_addrs=bases)
    return engine


def naive_descriptor_count(src: WorkerMetadata, dst: WorkerMetadata, num_tokens: int) -> int:
    """Descriptors of a planner that merges inside each (layer, P block, D block) but never across blocks.

    Raises:
        TopologyError: `check_compatible` refuses the pair.
    """
    layers = min(src.end_layer, dst.end_layer) - max(src.start_layer, dst.start_layer)
    heads = source_heads(src, dst)
    if layers <= 0 or num_tokens <= 0 or not heads:
        return 0
    if src.is_mla:
        local_src, local_dst = [0], [0]
    else:
        first_src = heads_of_rank(src.tp_rank, src.tp_size, src.num_kv_heads).start
        first_dst = heads_of_rank(dst.tp_rank, dst.tp_size, dst.num_kv_heads).start
        local_src, local_dst = [h - first_src for h in heads], [h - first_dst for h in heads]
    gs, gd = block_geometry(src), block_geometry(dst)
    return unmerged_run_count(gs, gd, local_src, local_dst, layers, num_tokens)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="show the transfer plan for a P/D layout pair",
        description="Plan one request between a synthetic P engine and a synthetic D engine and show, per "
        "(P worker, D worker) pair, the descriptors and bytes, against a naive per-(layer, block, K/V) planner.",
    )
    add = parser.add_argument
    add("--p-pp", type=int, default=1, help="P pipeline-parallel size (default 1)")
    add("--p-tp", type=int, default=2, help="P tensor-parallel size (default 2)")
    add("--d-pp", type=int, default=1, help="D pipeline-parallel size (default 1)")
    add("--d-tp", type=int, default=4, help="D tensor-parallel size (default 4)")
    add("--layers", type=int, default=32, help="number of model layers (default 32)")
    add("--kv-heads", type=int, default=8, help="total KV heads K (default 8)")
    add("--head-size", type=int, default=128, help="head size (default 128)")
    add("--block-size", type=int, default=16, help="block size of both engines (default 16)")
    add("--p-block-size", type=int, default=None, help="P block size (default: --block-size)")
    add("--d-block-size", type=int, default=None, help="D block size (default: --block-size)")
    add("--tokens", type=int, default=4096, help="tokens of the request (default 4096)")
    add("--mla", action="store_true", help="MLA model: one latent per token, no K/V heads")
    add("--dtype", default="bfloat16", help="KV dtype, a torch dtype name (default bfloat16)")
    add(
        "--layout",
        choices=LAYOUTS,
        default="HND",
        help=f"KV layout of both engines (default HND); {CROSS_LAYER} is one pool per worker, all layers per block",
    )
    add("--p-layout", choices=LAYOUTS, default=None, help="KV layout of P (default: --layout)")
    add("--d-layout", choices=LAYOUTS, default=None, help="KV layout of D (default: --layout)")
    add(
        "--d-ids",
        choices=["scattered", "contiguous"],
        default="scattered",
        help="D block ids: a seeded random sample of a pool twice the size (default), or 0..n-1",
    )
    add("--json", action="store_true", help="print one JSON object on one line instead of the table")
    parser.set_defaults(func=run)


def _build(args: argparse.Namespace) -> dict[str, Any]:
    p_bs = args.p_block_size or args.block_size
    d_bs = args.d_block_size or args.block_size
    if args.tokens < 1:
        raise ValueError(f"--tokens {args.tokens} must be >= 1")
    if not args.mla:
        check_kv_heads(args.kv_heads, args.p_tp, "P")
        check_kv_heads(args.kv_heads, args.d_tp, "D")
    p_needed, d_needed = -(-args.tokens // p_bs), -(-args.tokens // d_bs)
    d_pool = 2 * d_needed if args.d_ids == "scattered" else d_needed
    p_layout, d_layout = args.p_layout or args.layout, args.d_layout or args.layout
    common = dict(
        num_layers=args.layers,
        num_kv_heads=1 if args.mla else args.kv_heads,
        head_size=args.head_size,
        dtype=args.dtype,
        is_mla=args.mla,
    )

    def engines(p_layout: str, d_layout: str) -> tuple[dict[Worker, WorkerMetadata], dict[Worker, WorkerMetadata]]:
        p_engine = synthetic_engine(
            "P", pp_size=args.p_pp, tp_size=args.p_tp, block_size=p_bs, num_blocks=p_needed, base_addr=P_BASE,
            layout=p_layout, **common,
        )  # fmt: skip
        # Each P worker publishes a staging region, as `kvsvc serve` and `demo` give it: P may gather, which also
        # lets it take the same heads in another order.
        p_engine = {w: replace(m, staging_addr=1 << 60, staging_size=64 << 20) for w, m in p_engine.items()}
        d_engine = synthetic_engine(
            "D", pp_size=args.d_pp, tp_size=args.d_tp, block_size=d_bs, num_blocks=d_pool, base_addr=D_BASE,
            layout=d_layout, **common,
        )  # fmt: skip
        return p_engine, d_engine

    p_engine, d_engine = engines(p_layout, d_layout)
    # The comparison doubles the planning work, so it is made only when a side uses the cross-layer pool.
    cross = CROSS_LAYER in (p_layout, d_layout)
    per_layer = engines("HND", "HND") if cross else None
    p_ids = list(range(p_needed))
    d_ids = random.Random(0).sample(range(d_pool), d_needed) if args.d_ids == "scattered" else list(range(d_needed))
    # The first plan pays numpy's one-off set-up; keep it out of the timings.
    plan_transfer_arrays(p_engine[(0, 0)], d_engine[(0, 0)], p_ids, d_ids, args.tokens)
    pairs: list[dict[str, Any]] = []
    rule = StagingRule()
    for p_key, p_meta in sorted(p_engine.items()):
        for d_key, d_meta in sorted(d_engine.items()):
            start = time.perf_counter()
            srcs, dsts, lengths = plan_transfer_arrays(p_meta, d_meta, p_ids, d_ids, args.tokens)
            elapsed = time.perf_counter() - start
            if lengths.size == 0:
                continue
            runs = count_runs(dsts, lengths, region_ids(dsts, [start for start, _ in pool_regions(d_meta)]))
            src_region = region_ids(srcs, [start for start, _ in pool_regions(p_meta)])
            window = int(window_plan(srcs, dsts, lengths, 0, src_region)[0].size)
            way = rule.way(int(lengths.size), runs, window, int(lengths.sum()), gather=True, scatter=True)
            heads = source_heads(p_meta, d_meta)
            hnd: int | None = None
            if per_layer is not None:
                plan = plan_transfer_arrays(per_layer[0][p_key], per_layer[1][d_key], p_ids, d_ids, args.tokens)
                hnd = int(plan[2].size)
            pairs.append(
                {
                    "p": list(p_key),
                    "d": list(d_key),
                    "layers": [max(p_meta.start_layer, d_meta.start_layer), min(p_meta.end_layer, d_meta.end_layer)],
                    "heads": "latent" if args.mla else [heads[0], heads[-1] + 1],
                    "descriptors": int(lengths.size),
                    "staged_descriptors": runs,
                    "window_descriptors": window,
                    "way": way.value,
                    "chosen_descriptors": {
                        Way.DIRECT: int(lengths.size),
                        Way.GATHER: runs,
                        Way.SCATTER: window,
                        Way.BOTH: 1,
                    }[way],
                    "bytes": int(lengths.sum()),
                    "naive_descriptors": naive_descriptor_count(p_meta, d_meta, args.tokens),
                    "per_layer_hnd_descriptors": hnd,
                    "plan_ms": elapsed * 1e3,
                }
            )
    d_heads = "latent" if args.mla else str(heads_of_rank(0, args.d_tp, args.kv_heads))
    p_name, d_name = _layout_name(p_layout, args.mla), _layout_name(d_layout, args.mla)
    return {
        "p": {"pp": args.p_pp, "tp": args.p_tp, "block_size": p_bs, "block_ids": "contiguous", "layout": p_name},
        "d": {
            "pp": args.d_pp,
            "tp": args.d_tp,
            "block_size": d_bs,
            "block_ids": args.d_ids,
            "rank0_heads": d_heads,
            "layout": d_name,
        },
        "layers": args.layers,
        "kv_heads": args.kv_heads,
        "head_size": args.head_size,
        "dtype": args.dtype,
        "layout": p_name if p_name == d_name else f"P {p_name}, D {d_name}",
        "tokens": args.tokens,
        "pairs": pairs,
        "idle_pairs": len(p_engine) * len(d_engine) - len(pairs),
        "descriptors": sum(p["descriptors"] for p in pairs),
        "staged_descriptors": sum(p["staged_descriptors"] for p in pairs),
        "window_descriptors": sum(p["window_descriptors"] for p in pairs),
        "chosen_descriptors": sum(p["chosen_descriptors"] for p in pairs),
        "bytes": sum(p["bytes"] for p in pairs),
        "naive_descriptors": sum(p["naive_descriptors"] for p in pairs),
        "per_layer_hnd_descriptors": sum(p["per_layer_hnd_descriptors"] for p in pairs) if cross else None,
        "plan_ms": sum(p["plan_ms"] for p in pairs),
        "max_plan_ms": max((p["plan_ms"] for p in pairs), default=0.0),
    }


def _layout_name(layout: str, mla: bool) -> str:
    """A side's layout in the report: the layout, or "MLA" / "MLA_CROSS_LAYER" (a latent has no head order)."""
    if not mla:
        return layout
    return "MLA_CROSS_LAYER" if layout == CROSS_LAYER else "MLA"


def _render(report: dict[str, Any]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    p, d = report["p"], report["d"]
    title = (
        f"P pp{p['pp']} tp{p['tp']} block {p['block_size']} -> D pp{d['pp']} tp{d['tp']} block {d['block_size']}: "
        f"{report['tokens']} tokens, {report['layers']} layers, K={report['kv_heads']}, "
        f"head {report['head_size']}, {report['dtype']}, {report['layout']}"
    )
    table = Table(
        title=title,
        caption=f"P block ids contiguous, D block ids {d['block_ids']}; naive: no merging across blocks; gather: one "
        "write per contiguous D run after a gather on P; window: one write per P run into a window of D's region "
        "that D scatters (both: one write); way: what the staging rule picks with a region on each side (total: its "
        "descriptors; a small region cuts runs into chunks)",
        box=box.SIMPLE,
    )
    columns = (
        "P (pp,tp)",
        "D (pp,tp)",
        "layers",
        "heads",
        "descriptors",
        "gather",
        "window",
        "way",
        "bytes",
        "naive",
        "avg size",
    )
    for name in columns:
        table.add_column(name, justify="right", no_wrap=True)
    for pair in report["pairs"]:
        heads = pair["heads"] if isinstance(pair["heads"], str) else "{}-{}".format(*pair["heads"])
        table.add_row(
            "({},{})".format(*pair["p"]),
            "({},{})".format(*pair["d"]),
            "{}-{}".format(*pair["layers"]),
            heads,
            f"{pair['descriptors']:,}",
            f"{pair['staged_descriptors']:,}",
            f"{pair['window_descriptors']:,}",
            pair["way"],
            _size(pair["bytes"]),
            f"{pair['naive_descriptors']:,}",
            _size(pair["bytes"] // pair["descriptors"]),
        )
    total = report["descriptors"]
    table.add_section()
    table.add_row(
        "total",
        "",
        "",
        "",
        f"{total:,}",
        f"{report['staged_descriptors']:,}",
        f"{report['window_descriptors']:,}",
        f"{report['chosen_descriptors']:,}",
        _size(report["bytes"]),
        f"{report['naive_descriptors']:,}",
        _size(report["bytes"] // total) if total else "-",
    )
    console = Console()
    if not console.is_terminal:
        # Piped output has no width to fit; 80 columns would truncate the numbers.
        console = Console(width=120)
    console.print(table)
    console.print(
        f"{len(report['pairs'])} (P, D) pairs carry data, {report['idle_pairs']} carry nothing; "
        f"{total:,} descriptors where a per-block planner writes {report['naive_descriptors']:,}; "
        f"planning took {report['plan_ms']:.2f} ms in all (slowest pair {report['max_plan_ms']:.2f} ms)."
    )
    per_layer = report["per_layer_hnd_descriptors"]
    if per_layer is not None:
        ratio = f", {per_layer / total:.3g}x these pools' {total:,}" if total else ""
        console.print(f"Per-layer HND tensors on both sides would need {per_layer:,} descriptors{ratio}.")


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def run(args: argparse.Namespace) -> int:
    """Plan and print; returns 0, or 2 when the layouts cannot be matched or the arguments are invalid."""
    try:
        report = _build(args)
    except (TopologyError, ValueError) as exc:
        print(f"kvsvc plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, separators=(",", ":")))
    else:
        _render(report)
    return 0
