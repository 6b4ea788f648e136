"""LoopbackTransport keeps the Transport contract: byte-exact copies, address checks first, switchable faults."""

from __future__ import annotations

import asyncio
import ctypes

import pytest

from kvsvc.core.errors import TransportError
from kvsvc.testing.fakes import LoopbackTransport
from kvsvc.transport import InvalidDescriptor, Transport, TransportClosed, WriteFailed

SIZE = 1 << 16


@pytest.fixture
def pair() -> tuple[LoopbackTransport, ctypes.Array[ctypes.c_char], ctypes.Array[ctypes.c_char]]:
    src = ctypes.create_string_buffer(bytes(range(256)) * (SIZE // 256), SIZE)
    dst = ctypes.create_string_buffer(SIZE)
    transport = LoopbackTransport()
    transport.register([(ctypes.addressof(src), SIZE)])
    transport.add_peer("d", [(ctypes.addressof(dst), SIZE)])
    return transport, src, dst


def addrs(src: ctypes.Array[ctypes.c_char], dst: ctypes.Array[ctypes.c_char]) -> tuple[int, int]:
    return ctypes.addressof(src), ctypes.addressof(dst)


def test_loopback_transport_satisfies_the_protocol() -> None:
    assert isinstance(LoopbackTransport(), Transport)


async def test_write_copies_every_descriptor_byte_exact(pair) -> None:  # type: ignore[no-untyped-def]
    transport, src, dst = pair
    s, d = addrs(src, dst)
    descs = [(s + 0, d + 1000, 100), (s + 5000, d + 0, 300), (s + 200, d + SIZE - 10, 10)]
    assert await transport.write("d", descs) == 410
    expected = bytearray(SIZE)
    for so, do, n in [(0, 1000, 100), (5000, 0, 300), (200, SIZE - 10, 10)]:
        expected[do : do + n] = src.raw[so : so + n]
    assert dst.raw == bytes(expected)
    stats = transport.statistics()
    assert (stats.bytes_written, stats.descriptors_written, stats.writes_completed) == (410, 3, 1)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda s, d: (s + SIZE - 1, d, 2), id="src-past-end"),
        pytest.param(lambda s, d: (s, d + SIZE, 1), id="dst-past-end"),
        pytest.param(lambda s, d: (s - 1, d, 4), id="src-before-start"),
        pytest.param(lambda s, d: (s, d, 0), id="zero-length"),
    ],
)
async def test_out_of_range_write_is_refused_before_copying_anything(pair, bad) -> None:  # type: ignore[no-untyped-def]
    transport, src, dst = pair
    s, d = addrs(src, dst)
    with pytest.raises(InvalidDescriptor) as info:
        await transport.write("d", [(s, d, 64), bad(s, d)])
    assert isinstance(info.value, ValueError) and isinstance(info.value, TransportError)
    assert dst.raw == bytes(SIZE)
    assert transport.statistics().refused == 1


async def test_write_to_an_unknown_or_removed_peer_is_refused(pair) -> None:  # type: ignore[no-untyped-def]
    transport, src, dst = pair
    s, d = addrs(src, dst)
    with pytest.raises(InvalidDescriptor, match="unknown peer"):
        await transport.write("nobody", [(s, d, 1)])
    transport.remove_peer("d")
    transport.remove_peer("d")
    with pytest.raises(InvalidDescriptor):
        await transport.write("d", [(s, d, 1)])


def test_overlapping_registration_is_refused(pair) -> None:  # type: ignore[no-untyped-def]
    transport, src, _ = pair
    with pytest.raises(TransportError) as info:
        transport.register([(ctypes.addressof(src) + 8, 16)])
    assert info.value.code == -7


async def test_injected_failure_carries_the_code_and_copies_only_the_first_descriptors(pair) -> None:  # type: ignore[no-untyped-def]
    transport, src, dst = pair
    s, d = addrs(src, dst)
    transport.fail_next_writes(code=-102, after_descriptors=1)
    failed = await transport.write("d", [(s, d, 8), (s + 8, d + 8, 8)])
    assert isinstance(failed, WriteFailed) and failed.code == -102
    assert failed.drained is not None and failed.drained.done()
    assert dst.raw[:8] == src.raw[:8] and dst.raw[8:16] == bytes(8)
    assert await transport.write("d", [(s, d, 16)]) == 16  # only the next write failed
    assert transport.statistics().failures == 1


async def test_stalled_write_waits_for_release(pair) -> None:  # type: ignore[no-untyped-def]
    transport, src, dst = pair
    s, d = addrs(src, dst)
    transport.stall()
    task = asyncio.create_task(transport.write("d", [(s, d, 32)]))
    await asyncio.sleep(0.01)
    assert not task.done() and transport.statistics().writes_in_flight == 1
    assert dst.raw[:32] == bytes(32)
    transport.release()
    assert await task == 32
    assert dst.raw[:32] == src.raw[:32]


async def test_cancelled_stalled_write_copied_nothing(pair) -> None:  # type: ignore[no-untyped-def]
    transport, src, dst = pair
    s, d = addrs(src, dst)
    transport.stall()
    task = asyncio.create_task(transport.write("d", [(s, d, 32)]))
    await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    transport.release()
    await transport.drained()
    assert dst.raw == bytes(SIZE)
    assert transport.statistics().writes_in_flight == 0


async def test_close_refuses_new_writes_and_releases_stalled_ones(pair) -> None:  # type: ignore[no-untyped-def]
    transport, src, dst = pair
    s, d = addrs(src, dst)
    transport.stall()
    task = asyncio.create_task(transport.write("d", [(s, d, 32)]))
    await asyncio.sleep(0.005)
    await transport.close()
    with pytest.raises(TransportClosed):
        await task
    with pytest.raises(TransportClosed):
        await transport.write("d", [(s, d, 32)])
    await transport.close()
