"""The GPU block-table decode attention (``worker.model.attention.gpu_decode``) and its wiring.

Everything here but the tests marked ``cuda`` runs on the CPU: the kernel sources rendered from
one template for CUDA and Metal, the launch arithmetic, the float64 reference the GPU check holds
the kernel to (itself checked against SDPA), the batch metadata the kernel reads, which calls
``paged_sdpa`` hands to the kernel and which it keeps on mlx-lm's path, and the model-family
parity scenarios of ``test_paged_parity`` with the kernel's role played by the float64 reference
(so the windows, lengths and tables the wiring passes are the right ones). The tests marked
``cuda`` run the kernel itself; they are skipped without an NVIDIA GPU (MLX's CUDA backend)
and were run on an H100 (``docs/gpu-attention.md``).
"""

from __future__ import annotations

import logging
import re
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import tests.worker.test_paged_parity as parity
from tests.worker.helpers import (
    TOL,
    reference_kernel,
    route_as_cuda,
    runs_cuda_attention,
    tiny_model,
)
from worker.model import device as devices
from worker.model import mlx_fixes
from worker.model.attention import AttentionBackend, backend, gpu_decode, gpu_gather, seam
from worker.model.attention import cuda as cuda_backend
from worker.model.attention.cpu import CpuBackend
from worker.model.attention.cuda import CudaBackend
from worker.model.forward_batch import ForwardBatch, SeqInput
from worker.model.kv_pool import KVPool
from worker.model.paged_cache import PagedLayerCache
from worker.model.runner import ModelRunner
from worker.model.spec import probe

cuda = pytest.mark.skipif(
    not devices.cuda_available(), reason="needs an NVIDIA GPU (MLX's CUDA backend)"
)
KINDS = ("single", "partial", "reduce")


# --- the kernel sources -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_and_metal_sources_come_from_one_template(kind):
    cuda_header, cuda_body = gpu_decode.render("cuda", kind)
    metal_header, metal_body = gpu_decode.render("metal", kind)
    for body in (cuda_body, metal_body):
        assert "$" not in body
    # The bodies differ only in the backend's names for indices: swap them and they agree.
    translated = cuda_body
    names = gpu_decode._BACKENDS
    for key in sorted(names["cuda"], key=lambda k: -len(names["cuda"][k])):
        if names["cuda"][key]:
            translated = translated.replace(names["cuda"][key], names["metal"][key])
    assert translated.replace("\n", "") == metal_body.replace("\n", "")
    assert "blockIdx" in cuda_body and "threadgroup_position_in_grid" not in cuda_body
    assert "threadgroup_position_in_grid" in metal_body and "blockIdx" not in metal_body
    assert "__shfl_xor_sync" in cuda_header and "simd_shuffle_xor" in metal_header
    assert "__syncthreads" in cuda_header and "threadgroup_barrier" in metal_header


def test_every_input_and_output_is_used():
    for kind in KINDS:
        _, body = gpu_decode.render("cuda", kind)
        for name in gpu_decode._INPUTS[kind] + gpu_decode._OUTPUTS[kind]:
            assert re.search(rf"\b{name}\b", body), (kind, name)


@pytest.mark.parametrize("kind", ["single", "partial"])
def test_the_tensor_core_variant_shares_the_merge_and_is_cuda_only(kind):
    header, body = gpu_decode.render("cuda", kind, tc=True)
    _, core = gpu_decode.render("cuda", kind)
    assert "$" not in body and "mma.sync" in header and "cp.async" in header
    merge = body[body.index("// Merge the warps' (max, sum, output) rows") :]
    assert core.endswith(merge)  # one merge and write for both variants
    for name in gpu_decode._INPUTS[kind] + gpu_decode._OUTPUTS[kind]:
        assert re.search(rf"\b{name}\b", body), name
    with pytest.raises(ValueError, match="tensor-core"):
        gpu_decode.render("metal", kind, tc=True)
    with pytest.raises(ValueError, match="tensor-core"):
        gpu_decode.render("cuda", "reduce", tc=True)


