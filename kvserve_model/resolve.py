"""A model name to the local directory that holds it.

``kvserve-tiny-llama`` (the default, also for an empty name) is the embedded model that
``kvserve_model.default_model`` makes locally; a path names a model directory; anything else is
a Hugging Face id, downloaded (or found in the hub cache) the way ``mlx_lm.load`` does it: the
same file patterns, so a worker and a gateway on one host share one snapshot, and the worker's
``mlx_lm.load`` of the directory downloads nothing more.

No MLX: ``mlx_lm.utils._download`` would do the same, but importing ``mlx_lm`` imports MLX, and
the gateway resolves models too.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvserve_model.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from kvserve_model.errors import ModelLoadError

# mlx_lm.utils.DEFAULT_ALLOW_PATTERNS (mlx-lm 0.32): what a hub download fetches.
HUB_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)


def resolve_model(name_or_path: str | None = None) -> Path:
    """The local directory of a model: the embedded default, a directory, or a hub download.
    Raises ModelLoadError when there is none."""
    if not name_or_path or name_or_path == DEFAULT_MODEL_NAME:
        return ensure_default_model()
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json: not a model directory")
        return path
    if _is_path(name_or_path):
        raise ModelLoadError(f"model directory {path} does not exist")
    try:
        return _download(name_or_path)
    except Exception as e:  # the hub client raises many types; all mean "not available"
        raise ModelLoadError(f"cannot resolve model {name_or_path!r}: {e}") from e


def _is_path(name: str) -> bool:
    """A Hugging Face id is ``name`` or ``owner/name``; anything else names a directory (the
    hub client would answer it with a puzzling "Repo id must be in the form ...")."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def _download(repo_id: str) -> Path:
    """``mlx_lm.utils._download``: the hub snapshot of ``repo_id`` (ModelScope's where
    ``MLXLM_USE_MODELSCOPE=true``, as mlx-lm reads it)."""
    if os.getenv("MLXLM_USE_MODELSCOPE", "False").lower() == "true":
        from modelscope import snapshot_download
    else:
        from huggingface_hub import snapshot_download
    return Path(snapshot_download(repo_id, allow_patterns=list(HUB_PATTERNS)))
