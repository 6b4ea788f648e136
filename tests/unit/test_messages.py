"""The wire codec: every message round-trips, and any bad input becomes MalformedFrame and nothing else."""

from __future__ import annotations

import re
import struct
from typing import get_args

import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvsvc.core.errors import MalformedFrame, RemoteProtocolError, VersionMismatch
from kvsvc.core.messages import (
    MAX_ADDRESS,
    MAX_COUNT,
    MAX_FRAME_BYTES,
    MAX_NAME_CHARS,
    MAX_REASON_CHARS,
    PROTOCOL_VERSION,
    Abort,
    ErrorMessage,
    FrameReader,
    Hello,
    HelloOk,
    HelloRefused,
    Message,
    Ping,
    Pong,
    Release,
    TransferDone,
    TransferFailed,
    TransferRequest,
    WorkerMetadata,
    WorkerRef,
    check_own_metadata,
    check_transfer_id,
    check_version,
    clip,
    decode,
    decode_engine_metadata,
    encode,
    encode_engine_metadata,
)


def meta(pp: int = 0, tp: int = 0, **kw: object) -> WorkerMetadata:
    fields: dict[str, object] = dict(
        engine_id="prefill",
        incarnation="abc",
        pp_rank=pp,
        pp_size=2,
        tp_rank=tp,
        tp_size=2,
        start_layer=0,
        end_layer=2,
        num_kv_heads=4,
        head_size=16,
        dtype="bfloat16",
        block_size=16,
        num_blocks=8,
        layout="HND",
        is_mla=False,
        base_addrs=[4096, 8192],
    )
    fields.update(kw)
    return WorkerMetadata(**fields)  # type: ignore[arg-type]


ids = st.text(min_size=1, max_size=40)
messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(
        Hello,
        version=st.integers(0, 5),
        sender=st.just(meta()),
        stage_layers=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=4),
        expect_engine_id=ids,
        expect_incarnation=ids,
        expect_pp_rank=st.integers(0, 7),
        expect_tp_rank=st.integers(0, 7),
    ),
    st.builds(HelloOk, version=st.just(PROTOCOL_VERSION), sender=st.just(meta(1, 1))),
    st.builds(HelloRefused, version=st.just(PROTOCOL_VERSION), reason=st.text()),
    st.builds(
        TransferRequest,
        transfer_id=ids,
        block_ids=st.lists(st.integers(0, MAX_COUNT - 1), max_size=64),
        num_tokens=st.integers(0, 10**6),
    ),
    st.builds(Release, transfer_id=ids),
    st.builds(TransferDone, transfer_id=ids, bytes=st.integers(0, 2**40), descriptors=st.integers(0, 10**6)),
    st.builds(TransferFailed, transfer_id=ids, reason=st.text()),
    st.builds(Abort, transfer_id=ids, reason=st.text()),
    st.builds(ErrorMessage, reason=st.text(), transfer_id=ids),
    st.builds(Ping, nonce=st.integers(0, 2**62)),
    st.builds(Pong, nonce=st.integers(0, 2**62)),
)


@given(messages)
def test_every_message_round_trips_through_one_frame(message: Message) -> None:
    frame = encode(message)
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert decode(frame[4:]) == message


@given(st.lists(messages, min_size=1, max_size=6), st.data())
def test_frame_reader_reassembles_frames_split_anywhere(batch: list[Message], data: st.DataObject) -> None:
    stream = b"".join(encode(m) for m in batch)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    reader = FrameReader()
    out: list[Message] = []
    start = 0
    for cut in [*cuts, len(stream)]:
        out += reader.feed(stream[start:cut])
        start = cut
    assert out == batch
    assert reader.buffered == 0


