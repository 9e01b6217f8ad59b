"""The block-table prefill kernel (``worker.model.gpu_prefill``), its wiring and its policy.

Off an NVIDIA GPU the kernel's role is played by its float64 reference (the decode kernel's:
the same arguments and result), with the dtype and head-dim limits opened to the tiny fp32
models, so the calls the hook makes (which forwards, which windows, which tables) are checked
here; the tests marked ``cuda`` run the kernel itself and were run on an H100.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

import tests.worker.test_paged_parity as parity
from tests.worker.helpers import TOL, reference_kernel, route_as_cuda, tiny_model
from tests.worker.test_gpu_attention import _random_case
from worker.model import device as devices
from worker.model import mlx_fixes
from worker.model import runner as runner_module
from worker.model.attention import AttentionOptions, gpu_decode, gpu_prefill, seam
from worker.model.attention import cuda as cuda_backend
from worker.model.forward_batch import ForwardBatch, SeqInput
from worker.model.kv_pool import KVPool
from worker.model.paged_cache import PagedLayerCache
from worker.model.runner import ModelRunner
from worker.model.spec import probe

cuda = pytest.mark.skipif(
    not devices.cuda_available(), reason="needs an NVIDIA GPU (MLX's CUDA backend)"
)


# --- the policy: the kernel first, cuDNN once a shape recurs ----------------------------------


def test_a_shape_goes_to_cudnn_on_its_second_sighting():
    history = gpu_prefill.ShapeHistory()
    assert not history.recurring([("a",), ("b",)])
    assert history.recurring([("a",)])
    assert not history.recurring([("a",), ("c",)])  # one new shape: the whole forward waits
    assert history.recurring([("c",), ("b",), ("a",)])


def test_the_history_forgets_the_oldest_shapes():
    history = gpu_prefill.ShapeHistory(capacity=2)
    history.recurring([1])
    history.recurring([2])
    history.recurring([1])  # 1 is now the newest
    history.recurring([3])  # evicts 2
    assert history.recurring([1]) and not history.recurring([2])


@pytest.mark.parametrize(
    ("starts", "lens"),
    [([0, 0], [20, 20]), ([0, 32, 5], [45, 20, 20]), ([64], [30]), ([0], [32]), ([3, 0], [40, 3])],
)
def test_the_recorded_shapes_are_the_calls_the_cudnn_path_makes(starts, lens, monkeypatch):
    rng = np.random.default_rng(sum(lens))
    batch, pool_k, pool_v, _ = _random_case(
        rng, [s + n for s, n in zip(starts, lens, strict=True)], max(lens), q_lens=lens
    )
    heads = mx.arange(2)[None, :, None]
    k, v = (
        p[heads, batch.tables].reshape(batch.size, 2, batch.key_len, 16) for p in (pool_k, pool_v)
    )
    q = mx.array(rng.standard_normal((batch.size, 6, batch.query_len, 16)).astype(np.float32))
    made = []
    real = mx.fast.scaled_dot_product_attention

    def sdpa(q, k, v, **kw):
        made.append((q.shape[0], q.shape[2], k.shape[2]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", sdpa)
    cuda_backend.exact_context_attention(q, k, v, batch, 0.25)
    recorded = cuda_backend.cudnn_shapes(batch, q, k, batch.mask())
    assert [r[:3] for r in recorded] == made
    assert {r[3:] for r in recorded} == {(batch.key_len, 6, 2, 16, str(mx.float32))}


# --- the wiring, with the float64 reference standing in ---------------------------------------


class _Routes:
    """Routes attention as on an NVIDIA GPU, both kernels' roles played by the reference,
    the prefill kernel's limits opened to fp32 and head dim 16; counts each path's calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kernel: list[tuple[int, int | None]] = []  # (queries, window)
        self.exact: list[int] = []
        self.history = gpu_prefill.ShapeHistory()

        def kernel(queries, pool_k, pool_v, tables, ends, scale, window=None, q_lens=None, **kw):
            self.kernel.append((queries.shape[2], window))
            return reference_kernel(queries, pool_k, pool_v, tables, ends, scale, window, q_lens)

        real_exact = cuda_backend.exact_context_attention

        def exact(q, *args):
            self.exact.append(q.shape[2])
            return real_exact(q, *args)

        route_as_cuda(monkeypatch, reference_kernel)
        choose = runner_module.choose_backend

        def backend(options=None):  # one history across runners, as in one worker's life
            chosen = choose(options)
            chosen.history = self.history
            return chosen

        monkeypatch.setattr(runner_module, "choose_backend", backend)
        monkeypatch.setattr(gpu_prefill, "paged_prefill_attention", kernel)
        monkeypatch.setattr(gpu_prefill, "DTYPES", (*gpu_prefill.DTYPES, mx.float32))
        monkeypatch.setattr(gpu_prefill, "HEAD_DIMS", (16, 32, *gpu_prefill.HEAD_DIMS))
        monkeypatch.setattr(cuda_backend, "exact_context_attention", exact)
        self.backend = backend


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma3"])
def test_prefill_takes_the_kernel_then_cudnn_once_its_shapes_recur(family, monkeypatch):
    routes = _Routes(monkeypatch)
    model = tiny_model(family)
    for round_ in range(2):
        runner = ModelRunner.create(model, block_size=parity.BS, num_blocks=64)
        assert parity._batched_prefill_and_decode(model, runner) <= TOL
        assert parity._shared_unaligned_prefix(model, runner) <= TOL
        if round_ == 0:  # new shapes: the kernel (a shape met twice in the round: cuDNN)
            assert routes.kernel and min(n for n, _ in routes.kernel) > 17
            kernel, exact = list(routes.kernel), len(routes.exact)
        else:  # the same shapes again: cuDNN for every windowless layer call
            again = routes.kernel[len(kernel) :]
            assert all(w is not None for _, w in again)  # sliding-window layers: the kernel
            assert len(again) == sum(w is not None for _, w in kernel)
            assert len(routes.exact) - exact == exact + sum(w is None for _, w in kernel)
    if family == "gemma3":
        assert {w for _, w in routes.kernel} == {None, 16}
    before = len(routes.kernel)
    off = AttentionOptions(prefill_kernel=False)  # --no-prefill-kernel
    runner = ModelRunner.create(model, block_size=parity.BS, num_blocks=64, attention=off)
    routes.history.clear()
    assert parity._batched_prefill_and_decode(model, runner) <= TOL
    assert len(routes.kernel) == before  # switched off


