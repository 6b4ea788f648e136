"""`FakeCudaDriver`: the CUDA driver calls of the GPU plane (`kvsvc.transport.cuda_driver.CudaDriver`) over host
memory, so the plane's logic (handles, mappings, bounds, failures, completion) is tested on machines without a GPU.

How it stands in: an "allocation" is a memfd mapped into this process; its "IPC handle" names the process and file
descriptor, and "opening" it maps the same file again, through /proc, at another address (so a write through the
mapping lands in the allocation, as CUDA IPC's would, and works between processes of one user too). Copies are
`memmove`s done when enqueued; an event fires after `lag` queries. Knobs fail the next exports, opens or copies.
Never the proof that the GPU plane works on a GPU: `make gpu-check` is. Imports the standard library and numpy.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvsvc.transport.cuda_driver import IPC_HANDLE_BYTES, CudaError, CudaEvent

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_HANDLE = struct.Struct("<8sqqq")  # magic, pid, fd, size
_MAGIC = b"kvsvcgpu"
INVALID_VALUE = 1  # CUDA_ERROR_INVALID_VALUE


def _map(fd: int, size: int) -> int:
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        raise CudaError(f"mmap of {size} bytes failed: {os.strerror(ctypes.get_errno())}", INVALID_VALUE)
    return int(addr)


@dataclass
class FakeEvent:
    lag: int
    fail: str = ""
    queries: int = 0
    released: bool = False

    def query(self) -> bool:
        self.queries += 1
        if self.fail:
            raise CudaError(self.fail, INVALID_VALUE)
        return self.queries > self.lag


@dataclass
class FakeCudaDriver:
    """A `CudaDriver` over memfd mappings (module docstring). `uuid` names its one "GPU"."""

    uuid: str = "GPU-00000000-0000-4000-8000-000000000000"
    lag: int = 1
    fail_exports: int = 0
    fail_opens: int = 0
    fail_copies: int = 0
    fail_events: int = 0
    calls: list[int] = field(default_factory=list)  # pieces per `copy` call
    events: list[FakeEvent] = field(default_factory=list)
    _spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # base -> (size, fd or -1 for a mapping)

    def alloc(self, size: int) -> int:
        """A new "device allocation" of `size` bytes (zeroed); its base."""
        fd = os.memfd_create("kvsvc-fake-gpu")
        os.ftruncate(fd, size)
        base = _map(fd, size)
        self._spans[base] = (size, fd)
        return base

    def free(self) -> None:
        """Unmap every allocation and mapping this driver made."""
        for base, (size, fd) in self._spans.items():
            _libc.munmap(base, size)
            if fd >= 0:
                os.close(fd)
        self._spans.clear()

    def allocation(self, addr: int) -> tuple[int, int]:
        for base, (size, _) in self._spans.items():
            if base <= addr < base + size:
                return base, size
        raise CudaError(f"cuMemGetAddressRange({addr:#x}) failed: invalid argument", INVALID_VALUE)

    def gpu_uuid(self, addr: int) -> str:
        self.allocation(addr)
        return self.uuid

    def export(self, base: int) -> bytes:
        if self.fail_exports:
            self.fail_exports -= 1
            raise CudaError("cuIpcGetMemHandle failed: invalid argument", INVALID_VALUE)
        size, fd = self._spans[base]
        return _HANDLE.pack(_MAGIC, os.getpid(), fd, size).ljust(IPC_HANDLE_BYTES, b"\0")

    def open(self, handle: bytes) -> int:
        if self.fail_opens:
            self.fail_opens -= 1
            raise CudaError("cuIpcOpenMemHandle failed: invalid device context", 201)
        magic, pid, fd, size = _HANDLE.unpack_from(handle)
        if magic != _MAGIC:
            raise CudaError("cuIpcOpenMemHandle failed: invalid argument", INVALID_VALUE)
        try:
            opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        except OSError as exc:
            raise CudaError(f"cuIpcOpenMemHandle failed: {exc}", INVALID_VALUE) from None
        try:
            mapped = _map(opened, size)
        finally:
            os.close(opened)
        self._spans[mapped] = (size, -1)
        return mapped

    def close(self, mapped: int) -> None:
        size, fd = self._spans.pop(mapped)
        assert fd == -1, "close() takes what open() mapped"
        _libc.munmap(mapped, size)

    @property
    def mappings(self) -> int:
        """Mappings open now (opened and not closed)."""
        return sum(1 for _, fd in self._spans.values() if fd == -1)

    def new_stream(self) -> int:
        return 1

    def copy(self, stream: int, pieces: npt.NDArray[np.int64]) -> None:
        self.calls.append(len(pieces))
        for i, (src, dst, length) in enumerate(pieces.tolist()):
            if self.fail_copies:
                self.fail_copies -= 1
                raise CudaError(f"cuMemcpyDtoDAsync failed on piece {i}: an illegal memory access", 700)
            ctypes.memmove(dst, src, length)

    def record(self, stream: int) -> CudaEvent:
        fail = ""
        if self.fail_events:
            self.fail_events -= 1
            fail = "cuEventQuery failed: an illegal memory access was encountered"
        event = FakeEvent(self.lag, fail)
        self.events.append(event)
        return event

    def release(self, event: CudaEvent) -> None:
        assert isinstance(event, FakeEvent)
        event.released = True

    def destroy_stream(self, stream: int) -> None:
        pass


__all__ = ["FakeCudaDriver", "FakeEvent"]
