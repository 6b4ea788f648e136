"""Synthetic engines in separate processes move KV over real Mooncake (TCP loopback), every byte checked on D.

One module-scoped set of engines serves every case (process start with torch is the slow part); each case uses its
own transfer ids. Polls with deadlines; never asserts durations.
"""

from __future__ import annotations

import pstats
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from workers.engine import DecodeEngine, DecodeRequest, PrefillEngine
from workers.executor import EngineConfig, Executor, WorkerError, start_all
from workers.process import PROFILE_ENV, Batch, Verify

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

GEOMETRY: dict[str, Any] = dict(num_layers=4, num_kv_heads=4, head_size=16, block_size=4, num_blocks=128)
TOKENS = (50, 49, 53, 48)  # partial last blocks of 2, 1 and 1 tokens, and one exactly full
DEADLINE_S = 30.0

# (prefill engine, decode engine) per case; engines are shared between cases.
CASES = {
    "P tp1 -> D tp2": ("p1", "d_tp2"),
    "P tp2 -> D tp1": ("p_tp2", "d1"),
    "P pp2 -> D pp1": ("p_pp2", "d1"),
    "P pp1 -> D pp2": ("p1", "d_pp2"),
    "P tp2 -> D pp2 uneven split, block size 8": ("p_tp2", "d_pp2_bs8"),
}
LAYOUTS: dict[str, dict[str, Any]] = {
    "p1": dict(role="prefill"),
    "p_tp2": dict(role="prefill", tp_size=2),
    "p_pp2": dict(role="prefill", pp_size=2),
    "d1": dict(role="decode"),
    "d_tp2": dict(role="decode", tp_size=2),
    "d_pp2": dict(role="decode", pp_size=2),
    "d_pp2_bs8": dict(role="decode", pp_size=2, layer_split=[(0, 1), (1, 4)], block_size=8),
}


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, PrefillEngine | DecodeEngine]]:
    executors = {
        name: Executor(EngineConfig(engine_id=name, **{**GEOMETRY, **layout})) for name, layout in LAYOUTS.items()
    }
    start_all(list(executors.values()))
    try:
        yield {
            name: PrefillEngine(e) if e.config.role == "prefill" else DecodeEngine(e) for name, e in executors.items()
        }
    finally:
        for executor in executors.values():
            executor.close()
        assert not any(any(e.alive()) for e in executors.values())