def _prefill_layer(backend, d: int = 16):
    """A prefill batch of two sequences (one over a cached block) on one layer's cache view,
    K/V written, attention by ``backend``: (cache, queries, keys, values)."""
    rng = np.random.default_rng(1)
    seqs = [SeqInput([1] * 20, [3, 0, 5, 6, 7, 8], 4), SeqInput([4] * 18, [1, 2, 9, 10, 11], 0)]
    batch = ForwardBatch(seqs, 4, 16)
    spec = probe(tiny_model("llama"))
    pool = KVPool(spec.layers[:1], 16, 4)
    cache = PagedLayerCache(batch, pool, 0, backend)
    new = [mx.array(rng.standard_normal((2, 2, 20, d)).astype(np.float32)) for _ in range(2)]
    keys, values = cache.update_and_fetch(*new)
    q = mx.array(rng.standard_normal((2, 4, 20, d)).astype(np.float32))
    return cache, q, keys, values


def test_the_kernel_serves_only_what_it_can_rebuild(monkeypatch):
    routes = _Routes(monkeypatch)
    cache, q, keys, values = _prefill_layer(routes.backend())
    batch = cache.batch
    mask = batch.mask()
    got = seam.paged_sdpa(q, keys, values, cache, 0.25, mask)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.25, mask=mask)
    assert float(mx.abs(got - want).max()) < 1e-5 and routes.kernel == [(20, None)]
    routes.kernel.clear()
    fresh = [
        _prefill_layer(routes.backend()) for _ in range(3)
    ]  # a new batch each: decided per forward
    (c1, q1, k1, v1), (c2, q2, k2, v2), (c3, q3, k3, v3) = fresh
    seam.paged_sdpa(q1, k1 * 1, v1, c1, 0.25, c1.batch.mask())  # changed keys
    seam.paged_sdpa(q2, k2, v2, c2, 0.25, mx.array(np.array(c2.batch.mask())))
    seam.paged_sdpa(q3, k3, v3, c3, 0.25, c3.batch.mask(), sinks=mx.zeros((4,)))
    assert routes.kernel == []


def test_supports():
    q = mx.zeros((2, 8, 30, 64), mx.float16)
    pool = mx.zeros((2, 9, 32, 64), mx.float16)
    assert gpu_prefill.supports(q, pool, pool)
    assert gpu_prefill.supports(q.astype(mx.float32), pool, pool)  # queries are cast
    assert gpu_prefill.supports(
        mx.zeros((2, 8, 30, 128)), *[mx.zeros((2, 9, 32, 128), mx.bfloat16)] * 2
    )
    assert not gpu_prefill.supports(q, pool.astype(mx.float32), pool.astype(mx.float32))
    assert not gpu_prefill.supports(
        mx.zeros((2, 8, 30, 96)), *[mx.zeros((2, 9, 32, 96), mx.float16)] * 2
    )
    assert not gpu_prefill.supports(
        mx.zeros((2, 6, 30, 64)), *[mx.zeros((4, 9, 32, 64), mx.float16)] * 2
    )


