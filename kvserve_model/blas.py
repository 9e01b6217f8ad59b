"""Run MLX's CPU backend on a fast BLAS that works on *this* CPU, on Linux.

The stock ``mlx[cpu]`` wheel links a bundled *reference* BLAS (``mlx_cpu.libs/libblas-*.so``):
fp32 matmul runs at 4-6 GFLOPS, 20-40x slower than an optimized BLAS on the same cores, and
every prefill and decode step is matmul-bound. ``libmlx.so`` resolves ``cblas_sgemm`` (and the
LAPACK symbols) dynamically, so an unprefixed BLAS loaded *before* it (``LD_PRELOAD``) wins.
numpy's and scipy's OpenBLAS builds are symbol-prefixed (``scipy_cblas_sgemm``) and do not serve.

Not every build runs on every CPU: ``cmeel-openblas`` is built for one target (``SKYLAKEX`` on
x86-64, ``NEOVERSEN2`` on arm64) and dies of SIGILL on CPUs without AVX-512 (or SVE). So the
library is *chosen by measurement*, per machine. The candidates, in :func:`candidates`, in
the order of preference:

- ``KVSERVE_BLAS_LIB=/path/lib.so``: the operator's choice, and then the only candidate;
- AOCL-BLAS (AMD's BLIS, from the ``aoclda`` wheel, a dependency on x86-64): kernels picked at
  run time (zen2/3/4 kernels on AVX2 and AVX-512 CPUs of either vendor, generic C otherwise);
  first, as the one every x86-64 install has;
- a system OpenBLAS (``apt install libopenblas0-pthread``: Debian builds it ``DYNAMIC_ARCH``);
- MKL (``libmkl_rt``), when the operator installed ``mkl`` into the environment;
- ``cmeel-openblas``: the fastest where its single target matches the CPU, last because it
  runs on fewer CPUs than any other.

Each candidate is *probed* in a child process before anything is preloaded into a process that
matters: the child preloads it, checks that MLX's ``cblas_sgemm`` resolves to it, compares a few
products (square, skinny, transposed, vector) against numpy in float64, and times a prefill- and
a decode-shaped product. A child killed by a signal (SIGILL on a missing instruction set), one
that fails or computes wrong results is skipped. The choice must be the same at every start
and in every probe of a machine with the same libraries, so speed decides only where it is
clear (:func:`choose`): each probe times its best of :data:`PROBE_ROUNDS` rounds (a busy core
slows a round, not all of them), candidates within :data:`SPEED_FLOOR` of the fastest count as
equally fast and the preference order picks among them, and a choice recorded on this machine
is kept unless another candidate is clearly faster. Timing alone flipped between AOCL-BLAS and
Debian's OpenBLAS from one probe to the next on a busy 2-core EPYC. With no correct candidate,
MLX keeps its reference BLAS. One warning line says what failed and what it costs. The choice
is cached per (CPU model and flags, candidate files, interpreter) in ``~/.cache/kvserve/blas``,
so only the first start on a machine pays the probes (1-2 s each).

``LD_PRELOAD`` is read only when a process starts, so :func:`ensure_fast_blas` re-executes the
current process once with the preload set (an environment marker stops loops). On macOS MLX
uses Accelerate, and when MLX has a GPU the CPU BLAS is not on the model's path: nothing here
does anything then.

Environment: ``KVSERVE_FAST_BLAS=0`` turns the mechanism off; ``KVSERVE_BLAS_LIB`` names the
library; ``KVSERVE_BLAS_THREADS=N`` sets the chosen library's thread count (unless its own
variable, e.g. ``OPENBLAS_NUM_THREADS``, is set); ``KVSERVE_BLAS_REPROBE=1`` ignores the cached
choice; ``KVSERVE_BLAS_PROBE_PREFIX`` runs the probes under a command (``qemu-x86_64 -cpu
Haswell`` shows what a CPU without AVX-512 would choose). BLAS threads spin while they wait: on
a machine whose cores are shared with other busy processes, all-core OpenBLAS fell from 240 to
11-20 GFLOPS here while one thread kept 137, so colocated services on few cores want 1.

MLX is imported only inside functions (``_gpu_available``, ``matmul_seconds``), so importing
this module loads none; the launcher's ``fast_blas_env`` call still asks MLX whether a GPU is
there. Over 300 lines: one mechanism in three marked sections that run in that order
(candidates, probing, this process), not yet split.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import json
import logging
import os
import platform
import shlex
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

REEXEC_MARKER = "KVSERVE_BLAS_REEXEC"
DISABLE_ENV = "KVSERVE_FAST_BLAS"
LIB_ENV = "KVSERVE_BLAS_LIB"
THREADS_ENV = "KVSERVE_BLAS_THREADS"
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
class BlasLibrary:
    """A BLAS to preload: its file, the directories its own dependencies need on
    ``LD_LIBRARY_PATH``, variables it needs set, and the variable that sets its threads."""

    name: str
    path: str
    library_dirs: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    threads_var: str = "OPENBLAS_NUM_THREADS"


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


@dataclass(frozen=True, slots=True)
class BlasStatus:
    """What :func:`ensure_fast_blas` found: ``fast`` is False when matmuls use reference BLAS."""

    fast: bool
    library: str | None
    detail: str
    threads_var: str | None = None
    notes: tuple[str, ...] = field(default=())


# -- candidates -------------------------------------------------------------------------------


def _site_dirs() -> list[Path]:
    seen: list[Path] = []
    for entry in sys.path:
        path = Path(entry or ".")
        if path.is_dir() and path not in seen:
            seen.append(path)
    return seen


def needed_libraries(lib_path: str) -> list[str]:
    """The DT_NEEDED entries of a 64-bit little-endian ELF shared object (x86-64, arm64), read
    from its dynamic section; [] for a file that is not one, or a bare soname of a system
    library (whose dependencies are installed). The dynamic string table is found through the
    program headers, not by position: patchelf (auditwheel) moves it to the end of the file."""
    try:
        with open(lib_path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    phoff, phentsize, phnum = (
        struct.unpack_from("<Q", data, 0x20)[0],
        *struct.unpack_from("<HH", data, 0x36),
    )
    loads, dynamic = [], None
    for k in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + k * phentsize
        )
        if p_type == 1:  # PT_LOAD
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:  # PT_DYNAMIC
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return []
    needed, strtab = [], None
    for off in range(dynamic[0], dynamic[0] + dynamic[1] - 15, 16):
        tag, value = struct.unpack_from("<qQ", data, off)
        if tag == 0:  # DT_NULL
            break
        if tag == 1:  # DT_NEEDED: an offset into the string table
            needed.append(value)
        elif tag == 5:  # DT_STRTAB: a virtual address
            strtab = next((o + value - v for v, o, n in loads if v <= value < v + n), None)
    if strtab is None:
        return []
    return [data[strtab + n : data.index(b"\0", strtab + n)].decode() for n in needed]


def _needs_gfortran(lib_path: str) -> bool:
    """True if ``lib_path`` lists libgfortran.so.5 among its dependencies."""
    return "libgfortran.so.5" in needed_libraries(lib_path)


def _vendored_dirs(lib_path: str) -> tuple[str, ...]:
    """The library's own directory when a dependency of it lies there: wheels vendor their
    dependencies next to the library under hashed names (``aoclda.libs/libomp-75ed4440.so``)
    and not every library finds them through an RPATH."""
    folder = Path(lib_path).parent
    if any((folder / name).exists() for name in needed_libraries(lib_path)):
        return (str(folder),)
    return ()


def _gfortran_shim_dirs() -> tuple[str, ...] | None:
    """Directories that make ``libgfortran.so.5`` loadable, or None if no copy exists.

    () when the system has it; else a shim directory with a symlink to a vendored copy
    (auditwheel renamed it, e.g. ``mlx_cpu.libs/libgfortran-f7379c93.so.5.0.0``) plus the
    vendored directory itself, for that copy's own renamed dependencies (libquadmath).
    """
    if ctypes.util.find_library("gfortran"):
        return ()
    for site in _site_dirs():
        for libs in ("mlx_cpu.libs", "numpy.libs", "scipy.libs"):
            copies = sorted(glob.glob(str(site / libs / "libgfortran-*.so.5*")))
            if copies:
                shim = _cache_dir()
                link = shim / "libgfortran.so.5"
                if not (link.is_symlink() and os.readlink(link) == copies[0]):
                    tmp = shim / f".libgfortran.{os.getpid()}"
                    tmp.unlink(missing_ok=True)
                    tmp.symlink_to(copies[0])
                    tmp.replace(link)  # atomic: concurrent workers never see a missing link
                return (str(shim), str(Path(copies[0]).parent))
    return None


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvserve" / "blas"
    try:
        base.mkdir(parents=True, exist_ok=True)
        return base
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"kvserve-blas-{os.getuid()}"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def _with_dependencies(name: str, path: str, threads_var: str = "") -> BlasLibrary | None:
    """The library with the directories its dependencies need (vendored next to it, or
    libgfortran), or None when one cannot be met."""
    dirs = _vendored_dirs(path)
    threads_var = threads_var or _threads_var_for(path)
    if _needs_gfortran(path):
        shim = _gfortran_shim_dirs()
        if shim is None:
            return None
        dirs = (*dirs, *shim)
    return BlasLibrary(name, path, dirs, threads_var=threads_var)


def candidates() -> list[BlasLibrary]:
    """Every preloadable BLAS this environment has, in the order of preference (the module
    docstring)."""
    explicit = os.environ.get(LIB_ENV)
    if explicit:
        lib = _with_dependencies(LIB_ENV, explicit) if Path(explicit).exists() else None
        return [lib] if lib else []
    found: list[BlasLibrary | None] = []
    sites = _site_dirs()
    for site in sites:
        blis = sorted(glob.glob(str(site / "aoclda.libs" / "libblis-mt-*.so*")))
        if blis:
            found.append(_with_dependencies("aocl-blis", blis[0]))
            break
    system = ctypes.util.find_library("openblas")
    if system:  # a soname such as "libopenblas.so.0": ld.so searches the default paths
        found.append(BlasLibrary("openblas (system)", system))
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        mkl = sorted(glob.glob(str(Path(prefix) / "lib" / "libmkl_rt.so.*")))
        if mkl:
            if (Path(mkl[0]).parent / "libiomp5.so").exists():
                layer = "INTEL"
            else:
                layer = "GNU" if ctypes.util.find_library("gomp") else "SEQUENTIAL"
            found.append(
                BlasLibrary(
                    "mkl",
                    mkl[0],
                    env=(("MKL_THREADING_LAYER", layer),),
                    threads_var="MKL_NUM_THREADS",
                )
            )
            break
    for site in sites:
        cmeel = site / "cmeel.prefix" / "lib" / "libopenblas.so.0"
        if cmeel.exists():
            found.append(_with_dependencies("cmeel-openblas", str(cmeel)))
            break
    return [lib for lib in found if lib is not None]


# glibc malloc settings for a process whose MLX runs on the CPU. MLX's CPU backend has no
# buffer cache: every temporary (a layer's gathered K/V, its scores) is a malloc and a free.
# glibc gives freed memory back to the kernel (trimming an arena's top, or munmap above the
# mmap threshold) and the next allocation page-faults it in again: a batch-32 decode step of a
# 110M llama at context 1,024 took 225,000 minor faults (880 MB) and 2.3 s of system time.
# Keeping freed memory (a trim threshold of 1 GiB) and serving allocations up to 32 MiB (the
# most mmap_threshold allows) from the arenas took that to 256 faults and 0.66 s. Larger ones
# (a prefill chunk's scores: 256 queries x 4,096 keys x 12 heads is 50 MB) were still mmapped
# and faulted in on every use, 12,300 faults and 21 ms of system time for a 26 ms Q K^T;
# mmap_max 0 serves them from the arenas too (13 ms, no fault). Settings the operator gave in
# GLIBC_TUNABLES win; other allocators ignore the variable.
MALLOC_TUNABLES = (
    ("glibc.malloc.trim_threshold", str(1 << 30)),
    ("glibc.malloc.mmap_threshold", str(32 << 20)),
    ("glibc.malloc.mmap_max", "0"),
)


def with_malloc_tunables(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`MALLOC_TUNABLES` added to ``GLIBC_TUNABLES`` (those not set)."""
    given = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    names = {t.split("=", 1)[0] for t in given}
    added = [f"{name}={value}" for name, value in MALLOC_TUNABLES if name not in names]
    if added:
        env["GLIBC_TUNABLES"] = ":".join([*given, *added])
    return env


