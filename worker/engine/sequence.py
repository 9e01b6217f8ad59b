"""One request inside the worker: its tokens, its lease, and what it has streamed."""

from __future__ import annotations

import asyncio
import enum
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from worker.engine.lease import Lease
from worker.engine.sampling_params import Sampled, SamplingParams
from worker.errors import WorkerError

if TYPE_CHECKING:  # the sampler runs MLX; the sequence only carries it
    from worker.engine.speculation import NgramDrafter
    from worker.model.sampling import RowSampler


class Status(enum.Enum):
    WAITING = "waiting"  # no lease: queued, deferred, or preempted
    RUNNING = "running"  # holds a lease; prefilling or decoding
    FINISHED = "finished"


class Finish(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"  # ended by the worker or the client; the event's error says why


@dataclass(slots=True)
class StreamEvent:
    """What the Generate handler sends: new tokens and text, or the end. An ABORT carries the
    typed reason; the servicer turns it into a status code (worker.servicer.STATUS_OF)."""

    token_ids: list[int]
    text: str
    logprobs: list[Sampled]
    finish: Finish | None = None
    error: WorkerError | None = None

    def then(self, nxt: StreamEvent) -> StreamEvent:
        """This event and ``nxt`` as one (``nxt``'s end, if any): what a stream sends when its
        reader lags behind the engine."""
        return StreamEvent(
            [*self.token_ids, *nxt.token_ids],
            self.text + nxt.text,
            [*self.logprobs, *nxt.logprobs],
            nxt.finish,
        )


class EventSink(Protocol):
    """Where the engine puts a sequence's events (on the event loop's thread): its own queue
    (``Generate``) or a queue shared by a ``GenerateMany`` call's requests."""

    def put_nowait(self, item: StreamEvent, /) -> None: ...


class TextStream:
    """Incremental detokenization with stop strings.

    mlx-lm's streaming detokenizer never splits a UTF-8 character. Text that could still be
    the start of a stop string is held back until it cannot, so a stop string never leaks.
    The text is the tokens' own: a space opening the output is kept (:func:`keep_first_space`).
    """

    def __init__(
        self,
        detokenizer: Any,
        stop: tuple[str, ...],
        include_stop: bool,
        hidden: frozenset[int] = frozenset(),
    ) -> None:
        self._detok = keep_first_space(detokenizer)
        self._hidden = hidden  # special tokens left out of the text
        self._stop = stop
        self._include_stop = include_stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._text = ""  # everything decoded so far
        self._sent = 0  # characters of _text already emitted

    def add(self, token: int) -> tuple[str, bool]:
        """Feeds one token; returns (text to emit now, whether a stop string was hit)."""
        if token in self._hidden:
            return "", False
        self._detok.add_token(token)
        _release_held_space(self._detok)
        self._text += self._detok.last_segment
        return self._scan(final=False)

    def finish(self) -> str:
        """The text held back, at the output's end. Bytes of an unfinished UTF-8 character
        (an output cut by max_tokens or a stop token within a character) are left out: the
        detokenizer's flush decoded them to U+FFFD, which a client then showed as text. vLLM's
        detokenizer never emits them either."""
        _drop_unfinished_character(self._detok)
        self._detok.finalize()
        self._text += self._detok.last_segment
        return self._scan(final=True)[0]

    def _scan(self, final: bool) -> tuple[str, bool]:
        if self._stop:
            start = max(0, self._sent - self._holdback)
            hits = [(i, s) for s in self._stop if (i := self._text.find(s, start)) >= 0]
            if hits:
                i, s = min(hits)
                end = i + len(s) if self._include_stop else i
                return self._emit(max(end, self._sent)), True
        end = len(self._text) if final else len(self._text) - self._holdback
        return self._emit(max(end, self._sent)), False

    def _emit(self, end: int) -> str:
        out = self._text[self._sent : end]
        self._sent = end
        return out


def keep_first_space(detok: Any) -> Any:
    """``detok`` made to keep a space that opens the output. mlx-lm's byte-level BPE and
    SentencePiece detokenizers trim it (as a whole-text decode strips SentencePiece's leading
    marker), which dropped a real space from a continuation: a completion of "The capital of
    France is" read "Paris." while its logprobs' tokens were " Paris", "."; with ``echo``
    "...isParis."; and ``continue_final_message`` lost it too. The output's text is now the
    concatenation of its tokens' text, as vLLM's (which decodes after the prompt's tokens) and
    as the logprobs and their offsets say. Returns ``detok``."""
    kind = type(detok).__name__  # by name: this module imports no MLX
    if kind == "BPEStreamingDetokenizer":
        detok._maybe_trim_space = lambda text: text
    elif kind == "SPMStreamingDetokenizer":
        detok.trim_space = False
    return detok


def _drop_unfinished_character(detok: Any) -> None:
    """Drops from what ``detok`` holds the bytes of a UTF-8 character its tokens began but did
    not finish (at most 3: a lead byte and the continuations that followed it, fewer than it
    announces), so that its flush does not decode them to U+FFFD. Bytes that are invalid
    anyway (a lone continuation byte, an impossible lead) stay, U+FFFD as in the whole decode.
    mlx-lm's byte-level BPE detokenizer only, the one that holds raw bytes (SentencePiece's
    byte fallback is decoded by the tokenizer itself)."""
    if type(detok).__name__ != "BPEStreamingDetokenizer":  # by name: this module imports no MLX
        return
    held: str = getattr(detok, "_unflushed", "")
    if not held:
        return
    decoder = sys.modules[type(detok).__module__]._byte_decoder()
    tail = bytearray()
    for c in held[-3:]:
        b = decoder.get(c)
        if b is None:  # not a byte (an added token's text): complete characters
            tail.clear()
        else:
            tail.append(b)
    cut = _unfinished_length(bytes(tail))
    if cut:
        detok._unflushed = held[:-cut]


def _unfinished_length(raw: bytes) -> int:
    """How many of ``raw``'s last bytes are a UTF-8 character begun and not finished: 0 if
    they are none (complete, or invalid in any case)."""
    for back in range(1, min(3, len(raw)) + 1):
        b = raw[-back]
        if b & 0xC0 == 0x80:  # a continuation byte: its lead is further back
            continue
        width = 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 0
        return back if width > back else 0
    return 0


def _release_held_space(detok: Any) -> None:
    """mlx-lm's byte-level BPE detokenizer holds a space token back until the next token, so
    that a space opening the whole text can be trimmed; it holds every later space too, and a
    run of spaces (indentation, a model repeating " ") reached the client only with the next
    other token: 256 spaces arrived with the request's last token. Nothing is trimmed here
    (:func:`keep_first_space`), so what it holds is released at once unless it is an
    incomplete UTF-8 character. The text is the same in the end (``tests/worker_engine/
    test_scheduler.py`` checks it against mlx-lm's own on random tokens, which also catches a
    newer mlx-lm whose detokenizer keeps other state), only sooner."""
    if type(detok).__name__ != "BPEStreamingDetokenizer":  # by name: this module imports no MLX
        return
    held = getattr(detok, "_unflushed", "")
    if not held:
        return
    text = detok._decode_bytes(held)
    if text.endswith("\ufffd"):
        return
    detok.text += text
    detok._unflushed = ""


# One prompt token's (log-probability given the tokens before it, rank in the vocabulary, top
# alternatives as (id, logprob)): Sequence.prompt_logprobs' values.
PromptEntry = tuple[float, int, tuple[tuple[int, float], ...]]


@dataclass(eq=False)
class Sequence:
    """A request's state, mutated on the event loop only. Its fields come in three sections,
    each written by one owner (others only read it):

    - the request, as the intake made it (``worker.engine.intake``; the servicer sets ``out``
      before it submits): never changed after;
    - progress through the tokens, by the scheduler (``worker.engine.scheduler``: schedule,
      postprocess, end, requeue, roll_back);
    - the lease and the waits for one, by the lease sync (``worker.engine.lease_sync``:
      admission, extensions, commits, releases, preemption).

    The two lease transitions, :meth:`admit` (the lease sync) and :meth:`drop_lease` (the
    scheduler's ``requeue``), also reset progress to what the lease holds. The engine writes no
    field (a finished request's held event is ``worker.engine.final_hold``'s).

    Token regions::

        | prompt ........................ | output ......... |
        |<-- cached -->|<-- computed -->| next forward computes tokens[num_computed:]
        0                           num_computed            len(tokens)

    Every token but the last sampled one has its KV in the pool once a step finishes; a
    forward that computes through the last token yields the logits of the next one.
    """

    # -- the request: the intake's (and the servicer's ``out``) ------------------------------------
    request_id: str
    prompt: list[int]
    params: SamplingParams
    namespace: str
    max_tokens: int
    arrival: float
    sampler: RowSampler
    text: TextStream
    eos_ids: frozenset[int]
    block_size: int
    out: EventSink = field(default_factory=lambda: asyncio.Queue[StreamEvent]())
    # Speculative decoding: drafts per decode (0: off); prompt lookup's index, if it drafts
    # that way (fed by the scheduler as tokens come).
    num_draft: int = 0
    drafter: NgramDrafter | None = None

    # -- progress: the scheduler's -----------------------------------------------------------------
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    aborted: bool = False  # ended before it finished; no step of it is used any more
    # Speculative decoding: drafts verified and kept so far, and the recent share kept
    # (``worker.engine.speculation.MIN_ACCEPTANCE``).
    draft_tokens: int = 0
    accepted_drafts: int = 0
    acceptance: float = 1.0
    # params.prompt_logprobs: by prompt position (1 .. len(prompt) - 1), that token's
    # log-probability given the tokens before it, its rank in the vocabulary and the top
    # alternatives (id, logprob), filled as prefill chunks run (a recompute after preemption
    # writes the same keys); sent once, with the first output.
    prompt_logprobs: dict[int, PromptEntry] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False

    # -- the lease and the waits for one: the lease sync's -----------------------------------------
    lease: Lease | None = None
    block_table: list[int] = field(default_factory=list)
    admitted_tokens: int = 0  # tokens the current lease was acquired for
    cached_tokens: int | None = None  # of the first admission, for usage
    # Copy-on-write pairs the lease asks for before its first write (the scheduler puts them
    # in the sequence's next step and clears them).
    pending_cow: tuple[tuple[int, int], ...] = ()
    committed_tokens: int = 0
    # The lease sync's publish count when the cache service deferred this request (its
    # prefix was being computed by another lease); None: not deferred.
    deferred_at: int | None = None
    deferred_until: float = 0.0  # monotonic time after which it asks again regardless
    # Since when the pool has had no room for it (monotonic; None: it has not been refused),
    # across preemptions; the lease sync passes it, then ends it, after a bound.
    no_room_since: float | None = None
    preemptions: int = 0
    # The lease whose tier blocks are being loaded into this sequence's blocks (it does not
    # step meanwhile: worker.engine.tier_sync); None: none.
    loading: Lease | None = None
    # Leading blocks already spilled to the tiers (or found there) under the current lease.
    spilled_blocks: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_slice(self, start: int, n: int) -> list[int]:
        """tokens[start:start + n] without building the whole list (a decode step per token)."""
        p = len(self.prompt)
        if start >= p:
            return self.output[start - p : start - p + n]
        return self.prompt[start : start + n] + self.output[: max(0, start + n - p)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def to_compute(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def capacity(self) -> int:
        """Token slots the lease's block table covers."""
        return len(self.block_table) * self.block_size

    def admit(self, lease: Lease) -> None:
        self.lease = lease
        self.admitted_tokens = self.num_tokens
        self.block_table = list(lease.block_table)
        self.num_computed = lease.cached_tokens
        self.pending_cow = lease.copy_on_write
        self.spilled_blocks = 0
        self.committed_tokens = lease.cached_tokens // self.block_size * self.block_size
        if self.cached_tokens is None:
            self.cached_tokens = lease.cached_tokens
        self.status = Status.RUNNING
        self.deferred_at = None
        self.no_room_since = None

    def drop_lease(self) -> None:
        """Back to waiting without a lease (preempted, expired or fenced): the output so far
        is kept and recomputed from whatever prefix the cache still holds."""
        self.lease = None
        self.block_table = []
        self.num_computed = 0
        self.pending_cow = ()
        self.loading = None
        self.status = Status.WAITING
