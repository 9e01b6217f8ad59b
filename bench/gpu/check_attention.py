"""Correctness and speed of the GPU block-table decode attention, in one run on an NVIDIA GPU.

``worker.model.gpu_decode.paged_decode_attention`` (``mx.fast.cuda_kernel``) against:

(a) float64 numpy (``gpu_decode.reference_attention``) and gather-then-SDPA (the worker's
    GPU path before the kernel: ``KVPool.gather`` then ``mx.fast.scaled_dot_product_attention``
    with the batch's own mask) on random pools with shuffled block ids: batch 1-64, context
    1-32k (lengths off block boundaries, mixed lengths in a batch), head dims 64/128/256, GQA
    1/4/8 (and 2), sliding windows, 1, 5 and 17 queries a sequence (speculative verify, some
    with fewer real queries than others), fp16/bf16/fp32, block sizes 8/16/32, each case with the
    automatic number of splits and with one other (so both the one-split kernel and the
    split-then-merge pair run). Max abs error per case against a per-dtype tolerance; a
    corrupted block table as a negative control.
(b) speed: decode attention at batch 1/8/32 x context 1k/4k/16k, 32 query / 8 KV heads, head
    dim 128, fp16, block size 32 (the worker's default), blocks in random order, against dense
    SDPA on contiguous K/V and against gather-then-SDPA; then a sweep of the split count.
(c) greedy tokens: tiny random models of several families (``tests/worker/helpers.py``) and a
    larger llama (head dim 128, GQA 4, fp16) through the worker's ``ModelRunner`` with the
    kernel, against mlx-lm's dense path, decodes and 5-token verify forwards (in fp16 its
    prefill takes the block-table prefill kernel, ``worker.model.gpu_prefill``).
(d) the prefill kernel against the float64 reference on its own cases, then its speed and
    first calls (``prefill_kernel.py``, which also runs alone; ``--skip-prefill`` leaves it out).

Usage (on the GPU machine): ``python3 bench/gpu/check_attention.py [--skip-bench]``; exits
non-zero if any check fails. ``--cpu-dry-run`` runs the script's own logic on a CPU with the
float64 reference standing in for the kernel and small shapes (it checks the script, not the
kernel).
"""

from __future__ import annotations

import argparse
import functools
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

from worker.model import mlx_fixes
from worker.model.attention import device_backend, gpu_decode, gpu_prefill
from worker.model.forward_batch import ForwardBatch, SeqInput

# Largest abs error accepted against float64, as a fraction of max(1, max |reference|).
# Inputs are exact in every dtype (the reference reads the same rounded values); the kernel
# accumulates in fp32, so its error is the final rounding of the output to the dtype (at most
# half an ulp: 2^-11 fp16, 2^-8 bf16) plus fp32 summation and exp2 error (~1e-6 over 32k keys).
# The tolerance is 2 ulps of the dtype (4x the rounding bound); fp32 gets 1e-4. A key read from
# the wrong block or let through the mask moves the output by O(0.1-1) with these peaked scores
# (query std 2.5, score std ~2.5): the negative control below.
TOLERANCE = {mx.float32: 1e-4, mx.float16: 2 * 2.0**-10, mx.bfloat16: 2 * 2.0**-7}
Q_STD = 2.5
NAMES = {mx.float16: "fp16", mx.bfloat16: "bf16", mx.float32: "fp32"}


@dataclass
class Case:
    dtype: mx.Dtype
    d: int
    rep: int
    h: int
    lengths: list[int]
    nq: int = 1
    q_lens: list[int] | None = None
    window: int | None = None
    bs: int = 32

    def describe(self) -> str:
        lens = self.lengths
        shown = (
            ",".join(map(str, lens))
            if len(lens) <= 4
            else f"{len(lens)} in {min(lens)}..{max(lens)}"
        )
        ql = "" if self.q_lens is None else f" qlens {','.join(map(str, self.q_lens))}"
        return (
            f"{NAMES[self.dtype]} D{self.d} GQA{self.rep} H{self.h} bs{self.bs} "
            f"B{len(lens)} ctx[{shown}] Nq{self.nq}{ql} win {self.window}"
        )


