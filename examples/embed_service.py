"""Embed kvsvc in a worker of your own: a numpy KV pool, a Mooncake transport, a `KVTransferService` per worker.

Runs a P worker and a D worker in this one process (each with its own Mooncake engine, over TCP loopback), publishes
P's metadata on a `BootstrapServer`, moves one request of 100 tokens and checks every byte. An engine embeds the
same pieces: register the pool once, publish the merged metadata, call start_send / start_recv / get_finished.
Run: `.venv/bin/python examples/embed_service.py`
"""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np

from kvsvc.core.layout import kv_cache_shape
from kvsvc.core.messages import WorkerMetadata
from kvsvc.engine.bootstrap import BootstrapServer
from kvsvc.service import KVTransferService, new_incarnation
from kvsvc.transport.mooncake import MooncakeTransport

LAYERS, HEADS, HEAD_SIZE, BLOCK_SIZE, BLOCKS = 4, 4, 64, 16, 32


def kv_pool(engine_id: str) -> tuple[list[np.ndarray], WorkerMetadata]:
    """One worker's KV: a float16 HND tensor per layer, all in one buffer, and the metadata that describes it."""
    meta = WorkerMetadata(
        engine_id=engine_id, incarnation=new_incarnation(), pp_rank=0, pp_size=1, tp_rank=0, tp_size=1,
        start_layer=0, end_layer=LAYERS, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype="float16",
        block_size=BLOCK_SIZE, num_blocks=BLOCKS, layout="HND", is_mla=False, base_addrs=[],
    )  # fmt: skip
    buffer = np.zeros((LAYERS, *kv_cache_shape(meta)), dtype=np.float16)
    layers = list(buffer)  # views: the layers stay inside the one buffer that is registered
    return layers, msgspec.structs.replace(meta, base_addrs=[layer.ctypes.data for layer in layers])


async def start_worker(engine_id: str) -> tuple[list[np.ndarray], KVTransferService]:
    layers, meta = kv_pool(engine_id)
    transport = MooncakeTransport()  # loopback TCP by default
    first, last = layers[0], layers[-1]
    transport.register([(first.ctypes.data, last.ctypes.data + last.nbytes - first.ctypes.data)])
    service = KVTransferService(meta, transport)
    await service.start()  # binds the control server; the returned metadata carries the addresses to publish
    return layers, service


async def main() -> None:
    (p_layers, prefill), (d_layers, decode) = await start_worker("my-prefill"), await start_worker("my-decode")
    bootstrap = BootstrapServer({(0, 0): prefill.metadata})  # what D fetches at its first request
    url = await bootstrap.start()
    try:
        tokens, p_blocks, d_blocks = 100, [3, 4, 5, 6, 7, 8, 9], [20, 11, 12, 2, 30, 31, 0]
        rng = np.random.default_rng(0)
        for layer in p_layers:  # "the model": KV of the request's blocks
            layer[p_blocks] = rng.standard_normal(layer[p_blocks].shape).astype(np.float16)
        # ready=None: the KV is written already. P draws the transfer's secret; D must present it (a router carries
        # it with the transfer id), or P answers as for a transfer it never held.
        secret = prefill.start_send("p-req-1", "xfer-1", p_blocks, tokens)
        decode.start_recv("d-req-1", "xfer-1", "my-prefill", url, d_blocks, tokens, secret=secret)
        sent = received = False
        for _ in range(1000):  # an engine calls get_finished once per step
            sent |= bool(prefill.get_finished().finished_sending)
            out = decode.get_finished()
            assert not out.failed_recving, f"receive failed: blocks {out.invalid_block_ids} need recompute"
            received |= bool(out.finished_recving)
            if sent and received:
                break
            await asyncio.sleep(0.01)
        assert sent and received, "the transfer did not finish"
        for p_layer, d_layer in zip(p_layers, d_layers, strict=True):
            for p_block, d_block, start in zip(p_blocks, d_blocks, range(0, tokens, BLOCK_SIZE), strict=True):
                n = min(BLOCK_SIZE, tokens - start)  # only the request's tokens: a last block may be partial
                assert np.array_equal(p_layer[p_block, :, :, :n], d_layer[d_block, :, :, :n])
        print(f"moved {tokens} tokens x {LAYERS} layers from {prefill.metadata.transport_addr} to "
              f"{decode.metadata.transport_addr}: every byte matches")  # fmt: skip
    finally:
        await bootstrap.close()
        await decode.close()
        await prefill.close()


if __name__ == "__main__":
    asyncio.run(main())
