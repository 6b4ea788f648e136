"""The error taxonomy of kvsvc: who is at fault, and with which values.

Rules: every error names the side at fault and the values involved. `TopologyError` is a `ValueError` (the two
layouts cannot be matched); protocol errors split into `LocalProtocolError` (we broke the protocol) and
`RemoteProtocolError` (the peer did), converted at the one boundary that decodes frames; every timeout is also a
`TimeoutError`, so a caller's `except TimeoutError` works. Pure module: imports nothing but the standard library.
"""

from __future__ import annotations

from typing import Final

# Mooncake's own codes (transfer engine `error.h`), reused so every `TransportError.code` reads the same way.
ERR_FAILED: Final = -1  # the engine reported the transfer failed, or refused to submit it
ERR_ADDRESS_NOT_REGISTERED: Final = -3  # a range outside registered (local) or published (peer) memory
ERR_ADDRESS_OVERLAPPED: Final = -7  # a registration overlaps one already registered


class KVSvcError(Exception):
    """Base class of every error kvsvc raises on purpose."""


class TopologyError(KVSvcError, ValueError):
    """Two engines' layouts cannot be matched (dtype, head size, head count, MLA, TP, layout)."""


class ProtocolError(KVSvcError):
    """A control-channel message broke the protocol."""


class LocalProtocolError(ProtocolError):
    """We tried to send or do something the protocol forbids (a bug on our side)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something malformed, oversized, of the wrong version, or out of order."""


class MalformedFrame(RemoteProtocolError):
    """A frame could not be decoded: truncated, oversized, not msgpack, or of an unknown type."""


class VersionMismatch(RemoteProtocolError):
    """The peer speaks another protocol version."""


class HandshakeError(KVSvcError):
    """A remote engine's metadata could not be fetched, or its hello was refused."""


class NeedsMooncake(HandshakeError):
    """P refused the hello because the pair's writes take Mooncake and D's hello named no Mooncake session: D may
    start its engine and say hello again."""


class PeerMismatch(HandshakeError):
    """The peer's hello does not match what its engine published (engine, incarnation, rank or layout)."""


class TransferError(KVSvcError):
    """A transfer did not complete; the receiver's blocks must be treated as invalid."""


class TransportError(TransferError):
    """The transfer engine refused or failed a write (carries the engine's return code)."""

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code


class InvalidDescriptor(TransportError, ValueError):
    """A write was refused before submission: a range lies outside registered or published memory, a length is
    not positive, or the peer is unknown. Nothing was written; the caller's bug or a stale peer table."""


class PeerLost(TransferError):
    """The control connection to a peer broke, or the peer restarted with a new incarnation."""


class TransferAborted(TransferError):
    """The transfer was aborted by one side before it completed."""


class KVSvcTimeout(KVSvcError, TimeoutError):
    """A deadline passed."""


class ServiceClosed(KVSvcError):
    """The service was closed by its owner; no new work is accepted."""


class Busy(KVSvcError):
    """A bounded queue or table is full; the caller may retry later."""
