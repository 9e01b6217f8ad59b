"""The per-step sampler (its parameters: ``kvserve_model.sampling_params``; its results:
``worker.model.sampled``).

Every request samples from its own PRNG key, never from MLX's global random state: a seeded
request's key for a token derives from (seed, position), an unseeded one's from a seed drawn
at admission, so a request gives the same tokens alone, in any batch, and after a preemption,
and nothing one row does can change another row's draws or a later request's. mlx-lm's
samplers are not used for that reason: they draw from the global state, and their filters are
compiled with that state as an input and output, so one that raised (``top_k`` above the
vocabulary) left the global state holding a traced placeholder, and every later unseeded draw
of the process failed (``Attempting to eval an array without a primitive``) until a request
with a seed reset it.

Logit bias, presence and frequency penalties, and structured output's token masks are applied
to the whole batch's logits before any row samples (:func:`adjust_logits`): one scatter for the
biases and penalties of every row, one for the masks, whose bits llguidance fills while the
forward evaluates. No row costs a host round trip of its own for them; rows without them keep
exactly their tokens.

A row whose sampling raises anyway ends alone (:class:`RowFailed`); the other rows of the
batch get their tokens.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors

from kvserve_model.sampling_params import SamplingParams
from worker.model import host_draw
from worker.model.grammar import MaskPrefetch, apply_masks, constraint_failed, fill_masks
from worker.model.sampled import Accepted, RowFailed, Sampled

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RowSampler:
    """One sequence's sampler, built once at admission; called on the model thread."""

    params: SamplingParams
    # The request's structured output, compiled (``worker.model.grammar``): an llguidance
    # matcher, advanced by :meth:`accept`; None: unconstrained.
    grammar: Any = None
    # The request's own PRNG seed: its seed, or one drawn at admission. Kept for its life, so
    # an unseeded request is reproducible across its own preemptions too.
    seed: int = field(init=False)
    processors: list = field(init=False)
    # What bias and penalties add to each token's logit now: the bias, less the penalties of
    # the tokens generated so far (kept up to date by accept: O(1) a token).
    _delta: dict[int, float] = field(init=False)
    _bias: dict[int, float] = field(init=False)
    _counts: dict[int, int] = field(init=False)
    # A token the grammar consumed before the engine appended it (a step that looked ahead
    # consumes it with the next step's mask fill, on the fill's thread: :meth:`consumed_ahead`),
    # and what waits for that fill to end; :meth:`accept` does not consume it again.
    _ahead: int | None = field(init=False, default=None)
    _settle: Callable[[], None] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        p = self.params
        self.seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(4), "little")
        penalty = p.repetition_penalty if p.repetition_penalty not in (0.0, 1.0) else None
        self.processors = make_logits_processors(repetition_penalty=penalty)
        self._bias = dict(p.logit_bias)
        self._delta = dict(self._bias)
        self._counts = {}

    @property
    def plain_greedy(self) -> bool:
        """Its token is the argmax of the raw logits: nothing adjusts them, no history."""
        return self.batch_greedy and not self.adjusts

    @property
    def batch_greedy(self) -> bool:
        """Its token is the argmax of the batch's (adjusted) logits: one batched argmax."""
        return self.params.greedy and not self.processors and not self.params.logprobs

    @property
    def adjusts(self) -> bool:
        """Bias, penalties or a grammar change its logits before sampling."""
        return self.params.adjusts_logits or self.grammar is not None

    def accept(self, token: int) -> None:
        """``token`` joined the output: the penalties and the grammar advance. Called by the
        engine when it appends the token (not when it is drawn: a draw can be discarded)."""
        p = self.params
        if p.presence_penalty or p.frequency_penalty:
            n = self._counts[token] = self._counts.get(token, 0) + 1
            self._delta[token] = self._penalized(token, n)
        if self.grammar is not None:
            if self._ahead is not None:
                ahead, self._ahead = self._ahead, None
                if ahead == token:
                    return  # consumed already, on the fill's thread
                self._unconsume()  # not expected: the token the fill took was not appended
            self.grammar.consume_token(token)

    def consumed_ahead(self, token: int, settle: Callable[[], None]) -> None:
        """The grammar consumes ``token`` on another thread before the engine appends it
        (``MaskPrefetch.start_after``): the engine's :meth:`accept` of it does not wait for
        that thread, nor consume it again. ``settle`` waits for that thread to be done."""
        self._ahead, self._settle = token, settle

    def discard_ahead(self) -> None:
        """The engine dropped the token consumed ahead (its sequence lost its lease or was
        cancelled during the step): the grammar gives it back."""
        if self._ahead is not None:
            self._ahead = None
            self._unconsume()

    def _unconsume(self) -> None:
        if self._settle is not None:
            self._settle()  # no matcher is touched while the fill may hold it
        if not self.grammar.is_error():  # a refused token: the row fails at its next sampling
            self.grammar.rollback(1)

    @property
    def consumed_early(self) -> bool:
        """Whether the grammar holds a token the engine has not appended yet."""
        return self._ahead is not None

    def deltas(self, extra: Sequence[int] = ()) -> dict[int, float]:
        """What bias and penalties add per token, with ``extra`` tokens (drafts being
        verified) counted as generated."""
        if not extra:
            return self._delta
        out = dict(self._delta)
        counts = dict(self._counts)
        for t in extra:
            n = counts[t] = counts.get(t, 0) + 1
            out[t] = self._penalized(t, n)
        return out

    def _penalized(self, token: int, n: int) -> float:
        """What is added to ``token``'s logit once it appeared ``n`` times."""
        p = self.params
        return self._bias.get(token, 0.0) - p.presence_penalty - p.frequency_penalty * n

    def key(self, position: int) -> mx.array:
        """The key of the token at ``position``. The second half of a split: what the former
        ``mx.random.seed(s)`` and one draw used, so a given seed still gives the same tokens."""
        s = (self.seed * 1_000_003 + position) & 0xFFFFFFFF
        return mx.random.split(mx.random.key(s))[1]

    def uniform(self, position: int) -> float:
        """The number in (0, 1] the token at ``position`` is drawn at on the host
        (``host_draw``): from (seed, position) alone."""
        return host_draw.uniform(self.seed, position)

    def draw(self, x: np.ndarray, history: Sequence[int], position: int) -> Sampled:
        """This row's token at ``position`` from its logits ``x`` on the host (float32
        ``[vocab]``; the repetition penalty, if any, applied here over ``history``)."""
        p = self.params
        if self.processors:
            x = host_draw.repetition_penalty(x, history, p.repetition_penalty)
        row = host_draw.Row(x)
        token = int(np.argmax(row.x)) if p.greedy else row.draw(p, self.uniform(position))
        top = row.top_logprobs(p.logprobs) if p.logprobs else ()
        return Sampled(token, row.logprob(token), top)

    def sample(self, logprobs: mx.array, position: int) -> mx.array:
        """One token from a (1, vocab) row of log-probabilities; filters in mlx-lm's order."""
        if self.params.greedy:
            return mx.argmax(logprobs, axis=-1)
        return mx.random.categorical(self.weights(logprobs), key=self.key(position))

    def weights(self, logprobs: mx.array) -> mx.array:
        """The unnormalized log-weights a sampled (not greedy) token is drawn from: the
        filters in mlx-lm's order, then the temperature."""
        p = self.params
        x = logprobs
        if 0.0 < p.top_p < 1.0:
            x = _top_p(x, p.top_p)
        if p.min_p > 0.0:
            x = mx.where(x < mx.max(x, axis=-1, keepdims=True) + math.log(p.min_p), -mx.inf, x)
        if 0 < p.top_k < x.shape[-1]:  # top_k == vocab keeps every token: off
            x = _top_k(x, p.top_k)
        return x * (1.0 / p.temperature)


