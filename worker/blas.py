"""Run MLX's CPU backend on an optimized BLAS on Linux.

The stock ``mlx[cpu]`` wheel links a bundled *reference* BLAS (``mlx_cpu.libs/libblas-*.so``):
fp32 matmul runs at about 5 GFLOPS, roughly 40x slower than OpenBLAS on the same cores, and
every prefill and decode step is matmul-bound. ``libmlx.so`` resolves ``cblas_sgemm`` and the
LAPACK symbols dynamically, so an unprefixed OpenBLAS loaded *before* it (``LD_PRELOAD``) wins.
numpy's and scipy's OpenBLAS builds are symbol-prefixed (``scipy_cblas_sgemm``) and do not serve.

The library comes from the ``cmeel-openblas`` wheel (``cmeel.prefix/lib/libopenblas.so.0``). It
needs ``libgfortran.so.5``, which slim images lack; the wheels already installed here (mlx,
numpy) vendor a renamed copy, so a symlink under the canonical name in a small shim directory on
``LD_LIBRARY_PATH`` satisfies the loader. A system OpenBLAS (``apt install libopenblas0``) or an
explicit ``KVSERVE_BLAS_LIB=/path/libopenblas.so`` also work.

``LD_PRELOAD`` is read only when a process starts, so :func:`ensure_fast_blas` re-executes the
current process once with the preload set (an environment marker stops loops), after checking
in a throwaway child that the preload loads: a missing dependency of a preloaded library is fatal
to the process, and a worker must rather run slowly than not at all. On macOS MLX uses Accelerate
and nothing here does anything.

Environment: ``KVSERVE_FAST_BLAS=0`` turns the whole mechanism off; ``KVSERVE_BLAS_LIB`` names
the library explicitly; ``KVSERVE_BLAS_THREADS=N`` sets OpenBLAS's thread count (unless
``OPENBLAS_NUM_THREADS`` is set). OpenBLAS threads spin while they wait for each other: on a
machine whose cores are shared with other busy processes, all-core BLAS fell from 240 to 11-20
GFLOPS here while one thread kept 137, so colocated services on few cores want 1.
"""

from __future__ import annotations

import ctypes.util
import glob
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

REEXEC_MARKER = "KVSERVE_BLAS_REEXEC"
DISABLE_ENV = "KVSERVE_FAST_BLAS"
LIB_ENV = "KVSERVE_BLAS_LIB"
THREADS_ENV = "KVSERVE_BLAS_THREADS"


@dataclass(frozen=True, slots=True)
class BlasLibrary:
    """An OpenBLAS to preload and the extra library directories its dependencies need."""

    path: str
    library_dirs: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BlasStatus:
    """What :func:`ensure_fast_blas` found: ``fast`` is False when matmuls use reference BLAS."""

    fast: bool
    library: str | None
    detail: str


def _site_dirs() -> list[Path]:
    seen: list[Path] = []
    for entry in sys.path:
        path = Path(entry or ".")
        if path.is_dir() and path not in seen:
            seen.append(path)
    return seen


def _find_openblas() -> str | None:
    explicit = os.environ.get(LIB_ENV)
    if explicit:
        return explicit if Path(explicit).exists() else None
    for site in _site_dirs():
        candidate = site / "cmeel.prefix" / "lib" / "libopenblas.so.0"
        if candidate.exists():
            return str(candidate)
    system = ctypes.util.find_library("openblas")
    return system  # a soname such as "libopenblas.so.0": ld.so searches the default paths


def _needs_gfortran(lib_path: str) -> bool:
    """True if ``lib_path`` lists libgfortran.so.5 among its dependencies (ELF DT_NEEDED)."""
    try:
        with open(lib_path, "rb") as f:
            head = f.read(8 << 20)  # .dynstr sits in the first loadable segment
    except OSError:
        return False  # a bare soname of a system library: its dependencies are installed
    return b"libgfortran.so.5" in head


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
                shim = _shim_dir()
                link = shim / "libgfortran.so.5"
                if not (link.is_symlink() and os.readlink(link) == copies[0]):
                    tmp = shim / f".libgfortran.{os.getpid()}"
                    tmp.unlink(missing_ok=True)
                    tmp.symlink_to(copies[0])
                    tmp.replace(link)  # atomic: concurrent workers never see a missing link
                return (str(shim), str(Path(copies[0]).parent))
    return None


def _shim_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvserve" / "blas"
    try:
        base.mkdir(parents=True, exist_ok=True)
        return base
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"kvserve-blas-{os.getuid()}"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def find_fast_blas() -> BlasLibrary | None:
    """Locate a preloadable OpenBLAS on Linux, or None (macOS, disabled, or not installed)."""
    if not sys.platform.startswith("linux") or os.environ.get(DISABLE_ENV) == "0":
        return None
    lib = _find_openblas()
    if lib is None:
        return None
    dirs: tuple[str, ...] = ()
    if _needs_gfortran(lib):
        shim = _gfortran_shim_dirs()
        if shim is None:
            return None
        dirs = shim
    return BlasLibrary(path=lib, library_dirs=dirs)


