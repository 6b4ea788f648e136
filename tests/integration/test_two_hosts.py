"""P and D on two network hosts: network namespaces on a private link, every address non-loopback.

What crosses the link is checked where it is counted (the receiving host's interface), not assumed; the served P
is the `kvsvc serve` command an operator runs, started on its host with `ip netns exec`. Skips where namespaces
cannot be made (not root, no iproute2/iptables); CI runs as root. Every namespace a test makes is removed by it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsvc.core.messages import METADATA_PATH, decode_engine_metadata
from kvsvc.engine.netns import PREFIX, NetnsHosts, in_netns, skip_reason
from kvsvc.service import ServiceConfig
from kvsvc.service.config import is_loopback
from workers.engine import DecodeEngine, DecodeRequest, PrefillEngine
from workers.executor import EngineConfig, Executor, start_all
from workers.process import Peers

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]

TOKEN = "two-hosts-token-0123456789"
GEOMETRY = dict(num_layers=2, num_kv_heads=4, head_size=16, block_size=16, num_blocks=256)


@pytest.fixture
def hosts() -> Iterator[NetnsHosts]:
    with NetnsHosts(["prefill", "decode"]) as net:
        yield net
    left = [n for n in os.listdir("/var/run/netns") if n.startswith(PREFIX)] if os.path.isdir("/var/run/netns") else []
    assert left == [], f"namespaces left behind: {left}"


def _placed(engine_id: str, role: str, net: NetnsHosts, host: str, tp: int = 1, token: str = TOKEN) -> EngineConfig:
    service = ServiceConfig(control_token=token, early_request_timeout_s=3.0, recv_timeout_s=20.0)
    config = EngineConfig(engine_id=engine_id, role=role, tp_size=tp, service=service, **GEOMETRY)  # type: ignore[arg-type]
    return config.on_host(net.address(host), net.netns(host))


def _drain(decode: DecodeEngine, prefill: PrefillEngine | None, count: int, deadline_s: float) -> list[DecodeRequest]:
    ended: list[DecodeRequest] = []
    deadline = time.monotonic() + deadline_s
    while len(ended) < count and time.monotonic() < deadline:
        ended += decode.step(verify=True)
        if prefill is not None:
            prefill.step()
        time.sleep(0.005)
    return ended


def test_engines_on_two_hosts_move_every_byte_over_the_link(hosts: NetnsHosts) -> None:
    p_exec = Executor(_placed("hosts-p", "prefill", hosts, "prefill", tp=2))
    d_exec = Executor(_placed("hosts-d", "decode", hosts, "decode"))
    start_all([p_exec, d_exec])
    try:
        # What each engine publishes to its peers is its host's address, never loopback.
        assert p_exec.url.startswith(f"http://{hosts.address('prefill')}:")
        for executor, host in ((p_exec, "prefill"), (d_exec, "decode")):
            for meta in executor.metas.values():
                assert meta.control_addr.rsplit(":", 1)[0] == hosts.address(host)
                assert not is_loopback(meta.control_addr.rsplit(":", 1)[0])
        rx_before, _ = hosts.link_bytes("decode")
        prefill, decode = PrefillEngine(p_exec), DecodeEngine(d_exec)
        sizes = [1, 16, 17, 200, 555, 1000, 64, 33]
        for i, tokens in enumerate(sizes):
            prefill.submit(f"t{i}", tokens, seed=7 + i)
            decode.submit(f"t{i}", p_exec.engine_id, p_exec.url, tokens, seed=7 + i)
        ended = _drain(decode, prefill, len(sizes), 60.0)
        assert len(ended) == len(sizes)
        assert all(r.verified_ok for r in ended), [(r.transfer_id, r.state, r.reason) for r in ended]
        rx_after, _ = hosts.link_bytes("decode")
        kv_bytes = sum(tokens * 2 * 2 * 4 * 16 * 2 for tokens in sizes)  # layers × K/V × heads × size × bf16
        assert rx_after - rx_before >= kv_bytes  # the KV came in over D's link
        # Two network namespaces are two hosts to the rule: the same-host plane is never chosen across them.
        rows = [row for i in range(len(p_exec.workers)) for row in p_exec.call(i, Peers())]
        assert rows and {row["transport"] for row in rows if row["direction"] == "from_d"} == {"mooncake"}
    finally:
        d_exec.close()
        p_exec.close()


def test_a_wrong_control_token_is_refused_across_hosts(hosts: NetnsHosts) -> None:
    p_exec = Executor(_placed("hosts-p", "prefill", hosts, "prefill"))
    d_exec = Executor(_placed("hosts-d", "decode", hosts, "decode", token="another-token-0123456789"))
    start_all([p_exec, d_exec])
    try:
        decode = DecodeEngine(d_exec)
        decode.submit("wrong-token", p_exec.engine_id, p_exec.url, 20, seed=1)
        (ended,) = _drain(decode, None, 1, 60.0)
        assert ended.state == "failed" and "token" in ended.reason, ended.reason
    finally:
        d_exec.close()
        p_exec.close()


def _start_serve(net: NetnsHosts, token_file: Path, log: Path) -> tuple[subprocess.Popen[str], str]:
    argv = [
        *net.exec_prefix("prefill"),
        *(sys.executable, "-m", "kvsvc.cli", "serve", "--role", "prefill", "--engine-id", "served-p"),
        *("--host", net.address("prefill"), "--control-token-file", str(token_file)),
        *("--layers", "2", "--kv-heads", "4", "--head-size", "16", "--block-size", "16", "--num-blocks", "64"),
    ]
    with open(log, "w") as stderr:  # a file, not a pipe nobody reads while the engine runs
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert process.stdout is not None
    for line in process.stdout:  # ends at EOF if the command dies
        if line.startswith("bootstrap URL:"):
            return process, line.split()[2]
    process.kill()
    process.wait(30)
    pytest.fail(f"kvsvc serve did not start: {log.read_text()[-2000:]}")


def test_kvsvc_serve_on_one_host_answers_a_decode_engine_on_the_other(hosts: NetnsHosts, tmp_path: Path) -> None:
    token_file = tmp_path / "control-token"
    token_file.write_text(TOKEN + "\n")
    log = tmp_path / "serve.log"
    process, url = _start_serve(hosts, token_file, log)
    try:
        assert url.startswith(f"http://{hosts.address('prefill')}:")

        def fetch() -> bytes:
            with urllib.request.urlopen(url + METADATA_PATH, timeout=10) as response:
                return bytes(response.read())

        # From the decode host: the endpoint answers and every listener it publishes is on P's address.
        metadata = decode_engine_metadata(in_netns(hosts.netns("decode"), fetch))
        for meta in metadata.values():
            assert meta.control_addr.startswith(hosts.address("prefill") + ":")
        # A receive of a transfer P never holds crosses the control channel with the token and is answered, not
        # refused: P's early-request deadline is what fails it.
        d_exec = Executor(_placed("hosts-d", "decode", hosts, "decode"))
        d_exec.start()
        try:
            decode = DecodeEngine(d_exec)
            decode.submit("never-held", "served-p", url, 20, seed=None)
            (ended,) = _drain(decode, None, 1, 60.0)
            assert ended.state == "failed" and "not held by P" in ended.reason, ended.reason
        finally:
            d_exec.close()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(60)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGUSR1)  # every thread's stack into its log: where the stop waits
            time.sleep(1)
            pytest.fail(f"kvsvc serve did not stop within 60 s of SIGTERM; its log:\n{log.read_text()[-8000:]}")
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    assert code == 0


def test_kvsvc_serve_refuses_an_address_beyond_loopback_without_a_control_token(hosts: NetnsHosts) -> None:
    argv = [*hosts.exec_prefix("prefill"), sys.executable, "-m", "kvsvc.cli", "serve"]
    env = {k: v for k, v in os.environ.items() if k != "KVSVC_CONTROL_TOKEN"}
    done = subprocess.run(
        [*argv, "--host", hosts.address("prefill")], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 2
    assert f"--host {hosts.address('prefill')} is reachable beyond loopback" in done.stderr
    assert "--control-token-file" in done.stderr


def test_the_demo_runs_across_two_hosts(capsys: pytest.CaptureFixture[str]) -> None:
    from workers.commands import demo

    flags = ["--requests", "6", "--tokens", "70", "--layers", "4", "--kv-heads", "4", "--head-size", "16", "--json"]
    code = demo.main(["--hosts", "netns", *flags])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["ok"] is True, result
    assert result["verified"] == 6
    assert set(result["hosts"]) == {"prefill", "decode"}
    assert not any(is_loopback(address) for address in result["hosts"].values())
