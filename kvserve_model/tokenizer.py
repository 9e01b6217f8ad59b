"""The model's tokenizer, loaded with ``transformers`` the way mlx-lm loads it, without MLX.

The gateway tokenizes (the cache service's index is keyed by token ids) and must agree with the
workers on every id. A worker's tokenizer is mlx-lm's ``TokenizerWrapper`` (``mlx_lm.load``)
around ``AutoTokenizer.from_pretrained`` of the same directory. ``mlx_lm.tokenizer_utils`` needs
no MLX itself, but importing it runs ``mlx_lm/__init__``, which imports MLX, and the gateway runs
no model: it must not need MLX installed, nor load its native libraries (the import rules in
docs/architecture.md). So this module repeats the parts of mlx-lm's loading that change a token
id or a rendered chat template (mlx-lm 0.32):

- the tokenizer is ``AutoTokenizer.from_pretrained(path)``; a checkpoint whose class is mlx-lm's
  ``NewlineTokenizer`` (newlines spelled ``<n>`` in the vocabulary) gets the same class;
- a checkpoint that names a Python chat template (``chat_template_type`` in its
  ``tokenizer_config.json``) is rendered by mlx-lm's module of that name, loaded from its file;
- the thinking switch: unless the caller sets it, mlx-lm passes ``enable_thinking`` (or
  ``thinking``, to tokenizers whose own renderer takes that name) set to whether the vocabulary
  has thinking tokens.

Streaming detokenization stays the worker's (mlx-lm's detokenizers); whole sequences decode with
the Hugging Face tokenizer's own ``decode``, as mlx-lm's wrapper does.
``tests/model/test_tokenizer.py`` checks all of this against mlx-lm's loader.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve_model.context import context_length, load_config
from kvserve_model.errors import ModelLoadError

# mlx_lm.tokenizer_utils._infer_thinking: pairs of single-token markers, then multi-token forms.
THINK_PAIRS = (
    ("<think>", "</think>"),
    ("<longcat_think>", "</longcat_think>"),
    ("<|think:start|>", "<|think:end|>"),
    ("<|channel>", "<channel|>"),
)
XTML_TOKENS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")


@dataclass(frozen=True, slots=True)
class ModelTokenizer:
    """A Hugging Face tokenizer with mlx-lm's chat-template conventions (see the module
    docstring). ``hf`` is the ``transformers`` tokenizer."""

    hf: Any
    has_chat_template: bool
    has_thinking: bool = False
    thinking_kwarg: str = "enable_thinking"
    # mlx-lm's Python template, when the checkpoint names one: it replaces the Jinja template.
    python_template: Callable[..., str] | None = None

    def __len__(self) -> int:
        return len(self.hf)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return list(self.hf.encode(text, **kwargs))

    def decode(self, token_ids: Sequence[int], **kwargs: Any) -> str:
        return str(self.hf.decode(list(token_ids), **kwargs))

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        """The chat template's text for ``messages``: mlx-lm's
        ``TokenizerWrapper.apply_chat_template(messages, tokenize=False, **kwargs)``."""
        if self.thinking_kwarg != "enable_thinking" and "enable_thinking" in kwargs:
            kwargs[self.thinking_kwarg] = kwargs.pop("enable_thinking")
        kwargs.setdefault(self.thinking_kwarg, self.has_thinking)
        if self.python_template is not None:
            return str(self.python_template(list(messages), **kwargs))
        text = self.hf.apply_chat_template(
            list(messages), tokenize=False, return_dict=False, **kwargs
        )
        return str(text)


def load_tokenizer(path: Path) -> ModelTokenizer:
    """The tokenizer of the model directory ``path`` (``kvserve_model.resolve``'s answer).
    Raises ModelLoadError when ``transformers`` cannot load it."""
    from transformers import AutoTokenizer

    try:
        if _tokenizer_class(path) == "NewlineTokenizer":
            hf = _newline_tokenizer_class().from_pretrained(path)
        else:
            hf = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types for a missing or bad file
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {e}") from e
    # transformers warns past model_max_length (often a config default of 4096 or less); the
    # model's context is the limit, as the worker's loader sets it too.
    hf.model_max_length = context_length(load_config(path))
    kind = hf.init_kwargs.get("chat_template_type")
    python_template = _mlx_lm_template(kind) if kind else None
    thinking_kwarg, own_renderer = _thinking_kwarg(hf)
    return ModelTokenizer(
        hf,
        has_chat_template=hf.chat_template is not None
        or python_template is not None
        or own_renderer,
        has_thinking=_has_thinking(hf.get_vocab()),
        thinking_kwarg=thinking_kwarg,
        python_template=python_template,
    )


def _tokenizer_class(path: Path) -> str | None:
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None  # AutoTokenizer finds the tokenizer by other means, or says why not
    return config.get("tokenizer_class") if isinstance(config, dict) else None


def _has_thinking(vocab: Mapping[str, int]) -> bool:
    """mlx_lm.tokenizer_utils._infer_thinking, reduced to its answer's presence."""
    return any(a in vocab and b in vocab for a, b in THINK_PAIRS) or all(
        t in vocab for t in XTML_TOKENS
    )


def _thinking_kwarg(hf: Any) -> tuple[str, bool]:
    """mlx_lm.tokenizer_utils._infer_thinking_kwarg: the thinking switch's name, and whether the
    tokenizer class renders chats itself (overrides ``apply_chat_template``)."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    renderer = getattr(type(hf), "apply_chat_template", None)
    own = renderer is not PreTrainedTokenizerBase.apply_chat_template
    if own:
        try:
            params = inspect.signature(renderer).parameters  # type: ignore[arg-type]
            if "thinking" in params and "enable_thinking" not in params:
                return "thinking", own
        except (ValueError, TypeError):
            pass
    return "enable_thinking", own


def _mlx_lm_template(kind: str) -> Callable[..., str]:
    """``mlx_lm.chat_templates.<kind>.apply_chat_template``, loaded from its file under a name
    of ours: importing it as ``mlx_lm.chat_templates.<kind>`` would run ``mlx_lm/__init__``
    (MLX). The template modules import only the standard library and ``transformers``."""
    package = importlib.util.find_spec("mlx_lm")  # finds the package without importing it
    locations = list(package.submodule_search_locations or []) if package else []
    file = Path(locations[0]) / "chat_templates" / f"{kind}.py" if locations else None
    if not kind.isidentifier() or file is None or not file.is_file():
        raise ModelLoadError(f"the tokenizer names chat template {kind!r}, which mlx-lm lacks")
    spec = importlib.util.spec_from_file_location(f"kvserve_model._chat_template_{kind}", file)
    assert spec is not None and spec.loader is not None  # a .py file always has both
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    template: Callable[..., str] = module.apply_chat_template
    return template


def _newline_tokenizer_class() -> Any:
    """mlx_lm.tokenizer_utils.NewlineTokenizer: a fast tokenizer whose vocabulary spells a
    newline ``<n>``, member for member but ``encode_batch`` (which calls a method the base class
    lacks). Built on first use (``transformers`` is imported only by a load)."""
    from transformers import PreTrainedTokenizerFast

    class NewlineTokenizer(PreTrainedTokenizerFast):
        # Not redundant: transformers 5 builds a subclass that defines __init__ differently
        # (without tokenizer.json's decoder), and mlx-lm's class defines it.
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)

        def encode(self, text: str, **kwargs: Any) -> Any:
            return super().encode(text.replace("\n", "<n>"), **kwargs)

        def decode(self, *args: Any, **kwargs: Any) -> Any:
            text: Any = super().decode(*args, **kwargs)
            return text.replace("<n>", "\n")

        def batch_decode(self, *args: Any, **kwargs: Any) -> Any:
            texts: Any = super().batch_decode(*args, **kwargs)
            return [t.replace("<n>", "\n") for t in texts]

    return NewlineTokenizer
