"""Push mode's pure decisions: P and D derive one transfer and secret from what a router gives each, D takes router
params only from its push peers, and a D with another prompt presents a secret P refuses. No vLLM, no sockets."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsvc.core.auth import PARAMS_KEY, derive_key
from kvsvc.core.messages import TransferRequest, WorkerRef
from kvsvc.core.sender import Reply, Sender, SendRequest
from kvsvc.vllm.config import parse_config
from kvsvc.vllm.connector import SchedulerSide
from kvsvc.vllm.flow import (
    ParamsError,
    SchedulerFlow,
    parse_remote_prefill,
    push_transfer_id,
)

BS = 16
PROMPT = list(range(100, 140))
KEY = derive_key("deployment-secret-0123", PARAMS_KEY)
P_ADDR = "10.0.0.1:8998"
ROUTER_ID = "___prefill_addr_10.0.0.1:8000___decode_addr_10.0.0.2:8000_0f3c2a9e8b7d4c1aa5e6f7081928374b"


def p_flow() -> SchedulerFlow:
    return SchedulerFlow("P-engine", f"http://{P_ADDR}", BS, params_key=KEY, push=True, tp_size=2)


def d_flow(peers: frozenset[str] = frozenset({P_ADDR})) -> SchedulerFlow:
    return SchedulerFlow("D-engine", "", BS, params_key=KEY, push_peers=peers)


def router_params(p_params: dict[str, Any], router_id: str = ROUTER_ID) -> dict[str, Any]:
    """What vllm-router 0.1.17 sends D in push mode, built from P's first answer (measured: it keeps these keys)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p_params["remote_engine_id"],
        "remote_host": p_params["remote_host"],
        "remote_port": p_params["remote_port"],
        "tp_size": p_params["tp_size"],
        "remote_request_id": router_id,
    }


def p_holds(f: SchedulerFlow, req_id: str, prompt: list[int] = PROMPT) -> tuple[Any, dict[str, Any]]:
    f.on_new_request(req_id, prompt, {"do_remote_decode": True}, max_tokens=1)
    f.scheduled(req_id, 0, len(prompt), [[7, 8, 9]])
    (send,) = f.build().sends
    _, params = f.finished(req_id, [[7, 8, 9]], completed=True)
    assert params is not None
    return send, params


def d_loads(f: SchedulerFlow, req_id: str, params: dict[str, Any], prompt: list[int] = PROMPT) -> Any:
    f.on_new_request(req_id, prompt, params)
    f.after_alloc(req_id, [[3, 4, 5]], len(prompt), len(prompt))
    (recv,) = f.build().recvs
    return recv


def test_p_announces_push_as_vllm_router_reads_it_and_d_derives_p_s_transfer_and_secret() -> None:
    send, params = p_holds(p_flow(), f"cmpl-{ROUTER_ID}-0-1a2b3c4d")
    assert (params["transfer_mode"], params["remote_host"], params["remote_port"], params["tp_size"]) == (
        "push",
        "10.0.0.1",
        8998,
        2,
    )
    recv = d_loads(d_flow(), f"cmpl-{ROUTER_ID}-0-9e8d7c6b", router_params(params))  # its own random suffix
    assert (recv.transfer_id, recv.secret) == (send.transfer_id, send.secret)
    assert recv.push  # D's idle steps may wait longer for it: P's prefill started with it
    assert not d_loads(d_flow(), "pulled-0-9e8d7c6b", params).push  # P's own params: P is done, the fetch is short
    assert (recv.engine_id, recv.bootstrap_addr, recv.num_tokens) == ("P-engine", f"http://{P_ADDR}", len(PROMPT))
    # A router that passes P's params unchanged (pull) reaches the same transfer: P's params name it, signed.
    pulled = parse_remote_prefill(params, KEY)
    assert (pulled.transfer_id, pulled.secret) == (send.transfer_id, send.secret)