@given(st.binary(max_size=256))
@example(encode(Ping(nonce=7))[4:])
@example(msgspec.msgpack.encode({"type": "pong", "nonce": 3, "extra": [1]}))  # an unknown key is ignored
def test_any_garbage_body_is_malformed_frame_or_a_valid_message(body: bytes) -> None:
    try:
        message = decode(body)
    except MalformedFrame:
        return
    # Whatever decoded is a message of the protocol that travels unchanged: its own frame decodes to it.
    assert isinstance(message, get_args(Message))
    frame = encode(message)
    assert struct.unpack(">I", frame[:4]) == (len(frame) - 4,) and decode(frame[4:]) == message


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        msgspec.msgpack.encode({"type": "no_such_message"}),
        msgspec.msgpack.encode({"type": "xfer_req", "transfer_id": "t"}),  # missing fields
        msgspec.msgpack.encode({"type": "xfer_req", "transfer_id": "t", "block_ids": ["x"], "num_tokens": 1}),
        encode(Ping(nonce=1))[4:-1],  # truncated body
        msgspec.msgpack.encode([1, 2, 3]),
    ],
    ids=["empty", "invalid-byte", "unknown-tag", "missing-field", "wrong-type", "truncated", "not-a-map"],
)
def test_malformed_bodies_raise_malformed_frame_naming_the_size(body: bytes) -> None:
    with pytest.raises(MalformedFrame, match=f"{len(body)} bytes"):
        decode(body)


def test_malformed_frame_is_a_remote_protocol_error() -> None:
    assert issubclass(MalformedFrame, RemoteProtocolError)


def test_frame_reader_refuses_an_oversized_length_before_buffering_the_body() -> None:
    reader = FrameReader(max_frame_bytes=1024)
    with pytest.raises(MalformedFrame, match="announces 1025 bytes, limit is 1024"):
        reader.feed(struct.pack(">I", 1025))


def test_frame_reader_stays_broken_after_a_malformed_frame() -> None:
    reader = FrameReader()
    with pytest.raises(MalformedFrame):
        reader.feed(struct.pack(">I", 1) + b"\xc1")
    with pytest.raises(MalformedFrame, match="already broken"):
        reader.feed(encode(Ping(nonce=1)))


def test_decode_refuses_bodies_above_the_frame_limit() -> None:
    with pytest.raises(MalformedFrame, match="exceeds MAX_FRAME_BYTES"):
        decode(b"\x00" * (MAX_FRAME_BYTES + 1))


