"""`kvsvc demo` run in-process with small flags: both engines start, every request moves and verifies on every D worker.

Reads the JSON object of `--json` (the last stdout line); never asserts durations.
"""

from __future__ import annotations

import json

import pytest

from workers.commands import demo

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SMALL = ["--requests", "12", "--tokens", "70", "--layers", "4", "--kv-heads", "4", "--head-size", "16", "--json"]


def _run(capsys: pytest.CaptureFixture[str], *layout: str) -> dict[str, object]:
    code = demo.main([*layout, *SMALL])
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    assert code == (0 if result["ok"] else 1)
    return result


def _assert_all_verified(result: dict[str, object]) -> None:
    assert result["ok"] is True, result
    assert result["verified"] == result["requests"] == 12
    assert isinstance(result["bytes"], int) and result["bytes"] > 0
    assert isinstance(result["descriptors"], int) and result["descriptors"] > 0
    assert result["p50_ms"] is not None and result["p99_ms"] is not None


@pytest.mark.parametrize("transport", ["mooncake", "samehost"])
def test_default_layouts_p_pp2_tp1_to_d_pp1_tp2_verify_every_request(
    capsys: pytest.CaptureFixture[str], transport: str
) -> None:
    layout = ("--prefill-pp", "2", "--prefill-tp", "1", "--decode-pp", "1", "--decode-tp", "2")
    result = _run(capsys, *layout, "--transport", transport)
    _assert_all_verified(result)
    assert result["planes"] == [transport]  # what every P worker chose, as its peer table says


def test_p_tp1_to_d_tp2_with_other_block_sizes_verifies_every_request(capsys: pytest.CaptureFixture[str]) -> None:
    result = _run(
        capsys,
        *("--prefill-pp", "1", "--prefill-tp", "1", "--decode-pp", "1", "--decode-tp", "2"),
        *("--prefill-block-size", "16", "--decode-block-size", "8"),
    )
    _assert_all_verified(result)


def test_compare_runs_the_same_bytes_with_d_laid_out_as_p_and_reports_the_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = _run(
        capsys,
        *("--prefill-pp", "1", "--prefill-tp", "2", "--decode-pp", "2", "--decode-tp", "1"),
        *("--prefill-block-size", "8", "--decode-block-size", "16", "--compare"),
    )
    _assert_all_verified(result)
    base = result["homogeneous"]
    assert isinstance(base, dict)
    _assert_all_verified(base)
    assert "D pp1×tp2 (block 8)" in str(base["layout"]) and "D pp2×tp1 (block 16)" in str(result["layout"])
    assert base["kv_bytes"] == result["kv_bytes"]
    assert isinstance(result["ratio_to_homogeneous"], float) and result["ratio_to_homogeneous"] > 0
    assert result["transfer_seconds"] <= result["seconds"]  # type: ignore[operator]


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.cuda
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU and Mooncake's CUDA build")
@pytest.mark.parametrize("staging_mib", ["64", "0"], ids=["staged", "direct"])
@pytest.mark.parametrize(("transport", "plane"), [("auto", "cuda_ipc"), ("mooncake", "mooncake")])
def test_kv_in_gpu_memory_moves_on_each_plane_and_verifies(
    capsys: pytest.CaptureFixture[str], staging_mib: str, transport: str, plane: str
) -> None:
    """Every worker's KV on the GPU: P's gather into a GPU staging region on a side stream (staged) or the plane
    reading the KV tensors themselves (direct); by the rule the GPU plane (CUDA IPC, one host), or Mooncake when
    forced."""
    result = _run(capsys, "--device", "cuda", "--staging-mib", staging_mib, "--transport", transport)
    _assert_all_verified(result)
    assert result["planes"] == [plane]


@pytest.mark.skipif(_has_cuda(), reason="this host has a GPU")
def test_device_cuda_without_a_gpu_is_refused_by_name_before_any_engine_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = _run(capsys, "--device", "cuda")
    assert result["ok"] is False
    assert "device cuda" in str(result["error"]) and "sees no CUDA GPU" in str(result["error"])
