"""Probing each candidate BLAS in a child process, and choosing one (cached per machine).

The second of ``kvserve_model.blas``'s three steps (its docstring tells the whole mechanism):
:func:`probe` preloads a candidate into a throwaway child that checks it is used, right and
fast; :func:`choose` picks among the results so a near-tie never flips a machine between two
libraries; :func:`select_blas` does both, once per machine, and caches the choice.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvserve_model.blas_candidates import BlasLibrary, cache_dir, candidates, library_env

REEXEC_MARKER = "KVSERVE_BLAS_REEXEC"
DISABLE_ENV = "KVSERVE_FAST_BLAS"
REPROBE_ENV = "KVSERVE_BLAS_REPROBE"
PROBE_PREFIX_ENV = "KVSERVE_BLAS_PROBE_PREFIX"

# Bump when the probe or the candidate list changes meaning: old cached choices are ignored.
PROBE_VERSION = 3
# Candidates at least this share of the fastest one's GFLOPS count as equally fast: the
# preference order decides among them (and a recorded choice among them is kept). Probes of
# one library on a quiet machine varied by up to 12% here; AOCL-BLAS and Debian's OpenBLAS,
# whose timing race flipped, measured within 10% of each other where both were fast.
SPEED_FLOOR = 0.8
PROBE_ROUNDS = 3  # each probe's speed is its best round
PROBE_TIMEOUT_S = 120.0
# What MLX's bundled reference BLAS does on these machines, for the warning's "what it costs".
REFERENCE_GFLOPS = "4-6"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What probing one candidate in a child process found."""

    name: str
    path: str
    ok: bool
    detail: str  # the library's own description when ok, else why it was rejected
    gflops: float = 0.0  # fp32, over the probe's prefill- and decode-shaped products


@dataclass(frozen=True, slots=True)
class Selection:
    chosen: BlasLibrary | None
    results: tuple[ProbeResult, ...] = ()
    cached: bool = False

    @property
    def failures(self) -> tuple[ProbeResult, ...]:
        return tuple(r for r in self.results if not r.ok)


# Runs in a child with the candidate preloaded. Prints one JSON line; any crash is the parent's
# evidence. The tolerance is relative to the product's scale: a wrong kernel is off by O(1).
_PROBE = r"""
import json, sys
import numpy as np
import mlx.core as mx
sys.path.insert(0, sys.argv[2])
from kvserve_model.blas import blas_provider, library_config, matmul_seconds

provider = blas_provider()
rng = np.random.default_rng(0)
worst = 0.0
for (m, k, n, ta, tb) in [(67, 129, 33, 0, 0), (256, 512, 384, 0, 1), (8, 512, 1024, 1, 0),
                          (1, 300, 257, 0, 0), (64, 1000, 5, 1, 1)]:
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    xa, xb = mx.array(a), mx.array(b)
    got = np.array((xa.T if ta else xa) @ (xb.T if tb else xb))
    ref = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
    worst = max(worst, float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30)))
best = 0.0
for _ in range(int(sys.argv[3])):  # the best round: a busy core slows one, not all
    flops, seconds = 0.0, 0.0
    for (m, k, n, reps) in [(256, 1024, 1024, 3), (8, 1024, 4096, 20)]:
        seconds += matmul_seconds(m, k, n, reps) * reps
        flops += 2.0 * m * k * n * reps
    best = max(best, flops / seconds / 1e9)
print(json.dumps({"provider": provider, "config": library_config(), "error": worst,
                  "gflops": best}))
"""

_TOLERANCE = 1e-4  # max |error| / max |product|: fp32 over K <= 1000 is ~1e-6


def describe_signal(returncode: int) -> str:
    """A probe child's death by signal (``killed by SIGILL (illegal instruction)``), and for
    SIGILL what it means of a BLAS: built for another CPU. (The launcher's
    ``kvserve_launch.diagnosis.describe_exit`` says the same of its children; this package
    imports nothing of the launcher's.)"""
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return f"killed by signal {-returncode}"
    meaning = (signal.strsignal(sig) or "").lower()
    text = f"killed by {sig.name}" + (f" ({meaning})" if meaning else "")
    if sig == signal.SIGILL:
        text += ": an instruction this CPU lacks, so the library was built for another CPU"
    return text


