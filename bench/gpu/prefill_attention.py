"""Prefill attention over a cached prefix on a GPU: what gathering the prefix out of the pool costs.

A forward with more than 17 queries a sequence (a prefill chunk, or a request's own tokens after
a cached prefix) does not take the block-table decode kernel: each layer gathers every
sequence's whole blocks into a dense copy (``KVPool.gather``) and runs mlx-lm's attention,
``mx.fast.scaled_dot_product_attention`` (cuDNN on an NVIDIA GPU) with the batch's mask
(``ForwardBatch.mask``: ``"causal"`` where every sequence ends on a block boundary, else a
boolean array). Per layer, in microseconds (medians), this script times:

- **gather**: that path under the mask (the pool write excluded: every path pays it); the
  gather is ``KVPool.gather``: on an NVIDIA GPU a copy kernel
  (``gpu_gather.gather_blocks``), elsewhere MLX's indexing (timed alone in the last
  columns, with a ``take``-based alternative);
- **exact**: the gathered context without the array mask, one ``"causal"`` call per group of
  sequences with the same queries and context (``cuda.exact_context_attention``,
  what the worker runs now on an NVIDIA GPU for calls of more than 17 queries);
- **float mask**: the gather path with the mask as an additive fp16 array (0 / -inf) instead
  of a boolean one;
- **dense**: SDPA over contiguous K/V that are already in place, each sequence's exact
  context, ``"causal"`` (bottom-right): the floor a block-table prefill kernel would approach;
- **kernel**: the block-table decode kernel (``gpu_decode.paged_decode_attention``) handed
  all the queries. It serves 8 query rows a thread block and each block re-reads the context,
  so it is not made for this; it shows what the CUDA cores alone give here.

Cases: one long prompt's 2,048-token chunk at prefixes 0-30k; 32 requests whose own 40 tokens
follow one shared 8k prefix (the same pool blocks: the "followers" of a shared-prefix burst);
8 requests of 512 tokens over 4k contexts each. 32 query / 8 KV heads, head dim 64 (the 1B
benchmark model) and 128, fp16, block size 32, blocks in random order. Contexts end off block
boundaries, as they do in serving. Also the first call of each path in a case (a new shape:
cuDNN builds a graph for it, which a serving worker pays on a request).

    python3 bench/gpu/prefill_attention.py          # on the GPU machine
    .venv/bin/python bench/gpu/prefill_attention.py --cpu-dry-run   # checks the script only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
import numpy as np
from bench_models import gpu_name  # type: ignore[import-not-found]

from worker.model import device as devices
from worker.model.attention import cuda, gpu_decode
from worker.model.forward_batch import ForwardBatch, SeqInput
from worker.model.kv_pool import KVPool
from worker.model.spec import LayerSpec

BLOCK_SIZE = 32


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    prefix: int  # tokens already in the pool for each sequence
    own: int  # queries a sequence computes now
    shared: bool  # every sequence's prefix is the same pool blocks
    head_dim: int = 64
    heads: int = 32
    kv_heads: int = 8


CASES = [
    Case("one prompt, chunk at 0", 1, 0, 2048, False),
    Case("one prompt, chunk at 8k", 1, 8000, 2048, False),
    Case("one prompt, chunk at 30k", 1, 30000, 2048, False),
    Case("32 followers of an 8k prefix", 32, 8000, 40, True),
    Case("8 x 512 over 4k", 8, 3600, 512, False),
    Case("one prompt, chunk at 8k, d128", 1, 8000, 2048, False, 128),
    Case("32 followers of an 8k prefix, d128", 32, 8000, 40, True, 128),
]
DRY_CASES = [
    Case("one prompt", 1, 100, 40, False, 16, 4, 2),
    Case("followers", 4, 90, 20, True, 16, 4, 2),
]


def first_call(fn: Callable[[], mx.array]) -> float:
    """Microseconds of ``fn``'s first call: a new shape, cuDNN builds its graph."""
    start = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - start) * 1e6