def _top_k(x: mx.array, k: int) -> mx.array:
    drop = mx.argpartition(-x, kth=k - 1, axis=-1)[..., k:]
    return mx.put_along_axis(x, drop, mx.array(-mx.inf, x.dtype), axis=-1)


def _top_p(x: mx.array, top_p: float) -> mx.array:
    ordered = mx.sort(x, axis=-1)
    probs = mx.exp(ordered.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(ordered, dropped, axis=-1)
    return mx.where(x < threshold, -mx.inf, x)


Row = tuple[int, RowSampler, Sequence[int], int]


def adjust_logits(
    logits: mx.array, rows: Sequence[Row], prefetched: MaskPrefetch | None = None
) -> tuple[mx.array, dict[int, RowFailed]]:
    """``logits`` with every row's bias and penalties added (one scatter) and its grammar's
    mask applied (one more); rows without either are unchanged. Returns the failures too: a
    row whose grammar is in an error state (it fails alone)."""
    failed: dict[int, RowFailed] = {}
    adjusting = [r for r in rows if r[1].params.adjusts_logits]
    constrained = [r for r in rows if r[1].grammar is not None]
    if constrained:
        mx.async_eval(logits)  # the forward runs while llguidance fills the masks
        if prefetched is not None:
            prefetched.wait()  # no matcher is touched while a prefetch fills it
        ok = []
        for r in constrained:
            if r[1].grammar.is_error():
                failed[r[0]] = RowFailed(constraint_failed(r[1].grammar))
            else:
                ok.append(r)
        constrained = ok
        matchers = [r[1].grammar for r in constrained]
        masks = None
        if ok:
            masks = prefetched.take(matchers, logits.shape[-1]) if prefetched else None
            if masks is None:
                masks = fill_masks(matchers, logits.shape[-1])
            # A matcher that failed in its fill has a row allowing only EOS: sampled, the
            # request would end "stop" with whatever it had, silently unconstrained.
            for r in constrained:
                if r[1].grammar.is_error():
                    failed[r[0]] = RowFailed(constraint_failed(r[1].grammar))
    if adjusting:
        row_idx: list[int] = []
        tok_idx: list[int] = []
        values: list[float] = []
        for row, rs, *_ in adjusting:
            delta = rs.deltas()
            row_idx += [row] * len(delta)
            tok_idx += delta.keys()
            values += delta.values()
        if values:
            add = mx.array(values, dtype=mx.float32).astype(logits.dtype)
            logits = logits.at[mx.array(row_idx), mx.array(tok_idx)].add(add)
    if constrained:
        assert masks is not None
        upload = prefetched.upload if prefetched is not None else mx.array
        logits = apply_masks(logits, [r[0] for r in constrained], masks, upload=upload)
    return logits, failed


def sample_rows(
    logits: mx.array, rows: Sequence[Row], prefetched: MaskPrefetch | None = None
) -> list[Sampled | RowFailed]:
    """Samples one token for each (row index, sampler, tokens so far, position) of `logits`.

    Bias, penalties and grammar masks first, for the batch (:func:`adjust_logits`). Greedy
    rows without history or logprobs are then one batched argmax (per row if that raises);
    the others are drawn on the host from one copy of their logits (``host_draw``; row by
    row through MLX if the copy raises). A row that raises is a RowFailed and the others are
    unaffected: no row reads or writes state another row uses.
    """
    out: dict[int, Sampled | RowFailed] = {}
    if any(r[1].adjusts for r in rows):
        try:
            logits, failed = adjust_logits(logits, rows, prefetched)
            out.update(failed)
        except Exception as e:  # whatever llguidance or MLX raises: these rows end alone
            log.exception("adjusting logits failed")
            for r in rows:
                if r[1].adjusts:
                    out[r[0]] = RowFailed(e)
    greedy = [r for r in rows if r[1].batch_greedy and r[0] not in out]
    if greedy:
        try:
            idx = mx.array([r[0] for r in greedy])
            tokens = np.asarray(mx.argmax(logits[idx], axis=-1)).tolist()
            for (row, *_), tok in zip(greedy, tokens, strict=True):
                out[row] = Sampled(int(tok))
        except Exception:  # whatever MLX raises: find the row at fault below
            log.exception("batched greedy sampling failed; sampling its rows one by one")
    hosted = [r for r in rows if r[0] not in out]
    if hosted:
        out.update(_draw_on_host(logits, hosted))
    for r in rows:
        if r[0] in out:
            continue
        try:
            out[r[0]] = sample_row(logits, *r)
        except Exception as e:  # whatever MLX raises: this row ends, the batch goes on
            log.exception("sampling failed for row %d", r[0])
            out[r[0]] = RowFailed(e)
    return [out[r[0]] for r in rows]


def _draw_on_host(logits: mx.array, rows: Sequence[Row]) -> dict[int, Sampled | RowFailed]:
    """Each row's token drawn on the host (``RowSampler.draw``), its logits copied there once
    for all of them; empty if the copy raises (the rows then go one by one through MLX)."""
    try:
        ids = [r[0] for r in rows]
        picked = logits if ids == list(range(logits.shape[0])) else logits[mx.array(ids)]
        x = np.asarray(picked.astype(mx.float32))
    except Exception:  # whatever MLX raises: find the row at fault one by one
        log.exception("copying logits to the host failed; sampling the rows one by one")
        return {}
    out: dict[int, Sampled | RowFailed] = {}
    for k, (row, rs, history, position) in enumerate(rows):
        try:
            out[row] = rs.draw(x[k], history, position)
        except Exception as e:  # this row ends, the batch goes on
            log.exception("sampling failed for row %d", row)
            out[row] = RowFailed(e)
    return out


def sample_row(
    logits: mx.array, row: int, rs: RowSampler, history: Sequence[int], position: int
) -> Sampled:
    logprobs = _logprobs(logits[row : row + 1], rs, history)
    token = _token(rs.sample(logprobs, position))
    return _sampled(logprobs, token, rs)


def _token(x: mx.array) -> int:
    """A one-token draw as an int (through numpy, which releases the GIL while MLX evaluates;
    ``.item()`` holds it)."""
    return int(np.asarray(x).reshape(-1)[0])


def _logprobs(x: mx.array, rs: RowSampler, history: Sequence[int]) -> mx.array:
    """A (1, vocab) row of logits, through the request's processors, as log-probabilities."""
    if rs.processors:
        hist = mx.array(list(history), dtype=mx.int32)
        for proc in rs.processors:
            x = proc(hist, x)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _sampled(logprobs: mx.array, token: int, rs: RowSampler) -> Sampled:
    lp = np.asarray(logprobs[0])
    top: tuple[tuple[int, float], ...] = ()
    if rs.params.logprobs:
        top = tuple((int(i), float(lp[i])) for i in host_draw.top_n(lp, rs.params.logprobs))
    return Sampled(token, float(lp[token]), top)


# -- speculative decoding: verifying drafts ----------------------------------------------------

# (logits [1 + drafts, vocab], sampler, tokens so far, position of the first new token, drafts)
VerifyRow = tuple[mx.array, RowSampler, Sequence[int], int, Sequence[int]]


def verify_rows(rows: Sequence[VerifyRow]) -> list[Accepted | RowFailed]:
    """Each row's verdict on its drafts (:func:`verify_row`). Plain greedy rows take one
    batched argmax over all their positions; a row that raises is a RowFailed alone."""
    out: dict[int, Accepted | RowFailed] = {}
    greedy = [i for i, r in enumerate(rows) if r[1].plain_greedy]
    if greedy:
        try:
            picks = np.asarray(mx.argmax(mx.concatenate([rows[i][0] for i in greedy]), axis=-1))
            at = 0
            for i in greedy:
                drafts = rows[i][4]
                target = picks[at : at + len(drafts) + 1].tolist()
                at += len(drafts) + 1
                n = _agreed(target, drafts)
                tokens = tuple(Sampled(int(t)) for t in target[: n + 1])
                out[i] = Accepted(tokens, len(drafts))
        except Exception:  # whatever MLX raises: find the row at fault below
            log.exception("batched greedy verification failed; verifying its rows one by one")
            out.clear()
    for i, r in enumerate(rows):
        if i in out:
            continue
        try:
            out[i] = verify_row(*r)
        except Exception as e:  # whatever MLX raises: this row ends, the batch goes on
            log.exception("verifying drafts failed for row %d", i)
            out[i] = RowFailed(e)
    return [out[i] for i in range(len(rows))]


def _agreed(target: Sequence[int], drafts: Sequence[int]) -> int:
    n = 0
    while n < len(drafts) and target[n] == drafts[n]:
        n += 1
    return n


def verify_row(
    logits: mx.array, rs: RowSampler, history: Sequence[int], position: int, drafts: Sequence[int]
) -> Accepted:
    """The drafts the model keeps, then one token of its own; ``logits[j]`` is the model's
    distribution after ``drafts[:j]``.

    Greedy: a draft is kept while it is the argmax, so the tokens are exactly those of plain
    greedy decoding. Sampled: a draft is a point mass (prompt lookup, or a draft model's
    argmax), so speculative sampling's rule becomes: keep draft d with probability p(d), the
    request's filtered, tempered distribution; on rejection draw from p with d taken out. Each
    output token is then distributed exactly as p (Leviathan et al., 2023). Every draw is keyed
    by the output position, so a seeded request repeats itself (its tokens differ from those it
    gets without speculation: the draws are different ones).
    """
    history = list(history) if rs.processors else []
    tokens: list[Sampled] = []
    for j in range(len(drafts) + 1):
        x = logits[j : j + 1]
        if rs.params.adjusts_logits:  # the drafts kept so far count as generated
            x = _add_deltas(x, rs.deltas(drafts[:j]))
        logprobs = _logprobs(x, rs, history)
        if j == len(drafts):
            token = _token(rs.sample(logprobs, position + j))
        else:
            token = _judge(logprobs, rs, position + j, drafts[j])
        tokens.append(_sampled(logprobs, token, rs))
        if j == len(drafts) or token != drafts[j]:
            break
        if rs.processors:
            history.append(token)
    return Accepted(tuple(tokens), len(drafts))


def _add_deltas(x: mx.array, delta: dict[int, float]) -> mx.array:
    if not delta:
        return x
    add = mx.array(list(delta.values()), dtype=mx.float32).astype(x.dtype)
    return x.at[0, mx.array(list(delta.keys()))].add(add)


def _judge(logprobs: mx.array, rs: RowSampler, position: int, draft: int) -> int:
    """The token at ``position`` given a draft: the draft if kept, else a replacement."""
    if rs.params.greedy:
        return _token(mx.argmax(logprobs, axis=-1))
    weights = rs.weights(logprobs)
    accept_key, resample_key = mx.random.split(rs.key(position))
    p_draft = mx.softmax(weights, axis=-1)[0, draft]
    if bool(np.asarray(mx.random.uniform(key=accept_key) < p_draft)):
        return draft
    residual = mx.put_along_axis(
        weights, mx.array([[draft]]), mx.array(-mx.inf, weights.dtype), axis=-1
    )
    return _token(mx.random.categorical(residual, key=resample_key))
