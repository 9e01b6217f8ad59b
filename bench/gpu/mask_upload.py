"""A constrained step's token masks on their way to the GPU (issue 32): host time a call of
``apply_masks`` through ``mx.array`` (managed memory: the host's writes fault pages back from
the device) against ``MaskUpload`` (a pinned buffer and one driver copy), and the compiled
unpack-and-``where`` with the masks already on the device. Each result is checked against
numpy's own unpacking.

    python bench/gpu/mask_upload.py                 # 32 rows of SmolLM2's 49,152 tokens
    python bench/gpu/mask_upload.py --rows 8 --vocab 151936
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from worker.model.grammar import MaskUpload, _bit_index, _masked_on_device, apply_masks


def timed(fn: Callable[[], mx.array], rounds: int) -> tuple[float, float]:
    """Median microseconds of host time a call, and of the call with its evaluation."""
    for _ in range(5):
        mx.eval(fn())
    host, whole = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        out = fn()
        built = time.perf_counter()
        mx.eval(out)
        host.append(built - start)
        whole.append(time.perf_counter() - start)
    return statistics.median(host) * 1e6, statistics.median(whole) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rounds", type=int, default=300)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    words = -(-a.vocab // 32)
    masks = rng.integers(-(2**31), 2**31, size=(a.rows, words), dtype=np.int64).astype(np.int32)
    logits = mx.random.normal((a.rows, a.vocab))
    rows = list(range(a.rows))
    upload = MaskUpload()
    expected = np.unpackbits(masks.view(np.uint8), axis=1, count=a.vocab, bitorder="little")
    bit_words, bits = _bit_index(a.vocab)
    on_device = mx.array(masks)
    cases: dict[str, Callable[[], mx.array]] = {
        "apply_masks through mx.array": lambda: apply_masks(logits, rows, masks, on_device=True),
        "apply_masks through MaskUpload": lambda: apply_masks(
            logits, rows, masks, on_device=True, upload=upload
        ),
        "compiled unpack + where, masks on the device": lambda: _masked_on_device(
            logits, on_device, bit_words, bits
        ),
    }
    print(f"# {mx.default_device()}, {a.rows} rows x {a.vocab} tokens, medians of {a.rounds}")
    upload(masks)
    print(f"# MaskUpload through the driver: {upload._staging is not None}")
    print("\n| path | host us | host + device us |\n|---|---:|---:|")
    for name, fn in cases.items():
        got = np.isfinite(np.asarray(fn()))
        assert np.array_equal(got, expected.astype(bool)), name
        host, whole = timed(fn, a.rounds)
        print(f"| {name} | {host:.1f} | {whole:.1f} |")


if __name__ == "__main__":
    main()
