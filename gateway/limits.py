"""Size limits a request is checked against before any work proportional to its size.

Checked before tokenizing: a prompt's characters are a cheap upper bound on work, so a
body of megabytes is refused in microseconds rather than tokenized for seconds. The token
limit (the model's context) is checked after, by ``Tokenizer.completion_budget``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import ContextLengthExceeded, InvalidRequest

# With --max-prompt-chars 0: this many characters per token of context. Tokens average 3-5
# characters of text; 32 leaves room for long whitespace or repeated-symbol tokens while a
# 128k-token context still stops at 4 MB.
CHARS_PER_CONTEXT_TOKEN = 32


@dataclass(frozen=True, slots=True)
class RequestLimits:
    prompt_chars: int
    namespace_chars: int

    @classmethod
    def of(cls, max_prompt_chars: int, max_namespace_chars: int, max_context: int) -> RequestLimits:
        return cls(max_prompt_chars or CHARS_PER_CONTEXT_TOKEN * max_context, max_namespace_chars)

    def check_prompt_chars(self, chars: int, param: str = "prompt") -> None:
        if chars > self.prompt_chars:
            raise ContextLengthExceeded(
                f"The prompt has {chars} characters; at most {self.prompt_chars} are accepted. "
                "Please reduce the length of the prompt.",
                param=param,
            )

    def check_namespace(self, namespace: str, param: str = "cache_salt") -> None:
        """A namespace is stored by the cache service and printed by its admin tools:
        bounded and printable."""
        if len(namespace) > self.namespace_chars:
            raise InvalidRequest(
                f"{param} is longer than {self.namespace_chars} characters", param=param
            )
        if not namespace.isprintable():
            raise InvalidRequest(f"{param} holds non-printable characters", param=param)