def fast_blas_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) that starts processes on the fast BLAS.

    For launching workers, benchmarks and test runs as subprocesses. Unchanged where no
    library is found or on macOS.
    """
    env = dict(os.environ if base is None else base)
    lib = find_fast_blas()
    if lib is None:
        return env
    if env.get(THREADS_ENV) and not env.get("OPENBLAS_NUM_THREADS"):
        env["OPENBLAS_NUM_THREADS"] = env[THREADS_ENV]
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if lib.path not in preload:
        env["LD_PRELOAD"] = ":".join([lib.path, *preload])
    if lib.library_dirs:
        paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
        env["LD_LIBRARY_PATH"] = ":".join(
            [*lib.library_dirs, *[p for p in paths if p not in lib.library_dirs]]
        )
    return env


def loaded_openblas() -> str | None:
    """The path of an OpenBLAS mapped into this process, from /proc/self/maps, or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) >= 6 and "libopenblas" in Path(fields[5]).name:
            return fields[5]
    return None


def _preload_works(env: Mapping[str, str]) -> bool:
    try:
        probe = subprocess.run(
            [sys.executable, "-c", "pass"], env=dict(env), capture_output=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _reexec_argv() -> list[str] | None:
    """The argv that restarts this interpreter the way it was started, or None if impossible."""
    orig = list(getattr(sys, "orig_argv", []))
    if len(orig) < 2 or sys.flags.interactive:
        return None
    if orig[-1] == "-" or (not sys.argv or sys.argv[0] in ("", "-")):
        return None  # a script read from stdin cannot be read twice
    return [sys.executable, *orig[1:]]


def ensure_fast_blas() -> BlasStatus:
    """Make this process run matmuls on OpenBLAS, re-executing it once if needed.

    Call it first thing in a ``main()`` (before any threads or state that a restart would lose).
    Returns (never re-executes) when the library is already loaded, on macOS, when disabled, when
    nothing preloadable is installed, or when the preload fails to load; those cases warn.
    """
    if sys.platform == "darwin":
        return BlasStatus(fast=True, library="Accelerate", detail="macOS: MLX uses Accelerate")
    loaded = loaded_openblas()
    if loaded:
        return BlasStatus(fast=True, library=loaded, detail="OpenBLAS preloaded")
    if os.environ.get(DISABLE_ENV) == "0":
        return BlasStatus(fast=False, library=None, detail=f"disabled by {DISABLE_ENV}=0")
    lib = find_fast_blas()
    if lib is None:
        return _warn("no preloadable OpenBLAS found (pip install cmeel-openblas)")
    if os.environ.get(REEXEC_MARKER):
        return _warn(f"{lib.path} was preloaded but is not mapped; running on reference BLAS")
    argv = _reexec_argv()
    if argv is None:
        return _warn("cannot restart an interactive or stdin session with LD_PRELOAD")
    env = fast_blas_env()
    if not _preload_works(env):
        return _warn(f"preloading {lib.path} fails; running on reference BLAS")
    env[REEXEC_MARKER] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
    raise AssertionError("unreachable: execve returned")  # pragma: no cover


def _warn(detail: str) -> BlasStatus:
    logger.warning("slow matmuls: %s", detail)
    return BlasStatus(fast=False, library=None, detail=detail)


def measure_gflops(n: int = 512, repeats: int = 5) -> float:
    """fp32 matmul throughput of MLX's CPU backend in GFLOPS, for the startup log line."""
    import mlx.core as mx

    with mx.stream(mx.cpu):
        a = mx.random.normal((n, n), key=mx.random.key(0))
        b = mx.random.normal((n, n), key=mx.random.key(1))
        mx.eval(a, b, a @ b)
        start = time.perf_counter()
        for _ in range(repeats):
            mx.eval(a @ b)
        elapsed = (time.perf_counter() - start) / repeats
    return 2 * n**3 / elapsed / 1e9


def describe(status: BlasStatus, gflops: float | None = None) -> str:
    """One log line: which BLAS and how fast."""
    speed = f", fp32 matmul {gflops:.0f} GFLOPS" if gflops is not None else ""
    name = Path(status.library).name if status.library else "reference BLAS"
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "all cores") if status.fast else "1"
    return f"BLAS: {name} ({status.detail}, threads: {threads}){speed}"


def main(argv: list[str]) -> int:
    """``python -m worker.blas``: report; ``python -m worker.blas run CMD...``: exec CMD on it."""
    if argv[:1] == ["run"]:
        cmd = argv[2:] if argv[1:2] == ["--"] else argv[1:]
        if not cmd:
            print("usage: python -m worker.blas run [--] CMD [ARGS...]", file=sys.stderr)
            return 2
        os.execvpe(cmd[0], cmd, fast_blas_env())
    status = ensure_fast_blas()
    print(describe(status, measure_gflops()))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(main(sys.argv[1:]))