def cases(rng: np.random.Generator, small: bool) -> list[Case]:
    out = []
    f16, bf16, f32 = mx.float16, mx.bfloat16, mx.float32
    for dtype in (f16, bf16, f32):
        for d in (64, 128, 256):
            for rep in (1, 4, 8):
                out.append(Case(dtype, d, rep, 2, [1, 33, 500, 777]))
    mixed64 = rng.integers(1, 4097, 64).tolist()
    big = [
        Case(f16, 128, 4, 8, [4096] * 8),  # the benchmark's target shape
        Case(f16, 128, 4, 8, [32768]),
        Case(bf16, 128, 4, 8, [32768, 20001]),
        Case(f16, 128, 4, 8, mixed64),
        Case(f32, 64, 8, 1, [5000, 4999], bs=16),
        Case(f16, 128, 4, 8, [77, 1000, 31, 32, 33], bs=8),
        Case(f16, 128, 4, 8, [9000, 4097, 100], window=4096),
        Case(bf16, 256, 2, 4, [1, 40, 1500], window=1),
        Case(f16, 256, 2, 4, [3000, 2000], nq=5, window=512),
        Case(f16, 128, 4, 8, [2048] * 4, nq=5),  # "causal"
        Case(f32, 128, 8, 2, [300, 1000, 17], nq=5, q_lens=[5, 3, 1]),
        Case(bf16, 64, 1, 4, [100, 260], nq=17),
        Case(f16, 128, 8, 2, [700, 64], nq=17, q_lens=[17, 9], window=100),
        Case(f16, 64, 8, 4, [8000 - i for i in range(32)]),  # the 1B model's decode at 8k
        Case(bf16, 64, 8, 4, [3000, 129], nq=2, window=700, bs=16),  # 16 rows: one tensor tile
        Case(f16, 128, 4, 2, [1, 15, 16, 17, 4000], bs=16),
    ]
    if small:
        big = [
            Case(c.dtype, c.d, c.rep, min(c.h, 2), [min(n, 300) for n in c.lengths[:6]], c.nq,
                 c.q_lens if c.q_lens is None else c.q_lens[:6], c.window, c.bs)
            for c in big
        ]  # fmt: skip
    return out + big


