"""`make gpu-wheels` and `make gpu-check`: what a GPU host without a package index needs, and the check run there.

`python -m workers.gpu_check wheels DIR` (on a machine with an index) downloads into DIR the wheels such a host
lacks for CPython 3.12 on manylinux x86_64: msgspec, pytest-asyncio and Mooncake's CUDA 13 build, repacked slim
(its engine and the libraries the engine loads: the full wheel is 50 MB); a wheel already there is kept, so a
second run downloads nothing. `python -m workers.gpu_check check DIR` (on the GPU host, its own python3, no pip)
unpacks DIR's wheels into a temporary site directory beside a generated `kvsvc` dist-info (the entry points of
pyproject.toml, the code taken from the repository through PYTHONPATH), then runs the CUDA tests, the demo on each
plane and the GPU bench, each step in its own process with its own timeout and its output in a log file under
`$OUT` (else a temporary directory). It ends stdout with one JSON object: per step ok, rc and seconds, and the
bench's figures (those of the parts it measured, should it reach its timeout). Rules: without a GPU it prints
`{"gpu": false, "reason": ...}` and exits 0; without wheels (`.gpu` not carried) or with one that cannot be unpacked
it says so in the JSON object before any step, exit 1; a failing step never stops the later ones; the exit code is 1
when any step failed. Standard library only (the host's torch is asked in a child process), so the driver itself cannot
fail to import there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

REPO: Final = Path(__file__).resolve().parent.parent
PLATFORM: Final = ("--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64")
PLAIN_WHEELS: Final = (("msgspec", "msgspec==0.22.0"), ("pytest_asyncio", "pytest-asyncio==1.5.0"))
MOONCAKE: Final = "mooncake-transfer-engine-cuda13==0.3.14"
SLIM_NAME: Final = "mooncake_slim-cp312.whl"
# What the slim Mooncake wheel keeps: the engine, the libraries beside it, and the bundled libraries it links.
SLIM_FILES: Final = ("mooncake/__init__.py", "mooncake/engine.so", "mooncake/libasio.so", "mooncake/libetcd_wrapper.so")
SLIM_LIBS_DIR: Final = "mooncake_transfer_engine_cuda13.libs/"
SLIM_LIBS: Final = ("libyaml-cpp", "libjsoncpp", "libglog", "libgflags", "libunwind", "libasio")


# -- make gpu-wheels ------------------------------------------------------------------------------------------


def slim_keeps(name: str) -> bool:
    """Whether the slim Mooncake wheel keeps the member `name` of the full one."""
    if name in SLIM_FILES:
        return True
    top = name.split("/", 1)[0]
    if top.endswith(".dist-info"):
        return not name.endswith("/RECORD")  # written anew for the members kept
    if name.startswith(SLIM_LIBS_DIR):
        lib = name[len(SLIM_LIBS_DIR) :]
        return "/" not in lib and any(lib.startswith(prefix + "-") for prefix in SLIM_LIBS)
    return False


def repack_slim(full: Path, dest: Path) -> Path:
    """Write `dest`, a wheel holding the members of `full` that `slim_keeps`, with a RECORD that lists them.

    Raises:
        ValueError: `full` lacks one of `SLIM_FILES` or a dist-info (not Mooncake's wheel).
        OSError / zipfile.BadZipFile: `full` cannot be read, `dest` cannot be written.
    """
    with zipfile.ZipFile(full) as src:
        names = src.namelist()
        missing = [f for f in SLIM_FILES if f not in names]
        dist_info = sorted({n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")})
        if missing or len(dist_info) != 1:
            raise ValueError(f"{full} is not Mooncake's wheel: missing {missing or 'a dist-info'}")
        kept = [n for n in names if slim_keeps(n) and not n.endswith("/")]
        tmp = dest.with_name(dest.name + ".part")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
            for name in kept:
                out.writestr(src.getinfo(name), src.read(name))
            record = "".join(f"{name},,\n" for name in kept) + f"{dist_info[0]}/RECORD,,\n"
            out.writestr(f"{dist_info[0]}/RECORD", record)
    tmp.replace(dest)  # whole or absent: a second run never keeps half a wheel
    return dest


def _pip_download(python: str, spec: str, into: Path) -> None:
    """Raises CalledProcessError when pip fails (no index, no such wheel for the platform)."""
    argv = [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *PLATFORM, "-d", str(into), spec]
    subprocess.run(argv, check=True)


def download_wheels(dest: Path, python: str = sys.executable) -> list[Path]:
    """Fill `dest` with the GPU host's wheels (module docstring); those already there are kept. Returns them all.

    Raises:
        CalledProcessError: pip failed. ValueError: as `repack_slim`.
    """
    dest.mkdir(parents=True, exist_ok=True)
    for prefix, spec in PLAIN_WHEELS:
        if not list(dest.glob(f"{prefix}-*.whl")):
            _pip_download(python, spec, dest)
    slim = dest / SLIM_NAME
    if not slim.exists():
        with tempfile.TemporaryDirectory() as tmp:
            _pip_download(python, MOONCAKE, Path(tmp))
            (full,) = Path(tmp).glob("*.whl")
            repack_slim(full, slim)
    return sorted(dest.glob("*.whl"))


# -- make gpu-check -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]
    timeout_s: float
    # Whether stdout gets a file of its own (`<name>.out`, the bench's figures), else it joins stderr in `<name>.log`:
    # the device that runs the check hands back at most 8 files.
    own_stdout: bool = False


@dataclass(frozen=True)
class StepResult:
    name: str
    rc: int  # the exit status; -1: killed at its timeout
    seconds: float
    log: str

    @property
    def ok(self) -> bool:
        return self.rc == 0


def steps(python: str, logs: Path) -> list[Step]:
    """The check, in order; the timeouts add to under 6 minutes, the bench on quick sizes being the longest. Each
    demo keeps its workers' stderr (Mooncake's log, a worker's traceback) in `logs`, beside the step's own log."""
    cli = [python, "-m", "kvsvc.cli"]
    demo = [*cli, "demo", "--device", "cuda", "--json", "--timeout", "50"]
    return [
        Step("pytest_cuda", [python, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "tests"], 90),
        *(
            Step(
                f"demo_{plane}",
                [*demo, "--transport", plane, "--worker-log", str(logs / f"demo_{plane}.workers.log")],
                60,
            )
            for plane in ("auto", "mooncake")
        ),
        Step("bench", [*cli, "bench", "--device", "cuda", "--quick", "--json"], 140, own_stdout=True),
    ]


def no_gpu_reason(environ: Mapping[str, str], python: str) -> str:
    """Why this host cannot run the check ("" when it can): no nvidia-smi on PATH, nvidia-smi lists no GPU, or
    torch (asked in a child process) sees none."""
    smi = shutil.which("nvidia-smi", path=environ.get("PATH", ""))
    if smi is None:
        return "no nvidia-smi on PATH"
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi -L failed: {exc}"
    if listed.returncode != 0 or "GPU" not in listed.stdout:
        return f"nvidia-smi -L lists no GPU (rc {listed.returncode})"
    probe = "import torch; print(torch.cuda.is_available())"
    try:
        seen = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"asking torch failed: {exc}"
    if seen.stdout.strip() != "True":
        return f"torch sees no CUDA GPU ({(seen.stdout + seen.stderr).strip()[-300:]})"
    return ""


def dist_info(pyproject: Path, site: Path) -> Path:
    """Write `kvsvc-<version>.dist-info/` (METADATA, entry_points.txt) into `site` from `pyproject`, so that the
    entry points (the `kvsvc` subcommands, the pytest plugin) are found with the code on PYTHONPATH, without pip.

    Raises:
        OSError / tomllib.TOMLDecodeError / KeyError: pyproject.toml unreadable or without [project].
    """
    project = tomllib.loads(pyproject.read_text())["project"]
    groups: dict[str, dict[str, str]] = {}
    if project.get("scripts"):
        groups["console_scripts"] = dict(project["scripts"])
    for group, entries in project.get("entry-points", {}).items():
        groups[group] = dict(entries)
    where = site / f"{project['name']}-{project['version']}.dist-info"
    where.mkdir(parents=True, exist_ok=True)
    (where / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    text = "".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items()) + "\n"
        for group, entries in groups.items()
    )
    (where / "entry_points.txt").write_text(text)
    return where


def unpack_wheels(wheels: Sequence[Path], site: Path) -> None:
    """Extract every wheel into `site` (what pip would install, without its scripts). Raises BadZipFile, OSError."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)


def run_step(step: Step, env: Mapping[str, str], logs: Path) -> tuple[StepResult, str]:
    """Run one step from the repository root in a session of its own; its stderr goes to `<name>.log`, its stdout
    there too, or to `<name>.out` (and is returned) when it has one of its own (`Step.own_stdout`). When it exits or
    times out, whatever it started and left running (an engine's workers, holding the GPU) is killed with its process
    group, so no step leaves processes to the next. Never raises for the step's own failure: a timeout or a missing
    program is rc -1 or 127."""
    log, out = logs / f"{step.name}.log", logs / f"{step.name}.out"
    began = time.monotonic()
    with log.open("w") as err_file, contextlib.ExitStack() as stack:
        out_file = stack.enter_context(out.open("w")) if step.own_stdout else err_file
        err_file.write(f"$ {' '.join(step.argv)}\n")
        err_file.flush()
        try:
            proc = subprocess.Popen(
                step.argv, cwd=REPO, env=dict(env), stdout=out_file, stderr=err_file, start_new_session=True
            )
        except OSError as exc:
            err_file.write(f"\ncould not start: {exc}\n")
            return StepResult(step.name, 127, time.monotonic() - began, str(log)), ""
        try:
            rc = proc.wait(timeout=step.timeout_s)
        except subprocess.TimeoutExpired:
            rc = -1
            err_file.write(f"\nkilled after its timeout of {step.timeout_s:g} s\n")
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()  # should the group be gone or out of reach, the step itself still ends
            proc.wait()
    return StepResult(step.name, rc, time.monotonic() - began, str(log)), out.read_text() if step.own_stdout else ""


def last_json(stdout: str) -> dict[str, Any] | None:
    """The last line of `stdout` that is a JSON object, None when there is none."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


BENCH_FIGURES: Final = (
    "complete",  # false: the bench was stopped (its timeout); the figures are those of the parts it measured
    "transport",
    "kvsvc_gbps",
    "plane_gbps",
    "torch_copy_gbps",
    "mooncake_tcp_gbps",
    "kvsvc_over_plane",
    "kvsvc_over_torch_copy",
    "kvsvc_over_mooncake_tcp",
    "layerwise_ms",
    "whole_request_ms",
    "layerwise_baseline_ms",
    "layerwise_ratios",
    "split_over_homogeneous",
    "split_stage_ms",
    "verified",
    "failures",
)


def summary(results: Sequence[StepResult], bench: Mapping[str, Any] | None, logs: str) -> dict[str, Any]:
    """The check's one JSON object: `ok` when every step exited 0, each step's ok, rc, seconds and log, and the
    bench's figures (`BENCH_FIGURES` of the last summary it printed, partial when it was stopped; null when it
    printed none)."""
    return {
        "gpu": True,
        "ok": all(r.ok for r in results),
        "failed": [r.name for r in results if not r.ok],
        "steps": {r.name: {"ok": r.ok, "rc": r.rc, "seconds": round(r.seconds, 1), "log": r.log} for r in results},
        "bench": None if bench is None else {k: bench[k] for k in BENCH_FIGURES if k in bench},
        "logs": logs,
    }


def check(wheels_dir: Path, python: str = sys.executable) -> int:
    """The GPU host's check (module docstring); prints one JSON object, returns the exit code."""
    reason = no_gpu_reason(os.environ, python)
    if reason:
        print(json.dumps({"gpu": False, "reason": reason}))
        return 0
    wheels = sorted(wheels_dir.glob("*.whl"))
    if not wheels:  # `.gpu` is git-ignored: it reaches the host only when carried
        reason = f"no wheels in {wheels_dir}: run `make gpu-wheels` where pip has an index, and carry .gpu"
        print(json.dumps({"gpu": True, "ok": False, "reason": reason}))
        return 1
    out = os.environ.get("OUT")
    logs = Path(out) / "gpu-check" if out else Path(tempfile.mkdtemp(prefix="kvsvc-gpu-check-"))
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvsvc-gpu-site-") as tmp:
        site = Path(tmp)
        try:
            unpack_wheels(wheels, site)
            dist_info(REPO / "pyproject.toml", site)
        except Exception as exc:  # a bad wheel fails in many ways (BadZipFile, zlib.error, EOFError): all say why
            print(json.dumps({"gpu": True, "ok": False, "reason": f"preparing the site failed: {exc!r}"}))
            return 1
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(site), env.get("PYTHONPATH", "")) if p)
        env.setdefault("MC_LOG_LEVEL", "ERROR")
        results, bench = [], None
        for step in steps(python, logs):
            result, stdout = run_step(step, env, logs)
            results.append(result)
            print(f"gpu-check: {step.name} rc {result.rc} in {result.seconds:.1f} s", file=sys.stderr)
            if step.name == "bench":
                bench = last_json(stdout)
    print(json.dumps(summary(results, bench, str(logs)), sort_keys=True))
    return 0 if all(r.ok for r in results) else 1


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("wheels", "check"):
        print("usage: python -m workers.gpu_check {wheels|check} WHEELS_DIR", file=sys.stderr)
        return 2
    if argv[0] == "wheels":
        for wheel in download_wheels(Path(argv[1])):
            print(wheel)
        return 0
    return check(Path(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
