"""Copies between host memory and MLX's CUDA arrays through the CUDA driver (ctypes on
libcuda): the KV tiers' loads and spills on a GPU.

MLX's CUDA backend allocates every array with ``cudaMallocManaged``. An array filled on the
host therefore moves to the GPU page by page, when a kernel first touches it, and a device
array read on the host comes back the same way: loading tier blocks ran at 1.2-2 GB/s on an
H100 and an H200, slower than computing the blocks, and spilling them at ~2.9 GB/s, on the
model thread (docs/kv-tiers.md). :class:`PinnedStaging` keeps a pinned host buffer and a
device-resident MLX array of the same size; one ``cuMemcpyHtoD`` or ``cuMemcpyDtoH`` moves
the bytes at the link's speed (45-49 GB/s on an H200).

Only the driver's stable entry points are used (``cuInit``, ``cuDeviceGet``,
``cuDevicePrimaryCtxRetain``, ``cuCtxSetCurrent``, ``cuMemHostRegister_v2``,
``cuMemHostUnregister``, ``cuMemcpyHtoD_v2``, ``cuMemcpyDtoH_v2``, ``cuCtxSynchronize``):
their signatures are the same in CUDA 12 and 13. The context is the device's primary
context, the one MLX's runtime calls use.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import mlx.core as mx
import numpy as np

from worker.model.device import cuda_available

log = logging.getLogger(__name__)

# Threads that fill the staging buffer (host memory copies run at a few GB/s a thread).
FILL_THREADS = min(8, os.cpu_count() or 1)


class CudaDriverError(RuntimeError):
    """A driver call failed (its name and CUDA error code say which and why)."""


def on_cuda() -> bool:
    """Whether MLX computes on a CUDA GPU here (its default device)."""
    return mx.default_device() != mx.cpu and cuda_available()


class _Driver:
    """The few libcuda calls used here, with their argument types set."""

    def __init__(self, ordinal: int) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        c_int, c_uint, c_size, ptr = ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p
        signatures: dict[str, list[type]] = {
            "cuInit": [c_uint],
            "cuDeviceGet": [ctypes.POINTER(c_int), c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ptr), c_int],
            "cuCtxSetCurrent": [ptr],
            "cuCtxSynchronize": [],
            "cuMemHostRegister_v2": [ptr, c_size, c_uint],
            "cuMemHostUnregister": [ptr],
            "cuMemcpyHtoD_v2": [ctypes.c_uint64, ptr, c_size],
            "cuMemcpyDtoH_v2": [ptr, ctypes.c_uint64, c_size],
        }
        for name, args in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, c_int
        self._lib = lib
        self.call("cuInit", 0)
        device = c_int()
        self.call("cuDeviceGet", ctypes.byref(device), ordinal)
        context = ptr()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device.value)
        self.context = context

    def call(self, name: str, *args: object) -> None:
        rc = getattr(self._lib, name)(*args)
        if rc != 0:
            raise CudaDriverError(f"{name} failed: CUDA error {rc}")


def _address(array: mx.array | np.ndarray) -> int:
    """The first byte of an evaluated, contiguous array (MLX: its unified address)."""
    host = array if isinstance(array, np.ndarray) else np.array(array, copy=False)
    return int(host.ctypes.data)


class PinnedStaging:
    """A pinned host buffer of ``rows x row_bytes`` bytes (:attr:`host`, filled by the
    caller: :func:`fill_rows`) and a device MLX array of the same shape (:attr:`device`, uint8) that
    :meth:`to_device` fills from it; :meth:`from_device` fills the host buffer from any
    device array. One per pool, made at its first load or spill, kept; used on the model
    thread only."""

    def __init__(self, rows: int, row_bytes: int, ordinal: int = 0) -> None:
        self._driver = _Driver(ordinal)
        self._set_current()
        nbytes = rows * row_bytes
        # Page-aligned (mmap) so that registering pins exactly these pages.
        self._memory = mmap.mmap(-1, nbytes)
        self.host = np.frombuffer(self._memory, np.uint8).reshape(rows, row_bytes)
        self._driver.call("cuMemHostRegister_v2", _address(self.host), nbytes, 0)
        # Unpinned before its memory goes (a later buffer at the same address could not be
        # pinned again otherwise); the callback holds the mapping until then.
        weakref.finalize(self, _unpin, self._driver, self._memory, _address(self.host))
        # Filled by a kernel, so its pages start on the device, where to_device() writes them.
        self.device = mx.zeros((rows, row_bytes), mx.uint8)
        mx.eval(self.device)
        self.row_bytes = row_bytes

    def _set_current(self) -> None:
        self._driver.call("cuCtxSetCurrent", self._driver.context)

    def to_device(self, rows: int) -> mx.array:
        """Copies the first ``rows`` rows of :attr:`host` into :attr:`device` and returns
        them (a view of the device array). No MLX computation may be reading
        :attr:`device` (the caller evaluates what read it before refilling :attr:`host`);
        when this returns the bytes are on the device."""
        self._set_current()
        dst = _address(self.device)
        self._driver.call("cuMemcpyHtoD_v2", dst, _address(self.host), rows * self.row_bytes)
        # The copy is synchronous from pinned memory; waiting for the context makes the
        # bytes visible to MLX's streams whatever the driver chose.
        self._driver.call("cuCtxSynchronize")
        return self.device[:rows]

    def from_device(self, source: mx.array, first: int, rows: int) -> np.ndarray:
        """Copies rows ``first`` .. ``first + rows - 1`` of ``source`` (an evaluated,
        C-contiguous uint8 ``[n, row_bytes]`` device array) into the first rows of
        :attr:`host` and returns them (a view: valid until the next copy)."""
        if source.dtype != mx.uint8 or source.ndim != 2 or source.shape[1] != self.row_bytes:
            raise ValueError(f"expected uint8 rows of {self.row_bytes} bytes, got {source.shape}")
        if first < 0 or rows < 0 or first + rows > source.shape[0] or rows > len(self.host):
            raise ValueError(f"rows {first}..{first + rows} outside {source.shape[0]} or staging")
        view = np.array(source, copy=False)  # no copy: the unified address
        if not view.flags.c_contiguous:
            raise ValueError("the source rows must be one contiguous array")
        self._set_current()
        start = _address(view) + first * self.row_bytes
        self._driver.call("cuMemcpyDtoH_v2", _address(self.host), start, rows * self.row_bytes)
        self._driver.call("cuCtxSynchronize")
        return self.host[:rows]


def fill_rows(rows: np.ndarray, payloads: Sequence[bytes | memoryview]) -> None:
    """Copies ``payloads[j]`` into ``rows[j]`` (a C-contiguous uint8 ``[n, row]`` array), on
    several threads: one thread's copies ran at ~5 GB/s on an H200 host, 30x slower than
    the transfer after them (``ctypes.memmove`` lets go of the GIL)."""
    row = rows.shape[1]
    if len(payloads) > rows.shape[0] or not rows.flags.c_contiguous or rows.dtype != np.uint8:
        raise ValueError(f"{len(payloads)} payloads do not fit rows of {rows.shape}")
    sources = [np.frombuffer(p, np.uint8) for p in payloads]
    if any(len(src) != row for src in sources):
        raise ValueError(f"payloads must be {row} bytes each")
    base = _address(rows)

    def copy(first: int, last: int) -> None:
        for j in range(first, last):
            ctypes.memmove(base + j * row, sources[j].ctypes.data, row)

    _spread(copy, len(sources))


def copy_rows(rows: np.ndarray) -> list[memoryview]:
    """Each row of ``rows`` (C-contiguous uint8) copied into a buffer of its own, on several
    threads (the fresh buffers' page faults are paid there too)."""
    n, row = rows.shape
    out: list[memoryview | None] = [None] * n

    def copy(first: int, last: int) -> None:
        for j in range(first, last):
            block = np.empty(row, np.uint8)
            ctypes.memmove(block.ctypes.data, rows[j].ctypes.data, row)
            out[j] = block.data

    _spread(copy, n)
    return [m for m in out if m is not None]


def _spread(copy: Callable[[int, int], None], n: int) -> None:
    """Runs ``copy(first, last)`` over ``0 .. n - 1`` split among the filling threads."""
    if n <= 2 or FILL_THREADS == 1:
        copy(0, n)
        return
    step = -(-n // FILL_THREADS)
    fillers = _fillers()
    for done in [fillers.submit(copy, a, min(a + step, n)) for a in range(0, n, step)]:
        done.result()


@cache
def _fillers() -> ThreadPoolExecutor:
    """The process's filling threads (one set for every pool's staging buffer)."""
    return ThreadPoolExecutor(FILL_THREADS, thread_name_prefix="kv-stage")


def _unpin(driver: _Driver, memory: mmap.mmap, address: int) -> None:
    try:
        driver.call("cuCtxSetCurrent", driver.context)
        driver.call("cuMemHostUnregister", address)
    except CudaDriverError as err:  # at exit the context may be gone: nothing left to free
        log.debug("unpinning the staging buffer: %s", err)
    del memory  # the mapping is released with the buffer's last reference


def pinned_staging(rows: int, row_bytes: int, purpose: str = "tier copies") -> PinnedStaging | None:
    """A :class:`PinnedStaging` on a CUDA GPU, or None elsewhere or where the driver refuses
    (logged, naming ``purpose``: its copies then take MLX's own path, page migrations)."""
    if not on_cuda():
        return None
    try:
        # MLX computes on the first visible GPU (a worker group gives each rank its own).
        return PinnedStaging(rows, row_bytes, 0)
    except (OSError, AttributeError, CudaDriverError) as err:
        log.warning("%s take MLX's managed-memory path (no driver copy: %s)", purpose, err)
        return None
