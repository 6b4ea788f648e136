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
