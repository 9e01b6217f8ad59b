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
that fails or computes wrong results is skipped. The children are timed in alternating rounds
(:func:`probe_all`: one library's round, then the next's), so a busy spell of a shared machine
slows a round of each rather than every round of one. The choice must be the same at every
start and in every probe of a machine, so speed decides only where it is clear
(:func:`choose`): each library's speed is its best of :data:`PROBE_ROUNDS` rounds; a first
choice takes the preferred of those within :data:`SPEED_FLOOR` of the fastest; and the choice
is then recorded for the machine by library name (every venv on it starts from it) and kept
until another candidate is :data:`KEEP_FLOOR` (2x) faster. Timing alone flipped between
AOCL-BLAS and Debian's OpenBLAS from one probe to the next on a busy 2-core EPYC, and between
AOCL-BLAS and cmeel-openblas (straddling the 1.25x floor) on a CI machine. With no correct candidate,
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

The three steps, in the order they run: the candidates (``blas_candidates``), probing and
choosing (``blas_probe``), and this process (here: re-executing on the choice, and reporting
it); this module's names include the other two's, so callers import from here alone.

MLX is imported only inside functions (``_gpu_available``, ``matmul_seconds``), so importing
this module loads none; ``fast_blas_env`` (the launcher's, the benchmarks') asks a child
process whether MLX has a GPU, so a launcher holds no MLX (~35 MB of its RSS). Both live here,
the one file allowed to import MLX (tests/test_import_rules.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvserve_model.blas_candidates import THREADS_ENV as THREADS_ENV
from kvserve_model.blas_candidates import candidates as candidates
from kvserve_model.blas_candidates import library_env, threads_var_for
from kvserve_model.blas_candidates import trim_heap as trim_heap
from kvserve_model.blas_probe import DISABLE_ENV, REEXEC_MARKER, select_blas, summary
from kvserve_model.blas_probe import PROBE_PREFIX_ENV as PROBE_PREFIX_ENV

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BlasStatus:
    """What :func:`ensure_fast_blas` found: ``fast`` is False when matmuls use reference BLAS."""

    fast: bool
    library: str | None
    detail: str
    threads_var: str | None = None
    notes: tuple[str, ...] = field(default=())


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
    if env.get(DISABLE_ENV) == "0" or _gpu_available(in_process="mlx.core" in sys.modules):
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


def _gpu_available(in_process: bool = True) -> bool:
    """Whether MLX has a GPU here: asked in this process, or (``in_process`` False: a
    launcher that should not hold MLX) in a child, ~50 ms."""
    if not in_process:
        import subprocess

        code = "import mlx.core as mx; print(int(mx.is_available(mx.gpu)))"
        try:
            done = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
            )
        except (OSError, subprocess.SubprocessError):
            return False
        return done.returncode == 0 and done.stdout.strip() == "1"
    try:
        import mlx.core as mx

        return bool(mx.is_available(mx.gpu))
    except Exception:  # an MLX without the call or without a backend: CPU it is
        return False


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
        return BlasStatus(True, loaded, "preloaded", threads_var_for(loaded))
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
