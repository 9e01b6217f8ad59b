"""The physical KV pool: per layer, K and V arrays holding every block of this worker.

Layout (CPU): per layer ``[n_kv_heads, num_blocks + 1, block_size, head_dim]``, head-major.
Token ``t`` of a sequence lives in block ``block_table[t // block_size]``, slot
``t % block_size``. Head-major makes the batched gather of whole blocks land directly in the
``[B, heads, L, head_dim]`` order attention wants, contiguous; the token-major layout of the
design doc (``[num_blocks, block_size, heads, dim]``) needs a take, a transpose and a copy, about
3x slower on CPU. A GPU layout may differ; it stays behind this class.

Block ``num_blocks`` (:attr:`KVPool.trash_block`) is reserved and never leased: padded positions
of a batch write to and read from it, so every index of a batched scatter or gather is a valid
block and no branch is needed per sequence. Real sequences never read it unmasked.

In-place writes: ``pool[idx] = x`` updates the buffer in place only if nothing else references
it when the graph is evaluated; otherwise MLX copies the whole pool (31 ms instead of 13 us for a
64 MB pool). So the pool hands out no long-lived views: gathers and block reads are fresh arrays,
and callers evaluate :meth:`arrays` together with their outputs at the end of every forward.
Only the single thread that owns the model touches a pool.

Memory is committed as the pool fills (CPU, Linux): MLX has no uninitialized allocation, so the
arrays are made with ``mx.zeros`` (unwritten slots must be finite: attention multiplies them
by a zero probability), and their pages are then handed back to the kernel
(:func:`release_pages`). An unwritten page reads as zero again and costs no memory until a
block written into it commits it. The cache service hands out low block ids first and reuses
freed ones first (``kvcache_service.block_pool``), so a pool commits about as much memory as
the most blocks it has held at once, live or cached.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import time
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from worker.errors import BatchError, PoolConfigError
from worker.ids import BlockId
from worker.model.cuda_copy import PinnedStaging, copy_rows, fill_rows, pinned_staging
from worker.model.spec import LayerSpec, ModelSpec

DEFAULT_BLOCK_SIZE = 32
# Blocks a GPU's load stages at once (KVPool._write_uniform): 64 MB for a 1B model's 1 MB
# blocks, kept once used.
STAGING_BLOCKS = 64


_MADV_DONTNEED = 4  # Linux: the range's pages are dropped, and read as zeros afterwards
# Linux: no transparent huge pages in the range. Where THP is "always", a written block would
# otherwise fault in (or khugepaged collapse) 2 MiB around it, not its own 4 KiB pages; where it
# is "madvise" (Debian's default, where the pool was measured) nothing changes.
_MADV_NOHUGEPAGE = 15


def _page_range(array: mx.array) -> tuple[int, int]:
    """The whole pages inside ``array``'s memory: [first, last) addresses (CPU memory)."""
    # MLX's buffer protocol (its stubs do not say so): the array's own memory, any dtype
    view = memoryview(array)  # type: ignore[arg-type]
    try:
        cell = ctypes.c_char.from_buffer(view)
        start = ctypes.addressof(cell)
        del cell
    finally:
        view.release()
    page = mmap.PAGESIZE
    return -(-start // page) * page, (start + array.nbytes) // page * page


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def release_pages(arrays: Sequence[mx.array]) -> int:
    """Hands the whole pages inside each (evaluated, zero-filled, CPU) array back to the
    kernel, so they cost no memory until written; returns the bytes released. Linux only
    (elsewhere it does nothing): a private anonymous page dropped with ``MADV_DONTNEED`` reads
    as zero afterwards, which is what the arrays hold. No computation may be using them;
    neighbouring bytes in a partial page are left alone."""
    if not sys.platform.startswith("linux"):
        return 0
    libc, released = _libc(), 0
    for array in arrays:
        first, last = _page_range(array)
        if last <= first:
            continue
        libc.madvise(first, last - first, _MADV_NOHUGEPAGE)  # best effort: kernels without THP
        if libc.madvise(first, last - first, _MADV_DONTNEED) == 0:
            released += last - first
    return released


def resident_bytes(arrays: Sequence[mx.array]) -> int | None:
    """Bytes of the arrays' whole pages that are in memory (``mincore``), or None off Linux.
    A released page becomes resident when written (or read: the kernel maps its shared zero
    page, which counts here though it costs nothing)."""
    if not sys.platform.startswith("linux"):
        return None
    libc, page, resident = _libc(), mmap.PAGESIZE, 0
    for array in arrays:
        first, last = _page_range(array)
        if last <= first:
            continue
        pages = (last - first) // page
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(first, last - first, vec) != 0:
            return None
        resident += sum(b & 1 for b in bytes(vec)) * page
    return resident


def describe_layout(layers: Sequence[LayerSpec], block_size: int, dtype: mx.Dtype) -> str:
    """A block payload's layout as one line (:meth:`KVPool.read_blocks`' form: per layer, K
    ``[heads, block_size, k_dim]`` then V): what a spilled block's bytes mean (worker.tier)."""
    shapes = ",".join(f"{s.n_kv_heads}x{s.k_head_dim}/{s.v_head_dim}" for s in layers)
    return f"head-major;bs={block_size};dtype={dtype};layers={shapes}"


def check_payloads(
    blocks: Sequence[int], payloads: Sequence[bytes | memoryview], per_block: int
) -> None:
    """Raise :class:`BatchError` unless there is one payload of ``per_block`` bytes a block."""
    if len(payloads) != len(blocks) or any(len(p) != per_block for p in payloads):
        raise BatchError(f"block payloads must be {per_block} bytes each, one per block")


def write_rate(write: Callable[[], None], nbytes: int) -> float:
    """Bytes a second ``write`` (of ``nbytes``) moves, timed on its second run (the first
    pays its kernels and buffers): a pool's, or a worker group's, measured load path."""
    write()
    start = time.perf_counter()
    write()
    took = time.perf_counter() - start
    return nbytes / took if took > 0 else 0.0


def bytes_per_block(layers: Sequence[LayerSpec], block_size: int, dtype: mx.Dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    per_token = sum(s.n_kv_heads * (s.k_head_dim + s.v_head_dim) for s in layers)
    return per_token * block_size * dtype.size


class KVPool:
    """K and V blocks of every layer of one model; block ids are assigned by the cache service."""

    def __init__(
        self,
        layers: Sequence[LayerSpec],
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: mx.Dtype = mx.float32,
    ) -> None:
        if num_blocks < 1:
            raise PoolConfigError(f"a pool needs at least one block, got {num_blocks}")
        if block_size < 1:
            raise PoolConfigError(f"block_size must be positive, got {block_size}")
        if not layers:
            raise PoolConfigError("a pool needs at least one layer")
        self.layers = tuple(layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_blocks + 1, block_size)
        self._keys = [mx.zeros((s.n_kv_heads, *shape, s.k_head_dim), dtype) for s in layers]
        self._values = [mx.zeros((s.n_kv_heads, *shape, s.v_head_dim), dtype) for s in layers]
        self._heads = [mx.arange(s.n_kv_heads, dtype=mx.int32)[None, :, None] for s in layers]
        # write_blocks' staging on a GPU, made at first use: a pinned host buffer and a device
        # array on CUDA (cuda_copy), else a host buffer that MLX copies from
        self._staging: np.ndarray | None = None
        self._pinned: PinnedStaging | None = None
        mx.eval(self._keys, self._values)
        if mx.default_device() == mx.cpu:
            release_pages(self.arrays())

    @classmethod
    def for_model(
        cls,
        spec: ModelSpec,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
    ) -> KVPool:
        """Size a pool by block count or by a memory budget (exactly one of them)."""
        if (num_blocks is None) == (memory_bytes is None):
            raise PoolConfigError("give exactly one of num_blocks and memory_bytes")
        if num_blocks is None:
            assert memory_bytes is not None
            per_block = bytes_per_block(spec.layers, block_size, spec.dtype)
            # The trash block comes out of the budget too.
            num_blocks = memory_bytes // per_block - 1
            if num_blocks < 1:
                raise PoolConfigError(
                    f"{memory_bytes} bytes hold no block of {per_block} bytes plus the trash block"
                )
        return cls(spec.layers, num_blocks, block_size, spec.dtype)

    @property
    def trash_block(self) -> BlockId:
        """The reserved padding block; never part of a lease."""
        return BlockId(self.num_blocks)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.layers, self.block_size, self.dtype)

    def resident_bytes(self) -> int | None:
        """Bytes of the pool in memory now (:func:`resident_bytes`): it grows as blocks are
        written (CPU, Linux); None where the platform cannot say."""
        return resident_bytes(self.arrays()) if mx.default_device() == mx.cpu else None

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool arrays, trash block included."""
        return sum(a.nbytes for a in self.arrays())

    def arrays(self) -> list[mx.array]:
        """Every pool array, to evaluate together with a forward's outputs."""
        return [*self._keys, *self._values]

    def replace(self, arrays: Sequence[mx.array]) -> None:
        """Take ``arrays`` (in :meth:`arrays`' order) as the pool: a compiled forward's
        written pool, or its inputs while it is traced (``worker.model.compiled_decode``)."""
        n = self.num_layers
        if len(arrays) != 2 * n:
            raise BatchError(f"a pool of {n} layers has {2 * n} arrays, got {len(arrays)}")
        self._keys, self._values = list(arrays[:n]), list(arrays[n:])

    def layer_arrays(self, layer: int) -> tuple[mx.array, mx.array]:
        """The K and V arrays of ``layer``, for one forward's attention; do not keep them."""
        return self._keys[layer], self._values[layer]

    def write(
        self,
        layer: int,
        blocks: mx.array,
        slots: mx.array,
        keys: mx.array,
        values: mx.array,
    ) -> None:
        """Scatter ``keys``/``values`` ``[B, heads, N, dim]`` to ``blocks``/``slots`` ``[B, 1, N]``.

        Lazy; in place once evaluated (see the module docstring).
        """
        heads = self._heads[layer]
        self._keys[layer][heads, blocks, slots] = keys.astype(self.dtype)
        self._values[layer][heads, blocks, slots] = values.astype(self.dtype)

    def gather(self, layer: int, tables: mx.array) -> tuple[mx.array, mx.array]:
        """K and V of whole blocks ``tables`` ``[B, 1, n]``, as contiguous ``[B, heads, n*bs, dim]``."""
        keys, values = self._keys[layer], self._values[layer]
        b, n = tables.shape[0], tables.shape[2]
        heads = self._heads[layer]
        k, v = keys[heads, tables], values[heads, tables]
        return (
            k.reshape(b, k.shape[1], n * self.block_size, k.shape[-1]),
            v.reshape(b, v.shape[1], n * self.block_size, v.shape[-1]),
        )

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy block ``src`` into ``dst`` in every layer, for each ``(src, dst)`` (copy on write).

        Apply before the first write to ``dst``. Sources are read and evaluated before the
        writes, so each write owns its buffer and stays in place.
        """
        if not pairs:
            return
        src = [s for s, _ in pairs]
        dst = [d for _, d in pairs]
        self.check_blocks(src + dst)
        if len(set(dst)) != len(dst) or set(src) & set(dst):
            raise BatchError(f"copy-on-write pairs overlap: {list(pairs)}")
        src_ids, dst_ids = mx.array(src, dtype=mx.int32), mx.array(dst, dtype=mx.int32)
        copies = [
            (k[:, src_ids], v[:, src_ids]) for k, v in zip(self._keys, self._values, strict=True)
        ]
        mx.eval(copies)
        for layer, (k, v) in enumerate(copies):
            self._keys[layer][:, dst_ids] = k
            self._values[layer][:, dst_ids] = v
        del copies
        mx.eval(self.arrays())

    def describe_layout(self) -> str:
        """The pool's layout as one line: what a spilled block's bytes mean (worker.tier)."""
        return describe_layout(self.layers, self.block_size, self.dtype)

    def read_blocks(self, blocks: Sequence[int]) -> list[bytes | memoryview]:
        """A copy of each block's K and V in every layer, as one payload per block: per layer,
        K ``[heads, block_size, k_dim]`` then V, C order, the pool's dtype (worker.tier spills
        them). On the model thread; the pool is only read.

        Where every layer has one shape (most models), the blocks are gathered on the device
        into one ``[n, layers, 2, heads, block_size, dim]`` array, so one transfer brings them
        all and each block's payload is one contiguous slice: on an H100 a per-layer copy
        and a strided join per block took 0.37 s for 218 blocks of 1 MB. The payloads are
        views of that array (unified memory), or on CUDA a buffer of their own each, copied
        back through the pinned staging buffer (:mod:`worker.model.cuda_copy`)."""
        if not blocks:
            return []
        self.check_blocks(blocks)
        ids = mx.array(list(blocks), dtype=mx.int32)
        if self._uniform:
            parts = [
                mx.stack([k[:, ids], v[:, ids]], axis=1).transpose(2, 1, 0, 3, 4)
                for k, v in zip(self._keys, self._values, strict=True)
            ]  # each [n, 2, heads, bs, dim]
            whole = mx.stack(parts, axis=1).reshape(len(blocks), -1).view(mx.uint8)
            mx.eval(whole)
            self._staging_rows()
            if self._pinned is not None:
                # CUDA: one driver copy a chunk, then a buffer of its own for each block
                # (the host tier keeps them as they are). Reading the gathered array on the
                # host instead migrated its pages at ~2.9 GB/s, on the model thread.
                out: list[bytes | memoryview] = []
                for at in range(0, len(blocks), STAGING_BLOCKS):
                    n = min(STAGING_BLOCKS, len(blocks) - at)
                    out += copy_rows(self._pinned.from_device(whole, at, n))
                return out
            # Views of the gathered array, no copy (a copy per block cost 52 ms of page faults
            # for 218 MB on an H100 host): unified memory on a CPU, Apple silicon and CUDA.
            host = np.array(whole, copy=False)
            return [memoryview(host[j]) for j in range(len(blocks))]
        parts = []
        for k, v in zip(self._keys, self._values, strict=True):
            parts += [k[:, ids].view(mx.uint8), v[:, ids].view(mx.uint8)]
        mx.eval(parts)
        arrays = [np.array(p) for p in parts]  # [heads, n, block_size, dim * itemsize]
        del parts
        return [b"".join(a[:, j].tobytes() for a in arrays) for j in range(len(blocks))]

    @property
    def _uniform(self) -> bool:
        """Whether every layer's K and V have one shape (a payload is then a plain array)."""
        first = self.layers[0]
        return first.k_head_dim == first.v_head_dim and all(s == first for s in self.layers)

    def write_blocks(self, blocks: Sequence[int], payloads: Sequence[bytes | memoryview]) -> None:
        """Writes payloads of :meth:`read_blocks`' form into ``blocks`` (a tier's blocks
        loaded back), before any forward reads them."""
        if not blocks:
            return
        self.check_blocks(blocks)
        check_payloads(blocks, payloads, self.bytes_per_block)
        self.write_payloads(blocks, payloads)

    def write_payloads(self, blocks: Sequence[int], payloads: Sequence[bytes | memoryview]) -> None:
        """:meth:`write_blocks` without its checks (the caller made them: rank 0 of a worker
        group for its followers), into any block, the trash block too."""
        if mx.default_device() == mx.cpu and self.dtype != mx.bfloat16:
            self._write_blocks_in_place(blocks, payloads)
            return
        ids = mx.array(list(blocks), dtype=mx.int32)
        size, bs, n = self.dtype.size, self.block_size, len(blocks)
        if self._uniform:
            self._write_uniform(list(blocks), payloads)
            return
        offset = 0
        for layer, s in enumerate(self.layers):
            for dim, arrays in ((s.k_head_dim, self._keys), (s.v_head_dim, self._values)):
                count = s.n_kv_heads * bs * dim * size
                stacked = np.stack(
                    [
                        np.frombuffer(p, np.uint8, count, offset).reshape(s.n_kv_heads, bs, -1)
                        for p in payloads
                    ],
                    axis=1,
                )  # [heads, n, block_size, dim * itemsize]
                value = mx.array(stacked).view(self.dtype).reshape(s.n_kv_heads, n, bs, dim)
                arrays[layer][:, ids] = value
                offset += count
        mx.eval(self.arrays())

    def _write_uniform(self, blocks: list[int], payloads: Sequence[bytes | memoryview]) -> None:
        """``write_blocks`` on a device with its own kernels (GPU): the payloads copied into a
        host staging buffer kept between loads, moved to the device in one transfer, then
        one scatter per layer's K and V on the device; ``STAGING_BLOCKS`` blocks at a time.

        On CUDA the staging buffer is pinned and the transfer is one driver copy into a
        device-resident array (:mod:`worker.model.cuda_copy`); MLX's own path (an array
        made from the host buffer) is kept for Apple silicon, whose memory is one, and
        where the driver refuses. On CUDA that path moved the bytes by page migrations
        when the scatters first touched them: 1.2-2 GB/s on an H100 and an H200. A fresh
        host buffer per load would pay its page faults as well (a 218 MB join took
        175 ms on an H100 host)."""
        s, bs = self.layers[0], self.block_size
        rows = self._staging_rows()
        for at in range(0, len(blocks), STAGING_BLOCKS):
            chunk = blocks[at : at + STAGING_BLOCKS]
            n = len(chunk)
            fill_rows(rows, payloads[at : at + n])  # the pinned buffer itself on CUDA
            staged = self._pinned.to_device(n) if self._pinned else mx.array(rows[:n])
            whole = staged.view(self.dtype)
            whole = whole.reshape(n, self.num_layers, 2, s.n_kv_heads, bs, s.k_head_dim)
            ids = mx.array(chunk, dtype=mx.int32)
            for layer in range(self.num_layers):
                self._keys[layer][:, ids] = whole[:, layer, 0].transpose(1, 0, 2, 3)
                self._values[layer][:, ids] = whole[:, layer, 1].transpose(1, 0, 2, 3)
            mx.eval(self.arrays())  # the staging rows are free again

    def _staging_rows(self) -> np.ndarray:
        """The host rows a load fills (made at the first load, kept)."""
        if self._staging is None:
            self._pinned = pinned_staging(STAGING_BLOCKS, self.bytes_per_block)
            if self._pinned is not None:
                self._staging = self._pinned.host
            else:
                self._staging = np.empty((STAGING_BLOCKS, self.bytes_per_block), np.uint8)
        return self._staging

    def measure_write_rate(self, blocks: int = 32) -> float:
        """Bytes a second :meth:`write_blocks` moves into the pool, measured by writing
        ``blocks`` blocks of zeros into the trash block (never read unmasked) on the path
        a load takes here; on the model thread. The tiers weigh loading against computing
        with it before any real load has been timed."""
        if mx.default_device() != mx.cpu and not self._uniform:
            return 0.0  # mixed layer shapes off the CPU: measured by the loads themselves
        zeros = [bytes(self.bytes_per_block)] * blocks
        trash = [int(self.trash_block)] * blocks
        return write_rate(lambda: self.write_payloads(trash, zeros), blocks * self.bytes_per_block)

    def _write_blocks_in_place(
        self, blocks: Sequence[int], payloads: Sequence[bytes | memoryview]
    ) -> None:
        """:meth:`write_blocks` on a CPU: the payloads copied straight into the pool's buffers
        (numpy views of them: unified memory), one copy, where building an MLX array and
        scattering it took three (~4x slower: 275 against 1,080 MB/s from the files). Safe on
        the model thread: every pool array is evaluated first (a forward in flight writes
        other blocks; these are a loading sequence's own, which no forward reads yet)."""
        mx.eval(self.arrays())
        bs, offset = self.block_size, 0
        for layer in range(self.num_layers):
            for arrays in (self._keys, self._values):
                view = np.array(arrays[layer], copy=False)  # [heads, blocks + 1, bs, dim]
                count = view.shape[0] * bs * view.shape[3] * view.itemsize
                shape = (view.shape[0], bs, view.shape[3])
                for b, p in zip(blocks, payloads, strict=True):
                    view[:, b] = np.frombuffer(
                        p, view.dtype, count // view.itemsize, offset
                    ).reshape(shape)
                offset += count

    def check_blocks(self, blocks: Sequence[int]) -> None:
        """Raise :class:`BatchError` unless every id names a leasable block of this pool."""
        bad = [b for b in blocks if not 0 <= b < self.num_blocks]
        if bad:
            raise BatchError(f"block ids {bad[:8]} outside 0..{self.num_blocks - 1}")

    def read_block(self, layer: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """A copy of one block's K and V ``[heads, block_size, dim]`` (tests, debugging)."""
        k, v = self._keys[layer][:, block], self._values[layer][:, block]
        mx.eval(k, v)
        return np.array(k), np.array(v)