def build(case: Case, rng: np.random.Generator):
    """A random pool with the case's sequences at shuffled blocks, and the worker's batch
    metadata for them (``ForwardBatch``: tables, lengths, masks)."""
    q_lens = case.q_lens or [case.nq] * len(case.lengths)
    need = [-(-n // case.bs) for n in case.lengths]
    num_blocks = sum(need) + 5
    order = rng.permutation(num_blocks).tolist()
    seqs, at = [], 0
    for n, k, ql in zip(case.lengths, need, q_lens, strict=True):
        seqs.append(SeqInput([0] * ql, order[at : at + k], n - ql))
        at += k
    batch = ForwardBatch(seqs, case.bs, num_blocks)
    shape = (case.h, num_blocks + 1, case.bs, case.d)
    key = mx.random.key(int(rng.integers(1 << 30)))
    k1, k2, k3 = mx.random.split(key, 3)
    pool_k = mx.random.normal(shape, key=k1).astype(case.dtype)
    pool_v = mx.random.normal(shape, key=k2).astype(case.dtype)
    q = Q_STD * mx.random.normal((batch.size, case.h * case.rep, batch.query_len, case.d), key=k3)
    q = q.astype(case.dtype)
    mx.eval(pool_k, pool_v, q)
    return batch, pool_k, pool_v, q


def gathered_sdpa(batch: ForwardBatch, pool_k, pool_v, q, scale: float, window: int | None):
    """The worker's GPU path without the kernel: ``KVPool.gather``, then SDPA with the mask
    the batch gives mlx-lm."""
    h = pool_k.shape[0]
    heads = mx.arange(h)[None, :, None]
    k = pool_k[heads, batch.tables].reshape(batch.size, h, batch.key_len, -1)
    v = pool_v[heads, batch.tables].reshape(batch.size, h, batch.key_len, -1)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=batch.mask(window))


def as_f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def check(small: bool, start: int = 0, stop: int = 1000) -> bool:
    rng = np.random.default_rng(0)
    print("## (a) kernel vs float64 numpy and vs gather-then-SDPA")
    print(
        "tolerance: max abs error <= c * max(1, max|ref|), c = "
        + ", ".join(f"{NAMES[t]} {c:.3g}" for t, c in TOLERANCE.items())
    )
    print(
        "| case | kernel | splits | kernel vs f64 | tol | SDPA vs f64 | kernel vs SDPA | ok | (wall)\n"
        "|---|---|---|---|---|---|---|---|"
    )
    ok = True
    worst: dict[str, float] = {}
    control = None
    for index, case in enumerate(cases(rng, small)):
        if not start <= index < stop:
            continue
        began = time.perf_counter()
        batch, pool_k, pool_v, q = build(case, rng)
        tables, ends, q_lens = batch.kernel_inputs()
        scale = case.d**-0.5
        ref = gpu_decode.reference_attention(
            as_f32(q), as_f32(pool_k), as_f32(pool_v), np.array(tables), np.array(ends),
            scale, case.window, np.array(q_lens),
        )  # fmt: skip
        tol = TOLERANCE[case.dtype] * max(1.0, float(np.abs(ref).max()))
        sdpa = as_f32(gathered_sdpa(batch, pool_k, pool_v, q, scale, case.window))
        sdpa_err = float(np.abs(sdpa - ref).max())
        kernels = ["tc", "core"] if gpu_decode.uses_tensor_cores(pool_k) else ["core"]
        runs = []
        for kern in kernels:
            auto = gpu_decode.splits_for(q, pool_k, batch.key_blocks, case.window, kern)
            runs += [(kern, auto), (kern, 1 if auto > 1 else min(3, batch.key_blocks))]
        for kern, splits in runs:
            # An output the kernel leaves unwritten shows.
            mlx_fixes.dirty_buffer_cache(q, pool_k, pool_v, tables, ends, q_lens)
            got = as_f32(
                gpu_decode.paged_decode_attention(
                    q, pool_k, pool_v, tables, ends, scale, case.window, q_lens, splits=splits,
                    kernel=kern,
                )
            )  # fmt: skip
            err = float(np.abs(got - ref).max())
            vs_sdpa = float(np.abs(got - sdpa).max())
            good = bool(err <= tol and np.isfinite(got).all())
            ok &= good
            name = NAMES[case.dtype]
            worst[name] = max(worst.get(name, 0.0), err)
            print(
                f"| {case.describe()} | {kern} | {splits} | {err:.3g} | {tol:.3g} | {sdpa_err:.3g} | "
                f"{vs_sdpa:.3g} | {'ok' if good else 'FAIL'} | {time.perf_counter() - began:.1f} s",
                flush=True,
            )
        if control is None and case.dtype == mx.float16 and max(case.lengths) >= 1000:
            bad = np.array(tables)
            bad[0, 1] = np.array(tables)[0, 2]  # block 1 of sequence 0 read from elsewhere
            got = as_f32(
                gpu_decode.paged_decode_attention(
                    q, pool_k, pool_v, mx.array(bad), ends, scale, case.window, q_lens
                )
            )
            control = (case.describe(), float(np.abs(got - ref).max()), tol)
    print("worst kernel error per dtype:", {k: f"{v:.3g}" for k, v in worst.items()})
    if control is not None:
        name, err, tol = control
        caught = err > 10 * tol
        ok &= caught
        print(
            f"negative control (one table entry wrong, {name}): error {err:.3g} vs tol "
            f"{tol:.3g}: {'caught' if caught else 'NOT CAUGHT'}"
        )
    print("(a):", "PASS" if ok else "FAIL", flush=True)
    return ok


def timed(fn: Callable[[mx.array], mx.array], q: mx.array, chain: int, repeats: int) -> float:
    """Seconds per call: ``chain`` calls, each on the previous one's output (as layers
    follow each other in a forward), evaluated together; median of ``repeats``."""

    def run() -> None:
        x = q
        for _ in range(chain):
            x = fn(x)
        mx.eval(x)

    run()
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) / chain)
    return statistics.median(times)