def test_kernel_source_uses_every_input_and_output():
    for kind, outputs in (("single", ["out"]), ("partial", ["o_part", "ml_part"])):
        _, body = gpu_prefill.render(kind)
        assert "$" not in body
        for name in ["q", "pool_k", "pool_v", "tables", "ends", "q_lens", "params", *outputs]:
            assert re.search(rf"\b{name}\b", body), (kind, name)


# --- the kernel itself (NVIDIA GPU only) ------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize(
    ("lengths", "q_lens", "window", "d", "rep", "bs", "splits"),
    [
        ([100], [100], None, 128, 4, 32, None),  # a first chunk
        ([41, 300, 1041], [40, 18, 300], None, 64, 4, 32, None),  # ragged, padded rows
        ([933, 45], [40, 33], None, 64, 1, 16, None),
        ([250, 390, 1020], [250, 90, 20], 100, 128, 8, 32, None),  # a window
        ([2020, 133], [20, 130], None, 128, 4, 32, 5),  # split keys
        ([2570], [70], 700, 64, 8, 16, 3),
    ],
)
def test_kernel_matches_the_reference(dtype, lengths, q_lens, window, d, rep, bs, splits):
    rng = np.random.default_rng(sum(lengths))
    batch, pool_k, pool_v, q = _random_case(
        rng, lengths, max(q_lens), bs=bs, h=2, rep=rep, d=d, q_lens=q_lens
    )
    pool_k, pool_v, q = pool_k.astype(dtype), pool_v.astype(dtype), q.astype(dtype)
    tables, ends, query_lens = batch.kernel_inputs()
    scale = d**-0.5
    # An output the kernel leaves unwritten shows.
    mlx_fixes.dirty_buffer_cache(q, pool_k, pool_v, tables, ends, query_lens)
    got = gpu_prefill.paged_prefill_attention(
        q, pool_k, pool_v, tables, ends, scale, window, query_lens, splits=splits
    )
    f32 = [np.array(a.astype(mx.float32)) for a in (q, pool_k, pool_v)]
    want = gpu_decode.reference_attention(
        *f32, np.array(tables), np.array(ends), scale, window, np.array(query_lens)
    )
    tol = {mx.float16: 4e-3, mx.bfloat16: 2.5e-2}[dtype]
    assert np.abs(np.array(got.astype(mx.float32)) - want).max() <= tol * max(1, np.abs(want).max())


@cuda
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_the_self_check_passes_through_the_kernel(family, dtype, monkeypatch):
    """A half-precision model with 64-wide heads: the start-up self-check (paged against
    dense mlx-lm, a 20-token prefill among its steps) passes with prefill on the kernel."""
    from worker.model.self_check import check_paged_parity

    calls = []
    real = gpu_prefill.paged_prefill_attention
    monkeypatch.setattr(
        gpu_prefill,
        "paged_prefill_attention",
        lambda q, *a, **k: calls.append(1) or real(q, *a, **k),
    )
    model = tiny_model(
        family, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64
    )
    model.set_dtype(dtype)
    result = check_paged_parity(model)
    assert result.ok, result
    assert calls


@pytest.mark.parametrize("splits", [1, 3])
def test_both_kernels_launch_one_pass_or_split_then_reduce(splits, monkeypatch):
    """The launch both kernels share (``gpu_decode.launch``), with the kernels stood in
    for: which variants run, with which grids and output shapes, on any machine."""
    calls = []

    def stand_in(*names, **_):
        def call(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            calls.append((names[-1], grid, threadgroup, output_shapes, output_dtypes))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

        return call

    monkeypatch.setattr(gpu_decode, "_kernel", stand_in)
    monkeypatch.setattr(gpu_prefill, "_kernel", stand_in)
    q = mx.zeros((3, 8, 40, 64), mx.float32)
    pool = mx.zeros((2, 20, 16, 64), mx.float16)
    tables, ends = mx.zeros((3, 6), mx.int32), mx.full((3,), 90, mx.int32)
    out = gpu_prefill.paged_prefill_attention(q, pool, pool, tables, ends, 0.1, splits=splits)
    assert out.shape == q.shape and out.dtype == mx.float32  # the queries' dtype back
    want = ["single"] if splits == 1 else ["partial", "reduce"]
    assert [c[0] for c in calls] == want
    assert calls[0][1] == (128 * 3 * 2 * splits, 3, 1) and calls[0][2] == (128, 1, 1)
    if splits > 1:
        rows = 3 * 8 * 40
        assert calls[0][3] == [(rows, splits, 64), (rows, splits, 2)]
        assert calls[1][1] == (rows * 64, 1, 1) and calls[1][3] == [(3, 8, 40, 64)]
    else:
        assert calls[0][3] == [(3, 8, 40, 64)] and calls[0][4] == [mx.float16]
    calls.clear()
    out = gpu_decode.paged_decode_attention(
        q[:, :, :1], pool, pool, tables, ends, 0.1, splits=splits
    )
    assert out.shape == (3, 8, 1, 64) and [c[0] for c in calls] == want
