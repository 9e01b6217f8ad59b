"""What one kernel compile costs on MLX's CUDA backend, op by op: each op below evaluated once on
small arrays with an empty (or the kept) ``MLX_PTX_CACHE_DIR``, then again in the same process.
Run it twice with the same cache directory to see which modules a restart reads from disk and
which it compiles again (``mx.fast.cuda_kernel`` kernels, for instance).

    MLX_PTX_CACHE_DIR=/tmp/ptx python3 bench/gpu/jit_costs.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import mlx.core as mx

    from worker.model import mlx_lm_light

    mlx_lm_light.register_package()
    from mlx_lm.models.activations import swiglu

    from worker.model.attention import gpu_decode, gpu_gather, gpu_prefill

    f16 = mx.float16
    w = mx.random.normal((1000, 64)).astype(f16)
    idx = mx.array([1, 5, 7], dtype=mx.int32)
    pool = mx.zeros((4, 16, 32, 64), dtype=f16)  # heads, blocks, slots, dim
    x3 = mx.random.normal((4, 3, 64)).astype(f16)
    heads = mx.array([[0], [1], [2], [3]], dtype=mx.int32)
    blocks = mx.array([[2, 2, 3]], dtype=mx.int32)
    slots = mx.array([[0, 1, 0]], dtype=mx.int32)
    g = mx.random.normal((1, 5, 256)).astype(f16)
    u = mx.random.normal((1, 5, 256)).astype(f16)
    tables = mx.array([[2, 3, 4, 5]], dtype=mx.int32)
    ends = mx.array([40], dtype=mx.int32)
    q1 = mx.random.normal((1, 8, 1, 64)).astype(f16)
    q8 = mx.random.normal((1, 8, 8, 64)).astype(f16)
    mx.eval(w, idx, pool, x3, heads, blocks, slots, g, u, tables, ends, q1, q8)

    def scatter() -> mx.array:
        p = mx.array(pool)
        p[heads, blocks, slots] = x3
        return p

    def trivial() -> mx.array:
        kernel = mx.fast.cuda_kernel(
            name=f"kvserve_jit_cost_probe_{os.getpid()}",  # new every run: never cached
            input_names=["a"],
            output_names=["out"],
            source="out[threadIdx.x] = a[threadIdx.x];",
        )
        return kernel(
            inputs=[w.reshape(-1)],
            output_shapes=[(32,)],
            output_dtypes=[f16],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
        )[0]

    ops = [
        ("add (precompiled?)", lambda: w + w),
        ("gather, 1 index (embedding)", lambda: w[idx]),
        ("gather, 2 indices", lambda: pool[heads[:, 0], blocks[0, 1]]),
        ("take along axis", lambda: mx.take_along_axis(w, idx[:, None].astype(mx.int32), 0)),
        ("scatter assign, 3 indices (pool write)", scatter),
        ("compiled swiglu, prefill shape", lambda: swiglu(g, u)),
        ("compiled swiglu, decode shape", lambda: swiglu(g[:, :1], u[:, :1])),
        ("rms_norm", lambda: mx.fast.rms_norm(g, mx.ones((256,), dtype=f16), 1e-5)),
        ("rope", lambda: mx.fast.rope(q8, 64, traditional=False, base=10000.0, scale=1.0, offset=0)),
        ("softmax", lambda: mx.softmax(g, axis=-1)),
        ("argmax", lambda: mx.argmax(g, axis=-1)),
        ("custom kernel, trivial", trivial),
        ("kvserve gather_blocks kernel", lambda: gpu_gather.gather_blocks(pool, tables)),
        ("kvserve decode kernel", lambda: gpu_decode.paged_decode_attention(q1, pool, pool, tables, ends, 0.125)),
        ("kvserve prefill kernel", lambda: gpu_prefill.paged_prefill_attention(q8, pool, pool, tables, ends, 0.125)),
    ]  # fmt: skip
    cache = Path(os.environ.get("MLX_PTX_CACHE_DIR", "/nonexistent"))
    for attempt in ("first", "again"):
        for name, fn in ops:
            before = set(cache.glob("*.ptx")) if cache.is_dir() else set()
            t = time.perf_counter()
            try:
                mx.eval(fn())
                note = ""
            except Exception as e:  # a probe that does not apply here
                note = f"failed: {type(e).__name__}: {str(e)[:80]}"
            dt = time.perf_counter() - t
            new = (set(cache.glob("*.ptx")) if cache.is_dir() else set()) - before
            names = ", ".join(p.stem[:40] for p in sorted(new))
            print(f"{attempt:5s} {name:40s} {dt:7.3f} s  {len(new)} written {names} {note}")


if __name__ == "__main__":
    main()
