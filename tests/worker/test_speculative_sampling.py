"""Verifying drafts (``worker.model.sampling.verify_row``): greedy keeps exactly the argmax
chain; sampled output keeps the request's distribution whatever the drafts are."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from worker.engine.sampling_params import SamplingParams
from worker.model.sampling import RowSampler, verify_row, verify_rows

V = 6


def logits(seed: int, rows: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(0, 1.5, (rows, V)).astype(np.float32))


def test_greedy_keeps_the_drafts_the_argmax_agrees_with() -> None:
    x = logits(0, 4)
    best = np.asarray(mx.argmax(x, axis=-1)).tolist()
    rs = RowSampler(SamplingParams())
    for drafts in ([best[0], best[1], best[2]], [best[0], (best[1] + 1) % V, best[2]], [9 % V]):
        n = 0
        while n < len(drafts) and drafts[n] == best[n]:
            n += 1
        want = [*drafts[:n], best[n]]
        one = verify_row(x, rs, [], 0, drafts)
        assert [t.token for t in one.tokens] == want
        assert one.accepted == n and one.drafts == len(drafts)
        # The batched plain-greedy path agrees with the row path.
        (batched,) = verify_rows([(x[: len(drafts) + 1], rs, [], 0, drafts)])
        assert [t.token for t in batched.tokens] == want


@pytest.mark.parametrize(
    ("params", "draft"),
    [
        (SamplingParams(temperature=0.7), 2),
        (SamplingParams(temperature=1.3, top_k=3), 0),
        (SamplingParams(temperature=1.0, top_p=0.8), 4),
    ],
)
def test_sampled_tokens_keep_their_distribution(params: SamplingParams, draft: int) -> None:
    """Over many seeds, the first token (draft kept or replaced) is distributed as the
    request's filtered, tempered distribution, and so is the second given the first."""
    x = logits(1, 3)
    n = 3000
    firsts, seconds = np.zeros(V), np.zeros(V)
    kept = 0
    for seed in range(n):
        rs = RowSampler(SamplingParams(**{**_fields(params), "seed": seed}))
        out = verify_row(x, rs, [], 0, [draft, draft])
        firsts[out.tokens[0].token] += 1
        if out.accepted >= 1:
            kept += 1
            seconds[out.tokens[1].token] += 1
    if _distribution(x[:1], params)[draft] == 0:  # filtered out: never kept
        assert kept == 0
    else:
        assert kept > 0
    for counts, row, total in ((firsts, 0, n), (seconds, 1, kept)):
        if total == 0:
            continue
        want = _distribution(x[row : row + 1], params)
        got = counts / total
        # 4.5 standard errors: the test flakes once in ~10^5 runs, a wrong rule fails it.
        assert np.all(np.abs(got - want) <= 4.5 * np.sqrt(want * (1 - want) / total) + 1e-9), (
            got,
            want,
        )


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


def _distribution(row: mx.array, params: SamplingParams) -> np.ndarray:
    rs = RowSampler(params)
    w = rs.weights(row - mx.logsumexp(row, axis=-1, keepdims=True))
    return np.asarray(mx.softmax(w, axis=-1))[0].astype(np.float64)
