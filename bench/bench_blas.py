"""Every BLAS candidate against MLX's reference BLAS, on this CPU (or an emulated one).

    .venv/bin/python bench/bench_blas.py                 # this machine
    .venv/bin/python bench/bench_blas.py --cpu Haswell   # probes under qemu-x86_64 -cpu Haswell

Each library runs in its own child process (preloaded the way the worker preloads it): a
prefill-shaped product (256x1024 @ 1024x1024), a decode-shaped one (8x1024 @ 1024x4096) and a
square 1024 product, fp32, best of a few repeats, then the ratio to the reference BLAS measured
in the same run. The probe's verdict (the worker's choice) is printed beside it. Under
``--cpu`` only the verdicts mean anything (emulated speed is not the CPU's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvserve_model.blas import (  # noqa: E402
    PROBE_PREFIX_ENV,
    REEXEC_MARKER,
    candidates,
    library_env,
    select_blas,
)

SHAPES = {"prefill 256x1024x1024": (256, 1024, 1024), "decode 8x1024x4096": (8, 1024, 4096)}
SHAPES["square 1024"] = (1024, 1024, 1024)

_CHILD = r"""
import json, sys, time
import mlx.core as mx
shapes = json.loads(sys.argv[1])
out = {}
for name, (m, k, n) in shapes.items():
    a = mx.random.normal((m, k), key=mx.random.key(1)); b = mx.random.normal((k, n), key=mx.random.key(2))
    mx.eval(a, b, a @ b)
    best = float("inf")
    for _ in range(5):
        reps = max(1, int(2e8 // (2 * m * k * n)))
        start = time.perf_counter()
        for _ in range(reps):
            mx.eval(a @ b)
        best = min(best, (time.perf_counter() - start) / reps)
    out[name] = 2 * m * k * n / best / 1e9
print(json.dumps(out))
"""


def measure(env: dict[str, str]) -> dict[str, float] | str:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(SHAPES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        return f"exit {done.returncode}"
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", default="", help="probe under qemu-x86_64 -cpu CPU (verdicts only)")
    args = p.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", REEXEC_MARKER)}
    if args.cpu:
        base[PROBE_PREFIX_ENV] = f"qemu-x86_64 -cpu {args.cpu}"
    selection = select_blas(base, reprobe=True)
    verdicts = {r.path: r for r in selection.results}
    rows = [("reference (MLX's bundled)", "baseline", measure(base))]
    for lib in candidates():
        r = verdicts[lib.path]
        verdict = ("CHOSEN " if selection.chosen == lib else "") + ("ok" if r.ok else r.detail)
        speed = measure(library_env(lib, base)) if r.ok and not args.cpu else "-"
        rows.append((f"{lib.name}: {r.detail if r.ok else ''}".strip(" :"), verdict, speed))
    ref = rows[0][2]
    print(f"CPU: {args.cpu or 'this machine'}; fp32 GFLOPS (x reference)\n")
    print("| library | probe verdict | " + " | ".join(SHAPES) + " |")
    print("|---|---|" + "---|" * len(SHAPES))
    for name, verdict, speed in rows:
        cells = []
        for shape in SHAPES:
            if isinstance(speed, dict) and isinstance(ref, dict):
                cells.append(f"{speed[shape]:.0f} ({speed[shape] / ref[shape]:.1f}x)")
            else:
                cells.append(str(speed) if isinstance(speed, str) else "-")
        print(f"| {name} | {verdict} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
