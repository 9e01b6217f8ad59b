"""One context-length rule for the worker and the gateway, on the config shapes of many families.

The worker used to check four keys and fall back to 4096, the gateway one key and 2048: a GPT-2
config got 1024 on the worker and 2048 on the gateway, which then forwarded prompts that every
worker refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from gateway.tokenizer import Tokenizer
from kvserve_model.context import FALLBACK_CONTEXT, context_length, load_config
from kvserve_model.errors import ModelLoadError
from kvserve_model.tiny_model import ensure_tiny_model

# Shaped like each family's config.json: the fields the rule reads, and neighbours that must not
# fool it.
CONFIGS: dict[str, tuple[dict[str, Any], int]] = {
    "llama": ({"model_type": "llama", "max_position_embeddings": 131072}, 131072),
    "qwen2": (
        {"model_type": "qwen2", "max_position_embeddings": 32768, "sliding_window": 4096},
        32768,
    ),
    "gpt2": ({"model_type": "gpt2", "n_positions": 1024, "n_ctx": 1024}, 1024),
    "gpt_bigcode": ({"model_type": "gpt_bigcode", "n_positions": 8192}, 8192),
    "chatglm": ({"model_type": "chatglm", "seq_length": 32768}, 32768),
    # Qwen-1 declares both: the first key of the rule wins.
    "qwen": ({"model_type": "qwen", "max_position_embeddings": 32768, "seq_length": 8192}, 32768),
    "olmo (hf_olmo)": ({"model_type": "hf_olmo", "max_sequence_length": 2048}, 2048),
    # Multimodal wrappers: the language model's field, never the vision tower's.
    "gemma3": (
        {
            "model_type": "gemma3",
            "text_config": {"model_type": "gemma3_text", "max_position_embeddings": 131072},
            "vision_config": {"model_type": "siglip_vision_model", "image_size": 896},
        },
        131072,
    ),
    "llava": (
        {
            "model_type": "llava",
            "text_config": {"model_type": "llama", "max_position_embeddings": 4096},
            "vision_config": {"max_position_embeddings": 577},
        },
        4096,
    ),
    "wrapper with a null at the top": (
        {"max_position_embeddings": None, "text_config": {"max_position_embeddings": 131072}},
        131072,
    ),
    # Nothing declared (state-space models have no positional limit): the fallback.
    "mamba": ({"model_type": "mamba", "hidden_size": 768}, FALLBACK_CONTEXT),
    "nonsense values": (
        {"max_position_embeddings": True, "n_positions": 0, "seq_length": "8192"},
        FALLBACK_CONTEXT,
    ),
}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_context_length_of_each_family(family: str) -> None:
    config, expected = CONFIGS[family]
    assert context_length(config) == expected


def _model_with_config(tmp_path: Path, **config: Any) -> Path:
    model = tmp_path / "model"
    shutil.copytree(ensure_tiny_model(), model)
    base = json.loads((model / "config.json").read_text())
    base.pop("max_position_embeddings")
    (model / "config.json").write_text(json.dumps({**base, **config}))
    return model


@pytest.mark.parametrize("family", ["gpt2", "chatglm", "gemma3", "mamba"])
def test_the_gateway_checks_requests_against_the_same_number(tmp_path: Path, family: str) -> None:
    """The gateway's context is the rule's answer for the model directory it serves (the worker
    passes ``context_length(loaded.config)`` to its engine)."""
    config, expected = CONFIGS[family]
    model = _model_with_config(tmp_path, **{k: v for k, v in config.items() if k != "model_type"})
    assert context_length(load_config(model)) == expected
    assert Tokenizer.load(str(model)).max_context == expected
    assert Tokenizer.load(str(model), max_model_len=77).max_context == 77  # the operator's cap


def test_an_unreadable_config_is_a_model_load_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="unreadable"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="not a JSON object"):
        load_config(tmp_path)