def test_a_d_with_another_prompt_derives_another_secret_and_p_serves_it_nothing() -> None:
    send, params = p_holds(p_flow(), f"cmpl-{ROUTER_ID}-0-1a2b3c4d")
    other = [*PROMPT[:-1], 999]  # a client naming the victim's request with its own prompt
    recv = d_loads(d_flow(), f"cmpl-{ROUTER_ID}-0-9e8d7c6b", router_params(params), other)
    assert recv.transfer_id == send.transfer_id and recv.secret != send.secret
    sender = Sender(early_request_timeout_s=5.0)
    d_worker = WorkerRef(engine_id="D-engine", incarnation="1", pp_rank=0, tp_rank=0)
    early = TransferRequest(transfer_id=recv.transfer_id, block_ids=[3, 4, 5], num_tokens=40, secret=recv.secret)
    assert sender.request(d_worker, frozenset(), early, 0.0) == []  # D first: it waits for P's hold
    assert sender.hold(SendRequest("r", send.transfer_id, (7, 8, 9), 40, send.secret), 1.0) == []  # not applied
    (answer,) = sender.expire(6.0)
    assert isinstance(answer, Reply) and "not held" in answer.message.reason


@pytest.mark.parametrize(
    ("peers", "change", "match"),
    [
        (frozenset(), {}, "lists no push_peers"),
        (frozenset({"10.0.0.9:8998"}), {}, r"'10\.0\.0\.1:8998', not one of push_peers \['10\.0\.0\.9:8998'\]"),
        (frozenset({P_ADDR}), {"remote_request_id": "another-request"}, "is not part of this request's id"),
        (frozenset({P_ADDR}), {"remote_port": "8998"}, r"\['remote_port'\] is '8998', expected a non-empty int"),
        (frozenset({P_ADDR}), {"remote_engine_id": None}, r"\['remote_engine_id'\] is None"),
    ],
)
def test_d_refuses_router_push_params_it_cannot_trust_naming_the_value(
    peers: frozenset[str], change: dict[str, Any], match: str
) -> None:
    _, params = p_holds(p_flow(), f"cmpl-{ROUTER_ID}-0-1a2b3c4d")
    with pytest.raises(ParamsError, match=match):
        d_flow(peers).on_new_request(f"cmpl-{ROUTER_ID}-0-9e8d7c6b", PROMPT, router_params(params) | change)


def test_without_a_token_d_takes_push_params_only_from_loopback_peers() -> None:
    f = SchedulerFlow("D", "", BS, push_peers=frozenset({P_ADDR}))
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "10.0.0.1", "remote_port": 8998}
    with pytest.raises(ParamsError, match="remote_host"):
        f.on_new_request(f"cmpl-{ROUTER_ID}-0-9e8d7c6b", PROMPT, params | {"remote_request_id": ROUTER_ID})


@given(st.text(alphabet="abcdef0123456789-_xyz", min_size=1, max_size=60), st.integers(0, 5))
def test_two_engines_ids_for_one_router_id_give_one_transfer(router_id: str, index: int) -> None:
    ids = [f"cmpl-{router_id}-{index}-{suffix}" for suffix in ("0a1b2c3d", "ffffffff")]
    assert push_transfer_id(ids[0]) == push_transfer_id(ids[1]) == f"push-cmpl-{router_id}-{index}"


def test_an_overlong_request_id_is_refused() -> None:
    with pytest.raises(ParamsError, match="request id of 600 characters, limit 512"):
        push_transfer_id("x" * 600)


def test_push_config_is_checked_and_a_pushing_p_keeps_early_requests_as_long_as_d_waits() -> None:
    config = parse_config({"mode": "push", "recv_timeout_s": 90.0, "push_peers": ["10.0.0.1:8998", "[::1]:9"]})
    assert config.service_config(None).early_request_timeout_s == 90.0
    assert parse_config({}).service_config(None).early_request_timeout_s == 10.0
    with pytest.raises(ValueError, match=r"\['mode'\] is 'stream'; expected 'pull' or 'push'"):
        parse_config({"mode": "stream"})
    with pytest.raises(ValueError, match=r"\['push_peers'\] holds '10.0.0.1'; expected 'host:port'"):
        parse_config({"push_peers": ["10.0.0.1"]})


def test_a_d_that_came_first_with_the_derived_secret_is_served_at_the_hold_and_counted() -> None:
    send, params = p_holds(p_flow(), f"cmpl-{ROUTER_ID}-0-1a2b3c4d")
    recv = d_loads(d_flow(), f"cmpl-{ROUTER_ID}-0-9e8d7c6b", router_params(params))
    sender = Sender()
    d_worker = WorkerRef(engine_id="D-engine", incarnation="1", pp_rank=0, tp_rank=0)
    early = TransferRequest(transfer_id=recv.transfer_id, block_ids=[3, 4, 5], num_tokens=40, secret=recv.secret)
    assert sender.request(d_worker, frozenset(), early, 0.0) == []
    sender.hold(SendRequest("r", send.transfer_id, (7, 8, 9), 40, send.secret), 1.0)
    stats = sender.statistics()
    assert (stats.early_requests, stats.early_served, stats.refused_secrets) == (0, 1, 0)
    assert stats.jobs_by_state  # the request became a job of the hold


