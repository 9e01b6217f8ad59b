"""Sampled tokens drawn on the host, for a whole batch at once (``sampling.sample_rows``).

Drawing each row through MLX cost a request several milliseconds a token on a CPU, however
short its step: MLX's CPU ``exp`` runs at ~16 ns an element (numpy's: ~1.5), a categorical draw
makes a random number for every token of the vocabulary, and ``top_p`` sorted the vocabulary
(Qwen's 151,936 tokens, 2-core EPYC: 5 ms a row at temperature 0.8, 23 ms with ``top_p`` 0.95,
21 ms for a greedy row with ``logprobs``; ``bench/bench_sampling.py``). Here the batch's
logits come to the host once and each row is drawn with numpy:

- One ``exp`` pass a row gives the softmax's normalizer (the token's log-probability) and, at
  temperature 1, the weights themselves.
- The filters (mlx-lm's order: ``top_p``, ``min_p``, ``top_k``, then the temperature) each keep
  the tokens at or above a threshold, so their composition keeps those at or above the largest
  of the three. ``top_p`` and ``top_k`` read their thresholds off the row's candidates, sorted:
  the tokens within a few nats of the best (:data:`LEVELS`), as few as hold ``top_p`` of the
  mass or ``top_k`` tokens. That is exact, and a language model's peaked distribution needs
  tens to hundreds of them; a row that would need more than :data:`MAX_CANDIDATES` sorts (or
  partitions) its whole vocabulary, as before.
- The token is drawn by inverting the kept weights' cumulative sum at one uniform number, the
  row's own: :func:`uniform` of (seed, position), so a seeded request gives the same tokens
  alone, in any batch and after a preemption, and no global random state is read or written.

The distribution is exactly the filtered, tempered one that ``RowSampler.weights`` describes;
the token a given seed gives differs from the MLX draw's before this module (other random
numbers, another method).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvserve_model.sampling_params import SamplingParams

# Candidates for top_p, top_k and the top logprobs: the tokens within the first of these many
# nats of the best one that hold what the filter needs (a count of tokens, a share of the mass).
# A language model's next-token distribution is peaked: within 8 nats of the best, the default
# model's rows held 35-609 tokens and 88-99% of the mass; within 16, up to 30,000.
LEVELS = (2.0, 4.0, 6.0, 8.0, 11.0, 14.0, 18.0)
MAX_CANDIDATES = 4096  # more than this: the filter takes the whole row (sort or partition)
CHUNK = 1024  # the cumulative sum over a whole vocabulary runs a chunk at a time
REPETITION_CONTEXT = 20  # mlx-lm's repetition_context_size default, which its server uses
_MASK64 = (1 << 64) - 1


def uniform(seed: int, position: int) -> float:
    """A number in (0, 1] from (seed, position) alone: splitmix64 of the pair, 53 bits."""
    z = (seed * 1_000_003 + position + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return ((z >> 11) + 1) * 2.0**-53


class Row:
    """One row of logits on the host, its normalizer, and its candidates (made when asked)."""

    def __init__(self, x: np.ndarray) -> None:
        self.x = x  # float32 [vocab]
        self.top = float(x.max())
        self.e = np.exp(x - self.top)  # float32, the weights at temperature 1 (best: 1.0)
        self.total = float(self.e.sum(dtype=np.float64))
        self.lse = self.top + math.log(self.total)
        self._levels: dict[float, tuple[np.ndarray, float]] = {}  # cutoff: (ids, mass)
        self._sorted: dict[float, tuple[np.ndarray, np.ndarray]] = {}

    def logprob(self, token: int) -> float:
        return float(self.x[token]) - self.lse

    def candidates(self, count: int = 0, mass: float = 0.0) -> tuple[np.ndarray, np.ndarray] | None:
        """(token ids, logits), best first (ties: lower id first): the tokens within the first
        of :data:`LEVELS` of the best that number at least ``count`` and hold at least
        ``mass`` of the probability; None if that takes more than :data:`MAX_CANDIDATES`."""
        for cut in LEVELS:
            if cut not in self._levels:
                ids = np.flatnonzero(self.x >= self.top - cut)
                share = float(self.e[ids].sum(dtype=np.float64)) / self.total
                self._levels[cut] = ids, share
            ids, share = self._levels[cut]
            if len(ids) > MAX_CANDIDATES:
                return None
            if len(ids) >= count and share >= mass:
                if cut not in self._sorted:
                    vals = self.x[ids]
                    order = np.argsort(-vals, kind="stable")
                    self._sorted[cut] = ids[order], vals[order]
                return self._sorted[cut]
        return None

    def top_logprobs(self, n: int) -> tuple[tuple[int, float], ...]:
        """The ``n`` most likely tokens and their log-probabilities, best first."""
        cand = self.candidates(count=n)
        ids = cand[0][:n] if cand is not None else top_n(self.x, n)
        return tuple((int(t), float(self.x[t]) - self.lse) for t in ids)

    def threshold(self, p: SamplingParams) -> float:
        """The logit below which ``p``'s filters drop a token (-inf: none dropped)."""
        thr = -math.inf
        vocab = len(self.x)
        if 0.0 < p.top_p < 1.0:
            thr = max(thr, self._top_p(p.top_p))
        if p.min_p > 0.0:
            thr = max(thr, self.top + math.log(p.min_p))
        if 0 < p.top_k < vocab:
            cand = self.candidates(count=p.top_k)
            if cand is not None:
                thr = max(thr, float(cand[1][p.top_k - 1]))
            else:
                thr = max(thr, float(np.partition(self.x, vocab - p.top_k)[vocab - p.top_k]))
        return thr

    def _top_p(self, top_p: float) -> float:
        """The smallest logit kept by nucleus filtering: tokens are kept best first while the
        mass before them is below ``top_p``. Candidates holding ``top_p`` of the mass hold
        every kept token; without such (a flat row) the whole row is sorted."""
        cand = self.candidates(mass=top_p)
        vals = cand[1] if cand is not None else np.sort(self.x)[::-1]
        probs = np.exp(vals.astype(np.float64) - self.lse)
        before = np.cumsum(probs) - probs
        kept = int(np.count_nonzero(before < top_p))
        return float(vals[max(kept, 1) - 1])

    def draw(self, p: SamplingParams, u: float) -> int:
        """A token of ``p``'s filtered, tempered distribution, at ``u`` in (0, 1]."""
        thr = self.threshold(p)
        inv_t = 1.0 / p.temperature
        if thr > -math.inf:
            ids = np.flatnonzero(self.x >= thr)
            if len(ids) <= MAX_CANDIDATES:  # the kept tokens alone
                w = np.exp((self.x[ids].astype(np.float64) - self.top) * inv_t)
                cum = np.cumsum(w)
                i = int(np.searchsorted(cum, u * cum[-1], side="left"))
                return int(ids[min(i, len(ids) - 1)])
        w = self.e if inv_t == 1.0 else np.exp((self.x - self.top) * np.float32(inv_t))
        if thr > -math.inf:
            w = np.where(self.x >= thr, w, np.float32(0.0))
        return _invert(w, u)


