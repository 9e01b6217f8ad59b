"""Where the paged prefill's time goes on a GPU, against mlx-lm's dense path: one prompt in
chunks through ``ModelRunner.forward``, with the pool write and/or the context gather taken
out (the attention then reads stand-in zeros of the same shape: timing only, not answers).

    python3 bench/gpu/prefill_ablation.py [--tokens 16000] [--chunks 512,2048]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
import numpy as np
from bench_models import add_gpu_model_args, make_model  # type: ignore[import-not-found]
from bench_prefill import time_dense, time_paged  # type: ignore[import-not-found]
from mlx_lm.utils import load

from worker.model.kv_pool import KVPool
from worker.model.paged_cache import PagedLayerCache

COLUMNS = ("dense", "paged", "no write", "no gather", "neither")
VARIANTS = {  # (pool write kept, gather kept)
    "paged": (True, True),
    "no write": (False, True),
    "no gather": (True, False),
    "neither": (False, False),
}


def variant(write: bool, gather: bool) -> Callable[[], None]:
    """Patch the pool write and the gather out (or back in); returns the undo."""
    real_write, real_gather = KVPool.write, PagedLayerCache.gather
    zeros: dict[tuple[int, ...], mx.array] = {}

    def no_write(self, layer, blocks, slots, keys, values):  # type: ignore[no-untyped-def]
        return None

    def no_gather(self):  # type: ignore[no-untyped-def]
        k, _ = self.pool.layer_arrays(self.layer)
        b = self.batch
        shape = (b.size, k.shape[0], b.key_len, k.shape[-1])
        if shape not in zeros:
            zeros[shape] = mx.zeros(shape, k.dtype)
            mx.eval(zeros[shape])
        return zeros[shape], zeros[shape]

    if not write:
        KVPool.write = no_write  # type: ignore[method-assign]
    if not gather:
        PagedLayerCache.gather = no_gather  # type: ignore[method-assign]

    def undo() -> None:
        KVPool.write = real_write  # type: ignore[method-assign]
        PagedLayerCache.gather = real_gather  # type: ignore[method-assign]

    return undo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gpu_model_args(ap)
    ap.add_argument("--tokens", type=int, default=16000)
    ap.add_argument("--chunks", default="512,2048")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, params = make_model(Path(tmp) / "m", a.layers, a.hidden, a.dtype)
        model, _ = load(str(path))
    prompt = np.random.default_rng(0).integers(32, 127, a.tokens).tolist()
    print(f"# {a.tokens}-token prompt, {params / 1e6:.0f}M params, {a.dtype}, seconds (medians)\n")
    print("| chunk | dense | paged | no write | no gather | neither |")
    print("|---|---|---|---|---|---|")
    for chunk in (int(c) for c in a.chunks.split(",")):
        times: dict[str, list[float]] = {name: [] for name in COLUMNS}
        for r in range(a.repeat + 1):  # the first round builds each shape's plans: untimed
            for name in COLUMNS:
                if name == "dense":
                    t = time_dense(model, prompt, chunk)
                else:
                    undo = variant(*VARIANTS[name])
                    try:
                        t = time_paged(model, prompt, chunk)
                    finally:
                        undo()
                if r:
                    times[name].append(t)
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = " | ".join(
            f"{med[k]:.3f}" for k in ("dense", "paged", "no write", "no gather", "neither")
        )
        print(f"| {chunk} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