def probe(lib: BlasLibrary, base_env: Mapping[str, str] | None = None) -> ProbeResult:
    """Preloads ``lib`` into a throwaway child and checks that it is used, right and fast."""
    env = library_env(lib, _clean(os.environ if base_env is None else base_env))
    prefix = shlex.split(env.get(PROBE_PREFIX_ENV, ""))
    root = str(Path(__file__).resolve().parents[1])
    # Under a prefix (an emulator) nothing is timed: the probe says whether the library runs
    # on the emulated CPU and multiplies right, and the preference order chooses. qemu's TCG
    # ran AOCL-BLAS at 0.03 GFLOPS on a Sapphire Rapids host: one timed round took 155 s, past
    # the limit, where the checks alone take ~10 s.
    rounds = 0 if prefix else PROBE_ROUNDS
    try:
        done = subprocess.run(
            [*prefix, sys.executable, "-c", _PROBE, lib.path, root, str(rounds)],
            env=env,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return ProbeResult(lib.name, lib.path, False, f"no answer in {PROBE_TIMEOUT_S:.0f} s")
    except OSError as err:
        return ProbeResult(lib.name, lib.path, False, f"cannot run the probe: {err}")
    if done.returncode < 0:
        return ProbeResult(lib.name, lib.path, False, describe_signal(done.returncode))
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return ProbeResult(lib.name, lib.path, False, f"failed: {last[:300]}")
    try:
        report = json.loads(lines[-1])
    except ValueError:
        return ProbeResult(lib.name, lib.path, False, f"unreadable probe output: {lines[-1]!r}")
    if not report.get("provider"):
        return ProbeResult(lib.name, lib.path, False, "loaded, but cblas_sgemm is not its own")
    if not report["error"] <= _TOLERANCE:  # also catches NaN
        return ProbeResult(
            lib.name, lib.path, False, f"wrong results (relative error {report['error']:.2g})"
        )
    detail = report.get("config") or Path(report["provider"]).name
    return ProbeResult(lib.name, lib.path, True, detail, float(report["gflops"]))


def _clean(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != REEXEC_MARKER}


def cpu_fingerprint() -> str:
    """The CPU model and its feature flags: a new machine (or a VM moved to another host
    CPU) means a new choice (of a BLAS; of the CPU decode kernel's ``-march=native`` build)."""
    model = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "CPU part") and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = value.strip()
    except OSError:
        pass
    return f"{platform.machine()}|{model}|{flags}|{os.cpu_count()}"


def _cache_key(libs: Sequence[BlasLibrary], env: Mapping[str, str]) -> str:
    parts = [str(PROBE_VERSION), sys.executable, cpu_fingerprint(), env.get(PROBE_PREFIX_ENV, "")]
    for lib in libs:
        try:
            st = os.stat(lib.path)
            stamp = f"{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            stamp = "-"
        parts.append(f"{lib.name}|{lib.path}|{stamp}|{lib.library_dirs}|{lib.env}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def select_blas(env: Mapping[str, str] | None = None, reprobe: bool | None = None) -> Selection:
    """The fastest candidate that runs correctly on this CPU (cached), or none."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or env.get(DISABLE_ENV) == "0":
        return Selection(None)
    libs = candidates()
    if not libs:
        return Selection(None)
    if reprobe is None:
        reprobe = env.get(REPROBE_ENV, "") not in ("", "0")
    cache = cache_dir() / f"choice-{_cache_key(libs, env)}.json"
    by_path = {lib.path: lib for lib in libs}
    recorded: str | None = None
    try:
        saved = json.loads(cache.read_text())
        recorded = saved["chosen"]
        if not reprobe:
            results = tuple(ProbeResult(**r) for r in saved["results"])
            chosen = by_path.get(saved["chosen"]) if saved["chosen"] else None
            return Selection(chosen, results, cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no (readable) cached choice: probe
    results = tuple(probe(lib, env) for lib in libs)
    best = choose(results, recorded)
    selection = Selection(by_path[best.path] if best else None, results)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(
            json.dumps(
                {"chosen": best.path if best else None, "results": [asdict(r) for r in results]}
            )
        )
        tmp.replace(cache)
    except OSError:
        pass  # read-only cache: probe again next time
    return selection


def choose(results: Sequence[ProbeResult], recorded: str | None = None) -> ProbeResult | None:
    """The library to run on, from probes in preference order: of the correct ones at least
    :data:`SPEED_FLOOR` as fast as the fastest, the ``recorded`` choice (this machine's last)
    if it is one of them, else the first. So a near-tie never flips a machine between two
    libraries from one start to the next, and a clearly faster one (1/SPEED_FLOOR = 1.25x)
    still wins."""
    good = [r for r in results if r.ok]
    if not good:
        return None
    fastest = max(r.gflops for r in good)
    fast = [r for r in good if r.gflops >= SPEED_FLOOR * fastest]
    return next((r for r in fast if r.path == recorded), fast[0])


def summary(selection: Selection) -> str | None:
    """The one warning line: which candidates failed, why, and what the fallback costs."""
    failed = "; ".join(f"{r.name} {r.detail}" for r in selection.failures)
    if selection.chosen is None:
        why = (
            f" ({failed})" if failed else " (none installed: pip install aoclda or cmeel-openblas)"
        )
        return (
            f"no fast BLAS runs on this CPU{why}: matmuls run on MLX's reference BLAS at "
            f"{REFERENCE_GFLOPS} GFLOPS, prefill 20-40x slower"
        )
    if failed:
        best = next(r for r in selection.results if r.path == selection.chosen.path)
        return f"BLAS fallback: {failed}; using {best.name} ({best.gflops:.0f} GFLOPS in its probe)"
    return None
