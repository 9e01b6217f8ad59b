"""KVPool.read_blocks / write_blocks (the tiers' copies out of and into the pool): a block's
payload round-trips exactly, into any other block, in every dtype, on every path (the CPU's
in-place copy, the device path's staging and scatter, layers of mixed shapes), and the payload
layout is one format whatever path wrote it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from worker.errors import BatchError
from worker.model import cuda_copy
from worker.model.kv_pool import STAGING_BLOCKS, KVPool
from worker.model.spec import LayerSpec
from worker.tier.store import own

MIXED = [LayerSpec(2, 8, 8), LayerSpec(3, 4, 6)]
UNIFORM = [LayerSpec(2, 8, 8)] * 3


def filled(layers: list[LayerSpec], dtype: mx.Dtype, blocks: int = 10) -> KVPool:
    pool = KVPool(layers, blocks, 4, dtype)
    mx.random.seed(0)
    for layer in range(len(layers)):
        k, v = pool.layer_arrays(layer)
        pool._keys[layer] = mx.random.normal(k.shape).astype(dtype)
        pool._values[layer] = mx.random.normal(v.shape).astype(dtype)
    mx.eval(pool.arrays())
    return pool


def same_block(a: KVPool, i: int, b: KVPool, j: int) -> bool:
    return all(
        mx.array_equal(x[layer][:, i], y[layer][:, j]).item()
        for layer in range(a.num_layers)
        for x, y in ((a._keys, b._keys), (a._values, b._values))
    )


def reference_payload(pool: KVPool, block: int) -> bytes:
    """The documented layout: per layer, K [heads, block_size, dim] then V, C order."""
    return b"".join(
        np.array(x[layer][:, block].view(mx.uint8)).tobytes()
        for layer in range(pool.num_layers)
        for x in (pool._keys, pool._values)
    )


@pytest.mark.parametrize("layers", [MIXED, UNIFORM], ids=["mixed", "uniform"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_payloads_round_trip_into_other_blocks(layers, dtype) -> None:
    src = filled(layers, dtype)
    payloads = src.read_blocks([3, 7])
    assert [bytes(p) for p in payloads] == [reference_payload(src, 3), reference_payload(src, 7)]
    dst = KVPool(layers, 10, 4, dtype)
    dst.write_blocks([1, 5], payloads)
    assert same_block(src, 3, dst, 1) and same_block(src, 7, dst, 5)
    assert not bytes(dst.read_blocks([0])[0]).strip(b"\0")  # others untouched


@pytest.mark.parametrize("uniform_path", [False, True], ids=["own-path", "device-path"])
@pytest.mark.parametrize("layers", [MIXED, UNIFORM], ids=["mixed", "uniform"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_write_keeps_nothing_of_its_payloads_memory(layers, dtype, uniform_path) -> None:
    """A load's payloads are views of memory reused for the next chunk (tier.store's
    LoadArena) once ``write_blocks`` returns: the pool must have copied them by then."""
    if uniform_path and layers is MIXED:
        pytest.skip("the device path takes uniform layers only")
    src = filled(layers, dtype)
    arena = bytearray(2 * src.bytes_per_block)
    views = [
        memoryview(arena)[i * src.bytes_per_block : (i + 1) * src.bytes_per_block] for i in range(2)
    ]
    for view, payload in zip(views, src.read_blocks([3, 7]), strict=True):
        view[:] = payload
    dst = KVPool(layers, 10, 4, dtype)
    if uniform_path:
        dst._write_uniform([1, 5], views)
    else:
        dst.write_blocks([1, 5], views)
    arena[:] = bytes(len(arena))  # the next chunk's files land here
    mx.eval(dst.arrays())
    assert same_block(src, 3, dst, 1) and same_block(src, 7, dst, 5)


def test_the_device_path_stages_in_chunks() -> None:
    n = STAGING_BLOCKS + 3  # two chunks
    src = filled(UNIFORM, mx.float16, blocks=n + 2)
    payloads = src.read_blocks(list(range(n)))
    dst = KVPool(UNIFORM, n + 2, 4, mx.float16)
    dst._write_uniform(list(range(2, n + 2)), payloads)  # a GPU's path, run here
    assert all(same_block(src, i, dst, i + 2) for i in range(n))


@pytest.mark.skipif(not cuda_copy.on_cuda(), reason="needs an NVIDIA GPU (MLX's CUDA backend)")
def test_on_cuda_loads_take_the_driver_copy() -> None:
    """On CUDA the staging buffer is pinned and one driver copy moves it into a device array
    (not MLX's page migrations): the path is taken, round-trips exactly, and the device
    array is reused, a second load overwriting the first's rows."""
    n = STAGING_BLOCKS + 5
    src = filled(UNIFORM, mx.float16, blocks=2 * n)
    dst = KVPool(UNIFORM, 2 * n, 4, mx.float16)
    spilled = src.read_blocks(list(range(n, 2 * n)))
    assert src._pinned is not None, "the driver copy was refused (see the warning)"
    assert all(own(p) is p for p in spilled)  # a buffer each: the host tier copies nothing
    dst.write_blocks(list(range(n)), spilled)
    assert dst._pinned is not None
    dst.write_blocks(list(range(n, 2 * n)), src.read_blocks(list(range(n))))
    assert all(same_block(src, n + i, dst, i) and same_block(src, i, dst, n + i) for i in range(n))


def test_off_cuda_there_is_no_driver_copy() -> None:
    if cuda_copy.on_cuda():
        pytest.skip("on CUDA the driver copy is taken")
    assert cuda_copy.pinned_staging(4, 16) is None


def test_bad_payloads_and_blocks_are_refused() -> None:
    pool = filled(UNIFORM, mx.float32)
    good = pool.read_blocks([1])[0]
    with pytest.raises(BatchError):
        pool.write_blocks([2], [bytes(good)[:-1]])
    with pytest.raises(BatchError):
        pool.write_blocks([pool.trash_block], [good])


@pytest.mark.parametrize("n", [0, 1, 3, 17, STAGING_BLOCKS])
def test_fill_rows_copies_each_payload_into_its_row(n) -> None:
    """The staging fill (threaded copies): every row is its payload, bytes and memoryviews
    alike, and rows past the payloads are left alone."""
    rng = np.random.default_rng(n)
    rows = np.full((STAGING_BLOCKS + 1, 40), 7, np.uint8)
    payloads = [rng.integers(0, 256, 40, np.uint8).tobytes() for _ in range(n)]
    payloads = [memoryview(p) if j % 2 else p for j, p in enumerate(payloads)]
    cuda_copy.fill_rows(rows, payloads)
    assert [rows[j].tobytes() for j in range(n)] == [bytes(p) for p in payloads]
    assert (rows[n:] == 7).all()


def test_fill_rows_refuses_what_does_not_fit() -> None:
    rows = np.zeros((2, 8), np.uint8)
    with pytest.raises(ValueError, match="8 bytes each"):
        cuda_copy.fill_rows(rows, [bytes(8), bytes(9)])
    with pytest.raises(ValueError, match="do not fit"):
        cuda_copy.fill_rows(rows, [bytes(8)] * 3)
    with pytest.raises(ValueError, match="do not fit"):
        cuda_copy.fill_rows(np.zeros((4, 8), np.uint8)[:, :4], [bytes(4)])
