"""Host-to-device copies into MLX's CUDA arrays through the CUDA driver (ctypes on libcuda).

MLX's CUDA backend allocates every array with ``cudaMallocManaged``. An array filled on the
host therefore moves to the GPU page by page, when a kernel first touches it: loading tier
blocks that way ran at 1.2-2 GB/s on an H100 and an H200, slower than computing the blocks
(docs/kv-tiers.md). :class:`HostToDevice` keeps a pinned host buffer and a device-resident
MLX array of the same size and moves one into the other with one ``cuMemcpyHtoD``, a DMA
at the link's speed; the MLX kernels then read device memory.

Only the driver's stable entry points are used (``cuInit``, ``cuDeviceGet``,
``cuDevicePrimaryCtxRetain``, ``cuCtxSetCurrent``, ``cuMemHostRegister_v2``,
``cuMemcpyHtoD_v2``, ``cuCtxSynchronize``): their signatures are the same in CUDA 12 and 13.
The context is the device's primary context, the one MLX's runtime calls use.
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import mlx.core as mx
import numpy as np

from worker.model.device import cuda_available

log = logging.getLogger(__name__)


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


class HostToDevice:
    """A pinned host buffer of ``rows x row_bytes`` bytes (:attr:`host`, filled by the
    caller) and a device MLX array of the same shape (:attr:`device`, uint8) that
    :meth:`copy` fills from it. One per pool, made at its first load, kept."""

    def __init__(self, rows: int, row_bytes: int, ordinal: int = 0) -> None:
        self._driver = _Driver(ordinal)
        self._set_current()
        nbytes = rows * row_bytes
        # Page-aligned (mmap) so that registering pins exactly these pages.
        self._memory = mmap.mmap(-1, nbytes)
        self.host = np.frombuffer(self._memory, np.uint8).reshape(rows, row_bytes)
        self._driver.call("cuMemHostRegister_v2", _address(self.host), nbytes, 0)
        self._registered = True
        # Filled by a kernel, so its pages start on the device, where copy() writes them.
        self.device = mx.zeros((rows, row_bytes), mx.uint8)
        mx.eval(self.device)
        self.row_bytes = row_bytes

    def _set_current(self) -> None:
        self._driver.call("cuCtxSetCurrent", self._driver.context)

    def copy(self, rows: int) -> mx.array:
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

    def close(self) -> None:
        """Unpins the host buffer (the device array goes with its last reference)."""
        if self._registered:
            self._registered = False
            self._set_current()
            self._driver.call("cuMemHostUnregister", _address(self.host))


def host_to_device(rows: int, row_bytes: int) -> HostToDevice | None:
    """A :class:`HostToDevice` on a CUDA GPU, or None elsewhere or where the driver refuses
    (logged: loads then take MLX's own path, page migrations)."""
    if not on_cuda():
        return None
    try:
        # MLX computes on the first visible GPU (a worker group gives each rank its own).
        return HostToDevice(rows, row_bytes, 0)
    except (OSError, AttributeError, CudaDriverError) as err:
        log.warning("tier loads take MLX's managed-memory path (no driver copy: %s)", err)
        return None