def test_d_takes_each_push_transfer_once_so_a_repeated_router_id_is_computed_locally() -> None:
    # P answers a transfer it finished with its outcome again (for a D that re-sends after a reconnect): a second
    # receive of the same derived transfer would take blocks nothing wrote as loaded.
    _, params = p_holds(p_flow(), f"cmpl-{ROUTER_ID}-0-1a2b3c4d")
    d = d_flow()
    d_loads(d, f"cmpl-{ROUTER_ID}-0-9e8d7c6b", router_params(params))
    with pytest.raises(ParamsError, match="was already taken by this engine"):
        d.on_new_request(f"cmpl-{ROUTER_ID}-0-00ff00ff", PROMPT, router_params(params))
    d_loads(d, f"cmpl-{ROUTER_ID}-1-00ff00ff", router_params(params))  # the request's next prompt is another


def test_a_p_at_data_parallel_above_1_runs_the_pull_flow(caplog: pytest.LogCaptureFixture) -> None:
    side = SchedulerSide(parse_config({"mode": "push"}), "P", BS, dp_rank=1, dp_size=2)
    assert not side.flow.push
    assert "runs the pull flow" in caplog.text
    assert SchedulerSide(parse_config({"mode": "push"}), "P", BS).flow.push


def test_an_ipv6_push_peer_must_be_bracketed() -> None:
    assert parse_config({"push_peers": ["[::1]:8998"]}).push_peers == ["[::1]:8998"]
    with pytest.raises(ValueError, match=r"'::1:8998'; expected 'host:port' \('\[addr\]:port' for IPv6\)"):
        parse_config({"push_peers": ["::1:8998"]})


def test_a_pushing_p_withdraws_a_request_that_ends_unheld_so_ds_waiting_fetch_fails_now() -> None:
    """P aborted mid-prefill (before its hold): D's fetch, sent by the router at the same time, waits at P; the
    step tells every P worker to withdraw the transfer, with the transfer and secret D derived. A pulling P, or a
    held request, withdraws nothing (no D waits, or the hold is aborted)."""
    p, d = p_flow(), d_flow()
    req = f"cmpl-{ROUTER_ID}-0-1a2b3c4d"
    p.on_new_request(req, PROMPT, {"do_remote_decode": True}, max_tokens=1)
    p.scheduled(req, 0, BS, [[7]])  # a first chunk: not held yet
    assert p.build().sends == ()
    assert p.finished(req, [[7]], completed=False) == (False, None)
    (gone,) = p.build().withdrawn
    _, params = p_holds(p_flow(), "cmpl-other-0-00000000")
    recv = d_loads(d, f"cmpl-{ROUTER_ID}-0-9e8d7c6b", router_params(params))
    assert (gone.transfer_id, gone.secret) == (recv.transfer_id, recv.secret)
    assert "aborted or failed before its KV was held" in gone.reason
    pull = SchedulerFlow("P-engine", f"http://{P_ADDR}", BS, params_key=KEY)
    pull.on_new_request("r1", PROMPT, {"do_remote_decode": True}, max_tokens=1)
    pull.finished("r1", [[7]], completed=False)
    assert pull.build().withdrawn == ()
    held = p_flow()
    held.on_new_request(req, PROMPT, {"do_remote_decode": True}, max_tokens=1)
    held.scheduled(req, 0, len(PROMPT), [[7, 8, 9]])
    held.finished(req, [[7, 8, 9]], completed=False)
    step = held.build()
    assert step.withdrawn == () and step.aborts == (req,)


