"""Compiled decode forwards (``worker.model.compiled_decode``), on this CPU with the GPU's
attention routing and the block-table kernel's computation in lazy MLX ops standing in
(``helpers.traceable_kernel``): the same Python path as on an NVIDIA GPU, traced by
``mx.compile`` the same way.

What can go wrong in a compiled forward is a value of one step baked into the trace and
replayed in the next step of the same shapes; so every test here decodes several steps per
shape and compares each with dense mlx-lm or the uncompiled runner.
"""

from __future__ import annotations

import dataclasses
import logging

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from tests.worker.helpers import (
    TOL,
    DenseSeq,
    PagedSeq,
    decode_together,
    max_diff,
    prompts,
    route_as_cuda,
    runs_cuda_attention,
    tiny_model,
    traceable_kernel,
)
from worker.errors import BatchError
from worker.model import compiled_decode
from worker.model.attention import AttentionBackend, AttentionOptions
from worker.model.forward_batch import ForwardBatch, SeqInput
from worker.model.kv_pool import KVPool
from worker.model.paged_cache import PagedLayerCache
from worker.model.runner import ModelRunner
from worker.model.spec import probe

BS = 4  # small blocks: contexts cross block and bucket edges within a few steps


@pytest.fixture
def kernel_calls(monkeypatch):
    """The GPU's attention routing, the kernel's computation standing in; its calls."""
    calls: list[tuple[int, ...]] = []

    def kernel(queries, *args, **kw):
        calls.append(tuple(queries.shape))
        return traceable_kernel(queries, *args, **kw)

    route_as_cuda(monkeypatch, kernel)
    return calls


def _blocks(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def _prefilled(model, runner, lengths, seed=3):
    """Sequences of ``lengths`` prefilled on ``runner`` (uncompiled: several tokens each) and
    on dense mlx-lm: (paged, dense, first logits)."""
    ps = prompts(np.random.default_rng(seed), *lengths)
    paged = [PagedSeq.fresh(p, _blocks(12 * i, 12)) for i, p in enumerate(ps)]
    dense = [DenseSeq(model, p) for p in ps]
    first = runner.forward([s.take() for s in paged])
    return paged, dense, [first[i] for i in range(len(ps))]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "mistral"])
def test_compiled_decodes_match_dense_mlx_lm(family, kernel_calls):
    """Twelve greedy decode steps of three sequences whose contexts differ and cross block
    edges: each step's logits as dense mlx-lm's, the trace replayed for repeated shapes."""
    model = tiny_model(family)
    runner = ModelRunner.create(model, block_size=BS, num_blocks=64)
    kernel_calls.clear()  # the start's check that the model takes stand-ins built one decode
    paged, dense, first = _prefilled(model, runner, (5, 9, 14))
    assert runner.compiled_decode is None  # prefill is not compiled
    assert decode_together(runner, paged, dense, 12, first) <= TOL
    compiled = runner.compiled_decode
    assert compiled is not None and compiled.calls == 12
    # Contexts 15..26 need 4..7 blocks: widths 4 and 8, two traces for twelve steps.
    assert compiled.traces == 2
    # The kernel's Python runs while tracing only: the other ten steps replayed the graph.
    decodes = [shape for shape in kernel_calls if shape[2] == 1]
    assert len(decodes) == compiled.traces * len(model.layers)


def test_batch_changes_and_lazy_tokens_match_the_uncompiled_runner(kernel_calls):
    """Steps whose batch shrinks and grows again, and decodes on lazy tokens (the executor's
    lookahead): compiled logits as the uncompiled runner's on the same inputs."""
    model = tiny_model("llama")
    runners = [ModelRunner.create(model, block_size=BS, num_blocks=64) for _ in range(2)]
    runners[1].compile_decodes = False
    state = [_prefilled(model, r, (6, 11, 3))[0] for r in runners]
    rng = np.random.default_rng(5)
    for step in range(10):
        rows = [0, 2] if 3 <= step < 6 else [0, 1, 2]  # sequence 1 sits out three steps
        tokens = rng.integers(0, 128, len(rows)).tolist()
        got = []
        for runner, seqs in zip(runners, state, strict=True):
            for i, t in zip(rows, tokens, strict=True):
                seqs[i].push(t)
            inputs = [seqs[i].take() for i in rows]
            if step % 2:  # the lookahead's call: lazy tokens, placeholders in the inputs
                lazy = mx.array(tokens, dtype=mx.int32)
                placeholders = [SeqInput([0], s.block_table, s.start, s.seq_key) for s in inputs]
                logits = runner.forward_async(placeholders, lazy)
                mx.eval(logits)
            else:
                logits = runner.forward(inputs)
            got.append(logits)
        assert max_diff(got[0], got[1]) <= TOL, step
    compiled = runners[0].compiled_decode
    assert compiled is not None and compiled.calls == 10 and runners[1].compiled_decode is None
    assert compiled.traces < compiled.calls


