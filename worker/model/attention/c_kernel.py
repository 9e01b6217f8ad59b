"""A C source of this package compiled once per machine with the system's C compiler and
loaded with ctypes: the CPU decode kernel (``paged_decode_cpu.c``) without an LLVM in the
serving process.

numba compiled the same kernel at first use, and kept LLVM loaded for the life of the worker:
159 MiB of its resident memory (measured: RSS after importing numba and running the cached
kernel once, against before). A shared object built by ``cc`` costs nothing but its pages.
The build goes to ``~/.cache/kvserve/kernels`` (``XDG_CACHE_HOME``), named by a hash of the
source, the flags, the compiler's version and the CPU (``-march=native``: a library built for
one CPU may use instructions another lacks, so a machine with another CPU builds its own),
through a temporary file and a rename, so concurrent workers never load a half-written one.
Without a compiler (or where the build fails) the caller falls back (numba, then MLX's paths).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvserve_model.blas_probe import cpu_fingerprint
from kvserve_model.model_cache import user_cache_dir

log = logging.getLogger(__name__)

# Flags: vectorized dot products need reassociation; no -ffast-math as a whole, because the
# kernel's online softmax starts from -inf (finite-math-only would break it).
FLAGS = (
    "-O3",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-ffp-contract=fast",
)
NATIVE = ("-march=native",)


def compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on PATH."""
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def cache_dir() -> Path:
    return user_cache_dir("kernels")


def _version(cc: str) -> str:
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return done.stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(source: Path) -> Path | None:
    """The shared object of ``source`` for this machine, built on first use; None where no
    compiler builds it (logged)."""
    cc = compiler()
    if cc is None:
        log.info("no C compiler on PATH: %s is not built", source.name)
        return None
    text = source.read_bytes()
    for flags in ((*FLAGS, *NATIVE), FLAGS):
        key = hashlib.sha256(
            b"\0".join(
                [text, " ".join(flags).encode(), _version(cc).encode(), cpu_fingerprint().encode()]
            )
        ).hexdigest()[:20]
        target = cache_dir() / f"{source.stem}-{key}.so"
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{source.stem}-", suffix=".so")
        os.close(fd)
        cmd = [cc, *flags, "-o", tmp, str(source), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as err:
            done = None
            log.info("building %s failed: %s", source.name, err)
        if done is not None and done.returncode == 0:
            os.replace(tmp, target)  # atomic: a concurrent build wrote the same bytes
            return target
        Path(tmp).unlink(missing_ok=True)
        if done is not None:
            log.info("building %s with %s failed: %s", source.name, flags, done.stderr.strip())
    return None


def load(source: Path) -> ctypes.CDLL | None:
    """``source`` built (:func:`build`) and loaded; None where it cannot be."""
    path = build(source)
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as err:
        log.info("loading %s failed: %s", path, err)
        return None