def test_a_repeated_router_id_while_its_first_request_prefills_is_computed_without_push_and_withdraws_nothing() -> None:
    """Two live P requests with one X-Request-Id would share a transfer: the second is refused (P computes it
    without holding), so its abort cannot withdraw the first's transfer, which D's fetch waits for."""
    p = p_flow()
    first, second = f"cmpl-{ROUTER_ID}-0-1a2b3c4d", f"cmpl-{ROUTER_ID}-0-5e6f7a8b"
    p.on_new_request(first, PROMPT, {"do_remote_decode": True}, max_tokens=1)
    with pytest.raises(ParamsError, match=r"is being prefilled here for request .* already"):
        p.on_new_request(second, PROMPT, {"do_remote_decode": True}, max_tokens=1)
    assert p.finished(second, [[7]], completed=False) == (False, None)
    assert p.build().withdrawn == ()
    p.scheduled(first, 0, len(PROMPT), [[7, 8, 9]])
    (send,) = p.build().sends
    assert p.finished(first, [[7, 8, 9]], completed=True)[0]
    p.on_new_request(second, PROMPT, {"do_remote_decode": True}, max_tokens=1)  # the first is over: taken again
    p.finished(second, [[7]], completed=False)
    (gone,) = p.build().withdrawn
    assert gone.transfer_id == send.transfer_id


# llm-d's `mooncake` mode (its sidecar's connector_mooncake.go): P gets the first body, D the second, at once.
LLMD_ID = "xfer-1b4e28ba-2fa1-11d2-883f-0016d3cca427"
LLMD_P = {"do_remote_prefill": False, "do_remote_decode": True, "transfer_id": LLMD_ID}


def llmd_d(addr: str = f"http://{P_ADDR}", transfer_id: Any = LLMD_ID) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_bootstrap_addr": addr,
        "remote_engine_id": "P-engine",
    }


def test_a_router_named_transfer_is_held_under_its_name_and_d_derives_its_secret_in_either_p_mode() -> None:
    for p in (p_flow(), SchedulerFlow("P-engine", f"http://{P_ADDR}", BS, params_key=KEY)):  # push and pull
        p.on_new_request("p-own-id", PROMPT, LLMD_P, max_tokens=1)
        p.scheduled("p-own-id", 0, len(PROMPT), [[7, 8, 9]])
        (send,) = p.build().sends
        recv = d_loads(d_flow(), "d-own-id", llmd_d())  # the engines' request ids share nothing
        assert (recv.transfer_id, recv.secret, recv.engine_id) == (send.transfer_id, send.secret, "P-engine")
        assert recv.transfer_id == f"named-{LLMD_ID}" and recv.push
    other = d_loads(d_flow(), "d-2", llmd_d(), prompt=[*PROMPT[:-1], 7])
    assert other.secret != send.secret  # another prompt: P refuses what it presents


@pytest.mark.parametrize(
    ("params", "names"),
    [
        (llmd_d(addr="http://10.0.0.9:8998"), "'10.0.0.9:8998', not one of push_peers"),
        (llmd_d(addr="10.0.0.1:8998"), "is not 'http://host:port'"),
        (llmd_d(addr=f"http://{P_ADDR}/query"), "is not 'http://host:port'"),
        (llmd_d(transfer_id=""), "'' is not 1 to 200 printable ASCII"),
        (llmd_d(transfer_id=7), "7 is not 1 to 200 printable ASCII"),
        (llmd_d(transfer_id="x" * 201), "is not 1 to 200 printable ASCII"),
    ],
)
def test_d_refuses_router_named_params_it_cannot_trust_naming_the_value(params: dict[str, Any], names: str) -> None:
    with pytest.raises(ParamsError, match=re.escape(names)):
        d_flow().on_new_request("d", PROMPT, params)
    with pytest.raises(ParamsError, match="lists no push_peers"):
        d_flow(frozenset()).on_new_request("d", PROMPT, llmd_d())


def test_a_p_withdraws_a_named_transfer_that_ends_unheld_and_d_takes_each_name_once() -> None:
    p = SchedulerFlow("P-engine", f"http://{P_ADDR}", BS, params_key=KEY)
    p.on_new_request("p-1", PROMPT, LLMD_P, max_tokens=1)
    assert p.finished("p-1", [[7, 8, 9]], completed=False) == (False, None)
    (gone,) = p.build().withdrawn
    assert gone.transfer_id == f"named-{LLMD_ID}"
    d = d_flow()
    d_loads(d, "d-1", llmd_d())
    with pytest.raises(ParamsError, match="already taken"):
        d.on_new_request("d-2", PROMPT, llmd_d())
