"""Where kvserve keeps the models it makes: the tiny test model and converted GGUF files.

``$KVSERVE_MODEL_DIR`` where set, else ``$XDG_CACHE_HOME/kvserve/models`` (``~/.cache``). Each
model is one directory in it, written to a temporary sibling and renamed into place, so
processes that start together never load a half-written one.
"""

from __future__ import annotations

import os
from pathlib import Path

MODEL_DIR_ENV = "KVSERVE_MODEL_DIR"


def models_dir() -> Path:
    explicit = os.environ.get(MODEL_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "kvserve" / "models"
