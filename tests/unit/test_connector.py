"""Specification of kvsvc.core.connector: how handshake metadata reaches a connector, PP-aware or legacy, and how
a MultiConnector forwards it (docs/design.md, docs/protocol.md §1)."""

from __future__ import annotations

import pytest

from kvsvc.core.connector import KVConnectorBase, MultiConnector


class LegacyConnector(KVConnectorBase[str]):
    """Overrides only the TP-only method, as a connector written before PP-disaggregation would."""

    def __init__(self) -> None:
        self.received: list[dict[int, str]] = []

    def set_xfer_handshake_metadata(self, metadata: dict[int, str]) -> None:
        self.received.append(metadata)


class PPAwareConnector(KVConnectorBase[str]):
    def __init__(self) -> None:
        self.received: list[dict[tuple[int, int], str]] = []
        self.legacy_calls = 0

    def set_xfer_handshake_metadata(self, metadata: dict[int, str]) -> None:
        self.legacy_calls += 1

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], str]) -> None:
        self.received.append(metadata)


class MutatingConnector(KVConnectorBase[str]):
    """Edits what it is handed, to prove siblings are not affected."""

    def set_xfer_handshake_metadata(self, metadata: dict[int, str]) -> None:
        metadata.clear()

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], str]) -> None:
        metadata.clear()


def test_the_base_connector_accepts_stage_zero_metadata_in_both_forms_without_raising(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    connector = KVConnectorBase[str]()
    legacy, pp_aware = {0: "m", 5: "n"}, {(0, 0): "a", (0, 1): "b"}
    connector.set_xfer_handshake_metadata(legacy)
    handed: list[dict[int, str]] = []
    ignore = connector.set_xfer_handshake_metadata

    def spy(metadata: dict[int, str]) -> None:
        handed.append(metadata)
        ignore(metadata)

    monkeypatch.setattr(connector, "set_xfer_handshake_metadata", spy)
    connector.set_xfer_handshake_metadata_pp_aware(pp_aware)
    assert handed == [{0: "a", 1: "b"}]  # the PP-aware form reaches the legacy default, keyed by tp rank
    assert legacy == {0: "m", 5: "n"} and pp_aware == {(0, 0): "a", (0, 1): "b"}  # neither is changed


def test_stage_zero_metadata_reaches_the_legacy_method_keyed_by_tp_rank() -> None:
    connector = LegacyConnector()
    connector.set_xfer_handshake_metadata_pp_aware({(0, 0): "a", (0, 1): "b", (0, 3): "d"})
    assert connector.received == [{0: "a", 1: "b", 3: "d"}]


def test_empty_metadata_reaches_the_legacy_method_as_an_empty_dict() -> None:
    connector = LegacyConnector()
    connector.set_xfer_handshake_metadata_pp_aware({})
    assert connector.received == [{}]


@pytest.mark.parametrize("connector_type", [KVConnectorBase, LegacyConnector])
def test_metadata_of_another_pp_stage_is_refused_by_default(connector_type: type[KVConnectorBase[str]]) -> None:
    connector = connector_type()
    with pytest.raises(ValueError, match="does not support PP-disaggregated") as caught:
        connector.set_xfer_handshake_metadata_pp_aware({(0, 0): "a", (1, 0): "b", (2, 1): "c"})
    assert connector_type.__name__ in str(caught.value)
    assert "[1, 2]" in str(caught.value)
    if isinstance(connector, LegacyConnector):
        assert connector.received == []  # refused before anything was handed on


def test_a_pp_aware_override_receives_every_stage_untouched() -> None:
    connector = PPAwareConnector()
    metadata = {(0, 0): "a", (1, 0): "b"}
    connector.set_xfer_handshake_metadata_pp_aware(metadata)
    assert connector.received == [metadata]
    assert connector.legacy_calls == 0


def test_multi_connector_forwards_the_pp_aware_form_to_every_child() -> None:
    legacy, aware = LegacyConnector(), PPAwareConnector()
    MultiConnector([legacy, aware]).set_xfer_handshake_metadata_pp_aware({(0, 0): "a", (0, 1): "b"})
    assert legacy.received == [{0: "a", 1: "b"}]
    assert aware.received == [{(0, 0): "a", (0, 1): "b"}]


def test_multi_connector_forwards_the_legacy_form_to_every_child() -> None:
    first, second = LegacyConnector(), LegacyConnector()
    aware = PPAwareConnector()
    MultiConnector([first, second, aware]).set_xfer_handshake_metadata({0: "a"})
    assert first.received == second.received == [{0: "a"}]
    assert aware.legacy_calls == 1


def test_multi_connector_hands_each_child_its_own_copy() -> None:
    aware = PPAwareConnector()
    legacy = LegacyConnector()
    multi = MultiConnector([MutatingConnector(), aware, legacy])
    metadata = {(0, 0): "a"}
    multi.set_xfer_handshake_metadata_pp_aware(metadata)
    multi.set_xfer_handshake_metadata({0: "a"})
    assert aware.received == [{(0, 0): "a"}]
    assert legacy.received == [{0: "a"}, {0: "a"}]
    assert metadata == {(0, 0): "a"}


def test_multi_connector_with_pp_stages_reaches_aware_children_and_refuses_for_a_legacy_child() -> None:
    aware, legacy = PPAwareConnector(), LegacyConnector()
    with pytest.raises(ValueError, match="LegacyConnector does not support PP-disaggregated"):
        MultiConnector([aware, legacy]).set_xfer_handshake_metadata_pp_aware({(0, 0): "a", (1, 0): "b"})
    assert aware.received == [{(0, 0): "a", (1, 0): "b"}]
    assert legacy.received == []


def test_multi_connectors_nest() -> None:
    inner_child = LegacyConnector()
    outer = MultiConnector([MultiConnector([inner_child])])
    outer.set_xfer_handshake_metadata_pp_aware({(0, 2): "c"})
    assert inner_child.received == [{2: "c"}]


def test_multi_connector_keeps_its_children_in_order() -> None:
    children = [LegacyConnector(), PPAwareConnector()]
    assert MultiConnector(iter(children)).connectors == tuple(children)


def test_multi_connector_needs_at_least_one_child() -> None:
    with pytest.raises(ValueError, match="at least one"):
        MultiConnector([])
