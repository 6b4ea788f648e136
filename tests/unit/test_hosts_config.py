"""Rules of running across hosts that need no network: who may listen beyond loopback, which faults need hosts."""

from __future__ import annotations

import pytest

from kvsvc.engine.netns import NetnsHosts
from kvsvc.service import ServiceConfig
from kvsvc.service.config import is_loopback
from workers.chaos_spec import ChaosOptions
from workers.commands.serve import check_host
from workers.executor import EngineConfig


def test_a_control_server_beyond_loopback_needs_a_token() -> None:
    with pytest.raises(ValueError, match=r"control_host '10\.0\.0\.7' is reachable beyond loopback"):
        ServiceConfig(control_host="10.0.0.7")
    assert ServiceConfig(control_host="10.0.0.7", control_token="secret").control_host == "10.0.0.7"
    assert ServiceConfig(control_host="127.0.0.2").control_token is None
    assert is_loopback("localhost") and is_loopback("::1") and not is_loopback("example.com")


def test_on_host_puts_every_listener_on_the_one_address() -> None:
    config = EngineConfig(engine_id="e", service=ServiceConfig(control_token="t")).on_host("10.1.2.3", "ns1")
    assert (config.bootstrap_host, config.service.control_host, config.transport.host) == ("10.1.2.3",) * 3
    assert config.netns == "ns1" and config.service.control_token == "t"
    with pytest.raises(ValueError, match="control_token"):
        EngineConfig(engine_id="e").on_host("10.1.2.3")
    with pytest.raises(ValueError, match="binds every interface"):
        EngineConfig(engine_id="e", service=ServiceConfig(control_token="t")).on_host("0.0.0.0")
    assert EngineConfig(engine_id="e").on_host("localhost").bootstrap_host == "localhost"


def test_serve_refuses_wildcards_and_an_open_control_port_beyond_loopback() -> None:
    check_host("127.0.0.1", None)
    check_host("10.0.0.1", "token")
    with pytest.raises(ValueError, match=r"--host '0\.0\.0\.0' binds every interface"):
        check_host("0.0.0.0", "token")
    with pytest.raises(ValueError, match=r"--host 10\.0\.0\.1 is reachable beyond loopback.*--control-token-file"):
        check_host("10.0.0.1", None)
    for wildcard in ("0", "::0", "0:0:0:0:0:0:0:0", ""):
        with pytest.raises(ValueError, match="binds every interface"):
            check_host(wildcard, "token")
    with pytest.raises(ValueError, match="IPv6"):
        check_host("fd00::1", "token")


def test_the_cli_names_the_same_link_faults_as_the_runner() -> None:
    from workers.chaos_spec import NET_FAULTS
    from workers.commands.chaos import _NET_FAULT_NAMES

    assert _NET_FAULT_NAMES == NET_FAULTS


def test_link_faults_need_network_hosts_and_hostgone_comes_last() -> None:
    with pytest.raises(ValueError, match=r"need hosts='netns'"):
        ChaosOptions(faults=("partition",))
    with pytest.raises(ValueError, match="must be the last fault"):
        ChaosOptions(faults=("hostgone", "partition"), hosts="netns")
    with pytest.raises(ValueError, match="unknown faults"):
        ChaosOptions(faults=("meteor",), hosts="netns")
    options = ChaosOptions(faults=("partition", "loss5"), hosts="netns", outage_s=4.0, loss_s=6.0)
    base = options.fault_bound_s("kill")
    assert options.fault_bound_s("partition") == base + 4.0 and options.fault_bound_s("loss5") == base + 6.0
    with pytest.raises(ValueError, match="must be > 0"):
        ChaosOptions(outage_s=-1.0)


def test_hosts_refuse_bad_names_and_unknown_hosts() -> None:
    with pytest.raises(ValueError, match="distinct"):
        NetnsHosts(["a", "a"])
    with pytest.raises(ValueError, match="at least one"):
        NetnsHosts([])
    with pytest.raises(KeyError, match="no host 'c'"):
        NetnsHosts(["a", "b"]).address("c")
    hosts = NetnsHosts(["a", "b"])  # not entered: nothing made
    assert (hosts.address("a"), hosts.address("b")) == ("10.213.0.1", "10.213.0.2")
    with pytest.raises(ValueError, match="probability"):
        hosts.loss("a", 1.5)
