"""The host draw (``worker.model.host_draw``) against the MLX sampler it replaced for the
batch: the same tokens kept by every filter, draws distributed as the filtered, tempered
distribution, top logprobs as a full sort gives them, and per-row numbers that depend on
(seed, position) only."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kvserve_model.sampling_params import SamplingParams
from worker.model import host_draw
from worker.model.sampling import RowSampler, sample_rows

FILTERS = [
    dict(top_p=0.5),
    dict(top_p=0.9),
    dict(top_p=0.999),
    dict(top_k=1),
    dict(top_k=7),
    dict(top_k=300),
    dict(min_p=0.05),
    dict(top_p=0.9, top_k=20),
    dict(top_p=0.95, min_p=0.1, top_k=50),
    dict(),
]


def peaked(rng: np.random.Generator, vocab: int) -> np.ndarray:
    """Logits shaped like a language model's: a few likely tokens, a long tail."""
    return (-2.0 * np.log(rng.permutation(vocab) + 1.0) + rng.normal(0, 0.5, vocab)) * 1.5


def flat(rng: np.random.Generator, vocab: int) -> np.ndarray:
    """Nearly uniform: no candidate set holds the nucleus (the whole-row fallbacks)."""
    return rng.normal(0, 0.1, vocab)


def reference_kept(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The tokens the MLX sampler's filters keep (``RowSampler.weights``: finite weights)."""
    lp = mx.array(x[None].astype(np.float32))
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    w = np.array(RowSampler(params).weights(lp))[0]
    return np.isfinite(w)


@pytest.mark.parametrize("shape", [peaked, flat])
@pytest.mark.parametrize("kw", FILTERS)
def test_the_filters_keep_what_the_mlx_sampler_keeps(shape, kw) -> None:
    rng = np.random.default_rng(len(kw) + 7 * len(str(kw)))
    for vocab in (50, 5000, 50000):
        x = shape(rng, vocab).astype(np.float32)
        params = SamplingParams(max_tokens=4, temperature=0.8, **kw)
        row = host_draw.Row(x)
        got = x >= row.threshold(params)
        want = reference_kept(x, params)
        # Where they differ, only by a token at the nucleus's edge: the mass before it within
        # float32 rounding (MLX's cumulative sum) of top_p; this module sums in float64.
        order = np.argsort(-x, kind="stable")
        p = np.exp(x[order].astype(np.float64) - row.lse)
        before = np.empty(vocab)
        before[order] = np.cumsum(p) - p
        differ = np.flatnonzero(got != want)
        assert all(abs(before[t] - params.top_p) < 1e-5 for t in differ), (vocab, len(differ))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
@pytest.mark.parametrize("kw", [dict(), dict(top_p=0.9), dict(top_k=5), dict(min_p=0.02)])
@pytest.mark.parametrize("vocab", [40, 3000])
def test_draws_follow_the_filtered_tempered_distribution(temperature, kw, vocab) -> None:
    """Draws at a grid of N evenly spaced numbers: token t comes N * p(t) times, give or
    take one (the draw is an inverse CDF), where p is the MLX sampler's distribution."""
    rng = np.random.default_rng(vocab + int(10 * temperature))
    x = peaked(rng, vocab).astype(np.float32)
    params = SamplingParams(max_tokens=4, temperature=temperature, **kw)
    lp = mx.array(x[None]) - mx.logsumexp(mx.array(x[None]), axis=-1, keepdims=True)
    p = np.array(mx.softmax(RowSampler(params).weights(lp), axis=-1))[0].astype(np.float64)
    n = 20000
    row = host_draw.Row(x)
    counts = np.bincount([row.draw(params, (i + 0.5) / n) for i in range(n)], minlength=vocab)
    assert np.all(np.abs(counts - n * p) <= 1.0 + 1e-3 * n * p), np.abs(counts - n * p).max()
    assert counts[p == 0].sum() == 0  # nothing a filter dropped


def test_a_draw_over_the_whole_vocabulary_crosses_its_chunks() -> None:
    """No filter, several chunks of the cumulative sum: the inverse CDF at chunk edges."""
    vocab = 3 * host_draw.CHUNK + 17
    rng = np.random.default_rng(3)
    x = rng.normal(0, 0.3, vocab).astype(np.float32)
    row = host_draw.Row(x)
    params = SamplingParams(max_tokens=4, temperature=1.0)
    cum = np.cumsum(np.exp(x.astype(np.float64) - x.max()))
    for u in [1e-9, 0.1, 0.25, 0.333, 0.5, 0.75, 0.999999, 1.0, *rng.random(200)]:
        want = int(np.searchsorted(cum, u * cum[-1], side="left"))
        got = row.draw(params, u)
        assert abs(got - want) <= 1 and (got == want or np.isclose(cum[got], u * cum[-1]))


def test_top_logprobs_are_a_full_sort_s() -> None:
    rng = np.random.default_rng(5)
    for x in (peaked(rng, 2000), flat(rng, 2000)):
        x = x.astype(np.float32)
        row = host_draw.Row(x)
        lse = float(np.log(np.exp(x.astype(np.float64) - x.max()).sum()) + x.max())
        for n in (1, 5, 20):
            want = np.argsort(-x, kind="stable")[:n]
            got = row.top_logprobs(n)
            assert [t for t, _ in got] == want.tolist()
            assert np.allclose([v for _, v in got], x[want] - lse, atol=1e-5)
        assert host_draw.top_n(x, 7).tolist() == np.argsort(-x, kind="stable")[:7].tolist()


def test_the_uniform_number_depends_on_seed_and_position_only() -> None:
    us = [host_draw.uniform(seed, pos) for seed in range(20) for pos in range(500)]
    assert all(0.0 < u <= 1.0 for u in us)
    assert len(set(us)) == len(us)
    assert abs(np.mean(us) - 0.5) < 0.01 and abs(np.var(us) - 1 / 12) < 0.005
    assert host_draw.uniform(7, 3) == host_draw.uniform(7, 3)
    assert host_draw.uniform(2**32 - 1, 10**9) <= 1.0


def test_sample_rows_draws_each_row_as_it_would_alone() -> None:
    """A row's token depends on its own logits, seed and position: the same batched with
    other rows (greedy, with logprobs, other settings) as alone; logprobs are log-softmax."""
    rng = np.random.default_rng(11)
    vocab = 4000
    logits = mx.array(np.stack([peaked(rng, vocab) for _ in range(6)]).astype(np.float32))
    kws = [
        dict(temperature=1.0, seed=1),
        dict(temperature=0.7, top_p=0.9, seed=2, logprobs=3),
        dict(temperature=0.0),
        dict(temperature=0.0, logprobs=2),
        dict(temperature=1.2, top_k=10, min_p=0.01, seed=3),
        dict(temperature=0.5, seed=4),
    ]
    samplers = [RowSampler(SamplingParams(max_tokens=4, **kw)) for kw in kws]  # type: ignore[arg-type]
    rows = [(i, rs, [], 9 + i) for i, rs in enumerate(samplers)]
    batched = sample_rows(logits, rows)
    lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    for i, rs in enumerate(samplers):
        (alone,) = sample_rows(logits[i : i + 1], [(0, rs, [], 9 + i)])
        assert batched[i] == alone
        if i != 2:  # (a plain greedy row is one batched argmax: no logprob computed)
            assert math.isclose(batched[i].logprob, float(lp[i, batched[i].token]), abs_tol=1e-4)
    assert batched[2].token == int(np.argmax(lp[2]))
    assert [t for t, _ in batched[3].top] == np.argsort(-lp[3], kind="stable")[:2].tolist()


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_the_repetition_penalty_is_mlx_lm_s(penalty) -> None:
    """The host's penalty equals mlx-lm's processor (``make_logits_processors``) over the
    same history: the last 20 tokens, repeats among them, logits of both signs."""
    from mlx_lm.sample_utils import make_logits_processors

    rng = np.random.default_rng(int(penalty * 10))
    x = rng.normal(0, 3, 500).astype(np.float32)
    (proc,) = make_logits_processors(repetition_penalty=penalty)
    for history in ([], [7], [3, 3, 9, 499, 0], rng.integers(0, 500, 60).tolist()):
        want = np.array(proc(mx.array(history, dtype=mx.int32), mx.array(x[None])))[0]
        got = host_draw.repetition_penalty(x, history, penalty)
        assert np.allclose(got, want, rtol=1e-6, atol=0), history
    assert host_draw.repetition_penalty(x, [1, 2], penalty) is not x  # a copy
    rows = [(0, RowSampler(SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=penalty)),
             [int(np.argmax(x))], 5)]  # fmt: skip
    (s,) = sample_rows(mx.array(x[None]), rows)
    want_x = np.array(proc(mx.array(rows[0][2], dtype=mx.int32), mx.array(x[None])))[0]
    assert s.token == int(np.argmax(want_x))
