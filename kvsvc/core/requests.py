"""What an engine asks of one worker's service, as one value each: `SendRequest` (P: hold a request's KV for D) and
`RecvRequest` (D: fetch it from P), and the one check each gets (`check_send`, `check_recv`).

Rules: the engine's side builds the request (`kvsvc.vllm.flow` for vLLM, `KVTransferService.start_send` and
`start_recv` for an embedder's arguments), the service checks it once at its edge against the worker's own metadata,
and from there it travels as it is, to `Sender.hold` or `Receiver.start`; no layer below re-checks it or unpacks it
into arguments. The values are frozen and hold only what was asked: no address, connection or future. A secret is
never put into an error message. The harnesses and the synthetic runtime, which stand in for both engines and the
router, derive a transfer's secret from its id (`harness_secret`), so that a D started before its P, or in another
process, finds it; anyone who knows the id can derive it, so nothing else may use it. Pure module: kvsvc's pure core
only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final

from kvsvc.core.messages import MAX_SECRET_CHARS, WorkerMetadata, check_transfer_id
from kvsvc.core.planner import check_block_ids

# A transfer's secret is at least this long: `secrets.token_urlsafe(16)` (128 bits) makes 22 characters. D takes
# one of at most `MAX_SECRET_CHARS` (`kvsvc.core.messages`), as it travels in every request.
MIN_SECRET_CHARS: Final = 16


@dataclass(frozen=True, slots=True)
class SendRequest:
    """P: hold `req_id`'s KV (its first `num_tokens` tokens, in `block_ids`) as transfer `transfer_id`, for the D
    workers that present `secret` (the same on every P worker of the engine, and in D's params)."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    secret: str


@dataclass(frozen=True, slots=True)
class RecvRequest:
    """D: fetch tokens `[first_token, num_tokens)` of `transfer_id` from P engine `engine_id`, whose bootstrap
    endpoint is `bootstrap_addr`, into `block_ids` (token t into block `block_ids[t // block_size]`), presenting
    `secret` as P issued it. `push`: the router asked D and P at once, so the fetch waits at P for a prefill that
    started with it (the engine's side reports such a receive as pushed; the service treats it as any other)."""

    req_id: str
    transfer_id: str
    engine_id: str
    bootstrap_addr: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    secret: str
    push: bool = False


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


def harness_secret(transfer_id: str) -> str:
    """The secret the harnesses (`kvsvc.testing`) and the synthetic runtime (`workers/`) use for `transfer_id`: 32
    hex digits derived from the id, for tests, demos and benchmarks only (a deployment draws each at random:
    `kvsvc.service.new_transfer_secret`, vLLM's producer params). Raises nothing."""
    return hashlib.blake2b(
        transfer_id.encode("utf-8", "surrogatepass"), digest_size=16, person=b"kvsvc-harness"
    ).hexdigest()


def check_send(meta: WorkerMetadata, request: SendRequest) -> None:
    """The one check of a send, against P worker `meta`.

    Raises:
        ValueError: a block id is outside the pool or the blocks cannot hold `num_tokens`
            (`kvsvc.core.planner.check_block_ids`), `transfer_id` is longer than `MAX_NAME_CHARS`, or the secret is
            refused (`check_secret`).
    """
    check_block_ids(meta, list(request.block_ids), request.num_tokens, "P")
    check_transfer_id(request.transfer_id)
    check_secret(request.secret, request.transfer_id)


def check_recv(meta: WorkerMetadata, request: RecvRequest) -> None:
    """The one check of a receive, against D worker `meta`.

    Raises:
        ValueError: a block id is outside the pool, the blocks cannot hold `num_tokens`, `first_token` lies
            outside `[0, num_tokens]` (`check_block_ids`), `transfer_id` is longer than `MAX_NAME_CHARS`, or the
            secret is refused (`check_secret`).
    """
    check_block_ids(meta, list(request.block_ids), request.num_tokens, "D", request.first_token)
    check_transfer_id(request.transfer_id)
    check_secret(request.secret, request.transfer_id)


__all__ = [
    "MIN_SECRET_CHARS",
    "RecvRequest",
    "SendRequest",
    "check_recv",
    "check_secret",
    "check_send",
    "harness_secret",
]
