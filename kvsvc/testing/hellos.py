"""Hellos as a bare test client of a worker's control port sends them, without the service's D role.

Imports: kvsvc's pure core only. A client without a control token sends its opening and its hello at once (P's
challenge asks nothing of it); a client with a key must read P's challenge first (`kvsvc.core.hello.answer_challenge`).
"""

from __future__ import annotations

from kvsvc.core.auth import NONCE_BYTES
from kvsvc.core.hello import HelloAccepted, HelloRefusal, accept_hello, challenge_hello
from kvsvc.core.messages import Hello, HelloStart, WorkerMetadata, encode


def start_of(hello: Hello, nonce: bytes = bytes(NONCE_BYTES), keyed: bool = False) -> HelloStart:
    """The opening frame of the D worker that sends `hello`, with `hello`'s version and expectations."""
    d = hello.sender
    return HelloStart(
        version=hello.version,
        engine_id=d.engine_id,
        incarnation=d.incarnation,
        pp_rank=d.pp_rank,
        tp_rank=d.tp_rank,
        expect_engine_id=hello.expect_engine_id,
        expect_incarnation=hello.expect_incarnation,
        expect_pp_rank=hello.expect_pp_rank,
        expect_tp_rank=hello.expect_tp_rank,
        nonce=nonce,
        keyed=keyed,
    )


def unkeyed_frames(hello: Hello) -> bytes:
    """`hello` on the wire as a D worker without a control token sends it: its opening, then the hello. P answers
    a `HelloChallenge`, then `HelloOk` or `HelloRefused` (or only `HelloRefused`, for an opening it refuses)."""
    return encode(start_of(hello)) + encode(hello)


def decide_unkeyed(p: WorkerMetadata, hello: Hello) -> HelloAccepted | HelloRefusal:
    """P worker `p`'s decision on `hello` from a D worker without a control token, the whole exchange run back to
    back (its opening, P's challenge, the hello): what a test of P's checks of a hello asks."""
    challenged = challenge_hello(p, start_of(hello), None, bytes(NONCE_BYTES))
    if isinstance(challenged, HelloRefusal):
        return challenged
    return accept_hello(p, challenged, hello, None)