def _poll(condition: Callable[[], bool], what: Callable[[], str]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {DEADLINE_S} s: {what()}")
        time.sleep(0.02)


def _finish(prefill: PrefillEngine | None, decode: DecodeEngine, count: int) -> list[DecodeRequest]:
    done: list[DecodeRequest] = []

    def all_done() -> bool:
        done.extend(decode.step())
        if prefill is not None:
            prefill.step()
        return len(done) == count and (prefill is None or not prefill.requests)

    _poll(
        all_done, lambda: f"{len(done)}/{count} receives ended; sends pending: {prefill and sorted(prefill.requests)}"
    )
    return done


def _holds(*executors: Executor) -> int:
    """Requests still held by P workers plus receives D workers still wait for."""
    return sum(int(s["holds"]) for e in executors for s in e.statistics())


@pytest.mark.parametrize("case", list(CASES))
def test_every_byte_arrives_and_no_hold_is_left(engines: dict[str, PrefillEngine | DecodeEngine], case: str) -> None:
    p_name, d_name = CASES[case]
    prefill, decode = engines[p_name], engines[d_name]
    assert isinstance(prefill, PrefillEngine) and isinstance(decode, DecodeEngine)
    p_exec, d_exec = prefill.executor, decode.executor
    tag = case.replace(" ", "")
    for i, tokens in enumerate(TOKENS):
        seed = 1000 * list(CASES).index(case) + i
        prefill.submit(f"{tag}-{i}", tokens, seed)
        decode.submit(f"{tag}-{i}", p_exec.engine_id, p_exec.url, tokens, seed)

    done = _finish(prefill, decode, len(TOKENS))
    for req in done:
        assert req.state == "finished", f"{req.req_id} {req.state}"
        assert len(req.verified) == d_exec.num_workers
        bad = [v for v in req.verified if not v.ok]
        assert not bad, f"{req.req_id}: {bad[0]}"
        assert all(v.checked > 0 for v in req.verified)
    assert decode.allocator.num_free == prefill.allocator.num_free == GEOMETRY["num_blocks"]
    assert not decode.requests

    _poll(lambda: _holds(p_exec, d_exec) == 0, lambda: f"{case}: {_holds(p_exec, d_exec)} holds left")
    p_stats, d_stats = p_exec.statistics(), d_exec.statistics()
    assert sum(s["bytes_sent"] for s in p_stats) > 0
    # Every write that landed and every receive that finished was timed by its worker (the metrics histogram).
    assert sum(sum(s["send_durations"]["counts"]) for s in p_stats) == sum(s["transfers_sent"] for s in p_stats)
    assert sum(sum(s["recv_durations"]["counts"]) for s in d_stats) == sum(s["receiver"]["finished"] for s in d_stats)
    assert sum(s["recv_durations"]["total"] for s in d_stats) > 0


def test_a_killed_prefill_worker_fails_the_receive_and_a_restarted_engine_serves_again(
    engines: dict[str, PrefillEngine | DecodeEngine],
) -> None:
    prefill, decode = engines["p1"], engines["d1"]
    assert isinstance(prefill, PrefillEngine) and isinstance(decode, DecodeEngine)
    p_exec = prefill.executor
    old_incarnation, url = p_exec.incarnation, p_exec.url

    p_exec.kill(0)
    assert p_exec.alive() == [False]
    lost = decode.submit("killed-0", p_exec.engine_id, url, 50, seed=1)
    (failed,) = _finish(None, decode, 1)
    assert failed is lost and failed.state == "failed" and failed.needs_recompute
    assert failed.invalid_block_ids == set(failed.block_ids)

    assert prefill.restart() == []
    assert p_exec.incarnation != old_incarnation and p_exec.url == url and p_exec.alive() == [True]
    for i, tokens in enumerate(TOKENS):
        prefill.submit(f"restarted-{i}", tokens, 500 + i)
        decode.submit(f"restarted-{i}", p_exec.engine_id, url, tokens, 500 + i)
    done = _finish(prefill, decode, len(TOKENS))
    assert all(req.verified_ok for req in done), [req.verified for req in done if not req.verified_ok]
    _poll(lambda: _holds(p_exec, decode.executor) == 0, lambda: "holds left after the restart")


def test_a_batch_that_fails_part_way_is_undone_on_every_worker(
    engines: dict[str, PrefillEngine | DecodeEngine],
) -> None:
    prefill = engines["p_tp2"]
    assert isinstance(prefill, PrefillEngine)
    p_exec = prefill.executor
    free = prefill.allocator.num_free
    aborted = [s["sender"]["aborted_holds"] for s in p_exec.statistics()]
    # The first prefill starts (its KV held for D) before the second is refused: both must be gone after.
    with pytest.raises(WorkerError, match=r"command 1 of the batch of 2 \(Prefill\).*-1 tokens"):
        prefill.submit_many([("batch-ok", 50, 7), ("batch-bad", -1, 8)])
    assert prefill.allocator.num_free == free and not prefill.requests
    _poll(lambda: _holds(p_exec) == 0, lambda: f"{_holds(p_exec)} holds left after the refused batch")
    # Undone, not never done: each worker held the first request, and its hold ended by the parent's abort.
    assert [s["sender"]["aborted_holds"] for s in p_exec.statistics()] == [n + 1 for n in aborted]


def test_a_batch_of_checks_answers_per_command_and_names_a_bad_one(
    engines: dict[str, PrefillEngine | DecodeEngine],
) -> None:
    decode = engines["d_tp2"]
    assert isinstance(decode, DecodeEngine)
    with pytest.raises(WorkerError, match=r"command 0 of the batch of 1 \(Verify\).*outside the pool"):
        decode.executor.broadcast(Batch([Verify(1, [10**6], 4)]))


def test_a_profile_folder_gets_each_workers_statistics_at_its_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path))  # the spawned workers inherit it
    executor = Executor(EngineConfig(engine_id="profiled", role="prefill", tp_size=2, **GEOMETRY))
    start_all([executor])
    executor.close()
    files = sorted(p.name for p in tmp_path.glob("*.prof"))
    assert [f.rsplit("-", 1)[0] for f in files] == ["profiled-prefill-pp0-tp0", "profiled-prefill-pp0-tp1"]
    served = [key for key in pstats.Stats(str(tmp_path / files[0])).stats if key[2] == "_serve"]  # type: ignore[attr-defined]
    assert served, "the worker's service loop is in its profile"
