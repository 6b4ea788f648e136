"""`kvsvc plan`: defaults, the JSON figures, per-side layouts and the cross-layer comparison; bad input exits 2."""

from __future__ import annotations

import itertools
import json

import pytest

from kvsvc.cli import main
from kvsvc.cli.plan import synthetic_engine
from kvsvc.core.layout import layer_bytes, pool_regions


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main(["plan", "--json", *args]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert isinstance(report, dict)
    return report


def test_plain_plan_prints_a_table_with_totals(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    for text in ("P pp1 tp2", "D pp1 tp4", "total", "descriptors", "naive", "scattered", "planning took"):
        assert text in out


def test_json_totals_match_the_pairs_and_cover_the_whole_kv(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, "--p-pp", "2", "--p-tp", "2", "--d-pp", "1", "--d-tp", "4", "--tokens", "1000")
    pairs = report["pairs"]
    assert isinstance(pairs, list) and len(pairs) == 8
    assert report["descriptors"] == sum(p["descriptors"] for p in pairs)
    # layers * heads * K/V * tokens * head_size * bf16, the last block of 16 whole (1,000 tokens fill 62.5 blocks)
    assert report["bytes"] == 32 * 8 * 2 * 1008 * 128 * 2
    assert report["idle_pairs"] == 8


def test_the_staged_ways_are_shown_and_picked_only_where_they_save_descriptors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    up = run_json(capsys, "--p-tp", "1", "--d-tp", "2", "--d-ids", "contiguous", "--tokens", "1024")
    for pair in up["pairs"]:  # D's blocks are one run per layer: a gather on P makes it one write
        assert pair["way"] == "gather" and pair["staged_descriptors"] == 32 < pair["descriptors"]
    assert up["chosen_descriptors"] == up["staged_descriptors"] == 64
    down = run_json(capsys, "--p-tp", "2", "--d-tp", "1", "--d-ids", "contiguous", "--tokens", "1024")
    for pair in down["pairs"]:  # each P worker fills every other head range of D's blocks: only a window helps
        assert pair["staged_descriptors"] == pair["descriptors"] == 4096
        assert pair["way"] == "scatter" and pair["window_descriptors"] == pair["chosen_descriptors"] == 32
    same = run_json(capsys, "--p-tp", "1", "--d-tp", "1", "--d-ids", "contiguous", "--tokens", "1024")
    for pair in same["pairs"]:  # already one write per layer: no copy pays
        assert pair["way"] == "direct" and pair["chosen_descriptors"] == pair["descriptors"] == 32


def test_coalescing_beats_the_naive_count_when_blocks_are_contiguous(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, "--p-tp", "1", "--d-tp", "1", "--d-ids", "contiguous")
    assert report["descriptors"] == 32
    assert report["naive_descriptors"] == 32 * 256


def test_mla_and_block_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, "--mla", "--p-tp", "4", "--d-tp", "2", "--p-block-size", "32", "--d-block-size", "16")
    assert report["bytes"] == 2 * 32 * 4096 * 128 * 2  # each D rank gets the whole latent
    assert report["layout"] == "MLA"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--p-tp", "3"], ["P", "tp_size 3", "8"]),
        (["--p-tp", "4", "--d-tp", "6", "--kv-heads", "12"], ["tp_size 4", "tp_size 6"]),
        (["--p-layout", "HND_FUSED", "--d-layout", "HND"], ["HND_FUSED", "HND", "opaque"]),
        (["--dtype", "float64"], ["float64"]),
        (["--tokens", "0"], ["--tokens"]),
    ],
)
def test_errors_print_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], words: list[str]
) -> None:
    assert main(["plan", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsvc plan: error:")
    for word in words:
        assert word in lines[0]


def test_synthetic_engines_never_overlap() -> None:
    engine = synthetic_engine(
        "P", pp_size=2, tp_size=2, num_layers=5, num_kv_heads=4, head_size=8, block_size=4, num_blocks=3
    )
    regions = sorted((b, b + layer_bytes(m)) for m in engine.values() for b in m.base_addrs)
    assert len(regions) == 10
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(regions))
    assert [m.end_layer - m.start_layer for _, m in sorted(engine.items())] == [3, 3, 2, 2]


def test_cross_layer_pools_on_both_sides_and_the_per_layer_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--p-tp", "1", "--d-tp", "1", "--d-ids", "contiguous")
    report = run_json(capsys, *args, "--layout", "HND_CROSS_LAYER")
    assert report["descriptors"] == 1
    assert report["per_layer_hnd_descriptors"] == 32
    assert report["layout"] == "HND_CROSS_LAYER"
    assert report["bytes"] == 32 * 8 * 2 * 4096 * 128 * 2
    plain = run_json(capsys, *args)
    assert plain["per_layer_hnd_descriptors"] is None and plain["layout"] == "HND"


def test_layouts_per_side(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, "--p-layout", "HND_CROSS_LAYER", "--d-tp", "2", "--d-pp", "2", "--tokens", "512")
    assert report["layout"] == "P HND_CROSS_LAYER, D HND"
    p, d = report["p"], report["d"]
    assert isinstance(p, dict) and isinstance(d, dict)
    assert (p["layout"], d["layout"]) == ("HND_CROSS_LAYER", "HND")
    assert report["bytes"] == 32 * 8 * 2 * 512 * 128 * 2
    mla = run_json(capsys, "--mla", "--d-layout", "HND_CROSS_LAYER", "--tokens", "64")
    assert mla["layout"] == "P MLA, D MLA_CROSS_LAYER"


def test_table_adds_the_per_layer_line_only_for_cross_layer_pools(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--d-layout", "HND_CROSS_LAYER", "--tokens", "256"]) == 0
    assert "Per-layer HND tensors on both sides would need" in capsys.readouterr().out
    assert main(["plan", "--tokens", "256"]) == 0
    assert "Per-layer HND" not in capsys.readouterr().out


def test_nhd_against_a_cross_layer_pool_with_several_heads_is_gathered(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--p-tp", "2", "--d-tp", "2", "--p-layout", "NHD", "--d-layout", "HND_CROSS_LAYER", "--tokens", "64"]
    report = run_json(capsys, *args)
    assert report["layout"] == "P NHD, D HND_CROSS_LAYER"
    assert all(pair["way"] in ("gather", "gather+scatter") for pair in report["pairs"])


def test_synthetic_cross_layer_engines_have_one_pool_per_worker() -> None:
    engine = synthetic_engine(
        "D", pp_size=2, tp_size=2, num_layers=5, num_kv_heads=4, head_size=8, block_size=4, num_blocks=3,
        layout="HND_CROSS_LAYER",
    )  # fmt: skip
    regions = sorted(r for m in engine.values() for r in pool_regions(m))
    assert len(regions) == 4 and all(len(m.base_addrs) == 1 for m in engine.values())
    assert all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(regions))
    assert [size for _, size in regions] == [3 * layer_bytes(engine[(0, 0)])] * 2 + [
        2 * layer_bytes(engine[(0, 0)])
    ] * 2


def test_the_same_heads_in_another_order_are_gathered_on_p(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--p-tp", "2", "--d-tp", "2", "--p-layout", "NHD", "--d-layout", "HND", "--tokens", "64"]
    report = run_json(capsys, *args, "--d-ids", "contiguous")
    for pair in report["pairs"]:  # about one piece per (token, head); gathered into D's head order: a run per layer
        assert pair["way"] == "gather" and pair["staged_descriptors"] == 32 and pair["descriptors"] > 16000
