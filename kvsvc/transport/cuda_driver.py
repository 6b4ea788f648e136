"""The few CUDA driver calls the GPU plane makes (`kvsvc.transport.cuda_ipc`), through ctypes on `libcuda.so.1`: the
allocation an address lies in and its GPU, exporting and opening IPC handles, a copy stream, copies and events.

Rules: the driver library every CUDA host has, no toolkit and no torch, so the plane's logic is one small file a
fake can stand in for (`kvsvc.testing.cuda.FakeCudaDriver`) and CPU tests cover it. Every call first makes the
primary context of the bound GPU current on the calling thread (the one torch and vLLM use, so their memory is this
context's), and raises `CudaError` naming the call and the driver's own error text. A copy of many pieces is one
`cuMemcpyBatchAsync` call where the driver has it and a self-test of it passed, else one call per piece (about 5 us
each from Python); before that, each stretch of pieces at constant pitches (a split layout's head share of every
block) is one 2D copy (`kvsvc.core.planner.pitched_runs`), since the copy engine spends about a microsecond per piece
of a batch whatever its size. Imports the standard library, numpy and the pure `kvsvc.core.planner`.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

from kvsvc.core.errors import TransportError
from kvsvc.core.planner import pitched_runs

log = logging.getLogger(__name__)

IPC_HANDLE_BYTES: Final = 64
_NOT_READY: Final = 600  # CUDA_ERROR_NOT_READY
_POINTER_DEVICE_ORDINAL: Final = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
_IPC_LAZY_PEER_ACCESS: Final = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: D's GPU may be another of the host's
_STREAM_NON_BLOCKING: Final = 1  # the copies never wait for the default stream of torch or vLLM
_EVENT_DISABLE_TIMING: Final = 2
_SRC_ACCESS_ORDER_STREAM: Final = 1
_LOCATION_DEVICE: Final = 1
BATCH_MIN_PIECES: Final = 4  # fewer pieces go one call each: the batch's attribute arrays cost about as much
PITCHED_MIN_ROWS: Final = 8  # a 2D copy costs one driver call, as about 8 pieces of a batch cost the copy engine
_MEMORY_DEVICE: Final = 2  # CU_MEMORYTYPE_DEVICE
_PATTERN: Final = bytes(i % 251 + 1 for i in range(4096))  # the self-tests' bytes: no zero, no period of 4096/8


class CudaError(TransportError):
    """A CUDA driver call failed; `code` is the driver's `CUresult`."""


class CudaEvent(Protocol):
    """An event recorded on the copy stream: `query()` is True once every copy before it finished, and raises
    `CudaError` when one failed."""

    def query(self) -> bool: ...


class CudaDriver(Protocol):
    """What the GPU plane asks of CUDA. Addresses are device pointers of this process."""

    def allocation(self, addr: int) -> tuple[int, int]:
        """`(base, size)` of the device allocation `addr` lies in. Raises `CudaError` for memory that is not a
        device allocation (host memory, a freed pointer)."""
        ...

    def gpu_uuid(self, addr: int) -> str:
        """The UUID (`GPU-...`) of the GPU holding `addr`; binds this driver to that GPU. Raises `CudaError`."""
        ...

    def export(self, base: int) -> bytes:
        """The IPC handle of the allocation starting at `base`. Raises `CudaError` (memory from expandable
        segments or other virtual-memory allocations has none)."""
        ...

    def open(self, handle: bytes) -> int:
        """Map another process's allocation into this one; its base here. Raises `CudaError`."""
        ...

    def close(self, mapped: int) -> None:
        """Unmap what `open` mapped. Raises `CudaError`."""
        ...

    def new_stream(self) -> int:
        """A non-blocking stream for copies. Raises `CudaError`."""
        ...

    def copy(self, stream: int, pieces: npt.NDArray[np.int64]) -> None:
        """Enqueue the device-to-device copy of every row `(src, dst, length)` of `pieces` on `stream`. Raises
        `CudaError` when a copy could not be enqueued; those before it may still run (record an event to know
        when)."""
        ...

    def record(self, stream: int) -> CudaEvent:
        """An event recorded on `stream` after what was enqueued so far. Raises `CudaError`."""
        ...

    def release(self, event: CudaEvent) -> None:
        """Free an event whose query returned True or raised. Raises nothing."""
        ...

    def destroy_stream(self, stream: int) -> None:
        """Free a stream once nothing is enqueued on it. Raises nothing."""
        ...


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CopyAttributes(ctypes.Structure):
    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_location", _Location),
        ("dst_location", _Location),
        ("flags", ctypes.c_uint),
    ]


