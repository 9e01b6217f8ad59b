"""What a request asks of sampling: one definition for the gateway and the worker.

The fields and their zeros are those of ``worker.v1.SamplingParams``
(proto/worker/v1/worker.proto), the message both sides read; :meth:`SamplingParams.from_wire` is the one reading of it. Each side
checks the values against ``sampling_limits`` and raises its own error; the worker samples with
them (``worker.model.sampling``).

Pure Python: no MLX, and no protobuf either (``from_wire`` reads the message by its fields; the
bottom layer imports no generated code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve_model.structured_output import StructuredOutput

# worker.v1.Speculative's values by name; "" is SPECULATIVE_OFF.
SPECULATIVE_NAMES = {0: "", 1: "ngram", 2: "draft_model"}
SPECULATIVE_VALUES = {v: k for k, v in SPECULATIVE_NAMES.items()}


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Zero means "off" for ``top_k`` and ``min_p``, as on the wire."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    # 0: as many as fit, in the model's context and in the worker's pool (the worker decides:
    # its pool may hold fewer tokens than the context).
    max_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Top-n alternatives per generated token; 0: no logprobs at all.
    logprobs: int = 0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Speculative decoding: "" off, "ngram" (prompt lookup) or "draft_model" (the worker's
    # --draft-model); num_draft_tokens 0: the worker's default. Greedy output is unchanged by
    # it, sampled output keeps its distribution.
    speculative: str = ""
    num_draft_tokens: int = 0
    # (token id, bias) pairs, sorted by id, added to the logits before any filter (OpenAI's
    # logit_bias, -100..100).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's semantics, over the generated tokens: presence subtracts the penalty once from
    # every token that appeared, frequency once per appearance.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # What the output must match; None: unconstrained.
    structured_output: StructuredOutput | None = None
    # Top-n alternatives for each prompt token's own log-probability; None: none (vLLM's
    # prompt_logprobs). The prompt is then computed whole, no cached prefix reused.
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def speculates(self) -> bool:
        return self.speculative != ""

    @property
    def adjusts_logits(self) -> bool:
        """Whether logits change before sampling (bias or penalties): the sampler adds them to
        the batch's logits in one scatter."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty)

    @classmethod
    def from_wire(cls, msg: Any) -> SamplingParams:
        """A ``worker.v1.SamplingParams`` message's values (``msg`` is typed ``Any``: this
        package imports no generated code, and mypy sees none), its zeros read as the proto
        documents them: ``top_p`` and ``repetition_penalty`` 0 are off (1.0), an unset ``seed``
        is None, an unset ``skip_special_tokens`` is True. Anything else is kept as sent, for
        ``sampling_limits.check_sampling`` to refuse by name (a negative ``top_p`` is a bad
        request, not "off")."""
        return cls(
            temperature=msg.temperature,
            top_p=msg.top_p or 1.0,
            top_k=msg.top_k,
            min_p=msg.min_p,
            seed=msg.seed if msg.HasField("seed") else None,
            max_tokens=msg.max_tokens,
            stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            logprobs=msg.logprobs,
            repetition_penalty=msg.repetition_penalty or 1.0,
            include_stop_str_in_output=msg.include_stop_str_in_output,
            skip_special_tokens=(
                msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
            ),
            # An enum value this side does not know stays visible, for check_sampling.
            speculative=SPECULATIVE_NAMES.get(msg.speculative, f"#{msg.speculative}"),
            num_draft_tokens=msg.num_draft_tokens,
            logit_bias=tuple(sorted(msg.logit_bias.items())),
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            structured_output=(
                StructuredOutput.from_wire(msg.structured_output)
                if msg.HasField("structured_output")
                else None
            ),
            prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        )
