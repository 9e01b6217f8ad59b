"""Resolve a model name to a directory, load it with mlx-lm, and fingerprint it.

``kvserve-tiny-llama`` (the default) is the embedded model made locally by
``worker.default_model``; any other name is what ``mlx_lm.load`` accepts: a local model
directory or a Hugging Face id (downloaded where a network or a local copy exists).

The fingerprint travels with the worker's pool registration: the cache service must never match
a prefix computed by one model against blocks of another, and two workers with the same
fingerprint may share routing. It hashes the config, the tokenizer (the index is keyed by token
ids) and the weights' identity: each safetensors file's name, size, header (names, dtypes,
shapes) and its first and last MiB of data. Reading every byte of a many-GB checkpoint at each
start would cost seconds; a fine-tune changes the sampled bytes too.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from worker.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from worker.errors import ModelLoadError

SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready to serve: mlx-lm module, tokenizer wrapper, where it came from."""

    model: nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    path: Path
    fingerprint: str
    config: dict[str, Any]


def resolve_model(name_or_path: str | None = None) -> Path:
    """The local directory of a model: the embedded default, a directory, or a hub download."""
    if not name_or_path or name_or_path == DEFAULT_MODEL_NAME:
        return ensure_default_model()
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json: not a model directory")
        return path
    if _is_path(name_or_path):
        raise ModelLoadError(f"model directory {path} does not exist")
    from mlx_lm.utils import _download  # mlx_lm.load's own resolution of hub ids

    try:
        return Path(_download(name_or_path))
    except Exception as e:  # the hub client raises many types; all mean "not available"
        raise ModelLoadError(f"cannot resolve model {name_or_path!r}: {e}") from e


def _is_path(name: str) -> bool:
    """A Hugging Face id is ``name`` or ``owner/name``; anything else names a directory (the
    hub client would answer it with a puzzling "Repo id must be in the form ...")."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def load_model(name_or_path: str | None = None, *, fp32_on_cpu: bool = True) -> LoadedModel:
    """Resolve and load a model with ``mlx_lm.load``.

    On the CPU device, unquantized fp16/bf16 weights are cast to fp32 (``fp32_on_cpu``): MLX's
    CPU backend runs half precision without BLAS, about 25x slower.
    """
    import mlx_lm

    path = resolve_model(name_or_path)
    try:
        loaded = mlx_lm.load(str(path), return_config=True)
        model, tokenizer, config = cast(tuple[nn.Module, Any, dict[str, Any]], loaded)
    except Exception as e:
        raise ModelLoadError(f"mlx_lm.load({str(path)!r}) failed: {e}") from e
    quantized = "quantization" in config or "quantization_config" in config
    if fp32_on_cpu and not quantized and mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
    return LoadedModel(model, tokenizer, path, model_fingerprint(path), config)


def model_fingerprint(path: Path) -> str:
    """A stable id of the model in ``path``: ``sha256:<hex>`` (see the module docstring)."""
    h = hashlib.sha256()
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}/config.json unreadable: {e}") from e
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        file = path / name
        if file.exists():
            h.update(name.encode() + hashlib.sha256(file.read_bytes()).digest())
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    for file in weights:
        h.update(file.name.encode())
        h.update(_weights_identity(file))
    return "sha256:" + h.hexdigest()


def _weights_identity(file: Path) -> bytes:
    size = file.stat().st_size
    with open(file, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = f.read(header_len)
        data_start = 8 + header_len
        head = f.read(SAMPLE_BYTES)
        f.seek(max(data_start, size - SAMPLE_BYTES))
        tail = f.read(SAMPLE_BYTES)
    return hashlib.sha256(struct.pack("<Q", size) + header + head + tail).digest()
