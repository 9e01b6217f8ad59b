"""Constrained decoding: a request's structured output compiled with this worker's tokenizer,
and the token masks the sampler applies (``worker.model.sampling``).

The engine is llguidance (chosen by measurement: docs/structured-output.md). A constraint
(``kvserve_model.structured_output.StructuredOutput``) becomes a matcher: it says which tokens
keep the output a prefix of the constraint's language (a bitmask over the vocabulary, one bit
a token) and consumes the token that was picked. Compiling is the expensive part (building the
tokenizer's trie once, ~1 s; a grammar's lexer, ms to 100s of ms for large schemas), so:

- :class:`Grammars` compiles off the event loop (``matcher_async``) and keeps a bounded LRU of
  compiled matchers by constraint; each request gets a deep copy of the cached one (its own
  state, microseconds).
- The masks of a step's constrained rows are filled together (llguidance's executor, in
  parallel and without the GIL) while the forward evaluates, and applied to the batch's logits
  in one MLX op (:func:`apply_masks`).

The matcher advances when the engine appends a token to the output
(``RowSampler.accept``), not when the sampler draws it: a token drawn for a sequence that lost
its lease during the step is discarded and drawn again later, and must not be consumed twice.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvserve_model.grammar_check import GrammarChecker
from kvserve_model.structured_output import StructuredOutput, StructuredOutputError
from worker.errors import ConstraintFailed, InvalidRequest

CACHE_SIZE = 256


class Grammars:
    """The worker's constraints, compiled with its tokenizer, cached (LRU, ``capacity``)."""

    def __init__(
        self, hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int], capacity: int = CACHE_SIZE
    ) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self.capacity = capacity
        self._tokenizer: Any = None
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._pending: dict[StructuredOutput, asyncio.Future[Any]] = {}
        # A constraint's first compile runs in a child process first: one that crashes the
        # engine there is this request's error, not the worker's end (the worker's gRPC
        # clients are not all the gateway, which checks the same way).
        self.checker = GrammarChecker()
        self.compiles = 0  # grammars compiled (cache misses), for tests and stats

    def tokenizer(self) -> Any:
        """llguidance's view of the tokenizer (built at first use: about a second)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf, n_vocab=self.vocab_size, eos_token=self._eos or None
                    )
                except Exception as e:  # a slow (Python) tokenizer, or one llguidance cannot read
                    raise InvalidRequest(
                        f"structured output is not available for this model's tokenizer: {e}"
                    ) from None
            return self._tokenizer

    def matcher(self, so: StructuredOutput) -> Any:
        """A fresh matcher for ``so`` (its own state). Blocking: call :meth:`matcher_async` on
        the event loop. Raises InvalidRequest naming the problem when it does not compile."""
        with self._lock:
            cached = self._compiled.get(so)
            if cached is not None:
                self._compiled.move_to_end(so)
                return cached.deep_copy()
        return self._compile(so).deep_copy()

    def _compile(self, so: StructuredOutput) -> Any:
        import llguidance

        try:
            grammar = so.grammar()
        except StructuredOutputError as e:
            raise InvalidRequest(f"structured_output: {e}") from None
        compiled = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if compiled.is_error():
            raise InvalidRequest(
                f"structured_output: the {so.name} does not compile: {compiled.get_error()}"
            )
        # Its first mask, on a copy: llguidance builds the lexer lazily, so a constraint no
        # text satisfies (a schema that only refers to itself, the regex [^\s\S]) or one past
        # the lexer's limits compiles without error and fails at its first fill, where it
        # left only EOS allowed: the request "succeeded" with empty output. Filled here, off
        # the event loop, it is a 400 before the request holds anything, and never cached.
        first = compiled.deep_copy()
        fill_masks([first], self.vocab_size, check=False)
        if first.is_error():
            raise InvalidRequest(
                f"structured_output: the {so.name} admits no output: {error_line(first)}"
            )
        with self._lock:
            self.compiles += 1
            self._compiled[so] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def forget(self, so: StructuredOutput) -> None:
        """Drops ``so``'s compiled matcher: a copy of it failed while generating. The copies
        share its lexer's cache, which grows with everything any of them lexed; a popular
        constraint's cache can reach llguidance's limits after many requests, and then every
        later copy fails at once. The next request compiles it afresh."""
        with self._lock:
            self._compiled.pop(so, None)

    async def matcher_async(self, so: StructuredOutput) -> Any:
        """:meth:`matcher` with the compiling off the event loop; requests that arrive while
        their constraint compiles wait for that one compilation. A cached constraint is not
        awaited (a copy is microseconds)."""
        with self._lock:
            cached = self._compiled.get(so) if self._tokenizer is not None else None
            if cached is not None:
                self._compiled.move_to_end(so)
                return cached.deep_copy()
        task = self._pending.get(so)
        if task is None:
            task = asyncio.ensure_future(self._checked_compile(so))
            self._pending[so] = task
            task.add_done_callback(lambda _: self._pending.pop(so, None))
        compiled = await asyncio.shield(task)  # a cancelled waiter leaves it to the others
        return compiled.deep_copy()

    async def _checked_compile(self, so: StructuredOutput) -> Any:
        try:
            await self.checker.check(so)
        except StructuredOutputError as e:
            raise InvalidRequest(f"structured_output: {e}") from None
        return await asyncio.to_thread(self._compile, so)

    async def close(self) -> None:
        """Stops the checking child, if one runs."""
        await self.checker.close()


_executor: Any = None
_executor_lock = threading.Lock()


def _llg_executor() -> Any:
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor()
        return _executor


def error_line(matcher: Any) -> str:
    """A failed matcher's error, its first line: llguidance appends a dump of its state."""
    return (matcher.get_error() or "unknown error").strip().splitlines()[0]


