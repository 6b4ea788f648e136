"""`make gpu-wheels` and `make gpu-check` on a CPU host, and `kvsvc bench --device cuda` where torch sees no GPU:
the slim Mooncake repack (on a tiny fake wheel), the wheel download kept idempotent, the kvsvc dist-info that makes
the entry points visible without pip, the check's JSON summary, its no-GPU answer (the script run with a PATH that
has no nvidia-smi) and the bench's refusal by name. The GPU run itself needs a GPU (docs/testing.md).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from workers import gpu_check
from workers.bench.models import TINY
from workers.bench.report import (
    GPU_MOONCAKE,
    GPU_PLANE,
    GPU_TORCH,
    STAGE_PARTS,
    GpuLayerwiseResult,
    GpuReport,
    GpuScenarioResult,
    LayerwiseResult,
    LayoutResult,
    gpu_summary,
)
from workers.bench.runner import stage_means_ms
from workers.bench.worker import contiguous_runs
from workers.gpu_check import StepResult, dist_info, last_json, repack_slim, summary

REPO = Path(__file__).resolve().parents[2]
DIST = "mooncake_transfer_engine_cuda13-0.3.14.dist-info"
LIBS = "mooncake_transfer_engine_cuda13.libs"
KEPT = {
    "mooncake/__init__.py",
    "mooncake/engine.so",
    "mooncake/libasio.so",
    "mooncake/libetcd_wrapper.so",
    f"{DIST}/METADATA",
    f"{DIST}/WHEEL",
    f"{DIST}/RECORD",
    f"{LIBS}/libglog-6ed04f2c.so.0.0.0",
    f"{LIBS}/libyaml-cpp-2ec4b324.so.0.7.0",
    f"{LIBS}/libjsoncpp-4b349785.so.1.8.4",
    f"{LIBS}/libgflags-8aee0f6c.so.2.1.2",
    f"{LIBS}/libunwind-7e4e9a3c.so.8.0.1",
    f"{LIBS}/libasio-ffed6571.so",
}
DROPPED = {
    "mooncake/transfer_engine_bench",
    "mooncake/engine.pyi",
    "mooncake/store.so",
    f"{LIBS}/libcurl-0123abcd.so.4",
    f"{LIBS}/libibverbs-0123abcd.so.1",
}


def _fake_wheel(path: Path, members: set[str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name in sorted(members):
            zf.writestr(name, f"bytes of {name}")
        zf.writestr(f"{DIST}/RECORD", "".join(f"{n},sha256=x,1\n" for n in sorted(members)))
    return path


def test_the_slim_wheel_keeps_the_engine_and_its_libraries_only(tmp_path: Path) -> None:
    full = _fake_wheel(tmp_path / "full.whl", (KEPT | DROPPED) - {f"{DIST}/RECORD"})
    slim = repack_slim(full, tmp_path / "slim.whl")
    with zipfile.ZipFile(slim) as zf:
        assert set(zf.namelist()) == KEPT
        assert zf.read("mooncake/engine.so") == b"bytes of mooncake/engine.so"
        record = zf.read(f"{DIST}/RECORD").decode().split()
    assert {line.split(",")[0] for line in record} == KEPT  # the RECORD lists what is there, not the full wheel
    assert not list(tmp_path.glob("*.part"))


def test_a_wheel_without_the_engine_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    other = _fake_wheel(tmp_path / "other.whl", KEPT - {"mooncake/engine.so", f"{DIST}/RECORD"})
    with pytest.raises(ValueError, match=r"mooncake/engine\.so"):
        repack_slim(other, tmp_path / "slim.whl")
    assert not (tmp_path / "slim.whl").exists()


def test_download_wheels_fetches_each_wheel_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def fake_download(python: str, spec: str, into: Path) -> None:
        calls.append(spec)
        name = spec.split("==")[0].replace("-", "_")
        if name.startswith("mooncake"):
            _fake_wheel(into / f"{name}-0.3.14-cp312-cp312-manylinux_2_28_x86_64.whl", KEPT - {f"{DIST}/RECORD"})
        else:
            (into / f"{name}-1.0-py3-none-any.whl").write_bytes(b"PK")

    monkeypatch.setattr(gpu_check, "_pip_download", fake_download)
    first = gpu_check.download_wheels(tmp_path / "wheels")
    assert [p.name for p in first] == [
        "mooncake_slim-cp312.whl",
        "msgspec-1.0-py3-none-any.whl",
        "pytest_asyncio-1.0-py3-none-any.whl",
    ]
    assert len(calls) == 3
    assert gpu_check.download_wheels(tmp_path / "wheels") == first
    assert len(calls) == 3  # the second run downloads nothing


def test_the_dist_info_makes_kvsvc_entry_points_visible_without_pip(tmp_path: Path) -> None:
    where = dist_info(REPO / "pyproject.toml", tmp_path)
    assert where.name == "kvsvc-0.1.0.dist-info"
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path)])
    points = {(e.group, e.name): e.value for e in dist.entry_points}
    assert points[("kvsvc.commands", "bench")] == "workers.commands.bench:register"
    assert points[("pytest11", "kvsvc")] == "kvsvc.testing.plugin"
    assert points[("console_scripts", "kvsvc")] == "kvsvc.cli:main"


def test_the_summary_reports_every_step_and_fails_on_any() -> None:
    results = [StepResult("pytest_cuda", 0, 12.34, "a.log"), StepResult("demo_auto", -1, 60.0, "b.log")]
    bench = {"kvsvc_gbps": 900.0, "kvsvc_over_torch_copy": 0.8, "scenarios": {"large": {}}, "verified": True}
    found = summary(results, bench, "/logs")
    assert found["gpu"] is True and found["ok"] is False and found["failed"] == ["demo_auto"]
    assert found["steps"]["pytest_cuda"] == {"ok": True, "rc": 0, "seconds": 12.3, "log": "a.log"}
    assert found["steps"]["demo_auto"]["ok"] is False
    assert found["bench"] == {"kvsvc_gbps": 900.0, "kvsvc_over_torch_copy": 0.8, "verified": True}
    assert summary(results[:1], None, "/logs")["ok"] is True
    json.dumps(found)  # one JSON object


def test_the_bench_figures_are_the_last_json_object_of_its_stdout() -> None:
    assert last_json('{"a": 1}\nnoise\n{"b": 2}\n[1, 2]\ntrailing words\n') == {"b": 2}
    assert last_json("no json here\n") is None


def _large() -> GpuScenarioResult:
    return GpuScenarioResult(
        name="large", reps=3, requests=4, bytes_per_rep=1 << 28, transport="cuda_ipc",
        gbps={"kvsvc": 900.0, GPU_PLANE: 1000.0, GPU_TORCH: 1200.0, GPU_MOONCAKE: 2.0},
        ratios={GPU_PLANE: 0.9, GPU_TORCH: 0.75, GPU_MOONCAKE: 450.0},
        p50_ms=0.5, p99_ms=0.9, descriptors_per_request=28.0, verified=True, failures=0,
    )  # fmt: skip


def _layerwise() -> GpuLayerwiseResult:
    return GpuLayerwiseResult(
        LayerwiseResult(layer_ms=0.2, whole_ms=0.6, layer_time_ms=4.0, layers=28, request_bytes=1 << 26),
        baseline_ms={GPU_TORCH: 0.1, GPU_MOONCAKE: 30.0},
        ratios={GPU_TORCH: 0.5, GPU_MOONCAKE: 150.0},
        failures=1,
    )


def _layout(name: str, stage_ms: dict[str, float], verified: bool = True) -> LayoutResult:
    return LayoutResult(
        name=name, layout="HND", reps=1, requests=8, bytes_per_rep=1 << 25, gbps=20.0, homogeneous_gbps=80.0,
        ratio_to_homogeneous=0.25, descriptors_per_request=56.0, direct_descriptors_per_request=448.0,
        descriptor_bound_per_request=56.0, staged_writes_per_request=2.0, cpu_s_per_gb=0.1,
        homogeneous_cpu_s_per_gb=0.05, cpu_split_s_per_gb={}, homogeneous_cpu_split_s_per_gb={}, machine_busy=0.1,
        homogeneous_machine_busy=0.1, cpu_ceiling_ratio=9.0, verified=verified, failures=0, transport="cuda_ipc",
        stage_ms=stage_ms,
    )  # fmt: skip


def test_the_gpu_bench_summary_names_each_ratio() -> None:
    large, layerwise, layout = _large(), _layerwise(), _layout
    layouts = [layout("hetero_tp_up", {"staged_gather": 0.05, "staged_write": 0.4}), layout("hetero_tp_up_direct", {})]
    found = gpu_summary(GpuReport(TINY, [large], layerwise, 10.0, 60.0, layouts))
    # Only layouts that staged anything have parts; they reach make gpu-check's figures as they are.
    assert found["split_stage_ms"] == {"hetero_tp_up": {"staged_gather": 0.05, "staged_write": 0.4}}
    assert summary([], found, "/logs")["bench"]["split_stage_ms"] == found["split_stage_ms"]
    assert found["split_over_homogeneous"] == {"hetero_tp_up": 0.25, "hetero_tp_up_direct": 0.25}
    assert found["device"] == "cuda" and found["transport"] == "cuda_ipc"
    assert found["kvsvc_over_torch_copy"] == 0.75 and found["kvsvc_over_mooncake_tcp"] == 450.0
    assert found["kvsvc_over_plane"] == 0.9 and found["torch_copy_gbps"] == 1200.0
    assert found["layerwise_ratios"] == {"kvsvc_over_torch_copy": 0.5, "kvsvc_over_mooncake_tcp": 150.0}
    assert found["failures"] == 1 and found["verified"] is True and found["complete"] is True
    assert set(found["scenarios"]) == {"large", "hetero_tp_up", "hetero_tp_up_direct"}
    json.dumps(found)


def test_a_stopped_gpu_bench_still_reports_the_parts_it_measured() -> None:
    # Stopped after one layout: no large scenario, no layer-wise part; what ran is reported, as not complete.
    partial = gpu_summary(GpuReport(TINY, [], None, 10.0, 30.0, [_layout("hetero_tp_up", {}, verified=False)],
                                    complete=False))  # fmt: skip
    assert partial["complete"] is False and partial["split_over_homogeneous"] == {"hetero_tp_up": 0.25}
    assert "kvsvc_gbps" not in partial and "layerwise_ms" not in partial and "transport" not in partial
    assert partial["verified"] is False and partial["failures"] == 0
    # make gpu-check reads the bench's last JSON line: a killed bench leaves its latest partial summary there.
    stdout = "".join(json.dumps(gpu_summary(r)) + "\n" for r in (
        GpuReport(TINY, [_large()], None, 10.0, 20.0, complete=False),
        GpuReport(TINY, [_large()], _layerwise(), 10.0, 25.0, complete=False),
    ))  # fmt: skip
    found = summary([StepResult("bench", -1, 140.0, "/logs/bench.log")], last_json(stdout), "/logs")
    assert found["ok"] is False and found["bench"]["complete"] is False
    assert found["bench"]["kvsvc_gbps"] == 900.0 and found["bench"]["layerwise_ms"] == 0.2
    with pytest.raises(ValueError, match="layer-wise"):
        from workers.commands.bench import render_gpu

        render_gpu(GpuReport(TINY, [_large()], None, 10.0, 20.0, complete=False))


def test_the_gpu_run_hands_over_each_part_as_it_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.bench import runner as bench_runner

    # The runner's measuring stubbed out (pure orchestration under test): which reports reach `so_far`, in order.
    run = object.__new__(bench_runner.BenchRunner)
    run.sizes, run.progress, run.device, run.direct = TINY, lambda _: None, "cuda", []
    for name in ("p", "d", "ps", "ps2", "dh", "dh2", "dwide", "pn", "dn2"):
        setattr(run, name, None)
    monkeypatch.setattr(run, "start", lambda: None)
    monkeypatch.setattr(run, "_gpu_scenario", lambda *_: _large())
    monkeypatch.setattr(run, "_gpu_layerwise", _layerwise)
    monkeypatch.setattr(run, "_layout", lambda name, *_: _layout(name, {}))
    seen: list[GpuReport] = []
    whole = run.run_gpu(seen.append)
    assert [(len(r.scenarios), r.layerwise is not None, len(r.layouts), r.complete) for r in seen] == [
        (1, False, 0, False), (1, True, 0, False), (1, True, 1, False), (1, True, 2, False), (1, True, 3, False),
        (1, True, 4, False),
    ]  # fmt: skip
    assert whole.complete and [x.name for x in whole.layouts] == [
        "hetero_tp_up", "hetero_tp_down", "block_mismatch", "nhd_hetero_tp"
    ]  # fmt: skip


def test_staged_parts_are_averaged_over_what_each_round_observed() -> None:
    def round_of(**parts: tuple[int, float]) -> dict[str, float]:
        sums = {f"{part}_{kind}": 0.0 for part in STAGE_PARTS for kind in "ns"}
        for part, (n, seconds) in parts.items():
            sums[f"{part}_n"], sums[f"{part}_s"] = float(n), seconds
        return sums

    rounds = [round_of(staged_gather=(4, 0.004), staged_write=(4, 0.008)), round_of(staged_gather=(12, 0.004))]
    # A mean per chunk over every round (not a mean of the rounds' means); parts nobody observed are left out.
    assert stage_means_ms(rounds) == pytest.approx({"staged_gather": 0.5, "staged_write": 2.0})
    assert stage_means_ms([round_of()]) == {}


def test_torch_copy_merges_only_runs_contiguous_on_both_sides() -> None:
    descs = [(0, 100, 10), (10, 110, 5), (15, 200, 5), (20, 205, 5), (40, 210, 5)]
    assert contiguous_runs(descs) == [(0, 100, 15), (15, 200, 10), (40, 210, 5)]
    assert contiguous_runs([]) == []


def test_gpu_check_without_nvidia_smi_says_no_gpu_and_succeeds(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH")} | {"PATH": str(bin_dir)}
    done = subprocess.run(
        ["/bin/bash", str(REPO / "scripts" / "gpu-check.sh")], env=env, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [json.loads(line) for line in done.stdout.splitlines()] == [
        {"gpu": False, "reason": "no nvidia-smi on PATH"}
    ]


def test_bench_on_cuda_is_refused_by_name_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    from workers.commands import bench

    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "--device", "cuda", "--quick"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "device cuda" in err and "sees no CUDA GPU" in err and torch.__version__ in err


def test_check_runs_every_step_and_leaves_none_of_their_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check's own driving, with stand-ins for the GPU steps: a bench that prints its figures, a step that fails,
    and one that hangs past its timeout after starting a child of its own (as an engine's workers would): every
    step runs and is reported, the bench's figures reach the summary, and no process of a step outlives it."""
    pids = tmp_path / "pids"
    hang = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pids)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    bench = 'print("warming up"); print(\'{"transport": "cuda_ipc", "kvsvc_gbps": 875.0, "other": 1}\')'
    stand_ins = [
        gpu_check.Step("hangs", [sys.executable, "-c", hang], 3),
        gpu_check.Step("fails", [sys.executable, "-c", "print('said on stdout'); import sys; sys.exit(3)"], 30),
        gpu_check.Step("bench", [sys.executable, "-c", bench], 30, own_stdout=True),
    ]
    monkeypatch.setattr(gpu_check, "no_gpu_reason", lambda environ, python: "")
    monkeypatch.setattr(gpu_check, "steps", lambda python, logs: stand_ins)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels / "plain-1.0-py3-none-any.whl", {"plain/__init__.py"})
    assert gpu_check.check(wheels) == 1
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["failed"] == ["hangs", "fails"] and not result["ok"]
    assert {name: step["rc"] for name, step in result["steps"].items()} == {"hangs": -1, "fails": 3, "bench": 0}
    assert result["bench"] == {"transport": "cuda_ipc", "kvsvc_gbps": 875.0}
    assert "killed after its timeout of 3 s" in Path(result["steps"]["hangs"]["log"]).read_text()
    assert "said on stdout" in Path(result["steps"]["fails"]["log"]).read_text()  # one file for both streams
    assert sorted(p.name for p in (tmp_path / "out" / "gpu-check").iterdir()) == [
        "bench.log", "bench.out", "fails.log", "hangs.log"
    ]  # fmt: skip
    stat = Path(f"/proc/{int(pids.read_text())}/stat")
    # Killed with its step's process group: gone, or dead and not yet reaped by whoever adopted it.
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_check_without_wheels_or_with_a_broken_one_says_why_before_any_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu_check, "no_gpu_reason", lambda environ, python: "")
    monkeypatch.setattr(gpu_check, "steps", lambda python, logs: pytest.fail("no step may run"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    assert gpu_check.check(wheels) == 1
    found = json.loads(capsys.readouterr().out)
    assert found["ok"] is False and f"no wheels in {wheels}" in found["reason"] and "carry .gpu" in found["reason"]
    (wheels / "msgspec-0.22.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"not a zip")
    assert gpu_check.check(wheels) == 1
    found = json.loads(capsys.readouterr().out)
    assert found["ok"] is False and "BadZipFile" in found["reason"]


def test_the_check_writes_no_more_files_than_the_device_hands_back(tmp_path: Path) -> None:
    """The device returns at most 8 files from $OUT: each step's log, the bench's stdout, each demo's workers' log."""
    found = gpu_check.steps("python3", tmp_path)
    named = [step.argv[step.argv.index("--worker-log") + 1] for step in found if "--worker-log" in step.argv]
    assert len(named) == 2 and all(Path(n).parent == tmp_path for n in named)
    assert sum(1 + step.own_stdout for step in found) + len(named) <= 8
