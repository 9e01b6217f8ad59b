"""Where kvserve keeps the models it makes: the tiny test model and converted GGUF files.

``$KVSERVE_MODEL_DIR`` where set, else ``$XDG_CACHE_HOME/kvserve/models`` (``~/.cache``). Each
model is one directory in it, written to a temporary sibling and renamed into place, so
processes that start together never load a half-written one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

MODEL_DIR_ENV = "KVSERVE_MODEL_DIR"


def models_dir() -> Path:
    """Where converted and generated models are kept: ``KVSERVE_MODEL_DIR`` as given, else
    ``$XDG_CACHE_HOME/kvserve/models`` (``~/.cache``), else, where that cannot be written (a
    container's read-only home), a per-user temporary directory: the default model is
    converted there, where the start died of a traceback before."""
    explicit = os.environ.get(MODEL_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    return _writable_or_temporary(
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvserve" / "models",
        "models",
    )


def _writable_or_temporary(base: Path, name: str) -> Path:
    """``base``, made if missing, when this user can write it; else ``kvserve-<name>-<uid>``
    in the temporary directory, made."""
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK | os.X_OK):
            return base
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"kvserve-{name}-{os.getuid()}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def user_cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/kvserve/<name>`` (``~/.cache``), made if missing; a per-user
    temporary directory where it cannot be written (a read-only home): the BLAS choice, the
    CPU kernel's build."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return _writable_or_temporary(cache / "kvserve" / name, name)


def build_once(
    target: Path, write: Callable[[Path], None], is_current: Callable[[Path], bool]
) -> Path:
    """``target``, first written by ``write`` into a temporary sibling and renamed into place
    unless ``is_current(target)`` already: a crash mid-way leaves no half-written model (the
    next start writes it again), and processes racing each write their own copy, the first
    rename winning."""
    if is_current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        if is_current(target):  # another process won the race
            return target
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
