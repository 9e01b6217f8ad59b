"""A GPU decode step against its memory floor, by parts (issue 35): what a batch-32 step at a
long context costs against the bytes it must read (the weights once, every sequence's K/V),
and where the rest goes (host graph build, kernel launch, the attention kernel, the other
kernels). One process, the worker's own ``ModelRunner`` on the random ~1B fp16 llama of the
GPU benchmarks (``bench_models.make_model``), under the worker process's MLX settings
(``worker.device_defaults.MLX_ENV``):

1. the whole paged decode step as the worker runs it (``ModelRunner.forward``, ``--batch``
   sequences of one token at ~``--context``, block tables of distinct random blocks over a pool
   of random values), uncompiled and compiled (``worker.model.compiled_decode``, where the
   runner compiles decodes), medians after warm-up; and the same steps split into building the
   graph (host: ``ForwardBatch``, Python and MLX op construction, as ``host_build.py`` measures
   it), launching it (``mx.async_eval`` returning) and waiting for the device; and run
   back to back, the next step built while the device runs this one and launched at once or
   once this one finished, with the peak device memory (a pool write not done in place
   copies the pool);
2. the same step at ``--short`` tokens of context: about the weights-bound part;
3. the decode attention kernel alone (``attention.gpu_decode``) for every layer at the long
   context, the layers' calls chained and evaluated once, and its K/V bandwidth;
4. the launch floor: the same layers at hidden 128 (the same graph, almost no bytes);
5. mlx-lm's dense batched decode (``BatchKVCache``) of the same model at the long context;
6. the device's bandwidth: an elementwise copy and a sum (MLX), and a plain device-to-device
   copy through PyTorch in a child process where it is installed.

The floor is the weights (all but the embedding table, of which ``--batch`` rows are read) and
the K/V of every sequence's context, once, over the device's bandwidth: its datasheet figure
(H200 4.8 TB/s, H100 3.35) and the best measured in 6.

The device's own time, kernel by kernel: ``--kernel-times`` runs one step between
``cuProfilerStart`` and ``cuProfilerStop`` for ``ncu --profile-from-start off --metrics
gpu__time_duration.sum --csv --log-file ncu.csv``, and ``--ncu-summary ncu.csv`` sums it by
kind (attention, matmuls, the rest); the commands: ``docs/gpu-decode-parts.md``.

Usage (GPU machine): ``python3 bench/gpu/decode_parts.py``; a CPU dry run:
``--layers 2 --hidden 128 --dtype float32 --context 256`` (no kernel there: part 3 runs a
stand-in that returns the kernel's output shapes, ``host_build.stand_in_kernel``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.device_defaults import MLX_ENV, apply_mlx_env

apply_mlx_env()  # before anything runs on the GPU: MLX reads them once

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from bench_models import add_gpu_model_args, gpu_name, make_model  # noqa: E402
from host_build import median_ms, stand_in_kernel  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from worker.model import device as devices  # noqa: E402
from worker.model.attention import gpu_decode  # noqa: E402
from worker.model.forward_batch import ForwardBatch, SeqInput  # noqa: E402
from worker.model.loader import load_model  # noqa: E402
from worker.model.runner import ModelRunner  # noqa: E402

BLOCK = 32  # the worker's block size
DATASHEET = {"H200": 4.8e12, "H100": 3.35e12}  # bytes/s, HBM

TORCH_COPY = """
import sys, time, torch
n = int(sys.argv[1])
a = torch.empty(n, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
for _ in range(3): b.copy_(a)
torch.cuda.synchronize(); s, e = torch.cuda.Event(True), torch.cuda.Event(True)
s.record()
for _ in range(10): b.copy_(a)
e.record(); torch.cuda.synchronize(); print(s.elapsed_time(e) / 10)
"""


def weight_bytes(model, batch: int) -> int:  # type: ignore[no-untyped-def]
    """Bytes of weights a decode step reads: every parameter once, but of the embedding table
    only the ``batch`` rows looked up."""
    total = 0
    for name, p in tree_flatten(model.parameters()):
        if "embed_tokens" in name:
            total += batch * p.nbytes // p.shape[0]
        else:
            total += p.nbytes
    return total


def sync_eval(*arrays: mx.array) -> None:
    mx.eval(*arrays)
    mx.synchronize()


class Decoder:
    """One model's runner, its pool filled with random values, and ``batch`` sequences on
    distinct random blocks, each long enough for ``context`` tokens."""

    def __init__(self, model, batch: int, context: int, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
        self.batch = batch
        blocks_each = -(-(context + 1) // BLOCK)
        num_blocks = batch * blocks_each
        self.runner = ModelRunner.create(model, block_size=BLOCK, num_blocks=num_blocks)
        pool = self.runner.pool
        filled = []
        for a in pool.arrays():  # one at a time: no more than one array's temporaries at once
            r = (mx.random.normal(a.shape, key=mx.random.key(seed + len(filled))) * 0.5).astype(
                a.dtype
            )
            mx.eval(r)
            filled.append(r)
        pool.replace(filled)
        del filled
        order = np.random.default_rng(seed).permutation(num_blocks).tolist()
        self.tables = [order[i * blocks_each : (i + 1) * blocks_each] for i in range(batch)]
        self.token_bytes = pool.bytes_per_block // BLOCK  # K and V of every layer, one token

    def seqs(self, context: int) -> list[SeqInput]:
        """One decode token a sequence at ~``context``: lengths differ by up to 7 tokens, as
        in serving (an array offset and per-sequence masks)."""
        starts = [context - (i % 8) for i in range(self.batch)]
        return [
            SeqInput([65], t[: -(-(s + 1) // BLOCK)], s, i)
            for i, (t, s) in enumerate(zip(self.tables, starts, strict=True))
        ]

    def kv_bytes(self, seqs: list[SeqInput]) -> int:
        """K/V the step reads: every sequence's context, this token's included."""
        return sum(s.end for s in seqs) * self.token_bytes

    def forward_ms(self, seqs: list[SeqInput], compiled: bool, steps: int, warm: int) -> float:
        """The step as the worker runs it (``ModelRunner.forward``), median ms."""
        self.runner.compile_decodes = compiled
        times = []
        for i in range(warm + steps):
            if i == warm:
                before = mx.get_active_memory()
                mx.reset_peak_memory()
            t0 = time.perf_counter()
            self.runner.forward(seqs)
            mx.synchronize()
            if i >= warm:
                times.append(time.perf_counter() - t0)
        self.peak = (mx.get_peak_memory() - before) / 1e9
        return statistics.median(times) * 1e3

    def split_ms(self, seqs: list[SeqInput], compiled: bool, steps: int) -> dict[str, float]:
        """The same step as build (host), launch (``async_eval`` returning) and wait (the
        device after the last launch), medians in ms (``launch_settings.py``'s split)."""
        self.runner.compile_decodes = compiled
        pool = self.runner.pool
        parts: dict[str, list[float]] = {"build": [], "launch": [], "wait": []}
        for _ in range(steps):
            t0 = time.perf_counter()
            last = self.runner._last_logits(seqs)
            t1 = time.perf_counter()
            mx.async_eval(last, *pool.arrays())
            t2 = time.perf_counter()
            sync_eval(last, *pool.arrays())
            t3 = time.perf_counter()
            for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                v = v * 1e3
                parts[k].append(v)
        return {k: statistics.median(v) for k, v in parts.items()}

    def pipelined_ms(
        self, seqs: list[SeqInput], compiled: bool, steps: int, launch_after: bool = False
    ) -> tuple[float, float]:
        """Steps back to back, each built while the device runs the one before (as the
        executor's lookahead does; the next step's tokens are not waited for): launched at
        once, or (``launch_after``) once the one before has finished. Returns ms a step and
        the peak device memory above the memory in use before, GB (a pool array the step
        cannot write in place is copied: a layer's K or V is ``pool.nbytes / 2 / layers``)."""
        self.runner.compile_decodes = compiled
        pool = self.runner.pool
        sync_eval(*pool.arrays())
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        prev: mx.array | None = None
        for _ in range(steps):
            last = self.runner._last_logits(seqs)
            if launch_after and prev is not None:
                sync_eval(prev)
            mx.async_eval(last, *pool.arrays())
            prev = last
        sync_eval(*pool.arrays())
        ms = (time.perf_counter() - t0) / steps * 1e3
        return ms, (mx.get_peak_memory() - before) / 1e9


def attention_ms(dec: Decoder, seqs: list[SeqInput], heads: int, dim: int, repeats: int) -> float:
    """Every layer's decode attention kernel at ``seqs``' shape, each layer's call on the one
    before's output (so they run one after another, as in the model), evaluated once."""
    pool = dec.runner.pool
    fb = ForwardBatch(seqs, pool.block_size, pool.num_blocks, dec.runner.spec.mask_rank)
    tables, ends, q_lens = fb.kernel_inputs()
    q = mx.random.normal((len(seqs), heads, 1, dim)).astype(pool.dtype)
    mx.eval(q, tables, ends, q_lens)

    def chain() -> None:
        x = q
        for layer in range(pool.num_layers):
            k, v = pool.layer_arrays(layer)
            x = gpu_decode.paged_decode_attention(x, k, v, tables, ends, dim**-0.5, None, q_lens)
        sync_eval(x)

    return median_ms(chain, repeats)


def dense_ms(model, batch: int, context: int, dim: int, steps: int) -> float | None:  # type: ignore[no-untyped-def]
    """mlx-lm's batched decode step (``BatchKVCache``, as ``batch_generate`` runs it) over a
    dense cache of random values at ``context`` tokens, median ms; None where this mlx-lm has
    no ``BatchKVCache``."""
    try:
        from mlx_lm.models.cache import BatchKVCache
    except ImportError:
        return None
    caches = []
    step = BatchKVCache.step
    width = -(-(context + 1) // step) * step
    for layer in model.layers:
        attn = layer.self_attn
        shape = (batch, attn.n_kv_heads, width, dim)
        c = BatchKVCache([0] * batch)
        dtype = model.lm_head.weight.dtype
        c.keys = (mx.random.normal(shape) * 0.5).astype(dtype)
        c.values = (mx.random.normal(shape) * 0.5).astype(dtype)
        mx.eval(c.keys, c.values)
        caches.append(c)
    offset = mx.array([context] * batch)
    tokens = mx.array([[65]] * batch)
    times = []
    for i in range(steps + 4):
        for c in caches:  # the same context every step: the new token's slot is rewritten
            c._idx, c.offset = context, offset
        t0 = time.perf_counter()
        sync_eval(model(tokens, cache=caches)[:, -1, :])
        if i >= 4:
            times.append(time.perf_counter() - t0)
    del caches
    return statistics.median(times) * 1e3


def bandwidths(nbytes: int) -> dict[str, tuple[float, int]]:
    """ms and bytes moved of an elementwise copy (read + write) and a sum (read) in MLX, and
    of PyTorch's device-to-device copy (read + write) in a child process where it runs."""
    a = mx.random.uniform(shape=(nbytes // 2 // 4096, 4096)).astype(mx.float16)  # int32 sizes
    zero = mx.array(0, dtype=mx.float16)
    mx.eval(a)
    out = {
        "MLX elementwise copy (`a + 0`)": (median_ms(lambda: sync_eval(a + zero), 10), 2 * nbytes),
        "MLX sum (read only)": (median_ms(lambda: sync_eval(a.sum()), 10), nbytes),
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-c", TORCH_COPY, str(nbytes)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        out["PyTorch device-to-device copy"] = (float(proc.stdout.split()[-1]), 2 * nbytes)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError) as err:
        print(f"(no PyTorch copy: {type(err).__name__})", flush=True)
    return out


def kernel_times(dec: Decoder, seqs: list[SeqInput], warm: int) -> None:
    """One step (compiled where the runner compiles decodes) after ``warm``, the only thing
    between the driver's ``cuProfilerStart`` and ``cuProfilerStop``: what ``ncu
    --profile-from-start off`` times, kernel by kernel."""
    import ctypes

    dec.forward_ms(seqs, dec.runner.compile_decodes, 1, warm)
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    dec.runner.forward(seqs)
    mx.synchronize()
    cuda.cuProfilerStop()
    print("one step profiled", flush=True)


def ncu_summary(path: str) -> None:
    """Kernel count and summed ``gpu__time_duration`` of an ncu CSV, by kind of kernel."""
    import csv

    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    total: dict[str, list[float]] = {}
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0}
        ms = float(r["Metric Value"].replace(",", "")) * unit.get(r["Metric Unit"], 1e-6)
        total.setdefault(r["Kernel Name"].split("(")[0].split("<")[0][:60], []).append(ms)
    kinds: dict[str, list[float]] = {}
    for kernel, times in total.items():
        low = kernel.lower()
        kind = (
            "attention (kvserve_paged_attention)"
            if "kvserve_paged" in low
            else "matmul (gemm/gemv)"
            if any(w in low for w in ("gemm", "gemv", "xmma", "cutlass", "cublas", "nvjet"))
            else "other (norms, RoPE, elementwise, pool writes, embedding)"
        )
        kinds.setdefault(kind, []).extend(times)
    whole = sum(sum(t) for t in kinds.values())
    print(f"{sum(len(t) for t in kinds.values())} kernels, {whole:.3f} ms on the device\n")
    print("| kernels | count | ms | share |\n|---|---|---|---|")
    for kind, times in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {kind} | {len(times)} | {sum(times):.3f} | {sum(times) / whole:.0%} |")
    print("\n| kernel | count | ms |\n|---|---|---|")
    for kernel, times in sorted(total.items(), key=lambda kv: -sum(kv[1]))[:15]:
        print(f"| `{kernel}` | {len(times)} | {sum(times):.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gpu_model_args(ap)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--short", type=int, default=32, help="the short context of part 2")
    ap.add_argument("--steps", type=int, default=20, help="timed steps a median is taken of")
    ap.add_argument("--warm", type=int, default=5, help="untimed steps first")
    ap.add_argument("--copy-mb", type=int, default=4096, help="bytes of the bandwidth tests")
    ap.add_argument("--no-dense", action="store_true", help="skip mlx-lm's dense decode")
    ap.add_argument(
        "--kernel-times",
        action="store_true",
        help="only one compiled step at the long context between cuProfilerStart and Stop, "
        "for `ncu --profile-from-start off` (the summary: --ncu-summary)",
    )
    ap.add_argument("--ncu-summary", metavar="CSV", help="sum an ncu CSV's kernel times, by kind")
    args = ap.parse_args()
    if args.ncu_summary:
        ncu_summary(args.ncu_summary)
        return
    started = time.perf_counter()
    cuda = devices.cuda_available()
    if not cuda:  # a dry run: the kernel's output shapes, lazily, in place of the kernel
        gpu_decode._kernel = stand_in_kernel  # type: ignore[assignment]
    name = gpu_name() if cuda else f"{mx.default_device()} (dry run)"
    b, long_ctx, short_ctx = args.batch, args.context, args.short
    with tempfile.TemporaryDirectory() as tmp:
        path, params = make_model(Path(tmp) / "model", args.layers, args.hidden, args.dtype)
        model = load_model(str(path)).model
        tiny_path, _ = make_model(Path(tmp) / "tiny", args.layers, 128, args.dtype)
        tiny = load_model(str(tiny_path)).model
    dec = Decoder(model, b, long_ctx)
    runner = dec.runner
    if args.kernel_times:
        kernel_times(dec, dec.seqs(long_ctx), args.warm)
        return
    compiles = runner.compile_decodes
    modes = [("uncompiled", False)] + ([("compiled", True)] if compiles else [])
    env = " ".join(f"{k}={os.environ.get(k)}" for k in MLX_ENV)
    print(
        f"{name}; mlx {mx.__version__}; {params / 1e6:.0f}M {args.dtype}, {args.layers} layers; "
        f"{runner.attention.describe()}; pool {runner.pool.nbytes / 1e9:.2f} GB; {env}",
        flush=True,
    )
    w_bytes = weight_bytes(model, b)
    rows: list[tuple[str, float, int | None, bool]] = []  # (part, ms, bytes, share shown)

    def row(part: str, ms: float, nbytes: int | None = None, share: bool = True) -> None:
        rows.append((part, ms, nbytes, share))
        gbs = f", {nbytes / ms / 1e6:,.0f} GB/s" if nbytes else ""
        print(f"  {part}: {ms:.3f} ms{gbs}", flush=True)

    # 1-2. The step, long and short context, as the worker runs it; then split.
    long_seqs, short_seqs = dec.seqs(long_ctx), dec.seqs(short_ctx)
    long_bytes, short_bytes = w_bytes + dec.kv_bytes(long_seqs), w_bytes + dec.kv_bytes(short_seqs)
    step_ms: dict[str, float] = {}
    for mode, compiled in modes:
        step_ms[mode] = dec.forward_ms(long_seqs, compiled, args.steps, args.warm)
        row(f"step, {mode}, {b} x ~{long_ctx:,} (peak +{dec.peak:.2f} GB)", step_ms[mode],
            long_bytes)  # fmt: skip
    for mode, compiled in modes:
        split = dec.split_ms(long_seqs, compiled, args.steps)
        for part, ms in split.items():
            row(f"  {mode}: {part}", ms)
        for launch_after in (False, True):
            ms, peak = dec.pipelined_ms(long_seqs, compiled, args.steps, launch_after)
            when = "once the one before finished" if launch_after else "at once"
            row(f"  {mode}: next step built during this one, launched {when} "
                f"(peak +{peak:.2f} GB)", ms, long_bytes)  # fmt: skip
    for mode, compiled in modes:
        dec.forward_ms(short_seqs, compiled, 1, args.warm)  # first shapes of the short context
        row(f"step, {mode}, {b} x ~{short_ctx}", dec.forward_ms(short_seqs, compiled, args.steps, 0),
            short_bytes)  # fmt: skip
        split = dec.split_ms(short_seqs, compiled, args.steps)
        row(f"  {mode} at ~{short_ctx}: build", split["build"])
        ms, peak = dec.pipelined_ms(short_seqs, compiled, args.steps)
        row(f"  {mode} at ~{short_ctx}: next step launched at once (peak +{peak:.2f} GB)", ms,
            short_bytes)  # fmt: skip

    # 3. The attention kernel alone, every layer.
    spec = runner.spec.layers[0]
    heads = model.layers[0].self_attn.n_heads
    attn = attention_ms(dec, long_seqs, heads, spec.k_head_dim, args.steps)
    row(f"attention kernel alone, {args.layers} layers" + ("" if cuda else " (stand-in)"), attn,
        dec.kv_bytes(long_seqs))  # fmt: skip
    del dec, runner
    mx.clear_cache()

    # 4. The launch floor: the same graph at hidden 128.
    small = Decoder(tiny, b, short_ctx)
    tiny_seqs = small.seqs(short_ctx)
    for mode, compiled in modes:
        small.forward_ms(tiny_seqs, compiled, 1, args.warm)
        row(f"hidden-128 model, {mode}, {b} x ~{short_ctx}",
            small.forward_ms(tiny_seqs, compiled, args.steps, 0))  # fmt: skip
        split = small.split_ms(tiny_seqs, compiled, args.steps)
        row(f"  hidden 128, {mode}: build / launch / wait "
            f"{split['build']:.2f} / {split['launch']:.2f} / {split['wait']:.2f}",
            sum(split.values()))  # fmt: skip
    del small
    mx.clear_cache()

    # 5. mlx-lm's dense batched decode.
    if not args.no_dense:
        dense = dense_ms(model, b, long_ctx, spec.k_head_dim, args.steps)
        if dense is not None:
            dense_kv = long_ctx * b * (long_bytes - w_bytes) // sum(s.end for s in long_seqs)
            row(f"mlx-lm `BatchKVCache` decode, {b} x {long_ctx:,}", dense, w_bytes + dense_kv)
        mx.clear_cache()

    # 6. Bandwidth.
    measured = 0.0
    for what, (ms, nbytes) in bandwidths(args.copy_mb * 2**20).items():
        row(what, ms, nbytes, share=False)
        measured = max(measured, nbytes / ms * 1e3)
    sheet = next((v for k, v in DATASHEET.items() if k in name), None)

    worker_mode = "compiled" if compiles else "uncompiled"
    step = step_ms[worker_mode]
    print()
    print(f"{name}, mlx {mx.__version__}, {params / 1e9:.2f}B {args.dtype} llama, "
          f"{args.layers} layers; batch {b}; medians of {args.steps} after {args.warm} warm-up; "
          f"share: of the worker's step ({worker_mode}, {step:.2f} ms)\n")  # fmt: skip
    print("| part | ms | bytes | GB/s | share of the step |")
    print("|---|---|---|---|---|")
    for part, ms, nbytes, share in rows:
        gb = f"{nbytes / 1e9:.3f} GB" if nbytes else ""
        rate = f"{nbytes / ms / 1e6:,.0f}" if nbytes else ""
        print(f"| {part} | {ms:.3f} | {gb} | {rate} | {f'{ms / step:.0%}' if share else ''} |")
    kv = long_bytes - w_bytes
    for label, bw in (("datasheet", sheet), ("best measured", measured)):
        if not bw:
            continue
        parts = [("weights", w_bytes), ("K/V read", kv), ("floor: weights + K/V", long_bytes)]
        for what, nbytes in parts:
            ms = nbytes / bw * 1e3
            print(f"| {what} at {bw / 1e12:.2f} TB/s ({label}) | {ms:.3f} | "
                  f"{nbytes / 1e9:.3f} GB | {bw / 1e9:,.0f} | {ms / step:.0%} |")  # fmt: skip
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
    # MLX 0.32 can abort in its C++ teardown (status 134); nothing is left to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
