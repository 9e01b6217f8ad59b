"""Writing a random benchmark model as an mlx-lm model directory (shared by the benchmarks)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


def save_model(directory: Path, model: Any, config: dict, tokenizer_from: Path) -> int:
    """Writes ``model``'s weights and ``config`` to ``directory`` with the tokenizer files of
    the model directory ``tokenizer_from``; returns the parameter count."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    directory.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    (directory / "config.json").write_text(json.dumps(config))
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, directory / f.name)
    return sum(v.size for v in weights.values())