def test_the_pool_is_written_in_place(kernel_calls):
    """The compiled forward takes the pool's arrays in and hands the written ones back: the
    scatter must reuse the old buffers (a copy of the pool every step would cost as much as
    the forward on a GPU)."""
    model = tiny_model("llama")
    runner = ModelRunner.create(model, block_size=BS, num_blocks=64)
    paged, _, _ = _prefilled(model, runner, (5, 9))

    def addresses() -> list[int]:
        return [np.asarray(a).__array_interface__["data"][0] for a in runner.pool.arrays()]

    before = addresses()
    for t in (7, 8, 9):
        for s in paged:
            s.push(t)
        runner.forward([s.take() for s in paged])
    assert runner.compiled_decode is not None and runner.compiled_decode.calls == 3
    assert addresses() == before


def test_a_lookahead_forward_is_built_early_and_launched_after(kernel_calls):
    """The lookahead's way (``worker.engine.lookahead.start``): the next forward built on the
    lazy greedy tokens while this one computes, launched once they are in; its logits are the
    plain forward's and the pool is still written in place (on a GPU, launching it at once
    copied every layer's pool: docs/gpu-decode-parts.md)."""
    model = tiny_model("llama")
    runner = ModelRunner.create(model, block_size=BS, num_blocks=64)
    twin = ModelRunner.create(model, block_size=BS, num_blocks=64)
    twin.compile_decodes = False
    paged, _, _ = _prefilled(model, runner, (5, 9))
    plain, _, _ = _prefilled(model, twin, (5, 9))

    def addresses() -> list[int]:
        return [np.asarray(a).__array_interface__["data"][0] for a in runner.pool.arrays()]

    before = addresses()
    for s in (*paged, *plain):
        s.push(7)
    inputs = [s.take() for s in paged]
    logits = runner.forward_async(inputs)
    tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
    nxt = [SeqInput([0], s.block_table, s.start + 1, s.seq_key) for s in inputs]
    ahead = runner.forward_async(nxt, tokens, launch=False)
    ids = np.asarray(tokens).tolist()
    runner.launch(ahead)
    mx.eval(ahead)
    twin.forward([s.take() for s in plain])
    for s, t in zip(plain, ids, strict=True):
        s.push(t)
    want = twin.forward([s.take() for s in plain])
    assert max_diff(ahead, want) <= TOL
    assert addresses() == before


def test_a_model_that_cannot_be_traced_decodes_uncompiled(kernel_calls, monkeypatch, caplog):
    """A forward that needs a host value (here every attention asks ``cache.size()``) fails
    its first trace: the runner warns once, decodes uncompiled from then on, and nothing
    the failed trace touched reaches the pool."""
    real = llama.Attention.__call__

    def asks_size(self, x, mask=None, cache=None):
        if isinstance(cache, PagedLayerCache):
            cache.size()
        return real(self, x, mask=mask, cache=cache)

    monkeypatch.setattr(llama.Attention, "__call__", asks_size)
    model = tiny_model("llama")
    runner = ModelRunner.create(model, block_size=BS, num_blocks=64)
    paged, dense, first = _prefilled(model, runner, (5, 9, 14))
    with caplog.at_level(logging.WARNING, logger="worker.model.runner"):
        assert decode_together(runner, paged, dense, 6, first) <= TOL
    assert runner.compiled_decode is None and not runner.compile_decodes
    assert sum("cannot be compiled" in r.message for r in caplog.records) == 1