def constraint_failed(matcher: Any) -> ConstraintFailed:
    """The error a request whose matcher failed ends with (INVALID_ARGUMENT)."""
    return ConstraintFailed(f"structured output failed while generating: {error_line(matcher)}")


def _refuse_errors(matchers: Sequence[Any]) -> None:
    """Raises ConstraintFailed for a matcher in an error state: a token it refused was
    consumed, or the engine gave up on it (its lexer's limits)."""
    for m in matchers:
        if m.is_error():
            raise constraint_failed(m)


def consume_then_fill(pairs: Sequence[tuple[Any, int]], vocab_size: int) -> np.ndarray:
    """Each matcher consumes its token (together, in parallel, without the GIL), then its mask
    for the state after it is filled (row i: pair i's): the lookahead's early fill, whose
    tokens the engine then does not consume again (``RowSampler.consumed_ahead``). A refused
    token leaves its matcher in an error state, as the engine's own consume would, and its row
    unfilled: the next step's sampling fails that row alone (``adjust_logits``)."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    _llg_executor().consume_token_par(list(pairs))
    masks = allocate_token_bitmask(len(pairs), vocab_size)
    ok = [(m, i) for i, (m, _) in enumerate(pairs) if not m.is_error()]
    if ok:
        fill_next_token_bitmask_par(_llg_executor(), ok, masks)
    return masks


def fill_masks(matchers: Sequence[Any], vocab_size: int, check: bool = True) -> np.ndarray:
    """Each matcher's allowed tokens as a bitmask row (int32 words, bit ``t % 32`` of word
    ``t // 32`` set when token ``t`` is allowed), filled in parallel without the GIL. Raises
    ConstraintFailed for a matcher in an error state (``check``). A matcher can also fail *in*
    the fill (llguidance then allows only EOS in its row): the caller checks them after."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    if check:
        _refuse_errors(matchers)
    masks = allocate_token_bitmask(len(matchers), vocab_size)
    fill_next_token_bitmask_par(_llg_executor(), [(m, i) for i, m in enumerate(matchers)], masks)
    return masks


