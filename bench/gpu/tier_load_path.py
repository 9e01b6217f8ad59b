"""A GPU pool's load path (``KVPool.write_blocks``, what a tier load-back runs) against the
bytes' own transfer, in one run (issue 34: a host tier on a GPU pays only if blocks load
faster than they compute).

Rows: the driver path (a pinned staging buffer, one ``cuMemcpyHtoD`` into a device array,
the scatters; ``worker.model.cuda_copy``), MLX's managed-memory path (an array made from the
host buffer, moved by page migrations on the scatters' first touch; what loads took before),
the driver copy alone, and the spill path (``read_blocks``, the gather and the host's first
read of it). Each load is checked: the blocks read back are the payloads written.

    python bench/gpu/tier_load_path.py --blocks 218 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from worker.model.kv_pool import KVPool
from worker.model.spec import LayerSpec
from worker.tier.store import own


def timed(fn, rounds: int) -> float:
    """Median seconds of ``rounds`` calls, after one untimed call."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=218)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    layers = [LayerSpec(args.kv_heads, args.head_dim, args.head_dim)] * args.layers
    n = args.blocks
    pool = KVPool(layers, 2 * n, args.block_size, mx.float16)
    per = pool.bytes_per_block
    rng = np.random.default_rng(0)
    # Finite fp16 values (random bytes would hold NaNs, which compare unequal).
    payloads = [rng.standard_normal(per // 2).astype(np.float16).tobytes() for _ in range(n)]
    dst = list(range(n))
    nbytes = n * per
    print(f"{mx.default_device()}, {n} blocks of {per / 2**20:.2f} MiB ({nbytes / 1e6:.0f} MB)")

    def check() -> None:
        back = pool.read_blocks(dst)
        bad = sum(bytes(b) != p for b, p in zip(back, payloads, strict=True))
        assert bad == 0, f"{bad} of {n} blocks read back differently"

    def spill() -> None:
        """What a spill costs the model thread: the pool's copy, and a buffer of its own a
        block (the host tier's ``own``)."""
        for p in pool.read_blocks(dst):
            own(p)

    rows = []
    pool.write_blocks(dst, payloads)
    check()
    driver = pool._pinned is not None
    if driver:
        took = timed(lambda: pool.write_blocks(dst, payloads), args.rounds)
        rows.append(("write_blocks, driver copy (default on CUDA)", took))
        copier = pool._pinned
        assert copier is not None
        took = timed(lambda: copier.to_device(copier.host.shape[0]), args.rounds)
        rows.append(
            (f"driver copy alone ({copier.host.shape[0]} blocks)", took, copier.host.nbytes)
        )
        # MLX's managed path: the same pool without the copier, a plain host buffer.
        pool._pinned = None
        pool._staging = np.empty_like(copier.host)
        pool.write_blocks(dst, payloads[::-1])  # different bytes, so the check means it
        pool.write_blocks(dst, payloads)
        check()
        took = timed(lambda: pool.write_blocks(dst, payloads), args.rounds)
        rows.append(("write_blocks, MLX managed memory (before)", took))
        rows.append(
            (
                "read_blocks + host copies (spill), MLX managed memory (before)",
                timed(spill, args.rounds),
            )
        )
        pool._pinned, pool._staging = copier, copier.host
    else:
        took = timed(lambda: pool.write_blocks(dst, payloads), args.rounds)
        rows.append(("write_blocks (no driver copy here)", took))

    rows.append(("read_blocks + host copies (spill)", timed(spill, args.rounds)))
    rows.append(("measure_write_rate (the worker's start-up figure)", 0.0))
    rate = pool.measure_write_rate()

    print("\n| path | ms | GB/s |\n|---|---:|---:|")
    for row in rows:
        name, took = row[0], row[1]
        size = row[2] if len(row) > 2 else nbytes
        if took == 0.0:
            print(f"| {name} | | {rate / 1e9:.2f} |")
        else:
            print(f"| {name} | {took * 1e3:.1f} | {size / took / 1e9:.2f} |")


if __name__ == "__main__":
    main()
