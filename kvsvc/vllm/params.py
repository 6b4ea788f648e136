"""The `kv_transfer_params` of vLLM's remote-prefill convention, as kvsvc reads and writes them.

Pure module: standard library only. Rules: a request to P carries `{"do_remote_decode": True}`; P's finished output
carries what `producer_params` builds, and the caller hands that dict unchanged to D, so every key D needs is in it
and nothing else is required of a router. D refuses params it cannot use with a `ParamsError` naming the key and
value, so the request is computed locally instead of waiting on a transfer that cannot happen. Every value is a
msgpack-native type: vLLM carries the dict between its processes with msgpack.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

PARAMS_VERSION: Final = 1
# As `kvsvc.sender` bounds a transfer secret (this module imports nothing of kvsvc's core).
MIN_SECRET_CHARS: Final = 16
MAX_SECRET_CHARS: Final = 256
# The keys vLLM's tooling and routers already know (NixlConnector and MooncakeConnector use them too).
DO_REMOTE_DECODE: Final = "do_remote_decode"
DO_REMOTE_PREFILL: Final = "do_remote_prefill"


class ParamsError(ValueError):
    """A request's `kv_transfer_params` cannot be used; the message names the key and the value."""


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """What D needs to fetch a request's KV from the P engine that prefilled it."""

    engine_id: str  # P's engine
    bootstrap_addr: str  # P's bootstrap endpoint, "http://host:port"
    transfer_id: str  # the key P holds the KV under
    num_tokens: int  # prompt tokens whose KV P computed
    prompt_hash: str  # of P's prompt token ids, so D never takes the KV of another prompt
    secret: str  # the transfer's secret: P serves only a D that presents it (`kvsvc.sender.Sender.hold`)


def prompt_hash(token_ids: Sequence[int]) -> str:
    """A short digest of a prompt's token ids (16 hex digits)."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=8).hexdigest()


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Whether a request sent to P asks for its KV to be held for a remote decode."""
    return bool(params) and bool(params.get(DO_REMOTE_DECODE))  # type: ignore[union-attr]


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """Whether a request sent to D says its prompt was prefilled remotely (its KV is to be fetched)."""
    return bool(params) and bool(params.get(DO_REMOTE_PREFILL))  # type: ignore[union-attr]


def producer_params(remote: RemotePrefill) -> dict[str, Any]:
    """The dict P returns in `RequestOutput.kv_transfer_params`: what D's `parse_remote_prefill` reads.

    A new dict on every call: vLLM adds keys of its own to it.
    """
    return {
        DO_REMOTE_PREFILL: True,
        DO_REMOTE_DECODE: False,
        "remote_engine_id": remote.engine_id,
        "remote_bootstrap_addr": remote.bootstrap_addr,
        "transfer_id": remote.transfer_id,
        "remote_num_tokens": remote.num_tokens,
        "remote_prompt_hash": remote.prompt_hash,
        "transfer_secret": remote.secret,
        "kvsvc_params_version": PARAMS_VERSION,
    }


def parse_remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    """Read the params P returned, as D receives them.

    Raises:
        ParamsError: a key is missing or has the wrong type, or the params are of another version; the message
            names the key and what it held.
    """
    version = params.get("kvsvc_params_version")
    if version != PARAMS_VERSION:
        raise ParamsError(
            f"kv_transfer_params version {version!r}, this kvsvc reads {PARAMS_VERSION}: pass P's params unchanged "
            "(a P engine running another connector, or an older kvsvc, writes other keys)"
        )
    return RemotePrefill(
        engine_id=_get(params, "remote_engine_id", str),
        bootstrap_addr=_get(params, "remote_bootstrap_addr", str),
        transfer_id=_get(params, "transfer_id", str),
        num_tokens=_get(params, "remote_num_tokens", int),
        prompt_hash=_get(params, "remote_prompt_hash", str),
        secret=_secret(params),
    )


def _secret(params: Mapping[str, Any]) -> str:
    """The transfer secret, bounded (it travels in every request to P); an error never shows it."""
    value = params.get("transfer_secret")
    if not isinstance(value, str) or not MIN_SECRET_CHARS <= len(value) <= MAX_SECRET_CHARS:
        shape = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
        raise ParamsError(
            f"kv_transfer_params['transfer_secret'] holds {shape}, expected a string of {MIN_SECRET_CHARS} to "
            f"{MAX_SECRET_CHARS} characters: pass P's params unchanged"
        )
    return value


def _get(params: Mapping[str, Any], key: str, kind: type[Any]) -> Any:
    value = params.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) or value in ("", None):
        raise ParamsError(f"kv_transfer_params[{key!r}] is {value!r}, expected a non-empty {kind.__name__}")
    return value
