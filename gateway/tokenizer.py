"""The model's tokenizer as the gateway uses it: chat template, encode, context budget.

The gateway tokenizes (rather than sending text to a worker) because the cache service's
index is keyed by token ids: routing to the worker with the longest cached prefix needs the
tokens before the worker is chosen. It loads the tokenizer files the workers load, the way
mlx-lm loads them (``kvserve_model.tokenizer``, with no MLX), so both sides agree on every id;
the context length is ``kvserve_model.context``'s, the workers' own rule.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import ContextLengthExceeded, InvalidRequest
from kvserve_model.context import context_length, load_config
from kvserve_model.resolve import resolve_model
from kvserve_model.tokenizer import ModelTokenizer, load_tokenizer
from kvserve_model.tool_parsers import ToolParser, tool_parser_for

# Inputs at least this long are tokenized (or templated) on a worker thread, never on the
# event loop: a 4 MB prompt takes seconds to encode, and /health and every other client would
# wait as long. The tokenizer's Rust encode releases the GIL, so the loop keeps running.
# Shorter ones stay inline: encoding 4k characters takes ~1 ms, about a thread hop's cost.
OFF_LOOP_CHARS = 4096


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """The model's tokenizer (``kvserve_model.tokenizer.ModelTokenizer``) with the gateway's
    context budget, the model's tool-call format (mlx-lm's, ``kvserve_model.tool_parsers``;
    None: the model has none) and its special tokens' texts by id (what a worker leaves out of
    the text with ``skip_special_tokens``: the named ones and the added ones flagged special)."""

    hf: ModelTokenizer
    max_context: int
    vocab_size: int
    tool_parser: ToolParser | None = None
    special_tokens: Mapping[int, str] = field(default_factory=dict)

    @classmethod
    def load(cls, model: str, max_model_len: int = 0) -> Tokenizer:
        """Tokenizer of ``model`` (a name ``kvserve_model.resolve.resolve_model`` accepts);
        ``max_model_len`` (when set) replaces the model's context length. Raises
        ModelLoadError."""
        path = resolve_model(model)
        config = load_config(path)
        hf = load_tokenizer(path)
        text_config = config.get("text_config", config)
        vocab = int(text_config.get("vocab_size") or len(hf))
        special = {
            int(i): str(t.content)
            for i, t in (getattr(hf.hf, "added_tokens_decoder", None) or {}).items()
            if t.special
        }
        for i in getattr(hf.hf, "all_special_ids", None) or ():
            special.setdefault(int(i), hf.decode([i]))
        context = max_model_len or context_length(config)
        return cls(hf, context, vocab, tool_parser_for(hf.hf), special)

    def encode(self, text: str) -> list[int]:
        """Plain text as the workers tokenize a text prompt (the tokenizer's own special
        tokens, e.g. a BOS, included)."""
        return list(self.hf.encode(text))

    async def encode_async(self, text: str) -> list[int]:
        """``encode``, off the event loop when ``text`` is long."""
        if len(text) < OFF_LOOP_CHARS:
            return self.encode(text)
        return await asyncio.to_thread(self.encode, text)

    async def decode_async(self, token_ids: Sequence[int]) -> str:
        """``decode``, off the event loop when there are many ids."""
        if len(token_ids) < OFF_LOOP_CHARS // 4:
            return self.decode(token_ids)
        return await asyncio.to_thread(self.decode, token_ids)

    async def apply_chat_template_async(
        self, messages: Sequence[Mapping[str, Any]], chars: int, **kwargs: Any
    ) -> list[int]:
        """``apply_chat_template``, off the event loop when the messages hold ``chars`` or
        more characters of text."""
        if chars < OFF_LOOP_CHARS:
            return self.apply_chat_template(messages, **kwargs)
        return await asyncio.to_thread(lambda: self.apply_chat_template(messages, **kwargs))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(token_ids)))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Render the model's chat template and tokenize the result.

        Rendered to text first, then encoded without adding special tokens (the template
        writes its own BOS): this is what the model saw in training, and it does not depend
        on the return type ``tokenize=True`` has in a given transformers version.
        """
        if not self.hf.has_chat_template:
            raise InvalidRequest(
                "this model has no chat template; use /v1/completions", param="messages"
            )
        try:
            text = self.hf.render_chat(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **dict(template_kwargs or {}),
            )
        except Exception as e:  # jinja raises anything the template author chose
            raise InvalidRequest(f"chat template failed: {e}", param="messages") from e
        return list(self.hf.encode(text, add_special_tokens=False))

    def check_token_ids(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                param=param,
            )

    def completion_budget(
        self,
        prompt_tokens: int,
        max_tokens: int | None,
        default: int | None = None,
        prompt_param: str = "prompt",
        max_context: int = 0,
    ) -> int:
        """How many tokens to generate, checked against the context (OpenAI's semantics).

        An explicit ``max_tokens`` that does not fit is an error (a client asking for 100
        tokens should not silently get 10); without one, ``default`` (or everything that
        fits) is capped to the room left. ``max_context``: the limit, where it is less than
        the model's context (``OpenAIServing.max_context``: the workers' KV pools); 0: the
        model's.
        """
        limit = min(max_context, self.max_context) if max_context else self.max_context
        room = limit - prompt_tokens
        if prompt_tokens == 0:
            raise InvalidRequest("the prompt is empty", param=prompt_param)
        if room <= 0:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. "
                f"However, your prompt has {prompt_tokens} tokens. Please reduce the length "
                "of the prompt.",
                param=prompt_param,
            )
        if max_tokens is None:
            return room if default is None else min(default, room)
        if max_tokens > room:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. "
                f"However, you requested {prompt_tokens + max_tokens} tokens "
                f"({prompt_tokens} in the prompt, {max_tokens} for the completion). "
                "Please reduce the length of the prompt or the completion.",
                param="max_tokens",
            )
        return max_tokens