def bench(small: bool) -> None:
    """Decode attention at a few shapes: the kernel's two variants (tensor cores, CUDA cores)
    against dense SDPA on contiguous K/V and gather-then-SDPA, then the tensor-core variant's
    split count and pipeline (warps, stages)."""
    dtype, bs = mx.float16, 32
    # (label, KV heads, query heads, head dim, [(batch, context)])
    models = [
        ("32 q / 8 KV heads, D 128", 8, 32, 128, [(b, c) for b in (1, 8, 32) for c in (1024, 4096, 16384)]),
        ("32 q / 4 KV heads, D 64 (GQA 8)", 4, 32, 64, [(1, 4096), (8, 4096), (32, 1024), (32, 8000)]),
        ("16 q / 16 KV heads, D 64 (no GQA)", 16, 16, 64, [(8, 4096), (32, 4096)]),
    ]  # fmt: skip
    if small:
        models = [("small", 2, 8, 64, [(1, 256), (2, 512)])]
    chain, repeats = (2, 2) if small else (10, 7)
    rng = np.random.default_rng(1)
    for label, h, hq, d, shapes in models:
        scale = d**-0.5
        print(f"\n## (b) decode attention, {label}, fp16, block size {bs}")
        print(
            "| batch x context | dense SDPA | gather then SDPA | tensor cores | CUDA cores | "
            "tc / dense | core / dense | tc / core | splits tc, core | tc GB/s | core GB/s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|"
        )
        for b, ctx in shapes:
            n = -(-ctx // bs)
            num_blocks = b * n
            order = rng.permutation(num_blocks)
            seqs = [SeqInput([0], order[i * n : (i + 1) * n].tolist(), ctx - 1) for i in range(b)]
            batch = ForwardBatch(seqs, bs, num_blocks)
            tables, ends, q_lens = batch.kernel_inputs()
            keys = mx.random.split(mx.random.key(b * ctx), 3)
            pool_k = mx.random.normal((h, num_blocks + 1, bs, d), key=keys[0]).astype(dtype)
            pool_v = mx.random.normal((h, num_blocks + 1, bs, d), key=keys[1]).astype(dtype)
            q = mx.random.normal((b, hq, 1, d), key=keys[2]).astype(dtype)
            heads = mx.arange(h)[None, :, None]
            k_dense = pool_k[heads, batch.tables].reshape(b, h, n * bs, d)[:, :, :ctx]
            v_dense = pool_v[heads, batch.tables].reshape(b, h, n * bs, d)[:, :, :ctx]
            mx.eval(pool_k, pool_v, q, k_dense, v_dense, tables, ends, q_lens)

            def dense(x, k_dense=k_dense, v_dense=v_dense, scale=scale):
                return mx.fast.scaled_dot_product_attention(x, k_dense, v_dense, scale=scale)

            def gather(x, batch=batch, pool_k=pool_k, pool_v=pool_v, scale=scale):
                return gathered_sdpa(batch, pool_k, pool_v, x, scale, None)

            variant = functools.partial(_variant, (pool_k, pool_v, tables, ends, q_lens), scale)
            t_dense = timed(dense, q, chain, repeats)
            t_gather = timed(gather, q, chain, repeats)
            t_tc = timed(variant("tc"), q, chain, repeats)
            t_core = timed(variant("core"), q, chain, repeats)
            s_tc = gpu_decode.splits_for(q, pool_k, n, None, "tc")
            s_core = gpu_decode.splits_for(q, pool_k, n, None, "core")
            kv = 2 * b * h * ctx * d * dtype.size
            print(
                f"| {b} x {ctx} | {t_dense * 1e6:.0f} us | {t_gather * 1e6:.0f} us | "
                f"{t_tc * 1e6:.0f} us | {t_core * 1e6:.0f} us | {t_tc / t_dense:.2f} | "
                f"{t_core / t_dense:.2f} | {t_tc / t_core:.2f} | {s_tc}, {s_core} | "
                f"{kv / t_tc / 1e9:.0f} | {kv / t_core / 1e9:.0f} |",
                flush=True,
            )
            if (b >= 8 and ctx >= 4096) or small:
                line = []
                for s in (1, 2, 4, 8, 16, 32):
                    if s <= n // 4:
                        t = timed(variant("tc", splits=s), q, chain, repeats)
                        line.append(f"{s}{'*' if s == s_tc else ''}: {t * 1e6:.0f}")
                print(f"  tensor cores by splits (us; * automatic): {', '.join(line)}")
                line = []
                for nw, st in ((4, 2), (2, 2), (2, 3), (1, 2), (1, 3), (1, 4)):
                    if nw * st * 2 * gpu_decode.TC_KEYS * (d + 8) * 2 > 48 * 1024:
                        continue
                    t = timed(variant("tc", warps=nw, stages=st), q, chain, repeats)
                    line.append(f"{nw}w x {st}st: {t * 1e6:.0f}")
                print(f"  tensor cores by warps x stages (us): {', '.join(line)}", flush=True)
            del k_dense, v_dense, pool_k, pool_v, variant


def _variant(
    arrays: tuple[mx.array, ...],
    scale: float,
    kern: str,
    splits: int | None = None,
    warps: int | None = None,
    stages: int | None = None,
) -> Callable[[mx.array], mx.array]:
    """One decode kernel variant over ``arrays`` (pool K, V, tables, ends, query lengths)."""
    pool_k, pool_v, tables, ends, q_lens = arrays

    def f(x: mx.array) -> mx.array:
        return gpu_decode.paged_decode_attention(
            x, pool_k, pool_v, tables, ends, scale, None, q_lens, splits=splits, kernel=kern,
            warps=warps, stages=stages,
        )  # fmt: skip

    return f


def _gap(logits: mx.array) -> float:
    """Top-1 minus top-2 logit: how near a tie a greedy choice is."""
    top = np.sort(np.array(logits.astype(mx.float32)))[-2:]
    return float(top[1] - top[0])


class Tally:
    """Greedy decisions of the paged path against the dense path's, in lockstep."""

    def __init__(self, tol: float) -> None:
        self.tol = tol
        self.steps = self.flips = self.unexplained = 0
        self.worst = 0.0

    def add(self, got: mx.array, want: mx.array, diff: float) -> None:
        self.steps += 1
        self.worst = max(self.worst, diff)
        if int(mx.argmax(got)) != int(mx.argmax(want)):
            self.flips += 1
            # A flip is rounding only where the dense path's own top two are within tolerance.
            self.unexplained += _gap(want) > self.tol

    @property
    def ok(self) -> bool:
        return self.unexplained == 0 and self.worst <= self.tol


def greedy(small: bool) -> bool:
    from tests.worker import helpers
    from worker.model.runner import ModelRunner
    from worker.model.self_check import tolerance_for

    print("\n## (c) greedy tokens: ModelRunner with the kernel vs mlx-lm dense")
    calls = {"n": 0}
    real = gpu_decode.paged_decode_attention

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    gpu_decode.paged_decode_attention = counted  # type: ignore[assignment]
    helpers.CONFIGS["llama_d128"] = {
        **helpers.CONFIGS["llama"],
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
    }
    ok = True
    plans = [("llama", mx.float32, 8), ("qwen3", mx.float32, 8), ("gemma3", mx.float32, 8)]
    plans += [("llama_d128", mx.float16, 32), ("llama_d128", mx.float32, 32)]
    for family, dtype, bs in plans:
        model = helpers.tiny_model(family)
        if dtype != mx.float32:
            model.set_dtype(dtype)
        runner = ModelRunner.create(model, block_size=bs, num_blocks=512)
        rng = np.random.default_rng(5)
        lengths = (5, 70, 333, 130) if family == "llama_d128" and not small else (5, 13, 24, 31)
        ps = helpers.prompts(rng, *lengths)
        per_seq = -(-(max(lengths) + 64) // bs)
        seqs = [helpers.PagedSeq.fresh(p, list(range(i * per_seq, (i + 1) * per_seq))[::-1])
                for i, p in enumerate(ps)]  # fmt: skip
        before = calls["n"]
        first = runner.forward([s.take() for s in seqs])
        dense = [helpers.DenseSeq(model, p) for p in ps]
        scale = max(float(mx.abs(d.logits).max()) for d in dense)
        tally = Tally(tolerance_for(dtype, scale))
        for got, d in zip(first, dense, strict=True):
            tally.add(got, d.logits, helpers.max_diff(got, d.logits))
        for _ in range(24):  # decodes, fed the dense path's tokens
            tokens = [int(mx.argmax(d.logits)) for d in dense]
            for s, t in zip(seqs, tokens, strict=True):
                s.push(t)
            out = runner.forward([s.take() for s in seqs])
            for i, (d, t) in enumerate(zip(dense, tokens, strict=True)):
                want = d.step(t)
                tally.add(out[i], want, helpers.max_diff(out[i], want))
        for _ in range(2):  # verify forwards: 5 tokens a sequence, logits at each
            want_all = []
            for s, d in zip(seqs, dense, strict=True):
                steps = []
                for _ in range(5):
                    t = int(mx.argmax(d.logits))
                    s.push(t)
                    steps.append(d.step(t))
                want_all.append(steps)
            outs = runner.forward_all([s.take() for s in seqs])
            for got, steps in zip(outs, want_all, strict=True):
                for j, w in enumerate(steps):
                    tally.add(got[j], w, helpers.max_diff(got[j], w))
        used = calls["n"] - before
        good = tally.ok and used > 0
        ok &= good
        same = "identical" if tally.flips == 0 else f"{tally.flips} differ"
        print(
            f"  {family} ({NAMES[dtype]}, block size {bs}, prompts {lengths}): "
            f"{tally.steps} greedy choices (prefill, 24 decodes, 2 verify forwards of 5): "
            f"{same}, {tally.unexplained} not at a near-tie; max logit diff "
            f"{tally.worst:.3g} (tol {tally.tol:.3g}); kernel calls {used}: "
            f"{'ok' if good else 'FAIL'}",
            flush=True,
        )
    gpu_decode.paged_decode_attention = real  # type: ignore[assignment]
    print("(c):", "PASS" if ok else "FAIL", flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--start", type=int, default=0, help="first correctness case to run")
    parser.add_argument("--stop", type=int, default=1000, help="correctness cases before this")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--skip-greedy", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    small = args.cpu_dry_run
    if small:
        _stand_in_for_the_kernel()
    elif device_backend() != "cuda":
        print("needs MLX's CUDA backend on an NVIDIA GPU (the attention backend is not cuda)")
        return 2
    print(f"mlx {mx.__version__}, device {mx.default_device()}, {gpu_name()}")
    ok = True
    if not args.skip_check:
        ok &= check(small, args.start, args.stop)
    if not args.skip_bench:
        bench(small)
    if not args.skip_greedy:
        ok &= greedy(small)
    if not args.skip_prefill and not small:
        import prefill_kernel  # type: ignore[import-not-found]  # (bench/gpu, beside this file)

        print("\n## (d) the block-table prefill kernel\n")
        ok &= prefill_kernel.check()
        if not args.skip_bench:
            prefill_kernel.first_calls()
            prefill_kernel.bench(20)
    print("\nALL CHECKS PASSED" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


def _stand_in_for_the_kernel() -> None:
    """--cpu-dry-run: the float64 reference plays both kernels (decode and prefill), and the
    runner takes their paths."""

    def kernel(q, pool_k, pool_v, tables, ends, scale, window=None, q_lens=None, **_):
        out = gpu_decode.reference_attention(
            as_f32(q), as_f32(pool_k), as_f32(pool_v), np.array(tables), np.array(ends),
            scale, window, None if q_lens is None else np.array(q_lens),
        )  # fmt: skip
        return mx.array(out.astype(np.float32)).astype(q.dtype)

    gpu_decode.paged_decode_attention = kernel  # type: ignore[assignment]
    gpu_prefill.paged_prefill_attention = kernel  # type: ignore[assignment]
    gpu_decode.active = lambda: True  # type: ignore[assignment]


if __name__ == "__main__":
    sys.exit(main())