def library_env(lib: BlasLibrary, base: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``base`` that starts processes with ``lib`` preloaded (and glibc's malloc
    keeping freed memory: :data:`MALLOC_TUNABLES`)."""
    env = with_malloc_tunables(dict(base))
    for name, value in lib.env:
        env.setdefault(name, value)
    if env.get(THREADS_ENV) and not env.get(lib.threads_var):
        env[lib.threads_var] = env[THREADS_ENV]
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != lib.path]
    env["LD_PRELOAD"] = ":".join([lib.path, *preload])
    if lib.library_dirs:
        paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
        env["LD_LIBRARY_PATH"] = ":".join(
            [*lib.library_dirs, *[p for p in paths if p not in lib.library_dirs]]
        )
    return env


# -- probing ----------------------------------------------------------------------------------

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
    try:
        done = subprocess.run(
            [*prefix, sys.executable, "-c", _PROBE, lib.path, root, str(PROBE_ROUNDS)],
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


def _cpu_fingerprint() -> str:
    """The CPU model and its feature flags: a new machine (or a VM moved to another host
    CPU) means a new choice."""
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
    parts = [str(PROBE_VERSION), sys.executable, _cpu_fingerprint(), env.get(PROBE_PREFIX_ENV, "")]
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
    cache = _cache_dir() / f"choice-{_cache_key(libs, env)}.json"
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


# -- this process -----------------------------------------------------------------------------


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def blas_provider() -> str | None:
    """The file of the ``cblas_sgemm`` this process resolves globally (what MLX calls), or
    None when only MLX's privately linked reference BLAS has one."""
    try:
        scope = ctypes.CDLL(None)
        addr = ctypes.cast(scope.cblas_sgemm, ctypes.c_void_p).value
        dladdr = scope.dladdr
    except (AttributeError, OSError):
        return None
    info = _DlInfo()
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(os.fsdecode(info.dli_fname))


def library_config() -> str | None:
    """The loaded BLAS's own description (OpenBLAS's build config, BLIS's kernel set)."""
    scope = ctypes.CDLL(None)
    try:
        scope.openblas_get_config.restype = ctypes.c_char_p
        return str(scope.openblas_get_config().decode())
    except AttributeError:
        pass
    try:
        scope.bli_arch_query_id.restype = ctypes.c_int
        scope.bli_arch_string.restype = ctypes.c_char_p
        scope.bli_info_get_version_str.restype = ctypes.c_char_p
        arch = scope.bli_arch_string(scope.bli_arch_query_id()).decode()
        return f"{scope.bli_info_get_version_str().decode()} {arch} kernels"
    except AttributeError:
        pass
    try:
        buf = ctypes.create_string_buffer(256)
        scope.MKL_Get_Version_String(buf, len(buf))
        return buf.value.decode().strip()
    except AttributeError:
        return None


def fast_blas_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) that starts processes on the chosen BLAS.

    For launching workers, benchmarks and test runs as subprocesses. Unchanged where no
    library runs here, on macOS, on a GPU, or when disabled.
    """
    env = dict(os.environ if base is None else base)
    if env.get(DISABLE_ENV) == "0" or _gpu_available():
        return env
    selection = select_blas(env)
    line = summary(selection)
    if line:
        logger.warning("%s", line)
    if selection.chosen is None:
        return env
    return library_env(selection.chosen, env)


def _reexec_argv() -> list[str] | None:
    """The argv that restarts this interpreter the way it was started, or None if impossible."""
    orig = list(getattr(sys, "orig_argv", []))
    if len(orig) < 2 or sys.flags.interactive:
        return None
    if orig[-1] == "-" or (not sys.argv or sys.argv[0] in ("", "-")):
        return None  # a script read from stdin cannot be read twice
    return [sys.executable, *orig[1:]]


def _gpu_available() -> bool:
    try:
        import mlx.core as mx

        return bool(mx.is_available(mx.gpu))
    except Exception:  # an MLX without the call or without a backend: CPU it is
        return False


def _threads_var_for(path: str) -> str:
    """The variable that sets the threads of the BLAS in file ``path``, by its kind."""
    name = Path(path).name
    if "blis" in name:
        return "BLIS_NUM_THREADS"
    if "mkl" in name:
        return "MKL_NUM_THREADS"
    return "OPENBLAS_NUM_THREADS"


def ensure_fast_blas() -> BlasStatus:
    """Make this process run matmuls on the chosen BLAS, re-executing it once if needed.

    Call it first thing in a ``main()`` (before any threads or state that a restart would lose).
    Returns (never re-executes) when a BLAS is already preloaded, on macOS, on a GPU, when
    disabled, or when no candidate runs here; the last warns with what it costs.
    """
    if sys.platform == "darwin":
        return BlasStatus(fast=True, library="Accelerate", detail="macOS: MLX uses Accelerate")
    loaded = blas_provider()
    if loaded:
        return BlasStatus(True, loaded, "preloaded", _threads_var_for(loaded))
    if os.environ.get(DISABLE_ENV) == "0":
        return BlasStatus(False, None, f"disabled by {DISABLE_ENV}=0")
    if _gpu_available():
        return BlasStatus(True, None, "MLX runs on the GPU: the CPU BLAS is not on its path")
    if os.environ.get(REEXEC_MARKER):
        return _warn("the chosen BLAS was preloaded but cblas_sgemm does not resolve to it")
    argv = _reexec_argv()
    if argv is None:
        return _warn("cannot restart an interactive or stdin session with LD_PRELOAD")
    selection = select_blas()
    line = summary(selection)
    if selection.chosen is None:
        return _warn(line or "no preloadable BLAS")
    if line:
        logger.warning("%s", line)
    env = library_env(selection.chosen, os.environ)
    env[REEXEC_MARKER] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
    raise AssertionError("unreachable: execve returned")  # pragma: no cover


def _warn(detail: str) -> BlasStatus:
    logger.warning("slow matmuls: %s", detail)
    return BlasStatus(fast=False, library=None, detail=detail)


def matmul_seconds(m: int, k: int, n: int, repeats: int) -> float:
    """Seconds of one fp32 ``(m, k) @ (k, n)`` on MLX's CPU backend, averaged over
    ``repeats`` after one untimed run."""
    import mlx.core as mx

    with mx.stream(mx.cpu):
        a = mx.random.normal((m, k), key=mx.random.key(1))
        b = mx.random.normal((k, n), key=mx.random.key(2))
        mx.eval(a, b, a @ b)
        start = time.perf_counter()
        for _ in range(repeats):
            mx.eval(a @ b)
        return (time.perf_counter() - start) / repeats


def measure_gflops(n: int = 512, repeats: int = 5) -> float:
    """fp32 matmul throughput of MLX's CPU backend in GFLOPS, for the startup log line."""
    return 2 * n**3 / matmul_seconds(n, n, n, repeats) / 1e9