def timed(fn: Callable[[], mx.array], repeat: int) -> float:
    """Median microseconds of ``fn`` after three calls to warm it."""
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def paged_case(c: Case, dtype: mx.Dtype, rng: np.random.Generator) -> tuple[KVPool, ForwardBatch]:
    """A one-layer pool of random K/V holding ``c``'s contexts in shuffled blocks (followers
    share the prefix's blocks), and the forward batch of its own tokens."""
    per_seq = -(-(c.prefix + c.own) // BLOCK_SIZE)
    shared_blocks = c.prefix // BLOCK_SIZE if c.shared else 0
    own_blocks = per_seq - shared_blocks
    num_blocks = shared_blocks + c.batch * own_blocks
    order = rng.permutation(num_blocks).tolist()
    common, rest = order[:shared_blocks], order[shared_blocks:]
    tables = [common + rest[i * own_blocks : (i + 1) * own_blocks] for i in range(c.batch)]
    pool = KVPool([LayerSpec(c.kv_heads, c.head_dim, c.head_dim)], num_blocks, BLOCK_SIZE, dtype)
    k_pool, v_pool = pool.layer_arrays(0)
    k_pool[...] = (mx.random.normal(k_pool.shape) * 0.5).astype(dtype)
    v_pool[...] = mx.random.normal(v_pool.shape).astype(dtype)
    mx.eval(k_pool, v_pool)
    seqs = [SeqInput([1] * c.own, t, c.prefix) for t in tables]
    return pool, ForwardBatch(seqs, BLOCK_SIZE, num_blocks)


def run_case(c: Case, dtype: mx.Dtype, repeat: int, kernel: bool) -> tuple[dict[str, float], bool]:
    """Per-layer microseconds of each path (``*_cold``: first calls), and whether the batch's
    mask is an array."""
    rng = np.random.default_rng(c.batch * 100_003 + c.prefix + c.own)
    ctx = c.prefix + c.own
    per_seq = -(-ctx // BLOCK_SIZE)
    pool, batch = paged_case(c, dtype, rng)
    k_pool, v_pool = pool.layer_arrays(0)
    mask = batch.mask()
    q = (mx.random.normal((c.batch, c.heads, c.own, c.head_dim)) * 2.0).astype(dtype)
    scale = c.head_dim**-0.5
    # Dense: each sequence's exact context, contiguous, as a dense cache holds it.
    k_dense = (mx.random.normal((c.batch, c.kv_heads, ctx, c.head_dim)) * 0.5).astype(dtype)
    v_dense = mx.random.normal((c.batch, c.kv_heads, ctx, c.head_dim)).astype(dtype)
    mx.eval(q, k_dense, v_dense)

    def gathered() -> mx.array:
        k, v = pool.gather(0, batch.tables)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    def dense() -> mx.array:
        return mx.fast.scaled_dot_product_attention(q, k_dense, v_dense, scale=scale, mask="causal")

    def exact() -> mx.array:
        k, v = pool.gather(0, batch.tables)
        return cuda.exact_context_attention(q, k, v, batch, scale)

    def take_gather() -> tuple[mx.array, mx.array]:
        # One index per block along the pool's block axis, then a view in [B, heads, L, dim]
        # order (no copy): what KVPool.gather would be with a simpler gather.
        flat = batch.tables.reshape(-1)
        h, _, bs, d = k_pool.shape
        shape = (h, c.batch, batch.key_blocks * bs, d)
        k, v = (mx.take(p, flat, axis=1).reshape(shape).swapaxes(0, 1) for p in (k_pool, v_pool))
        return k, v

    def exact_take() -> mx.array:
        k, v = take_gather()
        return cuda.exact_context_attention(q, k, v, batch, scale)

    def gather_only() -> mx.array:
        return mx.stack(pool.gather(0, batch.tables))

    heads = mx.arange(c.kv_heads)[None, :, None]

    def fancy_only() -> mx.array:  # KVPool.gather before the copy kernel
        return mx.stack([k_pool[heads, batch.tables], v_pool[heads, batch.tables]])

    def take_only() -> mx.array:
        k, v = take_gather()
        return mx.stack([k, v])  # a copy in batch order, as a consumer needing it would make

    new = (mx.random.normal((c.batch, c.kv_heads, c.own, c.head_dim)) * 0.5).astype(dtype)
    mx.eval(new)

    def write() -> mx.array:
        pool.write(0, batch.write_blocks, batch.write_slots, new, new)
        return mx.stack([k_pool[0, 0, 0], v_pool[0, 0, 0]])

    additive = None if isinstance(mask, str) else mx.where(mask, 0.0, -mx.inf).astype(dtype)

    def float_mask() -> mx.array:
        k, v = pool.gather(0, batch.tables)
        return mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask=mask if additive is None else additive
        )

    paths = {"gather": gathered, "float": float_mask, "exact": exact, "dense": dense}
    out = {f"{name}_cold": first_call(fn) for name, fn in paths.items()}
    out.update({name: timed(fn, repeat) for name, fn in paths.items()})
    out.update(
        {
            "write": timed(write, repeat),
            "exact_take": timed(exact_take, repeat),
            "gather_only": timed(gather_only, repeat),
            "take_only": timed(take_only, repeat),
            "fancy_only": timed(fancy_only, repeat),
        }
    )
    k_take, _ = take_gather()
    k_fancy, _ = pool.gather(0, batch.tables)
    assert mx.array_equal(k_take, k_fancy), "the take gather reads other blocks"
    if not isinstance(mask, str) and mask is not None:
        real = [(i, n) for i, n in enumerate(batch.query_lens.tolist())]
        got, want = exact(), gathered()
        out["exact_err"] = max(
            float(mx.abs(got[i, :, :n] - want[i, :, :n]).astype(mx.float32).max()) for i, n in real
        )
    if kernel:
        tab, ends, q_lens = batch.kernel_inputs()

        def block_table() -> mx.array:
            return gpu_decode.paged_decode_attention(
                q, k_pool, v_pool, tab, ends, scale, None, q_lens
            )

        # Same answer as the gather path before it is timed.
        diff = mx.abs(block_table().astype(mx.float32) - gathered().astype(mx.float32)).max()
        out["kernel_err"] = float(diff.item())
        out["kernel"] = timed(block_table, repeat)
    gathered_bytes = 2 * c.batch * per_seq * BLOCK_SIZE * c.kv_heads * c.head_dim * dtype.size
    out["gathered_mb"] = gathered_bytes / 1e6
    return out, isinstance(mask, mx.array)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    gpu = mx.default_device() == mx.gpu
    if not gpu and not a.cpu_dry_run:
        sys.exit("no GPU here: run it on the GPU machine (--cpu-dry-run checks the script)")
    cases = DRY_CASES if a.cpu_dry_run else CASES
    dtype = mx.float32 if a.cpu_dry_run else mx.float16
    kernel = devices.cuda_available()
    where = gpu_name() if gpu else "CPU dry run"
    print(f"# {where}, MLX {mx.__version__}, {str(dtype).rsplit('.', 1)[-1]}, per layer\n")
    print(
        "| case | batch x (prefix + own) | mask | gathered MB | gather us | float mask us "
        "| exact us | dense us | gather / dense | float / dense | exact / dense | kernel us "
        "| kernel / dense | pool write us | first call ms: gather, float, exact, dense "
        "| exact over take us | gather alone us | take + copy us | MLX indexing alone us |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in cases:
        r, masked = run_case(c, dtype, 3 if a.cpu_dry_run else a.repeat, kernel)
        k = f"{r['kernel']:,.0f} | {r['kernel'] / r['dense']:.2f}" if "kernel" in r else "- | -"
        print(
            f"| {c.name} | {c.batch} x ({c.prefix:,} + {c.own:,}) | "
            f"{'array' if masked else 'causal'} | {r['gathered_mb']:,.0f} | "
            f"{r['gather']:,.0f} | {r['float']:,.0f} | {r['exact']:,.0f} | {r['dense']:,.0f} | "
            f"{r['gather'] / r['dense']:.2f} | {r['float'] / r['dense']:.2f} | "
            f"{r['exact'] / r['dense']:.2f} | {k} | {r['write']:,.0f} | "
            + ", ".join(
                f"{r[n + '_cold'] / 1e3:.1f}" for n in ("gather", "float", "exact", "dense")
            )
            + f" | {r['exact_take']:,.0f} | {r['gather_only']:,.0f} | {r['take_only']:,.0f} | "
            f"{r['fancy_only']:,.0f} |",
            flush=True,
        )
        if r.get("exact_err", 0.0) > 2e-2:
            print(f"  exact differs from the masked path by {r['exact_err']:.3g}")
        if "kernel_err" in r and r["kernel_err"] > 2e-2:
            print(f"  kernel differs from the gather path by {r['kernel_err']:.3g}")


if __name__ == "__main__":
    main()
