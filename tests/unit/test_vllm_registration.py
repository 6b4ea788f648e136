"""How a vLLM deployment finds and lays out kvsvc: the connector registered by name through vLLM's general plugins
(the module path keeps working beside it), and each data-parallel rank an engine of its own, with an endpoint port
of its own when the port is fixed. The connector end to end under these settings is proven with real engines in
tests/vllm."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from importlib.metadata import entry_points

import pytest

from kvsvc.vllm.config import ConnectorConfig
from kvsvc.vllm.plugin import register

pytestmark = pytest.mark.vllm


def test_kvsvc_is_a_vllm_general_plugin_in_its_package_metadata() -> None:
    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("kvsvc") == "kvsvc.vllm.plugin:register"


def test_the_plugin_registers_the_connector_by_name_once_and_the_module_path_still_works() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvsvc.vllm import KvsvcConnector

    register()
    register()  # vLLM may call every plugin again in a process: a no-op
    by_name = KVTransferConfig(kv_connector="KvsvcConnector", kv_role="kv_producer")
    assert KVConnectorFactory.get_connector_class(by_name) is KvsvcConnector
    by_path = KVTransferConfig(
        kv_connector="KvsvcConnector", kv_connector_module_path="kvsvc.vllm", kv_role="kv_consumer"
    )
    assert KVConnectorFactory.get_connector_class(by_path) is KvsvcConnector


@pytest.mark.parametrize(("port", "rank", "expected"), [(0, 0, 0), (0, 3, 0), (8998, 0, 8998), (8998, 1, 8999)])
def test_each_data_parallel_rank_gets_its_own_endpoint_port(port: int, rank: int, expected: int) -> None:
    assert ConnectorConfig(bootstrap_port=port).bootstrap_port_of(rank) == expected


def test_a_data_parallel_rank_past_the_last_port_is_refused_naming_the_values() -> None:
    with pytest.raises(ValueError, match=r"65535 plus data parallel rank 1 is 65536"):
        ConnectorConfig(bootstrap_port=65535).bootstrap_port_of(1)


@pytest.fixture
def loggers() -> Iterator[tuple[logging.Logger, logging.Logger]]:
    """kvsvc's and vLLM's loggers, bare, restored afterwards."""
    ours, theirs = logging.getLogger("kvsvc"), logging.getLogger("vllm")
    saved = [(x, list(x.handlers), x.level, x.propagate) for x in (ours, theirs)]
    for x in (ours, theirs):
        x.handlers = []
        x.setLevel(logging.NOTSET)
    yield ours, theirs
    for x, handlers, level, propagate in saved:
        x.handlers, x.propagate = handlers, propagate
        x.setLevel(level)


@contextlib.contextmanager
def bare_root() -> Iterator[logging.Logger]:
    """The root logger without handlers, as `vllm serve` leaves it (pytest adds its own for each test)."""
    root = logging.getLogger()
    saved, root.handlers = root.handlers, []
    try:
        yield root
    finally:
        root.handlers = saved


def test_kvsvc_logs_through_vllms_handler_at_its_level_when_nothing_else_is_configured(
    loggers: tuple[logging.Logger, logging.Logger],
) -> None:
    from kvsvc.vllm.connector import log_through_vllm

    ours, theirs = loggers
    handler = logging.StreamHandler(io.StringIO())
    theirs.addHandler(handler)
    theirs.setLevel(logging.INFO)
    with bare_root():
        log_through_vllm()
        logging.getLogger("kvsvc.service.sending").info("writes go over the same-host plane")
        log_through_vllm()  # a second connector in the process adds nothing
    assert "same-host plane" in handler.stream.getvalue()
    assert ours.handlers == [handler] and not ours.propagate and ours.level == logging.INFO


def test_kvsvc_leaves_logging_alone_where_the_operator_configured_it(
    loggers: tuple[logging.Logger, logging.Logger],
) -> None:
    from kvsvc.vllm.connector import log_through_vllm

    ours, theirs = loggers
    theirs.addHandler(logging.NullHandler())
    with bare_root() as root:
        root.addHandler(logging.NullHandler())  # the operator's root configuration applies to kvsvc too
        log_through_vllm()
    assert ours.handlers == [] and ours.propagate


def test_sleep_mode_is_declined_until_kvsvc_follows_the_remap() -> None:
    # vLLM 0.33 asks this when `enable_sleep_mode` is set and refuses to start the engine on False; 0.32 never asks.
    from vllm.config import KVTransferConfig

    from kvsvc.vllm import KvsvcConnector

    assert (
        KvsvcConnector.supports_sleep_mode(KVTransferConfig(kv_connector="KvsvcConnector", kv_role="kv_both")) is False
    )