def describe(status: BlasStatus, gflops: float | None = None) -> str:
    """One log line: which BLAS, its build, threads, and how fast."""
    speed = f", fp32 matmul {gflops:.0f} GFLOPS" if gflops is not None else ""
    if status.fast and not status.library:
        return f"BLAS: not used ({status.detail})"
    if not status.fast or not status.library:
        return f"BLAS: MLX's reference BLAS ({status.detail}){speed}"
    config = library_config() if status.library != "Accelerate" else None
    threads = os.environ.get(status.threads_var or "", "") or "all cores"
    build = f", {config}" if config else ""
    return f"BLAS: {Path(status.library).name} ({status.detail}{build}, threads: {threads}){speed}"


def main(argv: list[str]) -> int:
    """``python -m kvserve_model.blas [--reprobe]``: probe, choose and report;
    ``python -m kvserve_model.blas run CMD...``: exec CMD on the chosen BLAS."""
    if argv[:1] == ["run"]:
        cmd = argv[2:] if argv[1:2] == ["--"] else argv[1:]
        if not cmd:
            print("usage: python -m kvserve_model.blas run [--] CMD [ARGS...]", file=sys.stderr)
            return 2
        os.execvpe(cmd[0], cmd, fast_blas_env())
    if "--reprobe" in argv and not os.environ.get(REEXEC_MARKER):
        for result in select_blas(reprobe=True).results:
            verdict = f"{result.gflops:.0f} GFLOPS" if result.ok else "rejected"
            print(f"probe: {result.name}: {verdict}: {result.detail}")
    status = ensure_fast_blas()
    print(describe(status, measure_gflops()))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    raise SystemExit(main(sys.argv[1:]))
