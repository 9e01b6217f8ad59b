"""Every check a request passes before the engine queues it, in one place, and the
:class:`~worker.engine.sequence.Sequence` it becomes.

A request that fails a check is refused with :class:`~worker.errors.InvalidRequest` (or
:class:`~worker.errors.Overloaded` for a full worker) before it holds anything: no lease, no
block, no place in the queue. The servicer (the gRPC edge) calls this and nothing else does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve_model.structured_output import StructuredOutput
from worker.engine.sampling_params import SamplingParams, validate
from worker.engine.sequence import Sequence, TextStream
from worker.engine.speculation import NgramDrafter
from worker.errors import InvalidRequest, Overloaded
from worker.model.grammar import Grammars
from worker.model.sampling import RowSampler

MAX_PROMPT_CHARS = 4_000_000


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_context: int
    vocab_size: int
    block_size: int
    num_blocks: int
    max_pending_requests: int = 0  # running + waiting; 0: no limit
    # Speculative decoding: drafts per step when a request names none (--num-draft-tokens);
    # whether the runner can (the dense runner cannot roll recurrent state back); whether a
    # --draft-model is loaded.
    num_draft_tokens: int = 4
    speculation: bool = True
    draft_model: bool = False


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids ``skip_special_tokens`` leaves out of the text: the tokenizer's named special
    tokens (``all_special_ids``: BOS, EOS, pad, unk, additional ones) and every added token it
    flags special. Hugging Face's own ``decode(skip_special_tokens=True)`` skips the latter
    too, but ``all_special_ids`` lists only the named ones: a chat template's ``<|im_start|>``
    or a model's reserved tokens would otherwise reach the text."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, tok in added.items() if getattr(tok, "special", False))
    return frozenset(ids)


class Intake:
    def __init__(
        self, limits: RequestLimits, tokenizer: Any, max_namespace_chars: Callable[[], int]
    ) -> None:
        """``max_namespace_chars``: the cache service's limit, as it announced at registration
        (asked per request: a re-registration may change it)."""
        self.limits = limits
        self.tokenizer = tokenizer
        self._max_namespace_chars = max_namespace_chars
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.special_ids = special_token_ids(tokenizer) | self.eos_ids
        self._grammars: Grammars | None = None

    def check_room(self, held: int) -> None:
        """Raises Overloaded when the worker already holds ``max_pending_requests`` requests.
        Called before the request is tokenized or validated, so a full worker refuses in
        microseconds; the engine's ``submit`` must follow with no ``await`` between, or another
        request could take the room."""
        limit = self.limits.max_pending_requests
        if limit and held >= limit:
            raise Overloaded(
                f"this worker holds {held} requests (running + waiting; each choice of a "
                f"request with n > 1 counts as one), its limit (--max-pending-requests "
                f"{limit}); retry on another worker or later"
            )

    def tokenize(self, text: str) -> list[int]:
        if len(text) > MAX_PROMPT_CHARS:
            raise InvalidRequest(f"prompt_text is longer than {MAX_PROMPT_CHARS} characters")
        return list(self.tokenizer.encode(text))

    @property
    def grammars(self) -> Grammars:
        """The worker's compiled structured outputs (built at the first constrained request)."""
        if self._grammars is None:
            hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
            self._grammars = Grammars(hf, self.limits.vocab_size, sorted(self.eos_ids))
        return self._grammars

    async def close(self) -> None:
        """Stops what the intake started (the grammars' checking child)."""
        if self._grammars is not None:
            await self._grammars.close()

    async def grammar(self, so: StructuredOutput | None) -> Any:
        """A request's structured output as a fresh matcher (compiled off the event loop,
        cached), or None when it has none. Raises InvalidRequest naming what does not
        compile."""
        if so is None:
            return None
        return await self.grammars.matcher_async(so)

    def sequence(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        namespace: str,
        grammar: Any = None,
    ) -> Sequence:
        """The request checked against the model, the pool and the cache service's rules.
        ``grammar``: its structured output's matcher (:meth:`grammar`), when it has one."""
        lim = self.limits
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= lim.vocab_size:
            raise InvalidRequest(f"prompt token ids must be in [0, {lim.vocab_size})")
        validate(params, lim.vocab_size)
        # The cache service's rule for what it stores (and its admin tools print).
        max_chars = self._max_namespace_chars()
        if len(namespace) > max_chars:
            raise InvalidRequest(f"namespace is longer than {max_chars} characters")
        if not namespace.isprintable():
            raise InvalidRequest("namespace holds non-printable characters")
        room = lim.max_context - len(prompt)
        if room <= 0:
            raise InvalidRequest(
                f"the prompt has {len(prompt)} tokens; the model's context is {lim.max_context}"
            )
        # Unset: as many as fit, in the context and in this worker's pool (which may hold
        # fewer tokens than the context: a chat without max_tokens on a small pool was refused
        # for needing more blocks than the pool has).
        max_tokens = params.max_tokens or max(
            1, min(room, lim.num_blocks * lim.block_size - len(prompt))
        )
        if max_tokens > room:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"the model's context of {lim.max_context} tokens"
            )
        if params.structured_output is not None and grammar is None:
            raise InvalidRequest("structured_output: the constraint was not compiled")
        num_draft = self._speculation(params)
        need = -(-(len(prompt) + max_tokens) // lim.block_size)
        if need > lim.num_blocks:
            raise InvalidRequest(
                f"the request needs {need} KV blocks; this worker's pool has {lim.num_blocks}"
            )
        return Sequence(
            request_id=request_id,
            prompt=list(prompt),
            params=params,
            namespace=namespace,
            max_tokens=max_tokens,
            arrival=time.monotonic(),
            sampler=RowSampler(params, grammar),
            text=TextStream(
                self.tokenizer.detokenizer,
                params.stop,
                params.include_stop_str_in_output,
                self.special_ids if params.skip_special_tokens else frozenset(),
            ),
            eos_ids=self.eos_ids,
            block_size=lim.block_size,
            num_draft=num_draft,
            drafter=NgramDrafter() if params.speculative == "ngram" else None,
        )

    def _speculation(self, params: SamplingParams) -> int:
        """Drafts per step for this request (0: it does not speculate), or why it cannot."""
        if not params.speculates or params.structured_output is not None:
            # A constrained request does not speculate: its drafts would have to be verified
            # against the grammar too. The gateway says so in the response.
            return 0
        lim = self.limits
        if not lim.speculation:
            raise InvalidRequest(
                "speculative decoding needs the paged runner; this model runs on the dense "
                "runner (recurrent layers cannot roll rejected drafts back)"
            )
        if params.speculative == "draft_model" and not lim.draft_model:
            raise InvalidRequest(
                "speculative draft_model: this worker has no draft model (start it with "
                "--draft-model); speculative ngram needs none"
            )
        return params.num_draft_tokens or lim.num_draft_tokens
