"""The block-table decode kernel alone at the GPU benchmark model's decode shape, by variant.

32 sequences of ~8,000 tokens, 32 query heads over 8 KV heads of dim 64, fp16, block size 32:
one layer of the ~1B llama that ``decode_parts.py`` measures (45,056 bytes of K/V a token over
22 layers). Times the tensor-core and the CUDA-core variants of
``gpu_decode.paged_decode_attention`` (each call alone, and 22 chained as the layers of a
forward), with the sequences' blocks shuffled in a pool of just their size ("compact") and
scattered over a pool as large as the worker's at that batch ("spread", ``--pool-gb``), against
the time to read the same bytes (MLX's sum over the pool) and the bandwidth floor.

    python3 bench/gpu/decode_kernel.py
    ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section Occupancy --section WarpStateStats python3 bench/gpu/decode_kernel.py --profile

``--profile`` runs one call of each variant between ``cuProfilerStart`` and ``cuProfilerStop``.
Without a GPU it checks its own logic on a tiny shape (``--cpu-dry-run``: the kernel is the
float64 reference there, times mean nothing).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx
import numpy as np
from check_attention import timed  # type: ignore[import-not-found]  # (beside this file)

from worker.model.attention import gpu_decode
from worker.model.forward_batch import ForwardBatch, SeqInput

LAYERS = 22


def build(b: int, ctx: int, h: int, hq: int, d: int, bs: int, pool_blocks: int, seed: int = 0):
    """Queries, pool arrays and kernel inputs: ``b`` sequences of ``ctx - 0..7`` tokens on
    distinct random blocks of a ``pool_blocks``-block pool."""
    rng = np.random.default_rng(seed)
    lens = [ctx - int(x) for x in rng.integers(0, 8, b)]
    need = [-(-n // bs) for n in lens]
    ids = rng.choice(pool_blocks, size=sum(need), replace=False).tolist()
    seqs, at = [], 0
    for n, k in zip(lens, need, strict=True):
        seqs.append(SeqInput([0], ids[at : at + k], n - 1))
        at += k
    batch = ForwardBatch(seqs, bs, pool_blocks)
    tables, ends, q_lens = batch.kernel_inputs()
    keys = mx.random.split(mx.random.key(seed), 3)
    shape = (h, pool_blocks, bs, d)
    pool_k = mx.random.normal(shape, key=keys[0]).astype(mx.float16)
    pool_v = mx.random.normal(shape, key=keys[1]).astype(mx.float16)
    q = mx.random.normal((b, hq, 1, d), key=keys[2]).astype(mx.float16)
    mx.eval(pool_k, pool_v, q, tables, ends, q_lens)
    kv_bytes = 2 * sum(lens) * h * d * 2
    return q, pool_k, pool_v, tables, ends, q_lens, kv_bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--pool-gb", type=float, default=11.58, help="the spread pool's K+V, GB")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--profile", action="store_true", help="one call per variant, for ncu")
    ap.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    b, ctx, h, hq, d, bs = (args.batch, args.context, args.kv_heads, args.q_heads,
                            args.head_dim, args.block_size)  # fmt: skip
    if args.cpu_dry_run:
        b, ctx, h, hq, args.pool_gb, args.repeats = 2, 300, 2, 8, 0.01, 2
        gpu_decode._kernel = _stand_in  # type: ignore[assignment]
    per_block = 2 * h * bs * d * 2
    compact = b * -(-ctx // bs) + 1
    spread = max(compact, int(args.pool_gb * 1e9 / per_block))
    scale = d**-0.5
    print(f"mlx {mx.__version__}, {mx.default_device()}; {b} x ~{ctx}, {hq} q / {h} KV heads, "
          f"D {d}, fp16, block size {bs}", flush=True)  # fmt: skip
    print("| pool | variant | splits | one call | GB/s | 22 chained, per call | GB/s |")
    print("|---|---|---|---|---|---|---|")
    profiled = []
    for label, blocks in (
        ("compact", compact),
        (f"spread ({spread * per_block / 1e9:.1f} GB)", spread),
    ):
        q, pool_k, pool_v, tables, ends, q_lens, kv = build(b, ctx, h, hq, d, bs, blocks)
        for kern in ("tc", "core"):

            def call(x, kern=kern, pool_k=pool_k, pool_v=pool_v, tables=tables, ends=ends,
                     q_lens=q_lens):  # fmt: skip
                return gpu_decode.paged_decode_attention(
                    x, pool_k, pool_v, tables, ends, scale, None, q_lens, kernel=kern
                )

            if args.profile:
                mx.eval(call(q))
                profiled.append((call, q))
                continue
            one = timed(call, q, 1, args.repeats)
            chained = timed(call, q, LAYERS, max(3, args.repeats // 3))
            splits = gpu_decode.splits_for(q, pool_k, tables.shape[1], None, kern)
            print(f"| {label} | {kern} | {splits} | {one * 1e6:.0f} us | {kv / one / 1e9:,.0f} | "
                  f"{chained * 1e6:.0f} us | {kv / chained / 1e9:,.0f} |", flush=True)  # fmt: skip
        if not args.profile:
            total = pool_k.nbytes + pool_v.nbytes
            t = timed(lambda x, pool_k=pool_k: x + pool_k.sum() * 0, q, 1, args.repeats)
            print(f"| {label} | MLX sum over the K pool (read only) | | {t * 1e6:.0f} us | "
                  f"{pool_k.nbytes / t / 1e9:,.0f} | | |  (pool K+V {total / 1e9:.2f} GB)",
                  flush=True)  # fmt: skip
        del pool_k, pool_v
        mx.clear_cache()
    if profiled:
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuProfilerStart()
        for call, q in profiled:
            mx.eval(call(q))
        mx.synchronize()
        cuda.cuProfilerStop()
        print(f"{len(profiled)} calls profiled (compact tc, core; spread tc, core)")
    return 0


def _stand_in(backend: str, kind: str, tc: bool = False):  # type: ignore[no-untyped-def]
    """--cpu-dry-run: zeros of the kernel's output shapes."""

    def call(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):  # type: ignore[no-untyped-def]
        return [mx.zeros(s, t) for s, t in zip(output_shapes, output_dtypes, strict=True)]

    return call


if __name__ == "__main__":
    sys.exit(main())
