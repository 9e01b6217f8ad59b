"""KVPool.read_blocks / write_blocks (the tiers' copies out of and into the pool): a block's
payload round-trips exactly, into any other block, in every dtype, on every path (the CPU's
in-place copy, the device path's staging and scatter, layers of mixed shapes), and the payload
layout is one format whatever path wrote it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from worker.errors import BatchError
from worker.model.kv_pool import STAGING_BLOCKS, KVPool
from worker.model.spec import LayerSpec

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


def test_the_device_path_stages_in_chunks() -> None:
    n = STAGING_BLOCKS + 3  # two chunks
    src = filled(UNIFORM, mx.float16, blocks=n + 2)
    payloads = src.read_blocks(list(range(n)))
    dst = KVPool(UNIFORM, n + 2, 4, mx.float16)
    dst._write_uniform(list(range(2, n + 2)), payloads)  # a GPU's path, run here
    assert all(same_block(src, i, dst, i + 2) for i in range(n))


def test_bad_payloads_and_blocks_are_refused() -> None:
    pool = filled(UNIFORM, mx.float32)
    good = pool.read_blocks([1])[0]
    with pytest.raises(BatchError):
        pool.write_blocks([2], [bytes(good)[:-1]])
    with pytest.raises(BatchError):
        pool.write_blocks([pool.trash_block], [good])