def test_the_switch_turns_it_off(kernel_calls):
    model = tiny_model("llama")
    off = AttentionOptions(compile_decodes=False)  # --no-compile-decodes
    runner = ModelRunner.create(model, block_size=BS, num_blocks=64, attention=off)
    paged, dense, first = _prefilled(model, runner, (5, 9))
    assert decode_together(runner, paged, dense, 3, first) <= TOL
    assert runner.compiled_decode is None and kernel_calls  # the kernel, uncompiled


def test_only_kernel_served_decodes_compile(monkeypatch):
    """On a CPU's own attention path, and for a model that needs int offsets: no compiled
    forward."""
    model = tiny_model("llama")
    if not runs_cuda_attention():  # this machine's own attention path
        runner = ModelRunner.create(model, block_size=BS, num_blocks=64)
        paged, dense, first = _prefilled(model, runner, (5, 9))
        assert decode_together(runner, paged, dense, 2, first) <= TOL
        assert runner.compiled_decode is None
    route_as_cuda(monkeypatch)
    spec = dataclasses.replace(probe(model), int_offsets=True)
    pool = KVPool.for_model(spec, block_size=BS, num_blocks=64)
    assert not ModelRunner(model, pool, spec).compile_decodes


# --- the pieces ------------------------------------------------------------------------------


def test_bucket_blocks():
    assert [compiled_decode.bucket_blocks(n) for n in (1, 2, 3, 4, 5, 8, 9, 200)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        256,
    ]


@pytest.mark.parametrize("rank", [4, 5])
@pytest.mark.parametrize("window", [None, 3, 100])
def test_a_bound_batch_computes_its_masks_from_the_context_lengths(rank, window):
    """After ``bind``, masks come from the ``ends`` input, not from the numpy of the step
    the batch was built for: fed another step's lengths, they are that step's masks."""
    seqs = [SeqInput([1], _blocks(0, 4), 9), SeqInput([2], _blocks(4, 4), 2)]
    later = [SeqInput([1], _blocks(0, 4), 12), SeqInput([2], _blocks(4, 4), 4)]
    batch = ForwardBatch(seqs, BS, 16, rank, key_blocks=4)
    want = ForwardBatch(later, BS, 16, rank, key_blocks=4).mask(window, return_array=True)
    ends = mx.array([13, 5], dtype=mx.int32)
    b = batch
    b.bind(b.tokens, mx.array([12, 4]), b.write_blocks, b.write_slots, b.tables[:, 0], ends, ends)
    got = batch.mask(window)
    assert batch.traced and got.shape == want.shape
    assert mx.array_equal(got, want)
    assert batch.kernel_inputs()[1] is ends and batch.mask_window(got) == (True, window)


def test_key_blocks_pad_the_tables_with_the_trash_block():
    batch = ForwardBatch([SeqInput([1], [5, 6], 5)], BS, 16, key_blocks=8)
    assert batch.key_blocks == 8 and batch.key_len == 32
    assert batch.tables_np.tolist() == [[5, 6, 16, 16, 16, 16, 16, 16]]
    assert ForwardBatch([SeqInput([1], [5, 6], 5)], BS, 16, key_blocks=1).key_blocks == 2


def test_a_traced_batch_refuses_host_values():
    batch = ForwardBatch([SeqInput([1], [5, 6], 5)], BS, 16)
    with pytest.raises(BatchError, match="only a decode"):
        ForwardBatch([SeqInput([1, 2], [5, 6], 5)], BS, 16).bind(*[mx.array(0)] * 7)
    b = batch
    b.bind(
        b.tokens, mx.array([5]), b.write_blocks, b.write_slots, b.tables[:, 0], *[mx.array([6])] * 2
    )
    from worker.model.paged_cache import PagedLayerCache

    model = tiny_model("llama")
    pool = KVPool(probe(model).layers, 16, BS)
    with pytest.raises(BatchError, match="not traceable"):
        PagedLayerCache(batch, pool, 0, AttentionBackend()).size()