class _Copy2D(ctypes.Structure):
    """CUDA_MEMCPY2D, for device pointers only."""

    _fields_ = [
        ("src_x", ctypes.c_size_t),
        ("src_y", ctypes.c_size_t),
        ("src_type", ctypes.c_int),
        ("src_host", ctypes.c_void_p),
        ("src_device", ctypes.c_uint64),
        ("src_array", ctypes.c_void_p),
        ("src_pitch", ctypes.c_size_t),
        ("dst_x", ctypes.c_size_t),
        ("dst_y", ctypes.c_size_t),
        ("dst_type", ctypes.c_int),
        ("dst_host", ctypes.c_void_p),
        ("dst_device", ctypes.c_uint64),
        ("dst_array", ctypes.c_void_p),
        ("dst_pitch", ctypes.c_size_t),
        ("width", ctypes.c_size_t),
        ("height", ctypes.c_size_t),
    ]


class _Event:
    __slots__ = ("_driver", "handle")

    def __init__(self, driver: LibCuda, handle: int) -> None:
        self._driver, self.handle = driver, handle

    def query(self) -> bool:
        return self._driver.query(self)


class LibCuda:
    """`CudaDriver` on the host's `libcuda.so.1` (see module docstring).

    Raises:
        CudaError: the library cannot be loaded or `cuInit` fails (no GPU, no driver).
    """

    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaError(f"no CUDA driver here: {exc}") from None
        lib = self._lib
        lib.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuEventQuery.argtypes = [ctypes.c_void_p]
        self._context: int | None = None
        self._device = -1
        self._bound = threading.local()
        self._batch: bool | None = None if hasattr(lib, "cuMemcpyBatchAsync_v2") else False
        self._pitched: bool | None = None if hasattr(lib, "cuMemcpy2DAsync_v2") else False
        self._check(lib.cuInit(0), "cuInit")

    def _check(self, code: int, call: str) -> None:
        if code:
            text = ctypes.c_char_p()
            self._lib.cuGetErrorString(code, ctypes.byref(text))
            raise CudaError(f"{call} failed: {(text.value or b'unknown error').decode()} (CUresult {code})", code)

    def _current(self) -> None:
        """Make the bound GPU's primary context current on this thread (once per thread)."""
        if self._context is None:
            raise CudaError("the CUDA driver is bound to no GPU yet (gpu_uuid first)")
        if getattr(self._bound, "context", None) != self._context:
            self._check(self._lib.cuCtxSetCurrent(ctypes.c_void_p(self._context)), "cuCtxSetCurrent")
            self._bound.context = self._context

    def gpu_uuid(self, addr: int) -> str:
        ordinal = ctypes.c_int(-1)
        self._check(
            self._lib.cuPointerGetAttribute(ctypes.byref(ordinal), _POINTER_DEVICE_ORDINAL, ctypes.c_uint64(addr)),
            f"cuPointerGetAttribute({addr:#x}, device ordinal)",
        )
        device = ctypes.c_int()
        self._check(self._lib.cuDeviceGet(ctypes.byref(device), ordinal.value), "cuDeviceGet")
        if self._context is None:
            context = ctypes.c_void_p()
            self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
            self._context, self._device = context.value, device.value
        elif device.value != self._device:
            raise CudaError(f"address {addr:#x} is on GPU ordinal {ordinal.value}, this plane is bound to another")
        raw = (ctypes.c_ubyte * 16)()
        self._check(self._lib.cuDeviceGetUuid_v2(raw, device), "cuDeviceGetUuid_v2")
        h = bytes(raw).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def allocation(self, addr: int) -> tuple[int, int]:
        self._current()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(
            self._lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(addr)),
            f"cuMemGetAddressRange({addr:#x})",
        )
        return base.value, size.value

    def export(self, base: int) -> bytes:
        self._current()
        handle = _IpcHandle()
        self._check(self._lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(base)), "cuIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)

    def open(self, handle: bytes) -> int:
        if len(handle) != IPC_HANDLE_BYTES:
            raise CudaError(f"an IPC handle has {IPC_HANDLE_BYTES} bytes, not {len(handle)}")
        self._current()
        mapped = ctypes.c_uint64()
        self._check(
            self._lib.cuIpcOpenMemHandle_v2(
                ctypes.byref(mapped), _IpcHandle.from_buffer_copy(handle), ctypes.c_uint(_IPC_LAZY_PEER_ACCESS)
            ),
            "cuIpcOpenMemHandle",
        )
        return mapped.value

    def close(self, mapped: int) -> None:
        self._current()
        self._check(self._lib.cuIpcCloseMemHandle(ctypes.c_uint64(mapped)), "cuIpcCloseMemHandle")

    def new_stream(self) -> int:
        self._current()
        stream = ctypes.c_void_p()
        self._check(self._lib.cuStreamCreate(ctypes.byref(stream), _STREAM_NON_BLOCKING), "cuStreamCreate")
        return stream.value or 0

    def copy(self, stream: int, pieces: npt.NDArray[np.int64]) -> None:
        self._current()
        if len(pieces) >= PITCHED_MIN_ROWS and self._pitched is not False:
            if self._pitched is None:
                self._pitched = self._self_test(stream, "2D copies", self._copy_pitched_test)
            if self._pitched:
                runs, pieces = pitched_runs(pieces, PITCHED_MIN_ROWS)
                for src, dst, width, height, src_pitch, dst_pitch in runs.tolist():
                    self._copy_2d(stream, src, dst, width, height, src_pitch, dst_pitch)
        if len(pieces) >= BATCH_MIN_PIECES and self._batch is not False:
            if self._batch is None:
                self._batch = self._batch_works(stream)
            if self._batch:
                self._copy_batch(stream, pieces)
                return
        copy, handle = self._lib.cuMemcpyDtoDAsync_v2, ctypes.c_void_p(stream)
        for src, dst, length in pieces.tolist():
            code = copy(dst, src, length, handle)
            if code:
                self._check(code, f"cuMemcpyDtoDAsync({length} bytes to {dst:#x})")

    def _copy_batch(self, stream: int, pieces: npt.NDArray[np.int64]) -> None:
        n = len(pieces)
        # Three contiguous 64-bit columns, which the driver reads as its pointer and size arrays.
        srcs, dsts, sizes = (np.ascontiguousarray(pieces[:, i], dtype=np.uint64) for i in range(3))
        as_u64 = ctypes.POINTER(ctypes.c_uint64)
        where = _Location(_LOCATION_DEVICE, self._device)
        attributes = _CopyAttributes(_SRC_ACCESS_ORDER_STREAM, where, where, 0)
        first = (ctypes.c_size_t * 1)(0)
        self._check(
            self._lib.cuMemcpyBatchAsync_v2(
                dsts.ctypes.data_as(as_u64),
                srcs.ctypes.data_as(as_u64),
                sizes.ctypes.data_as(as_u64),
                ctypes.c_size_t(n),
                ctypes.byref(attributes),
                first,
                ctypes.c_size_t(1),
                ctypes.c_void_p(stream),
            ),
            f"cuMemcpyBatchAsync({n} copies)",
        )

    def _copy_2d(
        self, stream: int, src: int, dst: int, width: int, height: int, src_pitch: int, dst_pitch: int
    ) -> None:
        spec = _Copy2D(
            src_type=_MEMORY_DEVICE,
            src_device=src,
            src_pitch=src_pitch,
            dst_type=_MEMORY_DEVICE,
            dst_device=dst,
            dst_pitch=dst_pitch,
            width=width,
            height=height,
        )
        self._check(
            self._lib.cuMemcpy2DAsync_v2(ctypes.byref(spec), ctypes.c_void_p(stream)),
            f"cuMemcpy2DAsync({height} rows of {width} bytes to {dst:#x})",
        )

    def _copy_pitched_test(self, stream: int, first: int, second: int, n: int) -> bytes:
        """Rows of n/8 bytes from the start of `first`, contiguous, into `second` at a pitch of n/4."""
        row = n // 8
        self._copy_2d(stream, first, second, row, 4, row, 2 * row)
        return b"".join(_PATTERN[i * row : (i + 1) * row] + bytes(row) for i in range(4))

    def _copy_batch_test(self, stream: int, first: int, second: int, n: int) -> bytes:
        """`first` into `second` in four pieces, the last first."""
        quarter = n // 4
        pieces = [(first + i * quarter, second + i * quarter, quarter) for i in reversed(range(4))]
        self._copy_batch(stream, np.array(pieces, dtype=np.int64))
        return _PATTERN

    def _batch_works(self, stream: int) -> bool:
        return self._self_test(stream, "batched CUDA copies", self._copy_batch_test)

    def _self_test(self, stream: int, what: str, copy: Callable[[int, int, int, int], bytes]) -> bool:
        """Whether `copy` lands its bytes where it should: `copy(stream, first, second, n)` enqueues copies from a
        scratch allocation's first half (`_PATTERN`) into its zeroed second half and says what that half should
        then hold; it is read back. A driver whose call differs (another ABI) falls back to the plain path."""
        lib, n = self._lib, len(_PATTERN)
        scratch = ctypes.c_uint64()
        try:
            self._check(lib.cuMemAlloc_v2(ctypes.byref(scratch), ctypes.c_size_t(2 * n)), "cuMemAlloc")
        except CudaError:
            return False
        try:
            host = (ctypes.c_ubyte * (2 * n)).from_buffer_copy(_PATTERN + bytes(n))
            self._check(lib.cuMemcpyHtoD_v2(scratch, host, ctypes.c_size_t(2 * n)), "cuMemcpyHtoD")
            want = copy(stream, scratch.value, scratch.value + n, n)
            self._check(lib.cuStreamSynchronize(ctypes.c_void_p(stream)), "cuStreamSynchronize")
            back = (ctypes.c_ubyte * (2 * n))()
            self._check(lib.cuMemcpyDtoH_v2(back, scratch, ctypes.c_size_t(2 * n)), "cuMemcpyDtoH")
            works = bytes(back) == _PATTERN + want
        except CudaError as exc:
            log.info("%s are off: %s", what, exc)
            works = False
        finally:
            lib.cuMemFree_v2(scratch)
        log.info("%s: %s", what, "on" if works else "off")
        return works

    @property
    def pitched(self) -> bool | None:
        """Whether stretches of pieces at constant pitches go as 2D copies (None: not tried yet)."""
        return self._pitched

    @property
    def batched(self) -> bool | None:
        """Whether copies of many pieces go as one batch call (None: not tried yet)."""
        return self._batch

    def record(self, stream: int) -> CudaEvent:
        self._current()
        event = ctypes.c_void_p()
        self._check(self._lib.cuEventCreate(ctypes.byref(event), _EVENT_DISABLE_TIMING), "cuEventCreate")
        code = self._lib.cuEventRecord(event, ctypes.c_void_p(stream))
        if code:
            self._lib.cuEventDestroy_v2(event)
            self._check(code, "cuEventRecord")
        return _Event(self, event.value or 0)

    def query(self, event: _Event) -> bool:
        self._current()
        code = self._lib.cuEventQuery(ctypes.c_void_p(event.handle))
        if code == _NOT_READY:
            return False
        self._check(code, "cuEventQuery")
        return True

    def release(self, event: CudaEvent) -> None:
        if isinstance(event, _Event) and event.handle:
            self._lib.cuEventDestroy_v2(ctypes.c_void_p(event.handle))
            event.handle = 0

    def destroy_stream(self, stream: int) -> None:
        if stream:
            self._lib.cuStreamDestroy_v2(ctypes.c_void_p(stream))


__all__ = ["BATCH_MIN_PIECES", "IPC_HANDLE_BYTES", "CudaDriver", "CudaError", "CudaEvent", "LibCuda"]
