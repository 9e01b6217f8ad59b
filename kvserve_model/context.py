"""The model's context length, read from its ``config.json``: one rule for every process.

The worker sizes its engine by it (prompt plus completion must fit) and the gateway refuses
requests that would not fit before routing them; they must agree, or the gateway forwards
requests the worker then refuses (or refuses ones the worker would serve).

Families name the field differently: ``max_position_embeddings`` (Llama, Qwen, Mistral, Gemma,
Phi: most), ``n_positions`` (GPT-2, GPT-BigCode, GPT-J), ``seq_length`` (ChatGLM, Qwen-1,
PLaMo 2), ``max_sequence_length`` (a few older configs). Wrappers of a language model (Gemma 3,
Mistral 3, Qwen-VL, Llama 4) keep it in ``text_config``. The first of these keys at the top
level wins, then the same in ``text_config``; a config with none gets :data:`FALLBACK_CONTEXT`
(the worker's fallback before this rule was shared; the gateway's was 2048).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvserve_model.errors import ModelLoadError

CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length")
FALLBACK_CONTEXT = 4096


def context_length(config: Mapping[str, Any]) -> int:
    """The context length that ``config`` (a model's ``config.json``) declares, or
    :data:`FALLBACK_CONTEXT` when it declares none (see the module docstring)."""
    for key in CONTEXT_KEYS:
        value = config.get(key)
        # bool is an int too; a null or non-positive value declares nothing.
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    text = config.get("text_config")
    return context_length(text) if isinstance(text, Mapping) else FALLBACK_CONTEXT


def load_config(path: Path) -> dict[str, Any]:
    """The ``config.json`` of the model directory ``path``. Raises ModelLoadError."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}/config.json unreadable: {e}") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}/config.json is not a JSON object")
    return config
