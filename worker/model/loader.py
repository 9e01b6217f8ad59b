"""Load a model's weights with mlx-lm, and fingerprint it.

The name resolves to a directory through ``kvserve_model.resolve`` (the embedded default
``kvserve-tiny-llama``, a model directory, or a Hugging Face id, downloaded where a network or a
local copy exists), as the gateway resolves it for its tokenizer; this module is the part that
needs MLX.

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

from kvserve_model.context import load_config
from kvserve_model.errors import ModelLoadError
from kvserve_model.resolve import resolve_model

SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready to serve: mlx-lm module, tokenizer wrapper, where it came from."""

    model: nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    path: Path
    fingerprint: str
    config: dict[str, Any]


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
    config = load_config(path)
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
