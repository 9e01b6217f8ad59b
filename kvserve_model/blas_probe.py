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
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvserve_model.blas_candidates import BlasLibrary, cache_dir, candidates, library_env

REEXEC_MARKER = "KVSERVE_BLAS_REEXEC"
DISABLE_ENV = "KVSERVE_FAST_BLAS"
REPROBE_ENV = "KVSERVE_BLAS_REPROBE"
PROBE_PREFIX_ENV = "KVSERVE_BLAS_PROBE_PREFIX"

# Bump when the probe or the candidate list changes meaning: old cached choices are ignored.
PROBE_VERSION = 4
# Candidates at least this share of the fastest one's GFLOPS count as equally fast: the
# preference order decides among them (and a recorded choice among them is kept). Probes of
# one library on a quiet machine varied by up to 12% here; AOCL-BLAS and Debian's OpenBLAS,
# whose timing race flipped, measured within 10% of each other where both were fast.
SPEED_FLOOR = 0.8
# A machine's recorded choice is kept while it is at least this share of the fastest one's
# GFLOPS. AOCL-BLAS against cmeel-openblas straddled SPEED_FLOOR on a CI machine (two probes
# in one run chose differently): no single threshold is outside timing noise, so a choice is
# made once and changed only for a lead (2x) that noise does not make.
KEEP_FLOOR = 0.5
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


# Runs in a child with the candidate preloaded. Prints one JSON line of checks, then one line
# per timing round the parent asks for (a line on stdin); any crash is the parent's evidence.
# The tolerance is relative to the product's scale: a wrong kernel is off by O(1).
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
print(json.dumps({"provider": provider, "config": library_config(), "error": worst}), flush=True)
for _ in sys.stdin:  # one timing round per line the parent sends
    flops, seconds = 0.0, 0.0
    for (m, k, n, reps) in [(256, 1024, 1024, 3), (8, 1024, 4096, 20)]:
        seconds += matmul_seconds(m, k, n, reps) * reps
        flops += 2.0 * m * k * n * reps
    print(json.dumps({"gflops": flops / seconds / 1e9}), flush=True)
"""

_TOLERANCE = 1e-4  # max |error| / max |product|: fp32 over K <= 1000 is ~1e-6
# Between one child's timing round and the next child's: the finished child's BLAS threads
# spin a while before they sleep (OpenBLAS: 2^28 cycles, ~0.1 s), on the cores the next round
# needs.
_SETTLE_S = 0.2


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


class _Child:
    """One probe child: its process, its stdout read line by line against a deadline, and
    its stderr in a file (read only to say why it failed)."""

    def __init__(self, lib: BlasLibrary, env: Mapping[str, str], prefix: list[str]) -> None:
        self.lib = lib
        self.error: str | None = None  # why it was rejected
        self.report: dict[str, Any] = {}
        self.gflops = 0.0  # its best timing round: a busy core slows a round, not all
        self._buffer = b""
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        root = str(Path(__file__).resolve().parents[1])
        try:
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [*prefix, sys.executable, "-c", _PROBE, lib.path, root],
                env=dict(env),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
            )
        except OSError as err:
            self.proc = None
            self.error = f"cannot run the probe: {err}"

    def line(self, deadline: float) -> dict[str, Any] | None:
        """The child's next JSON line, or None (and :attr:`error` says why)."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.error = f"no answer in {PROBE_TIMEOUT_S:.0f} s"
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                self.error = self._why_it_ended()
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            value = json.loads(line)
        except ValueError:
            self.error = f"unreadable probe output: {line.decode(errors='replace')!r}"
            return None
        return value if isinstance(value, dict) else None

    def time_round(self, deadline: float) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(b"time\n")
            self.proc.stdin.flush()
        except OSError:
            self.error = self._why_it_ended()
            return
        answer = self.line(deadline)
        if answer is not None:
            self.gflops = max(self.gflops, float(answer.get("gflops", 0.0)))

    def _why_it_ended(self) -> str:
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return "closed its output but did not exit"
        if code < 0:
            return describe_signal(code)
        self._stderr.seek(0)
        err = self._stderr.read().decode(errors="replace").strip().splitlines()
        return f"failed: {(err or [f'exit status {code}'])[-1][:300]}"

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
        self._stderr.close()

    def result(self) -> ProbeResult:
        lib, report = self.lib, self.report
        if self.error is not None:
            return ProbeResult(lib.name, lib.path, False, self.error)
        if not report.get("provider"):
            return ProbeResult(lib.name, lib.path, False, "loaded, but cblas_sgemm is not its own")
        if not report["error"] <= _TOLERANCE:  # also catches NaN
            return ProbeResult(
                lib.name, lib.path, False, f"wrong results (relative error {report['error']:.2g})"
            )
        detail = report.get("config") or Path(report["provider"]).name
        return ProbeResult(lib.name, lib.path, True, detail, self.gflops)


