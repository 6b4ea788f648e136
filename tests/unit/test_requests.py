"""The engine's requests are checked once, as the service's roles take them (`kvsvc.core.sender.check_send`,
`kvsvc.core.receiver.check_recv`): each check refuses what no layer below could carry out, naming the values, and
accepts everything else."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsvc.cli.plan import synthetic_engine
from kvsvc.core.messages import MAX_NAME_CHARS, MIN_SECRET_CHARS, check_secret
from kvsvc.core.receiver import RecvRequest, check_recv
from kvsvc.core.sender import SendRequest, check_send

META = synthetic_engine(
    "E", pp_size=1, tp_size=1, num_layers=2, num_kv_heads=2, head_size=8, block_size=16, num_blocks=32
)[(0, 0)]
SECRET = "k" * 22


def _send(blocks: tuple[int, ...] = (1, 2), tokens: int = 20, secret: str = SECRET, tid: str = "t") -> SendRequest:
    return SendRequest("r", tid, blocks, tokens, secret)


def _recv(blocks: tuple[int, ...] = (1, 2), tokens: int = 20, first: int = 0, secret: str = SECRET) -> RecvRequest:
    return RecvRequest("r", "t", "P", "http://p:1", blocks, tokens, first, secret)


@pytest.mark.parametrize("secret", ["", "s" * 15, "s" * 257])
def test_a_send_and_a_receive_need_a_secret_of_16_to_256_characters_and_the_error_never_shows_it(secret: str) -> None:
    match = f"secret of transfer 't' has {len(secret)} characters, 16 to 256 needed"
    with pytest.raises(ValueError, match=match) as sent:
        check_send(META, _send(secret=secret))
    with pytest.raises(ValueError, match=match):
        check_recv(META, _recv(secret=secret))
    assert not secret or secret not in str(sent.value)


def test_blocks_outside_the_pool_or_too_few_for_the_tokens_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"P block ids \[32\] outside the pool of 32 blocks"):
        check_send(META, _send(blocks=(1, 32)))
    with pytest.raises(ValueError, match="D: 1 block ids hold fewer than 20 tokens of block_size 16"):
        check_recv(META, _recv(blocks=(1,)))


def test_a_receive_starts_inside_its_tokens_and_a_transfer_id_fits_a_frame() -> None:
    with pytest.raises(ValueError, match="first_token 21"):
        check_recv(META, _recv(first=21))
    with pytest.raises(ValueError, match=str(MAX_NAME_CHARS)):
        check_send(META, _send(tid="t" * (MAX_NAME_CHARS + 1)))


@given(
    blocks=st.lists(st.integers(-2, 40), max_size=4),
    tokens=st.integers(0, 80),
    secret_chars=st.integers(0, 300),
)
def test_a_send_is_accepted_exactly_when_its_blocks_lie_in_the_pool_hold_its_tokens_and_its_secret_fits(
    blocks: list[int], tokens: int, secret_chars: int
) -> None:
    fits = (
        all(0 <= b < META.num_blocks for b in blocks)
        and tokens <= len(blocks) * META.block_size
        and MIN_SECRET_CHARS <= secret_chars <= 256
    )
    try:
        check_send(META, _send(tuple(blocks), tokens, "s" * secret_chars))
    except ValueError:
        assert not fits
    else:
        assert fits


def test_check_secret_names_the_transfer() -> None:
    with pytest.raises(ValueError, match="'other'"):
        check_secret("short", "other")
