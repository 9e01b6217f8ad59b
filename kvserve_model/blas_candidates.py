"""Which BLAS libraries this environment could preload, and the environment that preloads one.

The first of ``kvserve_model.blas``'s three steps (its docstring tells the whole mechanism):
:func:`candidates` lists every preloadable BLAS in the order of preference, each with the
directories its own dependencies need (vendored next to it, or a libgfortran shim), and
:func:`library_env` is the environment that starts a process on one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import mmap
import os
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvserve_model.model_cache import user_cache_dir

LIB_ENV = "KVSERVE_BLAS_LIB"
THREADS_ENV = "KVSERVE_BLAS_THREADS"


@dataclass(frozen=True, slots=True)
class BlasLibrary:
    """A BLAS to preload: its file, the directories its own dependencies need on
    ``LD_LIBRARY_PATH``, variables it needs set, and the variable that sets its threads."""

    name: str
    path: str
    library_dirs: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    threads_var: str = "OPENBLAS_NUM_THREADS"


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
    program headers, not by position: patchelf (auditwheel) moves it to the end of the file.

    The file is mapped, not read: a BLAS is 15-40 MB, and a copy read into the heap stayed in
    the process (glibc keeps a freed block that size), 16 MiB of the launcher's 42 for good."""
    try:
        with open(lib_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _dt_needed(data)
    except (OSError, ValueError, struct.error):  # unreadable, empty (ValueError) or cut short
        return []


def _dt_needed(data: mmap.mmap) -> list[str]:
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
    return [data[strtab + n : data.find(b"\0", strtab + n)].decode() for n in needed]


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
                shim = cache_dir()
                link = shim / "libgfortran.so.5"
                if not (link.is_symlink() and os.readlink(link) == copies[0]):
                    tmp = shim / f".libgfortran.{os.getpid()}"
                    tmp.unlink(missing_ok=True)
                    tmp.symlink_to(copies[0])
                    tmp.replace(link)  # atomic: concurrent workers never see a missing link
                return (str(shim), str(Path(copies[0]).parent))
    return None


def cache_dir() -> Path:
    """Where the libgfortran shim and the probes' cached choices live (per user)."""
    return user_cache_dir("blas")


def _with_dependencies(name: str, path: str, threads_var: str = "") -> BlasLibrary | None:
    """The library with the directories its dependencies need (vendored next to it, or
    libgfortran), or None when one cannot be met."""
    dirs = _vendored_dirs(path)
    threads_var = threads_var or threads_var_for(path)
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


def trim_heap() -> int | None:
    """Gives the heap's free memory back to the kernel (glibc's ``malloc_trim``); for a worker
    once its start-up is over. :data:`MALLOC_TUNABLES` keep freed memory for the next step, so
    they would also keep, for good, what start-up freed: a quantized model's packed weights
    once dequantized (142 MiB of the default model's 798 after loading), the self-check's
    dense caches, the warm-up's temporaries. Returns the resident bytes freed (0 where
    ``/proc`` cannot say); None where the C library has no ``malloc_trim`` (not glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    before = _resident_bytes()
    trim(0)
    return max(0, before - _resident_bytes())


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


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


def threads_var_for(path: str) -> str:
    """The variable that sets the threads of the BLAS in file ``path``, by its kind."""
    name = Path(path).name
    if "blis" in name:
        return "BLIS_NUM_THREADS"
    if "mkl" in name:
        return "MKL_NUM_THREADS"
    return "OPENBLAS_NUM_THREADS"
