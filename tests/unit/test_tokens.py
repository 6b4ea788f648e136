"""The control token's settings: where `kvsvc serve` reads it from, and the empty token `ServiceConfig` refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsvc.service import ServiceConfig
from workers.commands.serve import CONTROL_TOKEN_ENV, TOKEN_ENV, read_token


def test_the_control_token_comes_from_its_file_then_its_own_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CONTROL_TOKEN_ENV, raising=False)
    monkeypatch.setenv(TOKEN_ENV, "admin-secret")  # the admin token's variable is not the control token's
    assert read_token(None, CONTROL_TOKEN_ENV, "control") is None
    monkeypatch.setenv(CONTROL_TOKEN_ENV, " control-secret \n")
    assert read_token(None, CONTROL_TOKEN_ENV, "control") == "control-secret"
    path = tmp_path / "token"
    path.write_text("from-the-file\nsecond line ignored\n")
    assert read_token(str(path), CONTROL_TOKEN_ENV, "control") == "from-the-file"


def test_an_empty_control_token_is_refused_naming_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONTROL_TOKEN_ENV, "  ")
    with pytest.raises(ValueError, match=rf"control token from \${CONTROL_TOKEN_ENV} is empty"):
        read_token(None, CONTROL_TOKEN_ENV, "control")
    with pytest.raises(ValueError, match="control_token must be a non-empty secret"):
        ServiceConfig(control_token="")
    assert ServiceConfig(control_token="s").control_token == "s" and ServiceConfig().control_token is None


def test_without_a_token_only_the_kernel_s_word_that_the_peer_is_this_user_stands_for_a_proof() -> None:
    from kvsvc.core.auth import unkeyed_peer_refusal

    assert unkeyed_peer_refusal(1000, 1000) == "" and unkeyed_peer_refusal(0, 0) == ""
    assert "the far end runs as uid 65534, this worker as uid 1000" in unkeyed_peer_refusal(1000, 65534)
    assert unkeyed_peer_refusal(1000, 0) != ""  # root is another user, unless configured
    assert unkeyed_peer_refusal(1000, 0, trust_root=True) == ""
    assert "names no local process" in unkeyed_peer_refusal(1000, None)  # another host or namespace


def test_the_prompt_digest_in_params_has_128_bits() -> None:
    """At 64 bits two prompts of one digest cost about 2^32 work: one prompt's KV would load as another's."""
    from kvsvc.vllm.flow import prompt_hash

    assert len(bytes.fromhex(prompt_hash([1, 2, 3]))) == 16
    assert prompt_hash([1, 2, 3]) != prompt_hash([1, 2, 4])
