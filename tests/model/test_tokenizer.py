"""The gateway's tokenizer (``kvserve_model.tokenizer``, no MLX) against mlx-lm's loader, which the
workers use: the same ids, the same decoded text, the same rendered chat template.

Each variant is the embedded default model with its tokenizer files changed to exercise one
part of mlx-lm's loading: thinking tokens (the ``enable_thinking`` default), mlx-lm's
``NewlineTokenizer`` class, and a Python chat template named by ``chat_template_type``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvserve_model.tiny_model import ensure_tiny_model
from kvserve_model.tokenizer import ModelTokenizer, load_tokenizer

THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking %}<think>{% else %}<think></think>{% endif %}{% endif %}"
)
VARIANTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "default": ({}, ()),
    "thinking": ({"chat_template": THINKING_TEMPLATE}, ("<think>", "</think>")),
    "newline": ({"tokenizer_class": "NewlineTokenizer"}, ()),
    "python template": ({"chat_template_type": "deepseek_v32"}, ()),
}
TEXTS = ["a\nb", "Héllo 👋 wörld", "<|im_start|>user\nhi<|im_end|>", "\n\n  tabs\tand spaces  "]
CHATS: list[tuple[list[dict[str, str]], dict[str, Any]]] = [
    ([{"role": "user", "content": "Hi!"}], {"add_generation_prompt": True}),
    (
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Héllo\n👋"}],
        {"add_generation_prompt": True, "enable_thinking": False},
    ),
    (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
        {"add_generation_prompt": False, "continue_final_message": True},
    ),
]


def _variant(root: Path, name: str) -> Path:
    extra_config, added = VARIANTS[name]
    model = root / name.replace(" ", "_")
    shutil.copytree(ensure_tiny_model(), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    for i, content in enumerate(added):
        token = {"content": content, "lstrip": False, "normalized": False, "rstrip": False}
        token |= {"single_word": False, "special": True}
        tokenizer["added_tokens"].append({"id": 264 + i, **token})
        config["added_tokens_decoder"][str(264 + i)] = token
    (model / "tokenizer_config.json").write_text(json.dumps({**config, **extra_config}))
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from mlx_lm.tokenizer_utils import load

    model = _variant(tmp_path_factory.mktemp("tokenizers"), request.param)
    return request.param, load_tokenizer(model), load(model)


def test_same_ids_and_text(pair: tuple[str, ModelTokenizer, Any]) -> None:
    _, ours, theirs = pair
    assert type(ours.hf).__name__ == type(theirs._tokenizer).__name__
    assert len(ours) == len(theirs)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == list(theirs.encode(text)), text
        assert ours.encode(text, add_special_tokens=False) == list(
            theirs.encode(text, add_special_tokens=False)
        )
        assert ours.decode(ids) == theirs.decode(ids), text


def test_same_chat_template(pair: tuple[str, ModelTokenizer, Any]) -> None:
    name, ours, theirs = pair
    assert ours.has_chat_template == theirs.has_chat_template
    assert ours.has_thinking == theirs.has_thinking == (name == "thinking")
    for messages, kwargs in CHATS:
        if name == "python template" and kwargs.get("continue_final_message"):
            continue  # deepseek_v32's template has no continue_final_message
        expected = theirs.apply_chat_template(messages, tokenize=False, **kwargs)
        assert ours.render_chat(messages, **kwargs) == expected, (messages, kwargs)


def test_thinking_is_on_by_default_where_the_vocabulary_has_it(tmp_path: Path) -> None:
    ours = load_tokenizer(_variant(tmp_path, "thinking"))
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.render_chat(chat, add_generation_prompt=True).endswith("assistant\n<think>")
    off = ours.render_chat(chat, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<think></think>")
