"""Host time to build one decode step's graph on the GPU path, against mlx-lm's dense
``KVCache`` forward of the same batch: the part of a batch-32 decode step that is Python and
MLX op construction, which on a GPU is most of the step for a ~1B model (``docs/
gpu-serving-benchmark.md``: 2.6-4.6 ms of a 7.8-10 ms step on an H100 host).

Building the graph needs no GPU: on a machine without MLX's CUDA backend the block-table
kernel is replaced by a stand-in that returns lazy arrays of its output shapes (nothing is
evaluated, so nothing it would compute is needed), and the runner is given the CUDA backend
(``worker.model.attention.cuda``), so that it takes exactly the GPU's decode path through its Python:
``ForwardBatch``, the pool writes, the attention hook's checks, the kernel's launch plan;
and the same forward compiled (``worker.model.compiled_decode``: the traced graph replayed).
On a GPU machine the real kernel is used (built, not run). The graph is built lazily and
dropped, many times; medians of ``--repeats``.

Usage: ``python3 bench/gpu/host_build.py`` (any machine; ``--profile`` adds the top
functions under cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
from bench_models import make_model  # type: ignore[import-not-found]

from worker.model import device as devices
from worker.model.attention import gpu_decode


def stand_in_kernel(backend: str, kind: str) -> Callable[..., list[mx.array]]:
    """The kernel's outputs, lazily, without the kernel (a CPU build has no CUDA back-end)."""

    def call(*, output_shapes, output_dtypes, **_):  # type: ignore[no-untyped-def]
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

    return call


def median_ms(f: Callable[[], object], repeats: int) -> float:
    for _ in range(5):
        f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--hidden", type=int, default=256, help="graph build does not depend on it")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    stood_in = not devices.cuda_available()
    if stood_in:
        gpu_decode._kernel = stand_in_kernel  # type: ignore[assignment]

    from mlx_lm.models.cache import KVCache

    from worker.model.forward_batch import SeqInput
    from worker.model.loader import load_model
    from worker.model.runner import ModelRunner

    with tempfile.TemporaryDirectory() as tmp:
        path, _ = make_model(Path(tmp) / "model", args.layers, args.hidden, "float16")
        model = load_model(str(path)).model
    blocks_each = -(-(args.context + 1) // 16)
    from worker.model.attention.cuda import CudaBackend

    runner = ModelRunner.create(
        model, num_blocks=args.batch * blocks_each + 1, block_size=16, attention=CudaBackend()
    )
    # Per-sequence lengths differ by a few tokens, as in serving (an array offset and a mask).
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(args.batch)]
    seqs = [SeqInput([65], t, args.context - (i % 8), i) for i, t in enumerate(tables, start=1)]

    def paged() -> mx.array:
        runner.compile_decodes = False
        return runner._last_logits(seqs)

    def compiled() -> mx.array:  # replays the traced graph (worker.model.compiled_decode)
        runner.compile_decodes = True
        return runner._last_logits(seqs)

    dense_cache = [KVCache() for _ in model.layers]
    mx.eval(model(mx.zeros((args.batch, args.context), mx.int32), cache=dense_cache))
    step = mx.zeros((args.batch, 1), mx.int32)

    def dense() -> mx.array:
        caches = [KVCache() for _ in model.layers]  # the same state every time
        for c, d in zip(caches, dense_cache, strict=True):
            c.keys, c.values, c.offset = d.keys, d.values, d.offset
        return model(step, cache=caches)[:, -1, :]

    # Interleaved rounds: this machine's speed drifts (shared, 2 cores), so each round times
    # both and the ratio is taken per round; medians over rounds.
    dense_ms, paged_ms, compiled_ms, ratios, compiled_ratios = [], [], [], [], []
    for _ in range(args.rounds):
        t_dense = median_ms(dense, args.repeats)
        t_paged = median_ms(paged, args.repeats)
        t_compiled = median_ms(compiled, args.repeats)
        dense_ms.append(t_dense)
        paged_ms.append(t_paged)
        compiled_ms.append(t_compiled)
        ratios.append(t_paged / t_dense)
        compiled_ratios.append(t_compiled / t_dense)
    t_dense, t_paged = statistics.median(dense_ms), statistics.median(paged_ms)
    t_compiled = statistics.median(compiled_ms)
    assert runner.compiled_decode is not None, "the compiled decode did not trace"
    kernel = "a stand-in for the CUDA kernel (no CUDA back-end here)" if stood_in else "CUDA"
    print(f"{args.layers} layers, batch {args.batch} decodes at ~{args.context} tokens; {kernel}")
    print(f"{args.rounds} interleaved rounds of {args.repeats} builds each; medians")
    print()
    print("| forward | build graph, ms | / dense (per round: median, range) |")
    print("|---|---|---|")
    print(f"| mlx-lm dense `KVCache` | {t_dense:.3f} | 1.00 |")
    print(
        f"| worker paged (GPU decode path) | {t_paged:.3f} | {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f}) |"
    )
    print(
        f"| worker paged, compiled (`mx.compile` replay) | {t_compiled:.3f} | "
        f"{statistics.median(compiled_ratios):.2f} "
        f"({min(compiled_ratios):.2f}-{max(compiled_ratios):.2f}) |"
    )
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.repeats):
            paged()
            compiled()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
