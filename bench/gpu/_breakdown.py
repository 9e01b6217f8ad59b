import time, numpy as np, mlx.core as mx
from worker.model.kv_pool import KVPool, STAGING_BLOCKS
from worker.model.spec import LayerSpec
pool = KVPool([LayerSpec(8,64,64)]*16, 512, 32, mx.float16)
per = pool.bytes_per_block; n = 64
rng = np.random.default_rng(0)
payloads = [rng.standard_normal(per//2).astype(np.float16).tobytes() for _ in range(n)]
pool.write_blocks(list(range(n)), payloads)
rows = pool._staging_rows(); td = pool._to_device
s = pool.layers[0]
for it in range(3):
    t0 = time.perf_counter()
    td.fill(payloads)
    t1 = time.perf_counter()
    staged = td.copy(n)
    t2 = time.perf_counter()
    whole = staged.view(pool.dtype).reshape(n, 16, 2, 8, 32, 64)
    ids = mx.array(list(range(n)), dtype=mx.int32)
    for layer in range(16):
        pool._keys[layer][:, ids] = whole[:, layer, 0].transpose(1, 0, 2, 3)
        pool._values[layer][:, ids] = whole[:, layer, 1].transpose(1, 0, 2, 3)
    mx.eval(pool.arrays())
    t3 = time.perf_counter()
    # contiguous first
    c = mx.contiguous(whole.transpose(1, 2, 3, 0, 4, 5)); mx.eval(c)
    t4 = time.perf_counter()
    for layer in range(16):
        pool._keys[layer][:, ids] = c[layer, 0]
        pool._values[layer][:, ids] = c[layer, 1]
    mx.eval(pool.arrays())
    t5 = time.perf_counter()
    print(f"fill {1e3*(t1-t0):.1f} ms, copy {1e3*(t2-t1):.1f}, scatters {1e3*(t3-t2):.1f}; transpose-once {1e3*(t4-t3):.1f} + scatters {1e3*(t5-t4):.1f}")