@dataclass(frozen=True, slots=True)
class _Fill:
    """A fill in flight: its matchers (held, so their ids are not reused while it is
    pending; matcher i's mask is row i), the masks being filled, the vocabulary size, and
    for a fill of the state after a token (:meth:`MaskPrefetch.start_after`) each matcher's
    token."""

    held: list[Any]
    masks: Future[np.ndarray]
    vocab_size: int
    after: dict[int, int] | None = None  # id(matcher) -> the token it is filled after


class MaskPrefetch:
    """A worker's next-step masks, filled as soon as the tokens they depend on are consumed:
    the engine calls :meth:`start` right after a step's tokens join their outputs, and
    llguidance fills them on its own thread (without the GIL) while the event loop streams,
    schedules and hands the next step over; the sampler :meth:`take` s them. One a worker
    (its executor's), used one step at a time: the engine :meth:`wait` s before it consumes
    tokens, the sampler before it touches a matcher, so no matcher is used by two threads at
    once. The pending fill holds its matchers, so their ids cannot be reused while it is
    pending: a matcher is found by identity.

    A step that looks ahead (``worker.engine.lookahead``) builds the next forward before the
    loop consumes its tokens, so the next step applies its masks first thing: filled only
    after the loop's turn, they would be the next step's wait. Such a step starts the fill
    itself the moment its tokens are known (:meth:`start_after`: the masks of the state after
    each token, the matchers left as they are), and the engine's :meth:`start` keeps it when
    every running matcher then consumed exactly the token it was filled after."""

    def __init__(self) -> None:
        self._pool: Any = None
        self._pending: _Fill | None = None
        self.upload = MaskUpload()  # the masks' way to the device (the sampler's)
        self.used = 0  # steps whose masks were prefetched (tests, the benchmark)
        self.early = 0  # of them, filled after the tokens before the loop consumed them

    def _submit(self, fn: Callable[..., np.ndarray], *args: Any) -> Future[np.ndarray]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-masks")
        return self._pool.submit(fn, *args)

    def start(
        self, matchers: Sequence[Any], vocab_size: int, last: Sequence[int] | None = None
    ) -> None:
        """Fills ``matchers``' masks for their current state, unless the pending fill is one
        :meth:`start_after` began after exactly the tokens each has consumed since (``last``:
        each matcher's last consumed token): that one is kept, still filling."""
        pending = self._pending
        if (
            matchers
            and pending is not None
            and pending.after is not None
            and last is not None
            and pending.vocab_size == vocab_size
            and all(
                id(m) in pending.after and pending.after[id(m)] == t
                for m, t in zip(matchers, last, strict=True)
            )
        ):
            return  # filling already, after these tokens
        self.wait()
        if not matchers:
            return
        held = list(matchers)
        self._pending = _Fill(held, self._submit(fill_masks, held, vocab_size), vocab_size)

    def start_after(self, pairs: Sequence[tuple[Any, int]], vocab_size: int) -> None:
        """Makes each matcher consume its token and fills its mask for the state after, on the
        fill's thread (:func:`consume_then_fill`): the caller has marked each row's sampler
        (``RowSampler.consumed_ahead``), so the engine appends the token without consuming it
        again, and without waiting for this fill."""
        self.wait()
        self._pending = None
        if not pairs:
            return
        held = [m for m, _ in pairs]
        after = {id(m): t for m, t in pairs}
        future = self._submit(consume_then_fill, list(pairs), vocab_size)
        self._pending = _Fill(held, future, vocab_size, after)

    def wait(self) -> None:
        """Lets a fill in flight end (its result kept for :meth:`take`)."""
        if self._pending is not None:
            try:
                self._pending.masks.result()
            except Exception:  # a matcher in an error state: take() falls back, which says so
                self._pending = None

    def take(self, matchers: Sequence[Any], vocab_size: int) -> np.ndarray | None:
        """The prefetched masks of ``matchers`` (in their order), or None when they were not
        all prefetched (a row new in this step: the caller fills them itself)."""
        self.wait()
        pending, self._pending = self._pending, None
        if pending is None or pending.vocab_size != vocab_size:
            return None
        index = {id(m): i for i, m in enumerate(pending.held)}  # ids of live objects: unique
        rows = [index[id(m)] for m in matchers if id(m) in index]
        if len(rows) != len(matchers):
            return None
        masks: np.ndarray = pending.masks.result()
        self.used += 1
        self.early += pending.after is not None
        if rows == list(range(len(masks))):  # the usual step: the same rows, in order
            return masks
        return masks[rows]


