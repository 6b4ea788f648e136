"""A D-side process for the GPU plane's CUDA tests: `python -m kvsvc.testing.gpu_peer HOST PORT NBYTES`.

It allocates NBYTES of GPU memory with torch (zeroed), registers it with its own `CudaIpcTransport`, connects to
HOST:PORT and keeps that connection open (P checks that this process holds it), then prints one JSON line: its
session, the region and the exported handles (hex), or why it offers no plane. Then it answers stdin lines
`sha OFFSET LENGTH` with the SHA-256 of those bytes as they are on the GPU, and exits on `quit` or end of input.
Run with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` it shows memory CUDA IPC cannot export. Test code only.
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys


def main(argv: list[str]) -> int:
    import torch

    from kvsvc.transport.cuda_ipc import CudaIpcTransport

    host, port, nbytes = argv[0], int(argv[1]), int(argv[2])
    memory = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    plane = CudaIpcTransport()
    region = (memory.data_ptr(), nbytes)
    plane.register([region])
    with socket.create_connection((host, port)):
        offer = {
            "session": plane.local_session_id,
            "unexportable": plane.unexportable,
            "region": region,
            "handles": [(h.handle.hex(), h.base, h.size) for h in plane.exported()],
        }
        print(json.dumps(offer), flush=True)
        for line in sys.stdin:
            words = line.split()
            if words[:1] != ["sha"]:
                break
            torch.cuda.synchronize()
            start, length = int(words[1]), int(words[2])
            data = memory[start : start + length].cpu().numpy().tobytes()
            print(hashlib.sha256(data).hexdigest(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