def test_which_pools_take_tensor_cores(monkeypatch):
    monkeypatch.delenv(gpu_decode.KERNEL_ENV, raising=False)
    takes = gpu_decode.uses_tensor_cores
    for dtype in (mx.float16, mx.bfloat16):
        for d in (64, 128):
            for bs in (16, 32, 64):
                assert takes(mx.zeros((2, 4, bs, d), dtype))
    assert not takes(mx.zeros((2, 4, 32, 64), mx.float32))  # no fp32 mma
    assert not takes(mx.zeros((2, 4, 32, 256), mx.float16))  # registers: CUDA cores
    assert not takes(mx.zeros((2, 4, 32, 32), mx.float16))
    assert not takes(mx.zeros((2, 4, 8, 64), mx.float16))  # a 16-key chunk would straddle
    assert not takes(mx.zeros((2, 4, 32, 64), mx.float16), backend="metal")
    monkeypatch.setenv(gpu_decode.KERNEL_ENV, "core")
    assert not takes(mx.zeros((2, 4, 32, 64), mx.float16))


def test_the_tensor_core_pipeline_fits_static_shared_memory():
    for d in gpu_decode.TC_HEAD_DIMS:
        nw, st = gpu_decode.tc_pipeline(d)
        assert st >= 2 and nw * st * 2 * gpu_decode.TC_KEYS * (d + 8) * 2 <= 48 * 1024
        merge = (nw * gpu_decode.TC_ROWS * d + 2 * nw * gpu_decode.TC_ROWS) * 4
        assert merge <= 48 * 1024
    assert gpu_decode.tc_pipeline(64) == (4, 2)
    assert gpu_decode.tc_pipeline(128) == (1, 3)
    assert gpu_decode.tc_pipeline(128, stages=2) == (2, 2)  # the most warps that fit
    assert gpu_decode.tc_pipeline(64, warps=1) == (1, 3)
    with pytest.raises(ValueError):
        gpu_decode.tc_pipeline(128, warps=4, stages=3)


def test_a_tensor_core_plan_tiles_16_rows():
    q_shape, pool_shape = (3, 32, 2, 64), (8, 100, 32, 64)  # rep 4 x 2 queries: 8 rows
    plan = gpu_decode._plan(q_shape, pool_shape, mx.float16, 30, None, None, "cuda",
                            (True, None, None))  # fmt: skip
    template = dict(plan.template)
    assert plan.tc and template["RT"] == 16 and template["ST"] == 2 and template["NW"] == 4
    assert plan.grid == (128 * 3 * 8 * plan.splits, 1, 1) and plan.threads == 128
    core = gpu_decode._plan(q_shape, pool_shape, mx.float16, 30, None, None, "cuda",
                            (False, None, None))  # fmt: skip
    assert not core.tc and dict(core.template)["RT"] == 8 and "ST" not in dict(core.template)
    q17 = (3, 32, 17, 64)  # 4 x 17 = 68 rows: five tiles of 16
    assert gpu_decode._plan(q17, pool_shape, mx.float16, 30, None, None, "cuda",
                            (True, None, None)).grid[1] == 5  # fmt: skip


def test_the_metal_twin_builds_without_a_gpu():
    """Only built (MLX checks nothing until it runs): it is untested on hardware."""
    for kind in KINDS:
        assert callable(gpu_decode._kernel("metal", kind))


# --- launch arithmetic ------------------------------------------------------------------------


def test_rows_per_tile():
    assert gpu_decode.rows_per_tile(1, 1) == 1
    assert gpu_decode.rows_per_tile(4, 1) == 4
    assert gpu_decode.rows_per_tile(8, 1) == 8
    assert gpu_decode.rows_per_tile(2, 3) == 8  # 6 rows round up
    assert gpu_decode.rows_per_tile(4, 5) == 8  # 20 rows: three tiles of 8
    assert gpu_decode.rows_per_tile(16, 1) == 8


