"""Completion futures from real CUDA events (skipped without a GPU)."""

from __future__ import annotations

import asyncio

import pytest

from kvsvc.transport.streams import LayerReadiness, completion_future, record_event

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


async def test_future_resolves_after_the_stream_work_finishes() -> None:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            a = a @ a
            a = a / a.norm()
        event = record_event(stream)
    assert event is not None
    fut = completion_future(event)
    await asyncio.wait_for(fut, 60)
    assert event.query()
    assert torch.isfinite(a).all().item()


async def test_layer_readiness_from_per_layer_events() -> None:
    stream = torch.cuda.Stream()
    events = []
    with torch.cuda.stream(stream):
        x = torch.randn(2048, 2048, device="cuda")
        for _ in range(4):
            x = (x @ x) / 2048
            events.append(record_event(stream))
    readiness = LayerReadiness(events)
    await asyncio.wait_for(readiness.wait_all(), 60)
    assert readiness.done_layers() == 4