def test_encode_refuses_a_message_above_the_frame_limit() -> None:
    huge = TransferRequest(transfer_id="t", block_ids=list(range(2**31, 2**31 + MAX_FRAME_BYTES // 4)), num_tokens=1)
    with pytest.raises(ValueError, match="exceeds MAX_FRAME_BYTES"):
        encode(huge)


def test_check_version_names_both_versions() -> None:
    check_version(PROTOCOL_VERSION)
    with pytest.raises(VersionMismatch, match=f"version 99, this side speaks {PROTOCOL_VERSION}"):
        check_version(99)


def test_worker_metadata_builds_from_the_contract_keywords_alone() -> None:
    m = meta()
    assert m.transport_addr == "" and m.control_addr == ""
    assert m.num_layers == 2 and m.worker == (0, 0)
    with pytest.raises(AttributeError):
        m.pp_rank = 1  # type: ignore[misc]


def test_engine_metadata_document_round_trips() -> None:
    metas = {(pp, tp): meta(pp, tp) for pp in range(2) for tp in range(2)}
    assert decode_engine_metadata(encode_engine_metadata(metas)) == metas


def test_engine_metadata_key_must_match_its_worker() -> None:
    body = msgspec.msgpack.encode({"0,1": meta(0, 0)})
    with pytest.raises(MalformedFrame, match="'0,1' holds worker \\(0, 0\\)"):
        decode_engine_metadata(body)


@pytest.mark.parametrize("body", [b"\xc1", msgspec.msgpack.encode({"zero": meta()}), msgspec.msgpack.encode([1])])
def test_malformed_engine_metadata_raises_malformed_frame(body: bytes) -> None:
    with pytest.raises(MalformedFrame):
        decode_engine_metadata(body)


def test_worker_ref_identifies_one_engine_start() -> None:
    a = WorkerRef.of(meta(1, 0))
    assert a.worker == (1, 0)
    assert str(a) == "prefill[pp1,tp0]"
    assert a != WorkerRef.of(meta(1, 0, incarnation="other"))


def test_a_hello_of_the_first_protocol_version_decodes_so_that_p_can_name_its_version() -> None:
    hello = Hello(
        version=1,
        sender=meta(),
        stage_layers=[(0, 4)],
        expect_engine_id="P",
        expect_incarnation="1",
        expect_pp_rank=0,
        expect_tp_rank=0,
    )
    fields = msgspec.to_builtins(hello)
    del fields["proof"]
    fields["token"] = "a secret that peers of version 1 sent"  # ignored, never kept
    assert decode(msgspec.msgpack.encode(fields)) == hello


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [
        ("transfer_id", "t" * (MAX_NAME_CHARS + 1), "$.transfer_id"),
        ("secret", "s" * 257, "$.secret"),
        ("receive", "r" * 65, "$.receive"),
        ("block_ids", [MAX_COUNT], "$.block_ids[0]"),
        ("block_ids", [-1], "$.block_ids[0]"),
        ("window_addr", MAX_ADDRESS, "$.window_addr"),
        ("num_tokens", 2**63, "$.num_tokens"),
    ],
)
def test_a_field_past_its_bound_is_a_malformed_frame_naming_it(field: str, value: object, where: str) -> None:
    # Built as plain data: a peer need not use our classes (encode cuts only reasons).
    fields = msgspec.to_builtins(TransferRequest(transfer_id="t", block_ids=[1], num_tokens=16)) | {field: value}
    with pytest.raises(MalformedFrame, match=re.escape(where)):
        decode(msgspec.msgpack.encode({"type": "xfer_req", **fields}))


def test_a_worker_address_past_int64_room_is_refused_as_it_decodes() -> None:
    body = msgspec.msgpack.encode(msgspec.to_builtins(meta()) | {"base_addrs": [2**63 + 2**40, 0]})
    with pytest.raises(MalformedFrame, match=re.escape(".base_addrs[0]")):
        decode_engine_metadata(msgspec.msgpack.encode({"0,0": msgspec.msgpack.decode(body)}))


def test_reasons_are_cut_as_they_are_sent_so_the_peer_still_takes_the_frame() -> None:
    long = TransferFailed(transfer_id="t", reason="x" * (3 * MAX_REASON_CHARS))
    sent = decode(encode(long)[4:])
    assert isinstance(sent, TransferFailed) and len(sent.reason) == MAX_REASON_CHARS
    assert sent.reason.endswith(f"... ({3 * MAX_REASON_CHARS} characters)")
    assert clip("short") == "short" and clip("x" * 10, 4) == "xxxx" and clip("y" * 99, 21) == "yy... (99 characters)"
    with pytest.raises(MalformedFrame, match=re.escape("$.reason")):  # the bound holds for what peers send
        decode(msgspec.msgpack.encode({"type": "xfer_failed", "transfer_id": "t", "reason": "x" * 3000}))


def test_local_values_a_peer_would_refuse_are_refused_where_they_are_set() -> None:
    with pytest.raises(ValueError, match=f"transfer id of {MAX_NAME_CHARS + 1} characters"):
        check_transfer_id("t" * (MAX_NAME_CHARS + 1))
    check_transfer_id("t" * MAX_NAME_CHARS)
    with pytest.raises(ValueError, match=re.escape("$.engine_id")):
        check_own_metadata(meta(engine_id="e" * (MAX_NAME_CHARS + 1)))
    check_own_metadata(meta())


def test_a_frame_nested_past_the_decoder_s_depth_is_a_malformed_frame() -> None:
    """A 30 KiB hello_start whose unknown field nests 30,000 arrays deep: msgspec recurses; P must answer it as any
    malformed frame, never with a RecursionError out of the connection handler."""
    start = msgspec.msgpack.encode({"type": "hello_start", "x": 0})
    nested = b"\x91" * 30_000 + b"\xc0"  # [[[...[nil]...]]]
    body = start[:-1] + nested  # the last field's value, 0, becomes the nested arrays
    with pytest.raises(MalformedFrame, match=r"nested too deeply to decode"):
        decode(body)