def probe_all(
    libs: Sequence[BlasLibrary], base_env: Mapping[str, str] | None = None
) -> tuple[ProbeResult, ...]:
    """Preloads each of ``libs`` into a throwaway child, checks that it is used and right,
    then times them in interleaved rounds (one child's round, then the next's, so a busy
    spell of the machine slows one round of each rather than all of one library's)."""
    env = _clean(os.environ if base_env is None else base_env)
    prefix = shlex.split(env.get(PROBE_PREFIX_ENV, ""))
    # Under a prefix (an emulator) nothing is timed: the probe says whether the library runs
    # on the emulated CPU and multiplies right, and the preference order chooses. qemu's TCG
    # ran AOCL-BLAS at 0.03 GFLOPS on a Sapphire Rapids host: one timed round took 155 s, past
    # the limit, where the checks alone take ~10 s.
    rounds = 0 if prefix else PROBE_ROUNDS
    children = [_Child(lib, library_env(lib, env), prefix) for lib in libs]
    try:
        for child in children:  # one at a time: the checks load each library, then it idles
            if child.error is None:
                report = child.line(time.monotonic() + PROBE_TIMEOUT_S)
                if report is not None:
                    child.report = report
        for _ in range(rounds):
            for child in children:
                if child.error is None and child.report.get("provider"):
                    child.time_round(time.monotonic() + PROBE_TIMEOUT_S)
                    time.sleep(_SETTLE_S)
        return tuple(child.result() for child in children)
    finally:
        for child in children:
            child.close()


def probe(lib: BlasLibrary, base_env: Mapping[str, str] | None = None) -> ProbeResult:
    """Preloads ``lib`` into a throwaway child and checks that it is used, right and fast."""
    return probe_all([lib], base_env)[0]


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


def _machine_record(env: Mapping[str, str]) -> Path:
    """Where this machine's last choice is kept, by library *name*: every environment on the
    machine (a fresh clone's venv, a reinstall) starts from it, not only the one that chose."""
    key = f"{PROBE_VERSION}|{cpu_fingerprint()}|{env.get(PROBE_PREFIX_ENV, '')}"
    return cache_dir() / f"machine-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def _write(path: Path, value: object) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(value))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache: probe again next time


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
    if not reprobe:
        try:
            saved = json.loads(cache.read_text())
            results = tuple(ProbeResult(**r) for r in saved["results"])
            chosen = by_path.get(saved["chosen"]) if saved["chosen"] else None
            return Selection(chosen, results, cached=True)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no (readable) cached choice: probe
    record = _machine_record(env)
    try:
        recorded = json.loads(record.read_text())["chosen"]
    except (OSError, ValueError, KeyError, TypeError):
        recorded = None
    results = probe_all(libs, env)
    best = choose(results, recorded if isinstance(recorded, str) else None)
    chosen_path = best.path if best else None
    _write(cache, {"chosen": chosen_path, "results": [asdict(r) for r in results]})
    if best is not None:
        _write(record, {"chosen": best.name})
    return Selection(by_path[best.path] if best else None, results)


def choose(results: Sequence[ProbeResult], recorded: str | None = None) -> ProbeResult | None:
    """The library to run on, from probes in preference order. The ``recorded`` one (the
    name this machine chose last) stays while it is correct and at least :data:`KEEP_FLOOR`
    as fast as the fastest. Otherwise, of the correct ones at least :data:`SPEED_FLOOR` as
    fast as the fastest, the first. So a machine keeps its library through any timing noise
    short of 2x, and a first choice is swayed only by a 1.25x lead."""
    good = [r for r in results if r.ok]
    if not good:
        return None
    fastest = max(r.gflops for r in good)
    kept = next((r for r in good if r.name == recorded), None)
    if kept is not None and kept.gflops >= KEEP_FLOOR * fastest:
        return kept
    return next(r for r in good if r.gflops >= SPEED_FLOOR * fastest)


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
