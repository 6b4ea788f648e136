"""Specification of kvsvc.engine.core_connector: `EngineCoreConnector` checks one engine start's metadata and publishes
it."""

from __future__ import annotations

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvsvc.core.connector import MultiConnector
from kvsvc.core.messages import METADATA_PATH, Worker, WorkerMetadata, decode_engine_metadata
from kvsvc.engine.bootstrap import add_metadata_route, published_metadata
from kvsvc.engine.core_connector import EngineCoreConnector, check_engine_metadata


def meta(pp: int, tp: int, *, pp_size: int = 2, tp_size: int = 2, **changes: object) -> WorkerMetadata:
    layers = 8 // pp_size
    m = WorkerMetadata(
        engine_id="p0",
        incarnation="inc1",
        pp_rank=pp,
        pp_size=pp_size,
        tp_rank=tp,
        tp_size=tp_size,
        start_layer=pp * layers,
        end_layer=(pp + 1) * layers,
        num_kv_heads=8,
        head_size=64,
        dtype="bfloat16",
        block_size=16,
        num_blocks=32,
        layout="HND",
        is_mla=False,
        base_addrs=[0x10000 * (i + 1) for i in range(layers)],
    )
    return msgspec.structs.replace(m, **changes) if changes else m


def engine(pp_size: int = 2, tp_size: int = 2) -> dict[Worker, WorkerMetadata]:
    return {(pp, tp): meta(pp, tp, pp_size=pp_size, tp_size=tp_size) for pp in range(pp_size) for tp in range(tp_size)}


def served(app: web.Application) -> dict[Worker, WorkerMetadata]:
    body = published_metadata(app)
    assert body is not None
    return decode_engine_metadata(body)


def test_pp_aware_metadata_is_kept_and_published() -> None:
    app = web.Application()
    connector = EngineCoreConnector(app, engine_id="p0")
    assert not connector.published and connector.metadata == {}
    connector.set_xfer_handshake_metadata_pp_aware(engine())
    assert connector.published
    assert connector.metadata == engine()
    assert served(app) == engine()


def test_legacy_tp_only_metadata_is_converted() -> None:
    app = web.Application()
    connector = EngineCoreConnector(app)
    connector.set_xfer_handshake_metadata({tp: meta(0, tp, pp_size=1) for tp in range(2)})
    assert served(app) == engine(pp_size=1)


def test_legacy_form_refuses_pp_stages_and_mismatched_keys() -> None:
    connector = EngineCoreConnector(web.Application())
    with pytest.raises(ValueError, match="PP stage 0"):
        connector.set_xfer_handshake_metadata({0: meta(1, 0)})
    with pytest.raises(ValueError, match=r"keys \[1\]"):
        connector.set_xfer_handshake_metadata({1: meta(0, 0, pp_size=1)})


def test_legacy_form_of_a_pp_engine_names_the_missing_stage() -> None:
    with pytest.raises(ValueError, match=r"missing \(pp_rank, tp_rank\) \[\(1, 0\), \(1, 1\)\]"):
        EngineCoreConnector(web.Application()).set_xfer_handshake_metadata({tp: meta(0, tp) for tp in range(2)})


def test_missing_workers_are_named() -> None:
    metas = engine()
    del metas[(1, 1)]
    with pytest.raises(ValueError, match=r"pp_size 2 x tp_size 2 workers: missing \(pp_rank, tp_rank\) \[\(1, 1\)\]"):
        check_engine_metadata(metas)


def test_out_of_range_workers_are_named() -> None:
    metas = engine()
    metas[(0, 2)] = meta(0, 2)
    with pytest.raises(ValueError, match=r"out of range \[\(0, 2\)\]"):
        check_engine_metadata(metas)


@pytest.mark.parametrize(
    ("field", "value"),
    [("engine_id", "other"), ("incarnation", "inc2"), ("pp_size", 4), ("tp_size", 1)],
)
def test_workers_of_several_engine_starts_or_sizes_are_refused(field: str, value: object) -> None:
    metas = engine()
    metas[(1, 0)] = msgspec.structs.replace(meta(1, 0), **{field: value})
    with pytest.raises(ValueError, match=f"several {field} values") as info:
        check_engine_metadata(metas)
    assert repr(value) in str(info.value)


def test_key_that_is_not_its_worker_is_refused() -> None:
    metas = engine()
    metas[(0, 0)], metas[(0, 1)] = metas[(0, 1)], metas[(0, 0)]
    with pytest.raises(ValueError, match="keys do not match their workers"):
        check_engine_metadata(metas)


def test_stage_workers_must_agree_on_layers_and_empty_is_refused() -> None:
    metas = engine()
    metas[(1, 1)] = meta(1, 1, end_layer=7)
    with pytest.raises(ValueError, match="PP stage 1 disagree on its layer range"):
        check_engine_metadata(metas)
    with pytest.raises(ValueError, match="no handshake metadata"):
        check_engine_metadata({})


def test_refused_metadata_leaves_the_served_document_unchanged() -> None:
    app = web.Application()
    connector = EngineCoreConnector(app, engine_id="p0")
    connector.set_xfer_handshake_metadata_pp_aware(engine())
    with pytest.raises(ValueError, match="this connector serves 'p0'"):
        connector.set_xfer_handshake_metadata_pp_aware(
            {k: msgspec.structs.replace(m, engine_id="q") for k, m in engine().items()}
        )
    restarted = {k: msgspec.structs.replace(m, incarnation="inc2") for k, m in engine().items()}
    with pytest.raises(ValueError, match="already published"):
        connector.set_xfer_handshake_metadata_pp_aware(restarted)
    assert served(app) == engine()
    # The same start may publish again (e.g. after a worker's addresses were filled in).
    connector.set_xfer_handshake_metadata_pp_aware(engine())


def test_publish_workers_merges_what_each_worker_published() -> None:
    app = web.Application()
    per_worker = [{k: m} for k, m in engine().items()] + [None]
    EngineCoreConnector(app).publish_workers(per_worker)
    assert served(app) == engine()
    conflict = [{(0, 0): meta(0, 0)}, {(0, 0): meta(0, 0, num_blocks=1)}]
    with pytest.raises(ValueError, match="conflicting"):
        EngineCoreConnector(web.Application()).publish_workers(conflict)


def test_multi_connector_reaches_the_pp_aware_override() -> None:
    app = web.Application()
    MultiConnector([EngineCoreConnector(app)]).set_xfer_handshake_metadata_pp_aware(engine())
    assert served(app) == engine()


async def test_published_metadata_is_served_over_http() -> None:
    app = web.Application()
    add_metadata_route(app)
    EngineCoreConnector(app).set_xfer_handshake_metadata_pp_aware(engine(pp_size=1, tp_size=4))
    async with TestClient(TestServer(app)) as client:
        response = await client.get(METADATA_PATH)
        assert decode_engine_metadata(await response.read()) == engine(pp_size=1, tp_size=4)