def repetition_penalty(x: np.ndarray, history: Sequence[int], penalty: float) -> np.ndarray:
    """``x`` with mlx-lm's repetition penalty (``make_repetition_penalty``) over the last
    :data:`REPETITION_CONTEXT` tokens of ``history``: a repeated token's logit is divided by
    ``penalty`` if positive, multiplied if negative. A copy; ``x`` is unchanged."""
    recent = np.asarray(list(history)[-REPETITION_CONTEXT:], dtype=np.int64)
    if not len(recent):
        return x
    out = x.copy()
    sel = out[recent]
    out[recent] = np.where(sel < 0, sel * np.float32(penalty), sel / np.float32(penalty))
    return out


def top_n(x: np.ndarray, n: int) -> np.ndarray:
    """The ids of the ``n`` largest of ``x``, largest first (ties: lower id first), by a
    partition and a sort of those ``n`` (a sort of the whole row took ~20 ms at 152k)."""
    n = min(n, len(x))
    part = np.argpartition(-x, n - 1)[:n] if n < len(x) else np.arange(len(x))
    return part[np.lexsort((part, -x[part]))]


def _invert(w: np.ndarray, u: float) -> int:
    """The first index whose cumulative weight reaches ``u`` of the whole, a chunk at a time
    (numpy's cumulative sum is a scalar loop; the chunks' sums are not)."""
    n = len(w)
    pad = -n % CHUNK
    chunks = np.pad(w, (0, pad)).reshape(-1, CHUNK).sum(axis=1, dtype=np.float64)
    cum = np.cumsum(chunks)
    target = u * cum[-1]
    c = min(int(np.searchsorted(cum, target, side="left")), len(cum) - 1)
    before = cum[c - 1] if c > 0 else 0.0
    inner = np.cumsum(w[c * CHUNK : (c + 1) * CHUNK], dtype=np.float64)
    i = min(int(np.searchsorted(inner, target - before, side="left")), len(inner) - 1)
    # Rounding can land on a zero-weight token at a chunk's edge: take the nearest kept one.
    at = c * CHUNK + i
    if w[at] > 0:
        return at
    nz = np.flatnonzero(w)
    return int(nz[np.searchsorted(nz, at)] if at < nz[-1] else nz[-1])
