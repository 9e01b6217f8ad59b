"""The paged path against mlx-lm's dense KVCache path: same greedy tokens, logits within 1e-4.

The families below run as fp32 models and quantized (4-bit llama and gemma3, 8-bit qwen3:
``helpers.QUANTIZED``), as most checkpoints users run are.

Every scenario runs for llama, qwen2, qwen3, mistral, gemma3 (sliding-window layers) and gemma2
with two and one kv heads (grouped-query attention on 5-D scores ``[B, kv_heads, rep, N, L]``,
which needs a 5-D mask) on tiny fp32 models, block size 8 so that prompts span several blocks, with decode attention served
from the pool blocks (the CPU default). ``test_reference_path`` repeats the batched and
copy-on-write scenarios on the gather-then-SDPA reference path and
``test_block_attention_split_over_streams`` with attention split over three MLX streams,
``test_gathered_decodes_with_cpu_prefill`` with decodes gathered but prefill on the CPU path,
``test_decodes_by_the_cpu_kernel`` with decodes by the compiled CPU kernel;
``test_default_block_size``
one scenario at block size 32, ``test_batches_of_one_two_three`` batches as small as the
kv-head counts (where a mask in the wrong layout broadcasts silently), and ``test_corrupted_block_table_is_detected`` shows that the
comparison catches a wrong block table.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.worker.helpers import (
    FAMILIES,
    QUANTIZED,
    TOL,
    DenseSeq,
    PagedSeq,
    decode_together,
    max_diff,
    prompts,
    tiny_model,
)
from worker.model.attention import AttentionOptions, cpu, cpu_decode
from worker.model.attention.cpu import decide_decode
from worker.model.forward_batch import SeqInput
from worker.model.runner import ModelRunner

STEPS = 32
BS = 8


@pytest.fixture(scope="module", params=FAMILIES + QUANTIZED)
def model(request):
    return tiny_model(request.param)


def _runner(model, num_blocks: int = 64, block_size: int = BS, **kw) -> ModelRunner:
    return ModelRunner.create(model, block_size=block_size, num_blocks=num_blocks, **kw)


def _blocks(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def test_one_sequence(model):
    (prompt,) = prompts(np.random.default_rng(1), 21)
    runner = _runner(model)
    seq = PagedSeq.fresh(prompt, [9, 3, 40, 17, 22, 5, 31, 60])  # scattered on purpose
    first = runner.forward([seq.take()])
    dense = DenseSeq(model, prompt)
    assert decode_together(runner, [seq], [dense], STEPS, [first[0]]) <= TOL


def _batched_prefill_and_decode(model, runner: ModelRunner) -> float:
    lengths = (5, 13, 24, 31)
    ps = prompts(np.random.default_rng(2), *lengths)
    seqs = [PagedSeq.fresh(p, _blocks(10 * i, 9)) for i, p in enumerate(ps)]
    first = runner.forward([s.take() for s in seqs])
    dense = [DenseSeq(model, p) for p in ps]
    return decode_together(runner, seqs, dense, STEPS, list(first))


def test_batch_of_four_lengths(model):
    assert _batched_prefill_and_decode(model, _runner(model)) <= TOL


def test_shared_aligned_prefix(model):
    rng = np.random.default_rng(3)
    prefix, tail_a, tail_b = prompts(rng, 2 * BS, 5, 7)
    runner = _runner(model)
    a = PagedSeq.fresh(prefix + tail_a, _blocks(0, 8))
    dense_a = DenseSeq(model, prefix + tail_a)
    first_a = runner.forward([a.take()])
    assert max_diff(first_a[0], dense_a.logits) <= TOL
    decode_together(runner, [a], [dense_a], 3)
    shared = [runner.pool.read_block(layer, 1) for layer in range(runner.pool.num_layers)]

    # b reads a's two prefix blocks where they are: no copy, and only its own tail is computed.
    b = PagedSeq.cached(prefix + tail_b, a.table[:2] + _blocks(20, 6), 2 * BS)
    first_b = runner.forward([b.take()])
    dense_b = DenseSeq(model, prefix + tail_b)
    worst = decode_together(runner, [a, b], [dense_a, dense_b], STEPS, [dense_a.logits, first_b[0]])
    assert worst <= TOL
    for layer, (k, v) in enumerate(shared):  # nobody wrote into the shared blocks
        k2, v2 = runner.pool.read_block(layer, 1)
        assert np.array_equal(k, k2) and np.array_equal(v, v2)


def _shared_unaligned_prefix(model, runner: ModelRunner) -> float:
    rng = np.random.default_rng(4)
    prefix, tail_a, tail_b = prompts(rng, 2 * BS + 4, 6, 9)  # prefix ends mid-block 2
    a = PagedSeq.fresh(prefix + tail_a, _blocks(0, 8))
    runner.forward([a.take()])
    dense_a = DenseSeq(model, prefix + tail_a)
    decode_together(runner, [a], [dense_a], 2)
    tail_block = [runner.pool.read_block(layer, 2) for layer in range(runner.pool.num_layers)]

    # b shares blocks 0-1 whole; block 2 holds 4 prefix tokens and a's own tokens after them,
    # so it is copied on write into b's fresh block 30 before b writes its tail from slot 4.
    runner.copy_blocks([(2, 30)])
    b = PagedSeq.cached(prefix + tail_b, [0, 1, 30, *_blocks(31, 5)], len(prefix))
    first_b = runner.forward([b.take()])
    dense_b = DenseSeq(model, prefix + tail_b)
    worst = decode_together(runner, [a, b], [dense_a, dense_b], STEPS, [dense_a.logits, first_b[0]])
    for layer, (k, v) in enumerate(tail_block):  # a's partial block is untouched by b
        k2, v2 = runner.pool.read_block(layer, 2)
        assert np.array_equal(k, k2) and np.array_equal(v, v2)
    return worst


def test_shared_unaligned_prefix_copy_on_write(model):
    assert _shared_unaligned_prefix(model, _runner(model)) <= TOL


def test_long_prompt_in_chunks(model):
    (prompt,) = prompts(np.random.default_rng(5), 100)
    runner = _runner(model)
    seq = PagedSeq.fresh(prompt, _blocks(3, 20))
    dense = DenseSeq(model, prompt)
    pos = 0
    for size in (24, 1, 30, 45):  # chunk edges fall inside blocks
        (chunk_logits,) = runner.forward_all([seq.take(size)])
        assert max_diff(chunk_logits, dense.logits_all[pos : pos + size]) <= TOL
        pos += size
    assert decode_together(runner, [seq], [dense], STEPS) <= TOL


@pytest.mark.parametrize("kernel", [False, True], ids=["mlx", "cpu-kernel"])
def test_speculative_verify_forwards_with_rollback(model, kernel):
    """Forwards of a few tokens a sequence (a decode with its drafts: the last token, then
    drafts of which only some are right), batched over sequences at different contexts: the
    logits where every input was right match the dense path, and the slots the wrong drafts
    wrote are overwritten by the next forward (rolled back by position alone). Through MLX's
    paths and through the compiled CPU kernel."""
    if kernel and not cpu_decode.available():
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(11)
    runner = _runner(model, num_blocks=40)
    if kernel:
        runner.attention.decode_path = "kernel"
    true = [p + c for p, c in zip(prompts(rng, 11, 20, 7), prompts(rng, 40, 40, 40), strict=True)]
    dense = [DenseSeq(model, t).logits_all for t in true]
    tables = [_blocks(0, 10), _blocks(10, 10), _blocks(20, 10)]
    pos = [11, 20, 7]
    runner.forward_all([SeqInput(t[:p], tb, 0) for t, p, tb in zip(true, pos, tables, strict=True)])
    worst = 0.0
    for k in (2, 5, 9, 17, 3, 1, 6):
        keep = [max(1, k // 2), k, 1]  # right inputs per sequence; the rest are wrong drafts
        inputs = []
        for i in range(3):
            chunk = list(true[i][pos[i] : pos[i] + k])
            chunk[keep[i] :] = [(t + 1) % 200 for t in chunk[keep[i] :]]
            inputs.append(SeqInput(chunk, tables[i], pos[i]))
        for i, logits in enumerate(runner.forward_all(inputs)):
            want = dense[i][pos[i] : pos[i] + keep[i]]
            worst = max(worst, max_diff(logits[: keep[i]], want))
            pos[i] += keep[i]
    assert worst <= TOL


def test_evicted_sequence_resumes_from_cached_blocks(model):
    rng = np.random.default_rng(6)
    px, py = prompts(rng, 11, 7)
    runner = _runner(model)
    x = PagedSeq.fresh(px, [0, 1, 2, 3, 4, 5, 6, 7])
    y = PagedSeq.fresh(py, _blocks(20, 10))
    runner.forward([x.take(), y.take()])
    dense_x, dense_y = DenseSeq(model, px), DenseSeq(model, py)
    decode_together(runner, [x, y], [dense_x, dense_y], 10)
    # x (21 tokens in pool: blocks 0-1 full, block 2 partial) is preempted. Its full blocks stay
    # cached; its partial block returns to the pool and y is given it next and overwrites it.
    y.table = y.table[:3] + [2] + y.table[3:]
    decode_together(runner, [y], [dense_y], 12)
    # x resumes: blocks 0-1 reused as they are, the tail recomputed into a fresh block, in the
    # same forward as y's next decode step (a prefill chunk and a decode mixed in one batch).
    resumed = PagedSeq.cached(x.tokens, [0, 1, *_blocks(40, 8)], 2 * BS)
    token_y = int(mx.argmax(dense_y.logits))
    y.push(token_y)
    first = runner.forward([resumed.take(), y.take()])
    assert max_diff(first[0], dense_x.logits) <= TOL
    assert max_diff(first[1], dense_y.step(token_y)) <= TOL
    assert decode_together(runner, [resumed, y], [dense_x, dense_y], STEPS) <= TOL


@pytest.mark.parametrize("size", [1, 2, 3])
def test_batches_of_one_two_three(model, size):
    """1-3 sequences of different lengths; the last joins with its prefill in the same forward
    as the others' decodes. With as many sequences as kv heads a mask of the wrong layout lines
    the batch up with the heads and mixes sequences without an error (gemma2 did)."""
    ps = prompts(np.random.default_rng(8), 7, 19, 12)[:size]
    runner = _runner(model)
    seqs = [PagedSeq.fresh(p, _blocks(10 * i, 9)) for i, p in enumerate(ps)]
    dense = [DenseSeq(model, p) for p in ps]
    *early, last = seqs
    worst = 0.0
    if early:
        first = runner.forward([s.take() for s in early])
        worst = decode_together(runner, early, dense[:-1], 3, list(first))
        tokens = [int(mx.argmax(d.logits)) for d in dense[:-1]]
        for s, t in zip(early, tokens, strict=True):
            s.push(t)
        mixed = runner.forward([s.take() for s in seqs])  # decodes and a prefill
        want = [d.step(t) for d, t in zip(dense, tokens, strict=False)] + [dense[-1].logits]
        for got, ref in zip(mixed, want, strict=True):
            assert int(mx.argmax(got)) == int(mx.argmax(ref)), "greedy tokens diverged"
            worst = max(worst, max_diff(got, ref))
    else:
        worst = max_diff(runner.forward([last.take()])[0], dense[0].logits)
    assert max(worst, decode_together(runner, seqs, dense, 8)) <= TOL


@pytest.mark.parametrize("scenario", ["batch", "copy_on_write"])
def test_reference_path(model, scenario):
    runner = _runner(model, attention=AttentionOptions(backend="reference"))
    run = _batched_prefill_and_decode if scenario == "batch" else _shared_unaligned_prefix
    assert run(model, runner) <= TOL


@pytest.mark.parametrize("scenario", ["batch", "copy_on_write"])
def test_gathered_decodes_with_cpu_prefill(model, scenario):
    """What ``choose_decode_attention`` picks on a multithreaded BLAS: prefill chunks through
    the CPU attention, decodes gathered."""
    runner = _runner(model)
    runner.attention.decode_path = runner.attention.pool_path = "gather"
    run = _batched_prefill_and_decode if scenario == "batch" else _shared_unaligned_prefix
    assert run(model, runner) <= TOL


@pytest.mark.parametrize("scenario", ["batch", "copy_on_write"])
def test_decodes_by_the_cpu_kernel(model, scenario, monkeypatch):
    """Decodes through the compiled CPU kernel (``worker.model.cpu_decode``), which the start-up
    measurement picks on most CPUs; it serves at least every layer decode that block-table
    attention serves (counted: gemma2 computes its own attention, so neither serves it)."""
    if not cpu_decode.available():
        pytest.skip("numba is not installed")
    if mx.default_device() == mx.gpu:
        pytest.skip("the CPU kernel serves the CPU: a GPU's attention takes its own route")
    calls = {"kernel": 0, "blocks": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(
        cpu_decode, "paged_decode_attention", counted("kernel", cpu_decode.paged_decode_attention)
    )
    monkeypatch.setattr(cpu, "block_table_attention", counted("blocks", cpu.block_table_attention))
    run = _batched_prefill_and_decode if scenario == "batch" else _shared_unaligned_prefix
    assert run(model, _runner(model)) <= TOL  # block-table attention, counted
    runner = _runner(model)
    runner.attention.decode_path = "kernel"
    assert run(model, runner) <= TOL
    # Every layer decode block-table attention served, and the short forwards (up to 17
    # queries a sequence, b's 9-token tail here) that MLX serves gathered.
    assert calls["kernel"] >= calls["blocks"]
    assert calls["kernel"] > 0 or model.model_type == "gemma2"


# On a GPU the choice is the GPU's (the CUDA kernel, or gather-then-SDPA), made without these
# CPU measurements: tests/worker/test_gpu_attention.py checks it.
cpu_only = pytest.mark.skipif(
    mx.default_device() == mx.gpu, reason="the CPU's decode choice; a GPU makes its own"
)


@cpu_only
def test_the_decode_attention_choice_is_measured(model):
    runner = _runner(model)
    choice = runner.choose_decode_attention(batch=2, context=16, repeats=1)
    assert choice.path in ("blocks", "gather", "kernel")
    assert choice.blocks_s > 0 and choice.gather_s > 0
    assert (choice.kernel_s > 0) == cpu_decode.available()
    assert runner.attention.decode_path == choice.path
    assert runner.attention.pool_path in ("blocks", "gather")
    reference = _runner(model, attention=AttentionOptions(backend="reference"))
    assert reference.choose_decode_attention().path == "reference"


def test_the_decision_rule_takes_a_clear_win_only() -> None:
    """``decide_decode`` on measured seconds: a path must be more than 10% faster to displace
    the one before it, the kernel's one thread to displace every core (a BLAS whose threads
    spin after a product slows a kernel that wants their cores: OpenBLAS)."""
    ms = 1e-3
    assert decide_decode({"blocks": 10 * ms, "gather": 9.5 * ms}, 2).path == "blocks"
    assert decide_decode({"blocks": 10 * ms, "gather": 8 * ms}, 2).path == "gather"
    times = {"blocks": 10 * ms, "gather": 12 * ms, "kernel": 5 * ms, "kernel-1": 4.8 * ms}
    choice = decide_decode(times, 2)
    assert (choice.path, choice.kernel_threads, choice.kernel_s) == ("kernel", 2, 5 * ms)
    assert choice.kernel_other_s == 4.8 * ms and "on 2 threads" in choice.describe()
    times["kernel-1"] = 3 * ms  # the spinning-BLAS case: one thread clearly faster
    choice = decide_decode(times, 2)
    assert (choice.path, choice.kernel_threads, choice.kernel_s) == ("kernel", 1, 3 * ms)
    assert "kernel on 1 thread" in choice.describe()
    times.update(kernel=20 * ms, **{"kernel-1": 9.5 * ms})  # neither beats blocks by 10%
    choice = decide_decode(times, 2)
    assert choice.path == "blocks" and choice.kernel_threads == 1
    assert decide_decode({"blocks": 1.0, "gather": 2.0, "kernel": 0.5}, 1).kernel_threads == 1
    # What a decode the kernel does not serve takes: the better MLX path, by the same rule.
    assert decide_decode({"blocks": 1.0, "gather": 0.8, "kernel": 0.5}, 2).pool_path == "gather"
    assert decide_decode({"blocks": 1.0, "gather": 0.95, "kernel": 0.5}, 2).pool_path == "blocks"
    assert decide_decode({"blocks": 1.0, "gather": 0.8}, 2).pool_path == "gather"


@cpu_only
def test_the_kernel_runs_on_the_threads_it_was_chosen_on(model, monkeypatch):
    """Whatever the measurement, the threads chosen are the threads the kernel gets, and
    the decodes still match the dense path."""
    if not cpu_decode.available():
        pytest.skip("numba is not installed")
    seen: list[int] = []
    real = cpu_decode.paged_decode_attention

    def spy(*args, threads=0, **kwargs):
        seen.append(threads)
        return real(*args, threads=threads, **kwargs)

    monkeypatch.setattr(cpu_decode, "paged_decode_attention", spy)
    runner = _runner(model)
    runner.choose_decode_attention(batch=2, context=16, repeats=1)
    measured = set(seen)
    assert 0 in measured and (1 in measured) == (cpu_decode.max_threads() > 1)
    runner.attention.decode_path, runner.attention.kernel_threads = "kernel", 1
    seen.clear()
    rng = np.random.default_rng(3)
    true = prompts(rng, 14, 35, 22)  # 9, 30 and 17 prompt tokens, then 5 decodes each
    dense = [DenseSeq(model, t).logits_all for t in true]
    tables = [_blocks(0, 10), _blocks(10, 10), _blocks(20, 10)]
    pos = [9, 30, 17]
    runner.forward_all([SeqInput(t[:p], tb, 0) for t, p, tb in zip(true, pos, tables, strict=True)])
    worst = 0.0
    for _ in range(5):
        inputs = [SeqInput([t[p]], tb, p) for t, p, tb in zip(true, pos, tables, strict=True)]
        for i, logits in enumerate(runner.forward_all(inputs)):
            worst = max(worst, max_diff(logits, dense[i][pos[i] : pos[i] + 1]))
            pos[i] += 1
    # Every decode the kernel served ran on one thread (gemma2 computes its own attention).
    assert set(seen) <= {1} and (bool(seen) or model.model_type == "gemma2")
    assert worst <= TOL


@cpu_only
def test_a_kernel_that_fails_is_left_out_of_the_choice(model, monkeypatch):
    """A compiled kernel that cannot run on this machine (LLVM, numba) never stops a worker:
    the choice is made between the MLX paths."""

    def broken(*args, **kwargs):
        raise RuntimeError("no such CPU")

    monkeypatch.setattr(cpu_decode, "paged_decode_attention", broken)
    runner = _runner(model)
    choice = runner.choose_decode_attention(batch=2, context=16, repeats=1)
    assert choice.path in ("blocks", "gather") and choice.kernel_s == 0
    assert runner.attention.decode_path != "kernel"


@pytest.mark.parametrize("scenario", ["batch", "copy_on_write"])
def test_block_attention_split_over_streams(model, scenario, monkeypatch):
    monkeypatch.setattr(cpu, "MIN_SPLIT", 1)  # split even tiny batches
    runner = _runner(
        model, attention=AttentionOptions(streams=3)
    )  # uneven parts of the (sequence, head) rows
    run = _batched_prefill_and_decode if scenario == "batch" else _shared_unaligned_prefix
    assert run(model, runner) <= TOL


def test_default_block_size(model):
    assert _batched_prefill_and_decode(model, _runner(model, num_blocks=40, block_size=32)) <= TOL


def test_corrupted_block_table_is_detected(model):
    """Negative control: a table entry pointing at the wrong block must fail the comparison.

    (Swapping two blocks of a table would not do: keys carry their rotary positions, and full
    attention is a sum over keys, so it is blind to their order.)
    """
    (prompt,) = prompts(np.random.default_rng(7), 30)
    runner = _runner(model)
    seq = PagedSeq.fresh(prompt, _blocks(0, 8))
    runner.forward([seq.take()])
    dense = DenseSeq(model, prompt)
    seq.table[1] = 50  # a block nobody wrote
    token = int(mx.argmax(dense.logits))
    seq.push(token)
    logits = runner.forward([seq.take()])
    assert max_diff(logits[0], dense.step(token)) > 100 * TOL