class MaskUpload:
    """A step's packed masks moved to the device. On a CUDA GPU through a pinned host buffer
    and one driver copy (``worker.model.cuda_copy``): ``mx.array`` of a numpy array there
    writes into managed memory whose pages sit on the device, and each page faults back to
    the host; 32 rows of SmolLM2's vocabulary (196 KB) took 340 us of the step's host time
    that way on an H200 and 50 us through the driver. Elsewhere, or where the driver
    refuses, ``mx.array``. One a worker (its MaskPrefetch's), used on the model thread: the
    device rows it returns are rewritten by its next call, so whatever reads them must be
    evaluated before then (a step reads its sampled tokens before it returns)."""

    def __init__(self) -> None:
        self._staging: Any = None
        self._refused = False

    def __call__(self, masks: np.ndarray) -> mx.array:
        rows, words = masks.shape
        staging = self._staging
        if staging is None or staging.row_bytes != 4 * words or len(staging.host) < rows:
            if self._refused:
                return mx.array(masks)
            from worker.model.cuda_copy import pinned_staging

            staging = pinned_staging(max(rows, 64), 4 * words, "structured output's masks")
            if staging is None:  # not a CUDA GPU (or the driver refused: logged)
                self._refused = True
                return mx.array(masks)
            self._staging = staging
        staging.host[:rows] = np.ascontiguousarray(masks, dtype=np.int32).view(np.uint8)
        return staging.to_device(rows).view(mx.int32)


_BITS: dict[int, tuple[mx.array, mx.array]] = {}


def _bit_index(vocab: int) -> tuple[mx.array, mx.array]:
    """For each token: its word in a mask row, and its bit in that word."""
    if vocab not in _BITS:
        t = np.arange(vocab, dtype=np.int32)
        _BITS[vocab] = (mx.array(t >> 5), mx.array(t & 31))
    return _BITS[vocab]


def apply_masks(
    logits: mx.array,
    rows: Sequence[int],
    masks: np.ndarray,
    on_device: bool | None = None,
    upload: Callable[[np.ndarray], mx.array] = mx.array,
) -> mx.array:
    """``logits`` with every token a row's mask disallows set to -inf (rows[k] takes
    masks[k]); the other rows unchanged: one ``where`` for the batch. The bits are unpacked
    where that is cheap: by numpy on the CPU (unpacking them with MLX ops there cost 10x
    more), on the device on a GPU (the packed words are 32x fewer bytes to copy over);
    ``on_device`` chooses (None: by the default device); ``upload`` moves them there
    (:class:`MaskUpload`)."""
    batch, vocab = logits.shape
    if list(rows) != list(range(batch)):
        full = np.full((batch, masks.shape[1]), -1, dtype=np.int32)  # every bit set: no mask
        full[list(rows)] = masks
        masks = full
    if on_device if on_device is not None else mx.default_device() == mx.gpu:
        words, bits = _bit_index(vocab)
        return _masked_on_device(logits, upload(masks), words, bits)
    unpacked = np.unpackbits(masks.view(np.uint8), axis=1, count=vocab, bitorder="little")
    return mx.where(mx.array(unpacked.view(np.bool_)), logits, mx.array(-mx.inf, logits.dtype))


@mx.compile
def _masked_on_device(
    logits: mx.array, packed: mx.array, words: mx.array, bits: mx.array
) -> mx.array:
    """``logits`` where the packed mask's bit is set, else -inf: compiled, so the unpacking
    and the ``where`` are one kernel after the gather (a GPU step is host-bound: fewer
    graph nodes, fewer launches)."""
    allowed = (mx.right_shift(mx.take(packed, words, axis=1), bits) & 1).astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))
