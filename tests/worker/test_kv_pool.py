"""The KV pool on its own: slots, partial blocks, copy on write, the trash block, in place."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

from worker.errors import BatchError, PoolConfigError
from worker.model.forward_batch import ForwardBatch, SeqInput
from worker.model.kv_pool import KVPool
from worker.model.spec import LayerSpec, ModelSpec

BS = 4
LAYERS = (LayerSpec(n_kv_heads=2, k_head_dim=3, v_head_dim=5), LayerSpec(1, 2, 2))


def _pool(num_blocks: int = 8) -> KVPool:
    return KVPool(LAYERS, num_blocks, BS)


def _address(a: mx.array) -> int:
    """Where ``a``'s data lives; the numpy view is dropped at once so it shares nothing."""
    view = np.asarray(memoryview(a))
    address = view.__array_interface__["data"][0]
    del view
    return address


def _kv(batch: ForwardBatch, spec: LayerSpec, seed: int) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    shape = (batch.size, spec.n_kv_heads, batch.query_len)
    k = rng.standard_normal((*shape, spec.k_head_dim)).astype(np.float32) + 1
    v = rng.standard_normal((*shape, spec.v_head_dim)).astype(np.float32) + 1
    return mx.array(k), mx.array(v)


def _write(pool: KVPool, seqs: list[SeqInput]) -> tuple[ForwardBatch, list]:
    batch = ForwardBatch(seqs, pool.block_size, pool.num_blocks)
    written = []
    for layer, spec in enumerate(pool.layers):
        k, v = _kv(batch, spec, seed=layer)
        pool.write(layer, batch.write_blocks, batch.write_slots, k, v)
        written.append((np.array(k), np.array(v)))
    mx.eval(pool.arrays())
    return batch, written


def test_writes_land_at_their_slots_across_partial_blocks():
    pool = _pool()
    # a: positions 2..6 -> block 5 slots 2-3, block 1 slots 0-2 (partial first and last block)
    # b: one decode token at position 4 -> block 7 slot 0; its 4 padded rows go to the trash
    seqs = [SeqInput([1] * 5, [5, 1], 2), SeqInput([2], [3, 7], 4)]
    _, written = _write(pool, seqs)
    expected = {(5, 2): (0, 0), (5, 3): (0, 1), (1, 0): (0, 2), (1, 1): (0, 3), (1, 2): (0, 4)}
    expected[(7, 0)] = (1, 0)
    for layer in range(pool.num_layers):
        wk, wv = written[layer]
        for block in range(pool.num_blocks):
            k, v = pool.read_block(layer, block)
            for slot in range(BS):
                if (block, slot) in expected:
                    row, j = expected[(block, slot)]
                    assert np.array_equal(k[:, slot], wk[row, :, j])
                    assert np.array_equal(v[:, slot], wv[row, :, j])
                else:
                    assert not k[:, slot].any() and not v[:, slot].any(), (block, slot)


def test_trash_block_only_takes_padding():
    pool = _pool()
    _write(pool, [SeqInput([1, 2, 3], [0], 0), SeqInput([4, 5, 6], [1], 0)])  # no padding
    k, v = pool.read_block(0, pool.trash_block)
    assert not k.any() and not v.any()
    _write(pool, [SeqInput([1, 2, 3], [2], 0), SeqInput([4], [3], 0)])  # b padded by 2 rows
    k, _ = pool.read_block(0, pool.trash_block)
    assert k.any()


def test_gather_returns_whole_blocks_in_table_order():
    pool = _pool()
    seqs = [SeqInput([1] * 6, [6, 2], 0), SeqInput([1] * 3, [4], 0)]
    batch, _ = _write(pool, seqs)
    keys, values = pool.gather(0, batch.tables)
    assert keys.shape == (2, 2, 2 * BS, 3) and values.shape == (2, 2, 2 * BS, 5)
    k6, _ = pool.read_block(0, 6)
    k2, _ = pool.read_block(0, 2)
    kt, _ = pool.read_block(0, pool.trash_block)
    assert np.array_equal(np.array(keys[0]), np.concatenate([k6, k2], axis=1))
    assert np.array_equal(np.array(keys[1, :, BS:]), kt)  # b's padding column reads the trash


