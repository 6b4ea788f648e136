"""Two engines of the standalone runtime on this machine move one request's KV, and the decode engine checks it.

P is pp2 × tp1 and D is pp1 × tp2 with another block size: each engine is an `Executor` of worker processes (torch
KV pools, a synthetic model whose every byte is known, a `KVTransferService` each) behind a bootstrap endpoint.
`PrefillEngine`/`DecodeEngine` play the engine core: allocate blocks, start the send and the receive, aggregate
the workers' reports. Run: `.venv/bin/python examples/two_engines.py`
"""

from __future__ import annotations

import time

from workers.engine import DecodeEngine, DecodeRequest, PrefillEngine
from workers.executor import EngineConfig, Executor, start_all


def engine(engine_id: str, role: str, pp_size: int, tp_size: int, block_size: int) -> Executor:
    """An engine of a small model: 4 layers, 4 KV heads of 64, 64 blocks per worker."""
    return Executor(
        EngineConfig(
            engine_id, role, num_layers=4, num_kv_heads=4, head_size=64, num_blocks=64,
            pp_size=pp_size, tp_size=tp_size, block_size=block_size,
        )
    )  # fmt: skip


def main() -> int:
    prefill_exec = engine("example-p", "prefill", pp_size=2, tp_size=1, block_size=16)
    decode_exec = engine("example-d", "decode", pp_size=1, tp_size=2, block_size=8)
    start_all([prefill_exec, decode_exec])  # both spawn at once: their torch imports overlap
    try:
        prefill, decode = PrefillEngine(prefill_exec), DecodeEngine(decode_exec)
        # A router hands both engines the transfer id; P computes and holds the KV, D asks P's endpoint for it.
        prefill.submit("xfer-1", num_tokens=100, seed=7)
        decode.submit("xfer-1", prefill_exec.engine_id, prefill_exec.url, num_tokens=100, seed=7)
        done: list[DecodeRequest] = []
        deadline = time.monotonic() + 30
        while not done or prefill.requests:  # one engine step: collect and aggregate the workers' reports
            done += decode.step()  # verifies every byte on every D worker once the receive finished
            prefill.step()
            if time.monotonic() > deadline:
                raise TimeoutError("the transfer did not finish within 30 s")
            time.sleep(0.01)
        req = done[0]
        checked = sum(v.checked for v in req.verified)
        print(f"{req.transfer_id}: {req.state}; {checked} KV elements checked on {len(req.verified)} D workers,"
              f" {'all equal' if req.verified_ok else 'MISMATCH'}")  # fmt: skip
        return 0 if req.verified_ok else 1
    finally:
        decode_exec.close()  # reaps every worker process
        prefill_exec.close()


if __name__ == "__main__":
    raise SystemExit(main())