def test_bucket_rows_and_buckets():
    rows = [compiled_decode.bucket_rows(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 31, 32, 33)]
    assert rows == [1, 2, 4, 8, 8, 16, 16, 24, 32, 32, 40]
    assert compiled_decode.buckets(32, compiled_decode.bucket_rows) == [1, 2, 4, 8, 16, 24, 32]
    assert compiled_decode.buckets(20, compiled_decode.bucket_blocks) == [1, 2, 4, 8, 16, 32]
    assert compiled_decode.buckets(1, compiled_decode.bucket_blocks) == [1]


def test_padding_rows_write_and_read_only_the_trash_block():
    seqs = [SeqInput([7], [2, 3], 5), SeqInput([9], [4], 0)]
    plain = ForwardBatch(seqs, BS, 16)
    padded = ForwardBatch(seqs, BS, 16, rows=5)
    assert (padded.size, padded.real_size, plain.real_size) == (5, 2, 2)
    assert padded.tables_np.tolist() == [[2, 3], [4, 16], [16, 16], [16, 16], [16, 16]]
    assert np.array(padded.tokens).ravel().tolist() == [7, 9, 0, 0, 0]
    assert np.array(padded.write_blocks).ravel().tolist() == [3, 4, 16, 16, 16]
    assert np.array(padded.write_slots).ravel().tolist() == [1, 0, 0, 0, 0]
    assert padded.ends.tolist() == [6, 1, 1, 1, 1]
    with pytest.raises(BatchError, match="only a decode"):
        ForwardBatch([SeqInput([1, 2], [2], 0)], BS, 16, rows=2)


def test_batch_buckets_share_a_trace(kernel_calls):
    """Three sequences decode, then four (the fourth joins): one padded shape, one trace."""
    model = tiny_model("llama")
    runner = ModelRunner.create(model, block_size=BS, num_blocks=64)
    paged, dense, first = _prefilled(model, runner, (9, 10, 11, 9))  # widths 3-4: bucket 4
    current = list(first)
    for rows in ([0, 1, 2], [3, 0, 1, 2]):
        tokens = [int(mx.argmax(current[i])) for i in rows]
        for i, t in zip(rows, tokens, strict=True):
            paged[i].push(t)
        got = runner.forward([paged[i].take() for i in rows])
        assert got.shape[0] == len(rows)
        for k, (i, t) in enumerate(zip(rows, tokens, strict=True)):
            current[i] = dense[i].step(t)
            assert max_diff(got[k], current[i]) <= TOL
    compiled = runner.compiled_decode
    assert compiled is not None and (compiled.traces, compiled.calls) == (1, 2)


def test_prepared_shapes_are_replayed_and_leave_the_pool_alone(kernel_calls):
    """The warm-up's tracing builds every bucketed shape without running a forward; the
    decodes after it trace nothing and match dense mlx-lm."""
    model = tiny_model("llama")
    runner = ModelRunner.create(model, block_size=BS, num_blocks=64)
    paged, dense, first = _prefilled(model, runner, (5, 9, 14))
    mx.eval(runner.pool.arrays())
    before = [np.array(a) for a in runner.pool.arrays()]
    # batch buckets 1, 2, 4, 8 by widths 1, 2, 4, 8, 16 (64 tokens)
    assert runner.prepare_compiled_decodes(8, 64) == 20
    compiled = runner.compiled_decode
    assert compiled is not None and compiled.traces == 20 and compiled.calls == 0
    after = [np.array(a) for a in runner.pool.arrays()]
    assert all((a == b).all() for a, b in zip(before, after, strict=True))
    assert decode_together(runner, paged, dense, 8, first) <= TOL
    assert compiled.traces == 20 and compiled.calls == 8
    assert runner.prepare_compiled_decodes(8, 64, most=3) == 3


def test_nothing_is_prepared_where_decodes_do_not_compile(monkeypatch):
    model = tiny_model("llama")
    runner = ModelRunner.create(model, block_size=BS, num_blocks=64)
    if not runs_cuda_attention():
        assert runner.prepare_compiled_decodes(8, 64) == 0
    route_as_cuda(monkeypatch)
    runner = ModelRunner.create(model, block_size=BS, num_blocks=64)
    runner.compile_decodes = False
    assert runner.prepare_compiled_decodes(8, 64) == 0 and runner.compiled_decode is None