def test_copy_on_write_copies_every_layer_and_leaves_the_source():
    pool = _pool()
    _write(pool, [SeqInput([1] * 7, [3, 6], 0)])
    before = [pool.read_block(layer, 6) for layer in range(pool.num_layers)]
    pool.copy_blocks([(6, 0), (3, 4)])
    for layer in range(pool.num_layers):
        for src, dst in ((6, 0), (3, 4)):
            assert all(
                np.array_equal(a, b)
                for a, b in zip(
                    pool.read_block(layer, src), pool.read_block(layer, dst), strict=True
                )
            )
        assert all(
            np.array_equal(a, b)
            for a, b in zip(before[layer], pool.read_block(layer, 6), strict=True)
        )


@pytest.mark.parametrize(
    "pairs", [[(0, 8)], [(-1, 2)], [(1, 1)], [(1, 2), (3, 2)], [(1, 2), (2, 3)]]
)
def test_copy_on_write_rejects_bad_pairs(pairs):
    with pytest.raises(BatchError):
        _pool().copy_blocks(pairs)


def test_writes_and_copies_stay_in_place():
    pool = _pool(num_blocks=64)
    addresses = [_address(a) for a in pool.arrays()]
    shapes = [a.shape for a in pool.arrays()]
    _write(pool, [SeqInput([1] * 9, [10, 11, 12], 0), SeqInput([2], [20], 3)])
    pool.copy_blocks([(10, 30)])
    assert [_address(a) for a in pool.arrays()] == addresses
    assert [a.shape for a in pool.arrays()] == shapes


def test_a_view_kept_alive_forces_a_copy():
    """The pitfall the pool avoids: a live view makes MLX copy the whole array on write."""
    pool = _pool(num_blocks=64)
    keys, _ = pool.layer_arrays(0)
    before = _address(keys)
    view = keys[:, :1]
    _write(pool, [SeqInput([1], [5], 0)])
    assert _address(pool.layer_arrays(0)[0]) != before
    del view


def test_for_model_sizes_from_a_memory_budget():
    spec = ModelSpec(LAYERS, mx.float32, vocab_size=10)
    per_block = (2 * (3 + 5) + 1 * (2 + 2)) * BS * 4
    pool = KVPool.for_model(spec, block_size=BS, memory_bytes=per_block * 11 + 5)
    assert pool.num_blocks == 10 and pool.bytes_per_block == per_block
    assert pool.nbytes == per_block * 11  # trash block included
    with pytest.raises(PoolConfigError):
        KVPool.for_model(spec, block_size=BS, memory_bytes=per_block)
    with pytest.raises(PoolConfigError):
        KVPool.for_model(spec, block_size=BS, num_blocks=4, memory_bytes=per_block * 8)
    assert KVPool.for_model(spec, block_size=BS, num_blocks=4).num_blocks == 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and mincore")
def test_a_pool_commits_memory_as_blocks_are_written():
    """A 128 MiB pool holds (almost) no memory until blocks are written: each written block
    commits its own pages, the others stay out and read as zeros, and the writes are right."""
    layers = [LayerSpec(4, 64, 64)] * 8  # 512 KiB a block of 32 tokens
    pool = KVPool(layers, 256, 32)
    assert pool.nbytes >= 128 * 2**20
    made = pool.resident_bytes()
    assert made is not None and made < 2**20, f"a new pool holds {made} bytes"
    table = list(range(100, 132))  # 32 blocks: 16 MiB
    _, written = _write(pool, [SeqInput([1] * 1024, table, 0)])
    grown = pool.resident_bytes()
    assert grown is not None
    assert 16 * 2**20 <= grown < 17 * 2**20, f"16 MiB of blocks written, {grown} bytes held"
    for layer in (0, 7):
        k, v = pool.read_block(layer, 101)
        assert np.array_equal(k, written[layer][0][0, :, 32:64])
        assert np.array_equal(v, written[layer][1][0, :, 32:64])
        k, v = pool.read_block(layer, 7)
        assert not k.any() and not v.any()