def test_splits_fill_the_gpu_at_small_batch_and_vanish_at_large():
    choose = gpu_decode.choose_splits
    # batch 1, 8 KV heads, 16k tokens in blocks of 32: as many splits as allowed
    assert choose(8, 512) == gpu_decode.MAX_SPLITS
    # batch 8 x 8 heads at 4k: enough for ~TARGET_CTAS thread blocks
    s = choose(64, 128)
    assert 64 * s >= gpu_decode.TARGET_CTAS and 64 * (s - 1) < gpu_decode.TARGET_CTAS
    assert choose(128 * 8, 128) == 1  # batch 128: the batch alone fills the GPU
    assert choose(8, 3) == 1  # fewer blocks than warps: one split
    assert choose(8, 40) == 10  # at least one block per warp in a split
    for ctas in (1, 7, 64, 1000):
        for blocks in (1, 5, 100, 1024):
            assert 1 <= choose(ctas, blocks) <= max(1, blocks)


def test_visible_blocks_under_a_window():
    vb = gpu_decode.visible_blocks
    assert vb(100, 32, 1, None) == 100
    assert vb(100, 32, 1, 1) == 1  # the query's own key
    assert vb(100, 32, 1, 64) == 3  # 64 keys from the middle of a block touch three
    assert vb(3, 32, 1, 4096) == 3
    # Brute force: the most blocks any W + nq - 1 consecutive positions touch.
    for bs in (4, 8, 32):
        for w in (1, 3, 8, 33, 70):
            for nq in (1, 5):
                span = w + nq - 1
                worst = max(((p + span - 1) // bs) - p // bs + 1 for p in range(3 * bs))
                assert vb(10**6, bs, nq, w) == worst


def test_supports():
    q = mx.zeros((2, 8, 1, 128), mx.float16)
    k = mx.zeros((2, 10, 32, 128), mx.float16)
    assert gpu_decode.supports(q, k, k)
    assert not gpu_decode.supports(mx.zeros((2, 8, 1, 96), mx.float16), k[..., :96], k[..., :96])
    assert not gpu_decode.supports(q, k, mx.zeros((2, 10, 32, 64), mx.float16))  # Dv != D
    assert not gpu_decode.supports(mx.zeros((2, 7, 1, 128), mx.float16), k, k)  # 7 % 2
    assert not gpu_decode.supports(mx.zeros((2, 8, 18, 128), mx.float16), k, k)  # prefill
    assert not gpu_decode.supports(q, k.astype(mx.int32), k.astype(mx.int32))


@pytest.mark.skipif(devices.cuda_available(), reason="a CPU-only MLX")
def test_inactive_without_cuda():
    assert not runs_cuda_attention()
    assert (
        not ModelRunner.create(tiny_model("llama"), num_blocks=8)
        .choose_decode_attention(batch=2, context=16, repeats=1)
        .path.startswith("block-table kernel")
    )


# --- the float64 reference, against SDPA on gathered K/V --------------------------------------


def _random_case(rng, lengths, nq, bs=8, h=2, rep=3, d=16, q_lens=None):
    """Sequences of ``lengths`` tokens (after the forward) each computing ``nq`` queries (or
    ``q_lens``), with shuffled block tables over a random pool: (batch, pool_k, pool_v, q)."""
    q_lens = q_lens or [nq] * len(lengths)
    need = [-(-n // bs) for n in lengths]
    num_blocks = sum(need) + 3
    order = rng.permutation(num_blocks).tolist()
    seqs, at = [], 0
    for n, k, ql in zip(lengths, need, q_lens, strict=True):
        seqs.append(SeqInput([0] * ql, order[at : at + k], n - ql))
        at += k
    batch = ForwardBatch(seqs, bs, num_blocks)
    shape = (h, num_blocks + 1, bs, d)
    pool_k = mx.array(rng.standard_normal(shape).astype(np.float32))
    pool_v = mx.array(rng.standard_normal(shape).astype(np.float32))
    q = mx.array(
        rng.standard_normal((len(lengths), h * rep, batch.query_len, d)).astype(np.float32)
    )
    return batch, pool_k, pool_v, q


def _gathered_sdpa(batch, pool_k, pool_v, q, scale, window):
    h = pool_k.shape[0]
    heads = mx.arange(h)[None, :, None]
    k = pool_k[heads, batch.tables].reshape(batch.size, h, batch.key_len, -1)
    v = pool_v[heads, batch.tables].reshape(batch.size, h, batch.key_len, -1)
    mask = batch.mask(window)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@pytest.mark.parametrize(
    ("lengths", "nq", "q_lens", "window"),
    [
        ([1, 9, 30], 1, None, None),
        ([17, 40], 1, None, 5),
        ([12, 12], 4, None, None),  # "causal"
        ([12, 25, 7], 4, [4, 2, 1], None),  # padded query rows
        ([33, 20], 3, [3, 2], 6),
    ],
)
def test_reference_matches_sdpa_on_gathered_blocks(lengths, nq, q_lens, window):
    rng = np.random.default_rng(len(lengths) * 10 + nq)
    batch, pool_k, pool_v, q = _random_case(rng, lengths, nq, q_lens=q_lens)
    tables, ends, query_lens = batch.kernel_inputs()
    scale = 0.3
    want = _gathered_sdpa(batch, pool_k, pool_v, q, scale, window)
    got = gpu_decode.reference_attention(
        np.array(q), np.array(pool_k), np.array(pool_v), np.array(tables), np.array(ends),
        scale, window, np.array(query_lens),
    )  # fmt: skip
    assert np.abs(got - np.array(want)).max() < 1e-5


def test_reference_detects_a_wrong_block():
    """Negative control: a table entry pointing elsewhere moves the output far past 1e-5."""
    rng = np.random.default_rng(3)
    batch, pool_k, pool_v, q = _random_case(rng, [40], 1)
    tables, ends, _ = batch.kernel_inputs()
    good = np.array(tables)
    bad = good.copy()
    bad[0, 2] = good[0, 2] + 1 if good[0, 2] + 1 < pool_k.shape[1] - 1 else good[0, 2] - 1
    args = (np.array(q), np.array(pool_k), np.array(pool_v))
    a = gpu_decode.reference_attention(*args, good, np.array(ends), 0.5)
    b = gpu_decode.reference_attention(*args, bad, np.array(ends), 0.5)
    assert np.abs(a - b).max() > 1e-2


# --- batch metadata ---------------------------------------------------------------------------


def test_kernel_inputs_and_mask_windows():
    seqs = [SeqInput([1, 2], [3, 0], 5), SeqInput([4], [1], 0)]
    batch = ForwardBatch(seqs, 4, 8)
    tables, ends, query_lens = batch.kernel_inputs()
    assert batch.kernel_inputs()[0] is tables  # built once a forward
    assert tables.dtype == ends.dtype == query_lens.dtype == mx.int32
    assert np.array(tables).tolist() == [[3, 0], [1, 8]]
    assert np.array(ends).tolist() == [7, 1] and np.array(query_lens).tolist() == [2, 1]
    plain, windowed = batch.mask(), batch.mask(3)
    assert batch.mask_window(plain) == (True, None)
    assert batch.mask_window(windowed) == (True, 3)
    assert batch.mask_window(mx.array(np.array(windowed))) == (False, None)  # equal, not ours
    assert batch.mask_window("causal") == (False, None)


@pytest.mark.parametrize(
    ("starts", "lens"),
    [
        ([0], [5]),  # one chunk from the start, context inside a block
        ([9, 0, 9, 3], [4, 6, 4, 1]),  # two equal sequences apart: groups out of batch order
        ([13, 13, 13], [3, 3, 3]),  # followers of one prefix: a single group, no gather
        ([2, 30, 7], [7, 2, 1]),  # padded rows, a one-query row among chunks
    ],
)
def test_exact_context_attention_equals_sdpa_under_the_mask(starts, lens):
    """One causal call per (queries, context) group gives what SDPA gives under the batch's
    array mask on every real row (GQA, fp32); padded rows, whose K/V go to the trash block,
    get their sequence's last real row."""
    rng = np.random.default_rng(sum(starts) + 7 * len(lens))
    bs, h, rep, d = 4, 2, 3, 16
    tables, nxt = [], 0
    for st, n in zip(starts, lens, strict=True):
        need = -(-(st + n) // bs)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    seqs = [SeqInput([1] * n, t, st) for st, n, t in zip(starts, lens, tables, strict=True)]
    batch = ForwardBatch(seqs, bs, nxt)
    mask = batch.mask(return_array=True)
    b, nq, kl = batch.size, batch.query_len, batch.key_len
    q = mx.array(rng.standard_normal((b, h * rep, nq, d)).astype(np.float32) * 2)
    k, v = (mx.array(rng.standard_normal((b, h, kl, d)).astype(np.float32)) for _ in range(2))
    assert cuda_backend._exact_contexts_express(batch, q, k, mask)
    got = cuda_backend.exact_context_attention(q, k, v, batch, 0.3)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    assert got.shape == want.shape
    got, want = np.array(got), np.array(want)
    for i, n in enumerate(lens):
        assert np.abs(got[i, :, :n] - want[i, :, :n]).max() < 1e-5
        assert (got[i, :, n:] == got[i, :, n - 1 : n]).all()
    groups = batch.context_groups()
    assert batch.context_groups() is groups  # built once a forward
    assert len(groups.groups) == len(set(zip(starts, lens, strict=True)))


def test_exact_context_attention_leaves_what_it_cannot_express():
    seqs = [SeqInput([1, 2, 3], [0], 0), SeqInput([4, 5], [1, 2], 3)]
    batch = ForwardBatch(seqs, 4, 8)
    q = mx.zeros((2, 2, 3, 8))
    k = mx.zeros((2, 1, batch.key_len, 8))
    plain, windowed = batch.mask(return_array=True), batch.mask(2)
    ok = cuda_backend._exact_contexts_express
    assert ok(batch, q, k, plain)
    assert not ok(batch, q, k, windowed)  # a sliding window
    assert not ok(batch, q, k, mx.array(np.array(plain)))  # equal, not the batch's own
    assert not ok(batch, q, k, "causal") and not ok(batch, q, k, None)
    assert not ok(batch, q, k[:, :, :4], plain)  # not the gathered context
    assert not ok(batch, q[:, :, :2], k, plain)


# --- which calls paged_sdpa hands to the kernel -----------------------------------------------


class _Spy:
    """Stands in for the kernel (float64 reference) and for mlx-lm's SDPA, counting calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count_original: bool = True) -> None:
        """Runners built from now on take the CUDA backend (``route_as_cuda``)."""
        self.kernel: list[tuple[tuple[int, ...], int | None]] = []
        self.original = 0
        original = backend.ORIGINAL_SDPA

        def kernel(
            queries, pool_k, pool_v, tables, context_lens, scale, window=None, q_lens=None, **kw
        ):
            self.kernel.append((tuple(queries.shape), window))
            return reference_kernel(
                queries, pool_k, pool_v, tables, context_lens, scale, window, q_lens
            )

        def sdpa(*args, **kwargs):
            self.original += 1
            return original(*args, **kwargs)

        route_as_cuda(monkeypatch, kernel)
        if count_original:  # (install() patches only modules holding the real original)
            monkeypatch.setattr(backend, "ORIGINAL_SDPA", sdpa)


def _layer(attention=None, num_blocks=16, bs=4, h=2, d=16):
    """A decode batch of two sequences (contexts 7 and 2) on one layer's cache view, with
    their K/V written, attention by ``attention`` (default: the CUDA backend): (cache,
    queries, keys, values)."""
    rng = np.random.default_rng(0)
    seqs = [SeqInput([1], [3, 0], 6), SeqInput([4], [1], 1)]
    batch = ForwardBatch(seqs, bs, num_blocks)
    model = tiny_model("llama")
    spec = probe(model)
    pool = KVPool(spec.layers[:1], num_blocks, bs)
    assert pool.layer_arrays(0)[0].shape[-1] == d and pool.layer_arrays(0)[0].shape[0] == h
    cache = PagedLayerCache(batch, pool, 0, attention or CudaBackend())
    new = [mx.array(rng.standard_normal((2, h, 1, d)).astype(np.float32)) for _ in range(2)]
    keys, values = cache.update_and_fetch(*new)
    q = mx.array(rng.standard_normal((2, 2 * h, 1, d)).astype(np.float32))
    return cache, q, keys, values


def test_paged_sdpa_serves_decodes_with_the_kernel(monkeypatch):
    cache, q, keys, values = _layer()
    spy = _Spy(monkeypatch)
    batch = cache.batch
    for mask, window in ((batch.mask(), None), (batch.mask(5), 5), (None, None)):
        got = seam.paged_sdpa(q, keys, values, cache, 0.25, mask)
        want = mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=0.25, mask=batch.mask(window)
        )
        assert float(mx.abs(got - want).max()) < 1e-5
    assert [w for _, w in spy.kernel] == [None, 5, None] and spy.original == 0


def test_paged_sdpa_keeps_what_the_kernel_cannot_express_on_mlx_lm_s_path(monkeypatch):
    cache, q, keys, values = _layer()
    off, q2, k2, v2 = _layer(AttentionBackend())  # the reference backend
    spy = _Spy(monkeypatch)
    batch = cache.batch
    foreign = mx.array(np.array(batch.mask()))  # same values, not built by the batch
    seam.paged_sdpa(q, keys, values, cache, 0.25, foreign)
    seam.paged_sdpa(q, keys * 1, values, cache, 0.25, batch.mask())  # changed keys
    sinks = mx.zeros((q.shape[1],))
    seam.paged_sdpa(q, keys, values, cache, 0.25, batch.mask(), sinks=sinks)
    seam.paged_sdpa(q2, k2, v2, off, 0.25, off.batch.mask())
    assert spy.kernel == [] and spy.original == 4  # decodes: masked SDPA, not per group


def test_paged_sdpa_never_calls_the_kernel_on_the_cpu(monkeypatch):
    cache, q, keys, values = _layer(CpuBackend())
    spy = _Spy(monkeypatch)
    seam.paged_sdpa(q, keys, values, cache, 0.25, cache.batch.mask())
    assert spy.kernel == [] and spy.original == 0  # the CPU's own block-table path


# --- model-family parity with the kernel's role played by the reference -----------------------

FAMILIES = ("llama", "qwen3", "mistral", "gemma3")


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def test_runner_on_the_kernel_path_matches_dense_mlx_lm(family, monkeypatch):
    """Prefill chunks on mlx-lm's path, decodes (and gemma3's windowed layers) through the
    kernel's interface: greedy tokens and fp32 logits as the dense path."""
    spy = _Spy(monkeypatch, count_original=False)
    exact = []
    real = cuda_backend.exact_context_attention
    monkeypatch.setattr(
        cuda_backend,
        "exact_context_attention",
        lambda q, *a: exact.append(q.shape[2]) or real(q, *a),
    )
    model = tiny_model(family)
    runner = ModelRunner.create(model, block_size=parity.BS, num_blocks=64)
    assert runner.attention.name == "cuda" and runner.stand_ins
    assert runner.choose_decode_attention().path == "cuda"
    assert parity._batched_prefill_and_decode(model, runner) <= TOL
    assert parity._shared_unaligned_prefix(model, runner) <= TOL
    windows = {w for _, w in spy.kernel}
    assert spy.kernel and windows == ({None, 16} if family == "gemma3" else {None})
    # The four-prompt prefill (5-31 tokens, an array mask) took the exact-context path.
    assert exact and min(exact) > backend.FEW_QUERIES


def test_kernel_forwards_build_no_gather(monkeypatch):
    """A decode the kernel serves hands mlx-lm the new K/V as stand-ins for the context (no
    gather built per layer: host time on a GPU) and marks every layer served."""
    _Spy(monkeypatch, count_original=False)
    gathers = []
    real = PagedLayerCache.gather
    monkeypatch.setattr(PagedLayerCache, "gather", lambda *a: gathers.append(1) or real(*a))
    model = tiny_model("llama")
    runner = ModelRunner.create(model, block_size=parity.BS, num_blocks=64)
    assert parity._batched_prefill_and_decode(model, runner) <= TOL
    prefills = len(model.layers)  # the first forward: one gather per layer
    assert len(gathers) == prefills and runner.stand_ins


def test_a_model_that_changes_the_fetched_keys_gets_them_gathered(monkeypatch, caplog):
    """Attention that does not hand the fetched K/V to attention unchanged (here: scaled by
    one, new arrays) would attend over the stand-ins: the runner finds it at start (one
    decode's graph built, never evaluated) and gathers in every forward; no forward runs
    twice."""
    _Spy(monkeypatch, count_original=False)
    model = tiny_model("llama")
    module = sys.modules[type(model.layers[0].self_attn).__module__]

    def changes_keys(queries, keys, values, cache, scale, mask, sinks=None):
        return seam.paged_sdpa(queries, keys * 1, values * 1, cache=cache, scale=scale, mask=mask)

    monkeypatch.setattr(module, "scaled_dot_product_attention", changes_keys)
    forwards = []
    real_call = type(model).__call__
    monkeypatch.setattr(
        type(model), "__call__", lambda *a, **k: forwards.append(1) or real_call(*a, **k)
    )
    with caplog.at_level(logging.WARNING, logger="worker.model.runner"):
        runner = ModelRunner.create(model, block_size=parity.BS, num_blocks=64)
    assert not runner.stand_ins and not runner.compile_decodes
    assert "does not take the fetched K/V unchanged" in caplog.text
    prompt = list(range(3, 3 + 2 * parity.BS - 1))
    runner.forward([SeqInput(prompt, [0, 1], 0)])
    # One sequence whose context fills its blocks: its decode has no mask array (no padded
    # keys to hide), so attention over the stand-ins would fail silently, not loudly.
    forwards.clear()
    got = runner.forward([SeqInput([7], [0, 1], len(prompt))])
    assert len(forwards) == 1  # one forward a step
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    want = model(mx.array([[7]]), cache=cache)[:, -1, :]
    assert float(mx.abs(got - want).max()) <= TOL
    assert parity._batched_prefill_and_decode(model, runner) <= TOL
    assert parity._shared_unaligned_prefix(model, runner) <= TOL


def test_speculative_verify_forwards_on_the_kernel_path(family, monkeypatch):
    spy = _Spy(monkeypatch, count_original=False)
    parity.test_speculative_verify_forwards_with_rollback(tiny_model(family), kernel=False)
    assert max(shape[2] for shape, _ in spy.kernel) == 17  # up to 16 drafts a sequence


# --- the kernel itself (NVIDIA GPU only) ------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize(
    ("lengths", "nq", "q_lens", "window", "d", "rep"),
    [
        ([1, 9, 30, 64], 1, None, None, 64, 4),
        ([300, 17], 1, None, 20, 128, 8),
        ([45, 45], 5, None, None, 128, 1),
        ([45, 20, 33], 5, [5, 2, 1], 9, 256, 2),
        ([1000], 1, None, None, 128, 4),  # several splits
    ],
)
def test_kernel_matches_the_reference(dtype, lengths, nq, q_lens, window, d, rep):
    rng = np.random.default_rng(sum(lengths) + nq)
    batch, pool_k, pool_v, q = _random_case(
        rng, lengths, nq, bs=8, h=2, rep=rep, d=d, q_lens=q_lens
    )
    pool_k, pool_v, q = pool_k.astype(dtype), pool_v.astype(dtype), q.astype(dtype)
    tables, ends, query_lens = batch.kernel_inputs()
    scale = d**-0.5
    # An output the kernel leaves unwritten shows.
    mlx_fixes.dirty_buffer_cache(q, pool_k, pool_v, tables, ends, query_lens)
    got = gpu_decode.paged_decode_attention(
        q, pool_k, pool_v, tables, ends, scale, window, query_lens
    )
    f32 = [np.array(a.astype(mx.float32)) for a in (q, pool_k, pool_v)]
    want = gpu_decode.reference_attention(
        *f32, np.array(tables), np.array(ends), scale, window, np.array(query_lens)
    )
    tol = {mx.float32: 1e-4, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}[dtype]
    assert np.abs(np.array(got.astype(mx.float32)) - want).max() <= tol * max(1, np.abs(want).max())


@cuda
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize(
    ("lengths", "nq", "q_lens", "window", "d", "rep", "bs"),
    [
        ([1, 9, 30, 64], 1, None, None, 64, 4, 16),
        ([300, 17], 1, None, 20, 128, 8, 32),
        ([45, 45], 5, None, None, 128, 1, 16),
        ([45, 20, 33], 5, [5, 2, 1], 9, 64, 2, 32),
        ([2000, 31], 1, None, None, 64, 8, 32),  # several splits
        ([700, 64], 17, [17, 9], 100, 128, 4, 16),  # 68 rows: five tiles
    ],
)
@pytest.mark.parametrize("splits", [None, 1])
@pytest.mark.parametrize("pipeline", [None, (1, 3), (2, 2), (4, 2)])
def test_tensor_core_kernel_matches_the_reference(dtype, lengths, nq, q_lens, window, d, rep,
                                                   bs, splits, pipeline):  # fmt: skip
    """Every (warps, stages) the variant may run with (``gpu_decode.tc_pipeline``; None: the
    default for the head dim) against the float64 reference."""
    warps, stages = pipeline or (None, None)
    if pipeline and warps * stages * 2 * gpu_decode.TC_KEYS * (d + 8) * 2 > 48 * 1024:
        pytest.skip("does not fit static shared memory")
    rng = np.random.default_rng(sum(lengths) + nq + bs)
    batch, pool_k, pool_v, q = _random_case(
        rng, lengths, nq, bs=bs, h=2, rep=rep, d=d, q_lens=q_lens
    )
    pool_k, pool_v, q = pool_k.astype(dtype), pool_v.astype(dtype), q.astype(dtype)
    tables, ends, query_lens = batch.kernel_inputs()
    scale = d**-0.5
    mlx_fixes.dirty_buffer_cache(q, pool_k, pool_v, tables, ends, query_lens)
    got = gpu_decode.paged_decode_attention(
        q, pool_k, pool_v, tables, ends, scale, window, query_lens, splits=splits, kernel="tc",
        warps=warps, stages=stages,
    )  # fmt: skip
    f32 = [np.array(a.astype(mx.float32)) for a in (q, pool_k, pool_v)]
    want = gpu_decode.reference_attention(
        *f32, np.array(tables), np.array(ends), scale, window, np.array(query_lens)
    )
    tol = {mx.float16: 2e-3, mx.bfloat16: 1.6e-2}[dtype]
    assert np.abs(np.array(got.astype(mx.float32)) - want).max() <= tol * max(1, np.abs(want).max())


@cuda
def test_runner_with_the_kernel_matches_dense_mlx_lm(family):
    from worker.model.self_check import tolerance_for

    model = tiny_model(family)
    runner = ModelRunner.create(model, block_size=parity.BS, num_blocks=64)
    assert runner.attention.name == "cuda"
    assert parity._batched_prefill_and_decode(model, runner) <= tolerance_for(mx.float32)


@cuda
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize(
    ("batch", "blocks", "bs", "h", "d"), [(1, 1, 8, 1, 16), (3, 7, 32, 8, 64), (5, 4, 16, 2, 128)]
)
def test_block_gather_kernel_equals_indexing(dtype, batch, blocks, bs, h, d):
    """The copy kernel behind ``KVPool.gather`` on an NVIDIA GPU gives what MLX's indexing
    gives: shuffled tables, repeated blocks, the trash block."""
    rng = np.random.default_rng(batch * 31 + blocks)
    num_blocks = batch * blocks + 3
    pool = mx.array(rng.standard_normal((h, num_blocks, bs, d)).astype(np.float32)).astype(dtype)
    tables = rng.integers(0, num_blocks, (batch, blocks)).astype(np.int32)
    tables[0, -1] = num_blocks - 1
    assert gpu_gather.supported(pool)
    got = gpu_gather.gather_blocks(pool, mx.array(tables))
    heads = mx.arange(h)[None, :, None]
    want = pool[heads, mx.array(tables)[:, None, :]].reshape(batch, h, blocks * bs, d)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.array_equal(got, want)
