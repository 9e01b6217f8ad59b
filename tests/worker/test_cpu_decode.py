"""The compiled CPU decode kernel (``worker.model.cpu_decode``) against attention in float64
numpy, on random pools with shuffled block ids and padded tables: batch 1-8, ragged lengths
from one token, 1-17 queries a sequence (decodes, and verify forwards whose sequences have
fewer drafts than the longest: padded rows), block sizes 1-32, head dims 16-128, grouped-query
ratios 1-8, sliding windows (narrower and wider than the context). And what it refuses."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from tests.worker.helpers import tiny_model
from worker.model.attention import AttentionOptions, cpu_decode
from worker.model.runner import ModelRunner

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="numba is not installed")


def reference(q, pool_k, pool_v, tables, ends, scale, window, query_lens) -> np.ndarray:
    q = np.array(q, dtype=np.float64)
    pk, pv = np.array(pool_k, dtype=np.float64), np.array(pool_v, dtype=np.float64)
    batch, hq, nq, dim = q.shape
    heads, _, bs, _ = pk.shape
    rep = hq // heads
    out = np.zeros((batch, hq, nq, dim))
    for b in range(batch):
        for i in range(nq):
            pos = int(ends[b]) - int(query_lens[b]) + min(i, int(query_lens[b]) - 1)
            first = 0 if window is None else max(0, pos + 1 - window)
            positions = range(first, pos + 1)
            blocks = [tables[b][p // bs] for p in positions]
            slots = [p % bs for p in positions]
            for h in range(hq):
                keys, values = pk[h // rep, blocks, slots], pv[h // rep, blocks, slots]
                scores = keys @ q[b, h, i] * scale
                weights = np.exp(scores - scores.max())
                out[b, h, i] = weights / weights.sum() @ values
    return out


def random_case(rng: np.random.Generator, window: bool):
    batch = int(rng.integers(1, 9))
    heads = int(rng.choice([1, 2, 4]))
    rep = int(rng.choice([1, 2, 4, 8]))
    dim = int(rng.choice([16, 64, 128]))
    bs = int(rng.choice([1, 4, 16, 32]))
    nq = int(rng.choice([1, 1, 2, 5, 17]))
    query_lens = rng.integers(1, nq + 1, batch)  # rows past a sequence's queries are padding
    ends = query_lens + rng.integers(0, 160, batch)
    width = int(max(-(-ends // bs)))
    num_blocks = batch * width + 1
    trash = num_blocks - 1
    order = rng.permutation(num_blocks - 1)
    tables = np.full((batch, width + 2), trash, dtype=np.int32)  # padded past every end
    for b in range(batch):
        need = -(-int(ends[b]) // bs)
        tables[b, :need] = order[b * width : b * width + need]
    key = mx.random.key(int(rng.integers(1 << 30)))
    k1, k2, k3 = mx.random.split(key, 3)
    pool_k = mx.random.normal((heads, num_blocks, bs, dim), key=k1)
    pool_v = mx.random.normal((heads, num_blocks, bs, dim), key=k2)
    q = mx.random.normal((batch, heads * rep, nq, dim), key=k3)
    w = int(rng.integers(1, 200)) if window else None
    return q, pool_k, pool_v, tables, ends, dim**-0.5, w, query_lens


@pytest.mark.parametrize("window", [False, True], ids=["full", "window"])
@pytest.mark.parametrize("seed", range(16))
def test_matches_float64_attention(seed, window):
    case = random_case(np.random.default_rng(seed), window)
    got = np.array(cpu_decode.paged_decode_attention(*case))
    assert got.shape == case[0].shape
    np.testing.assert_allclose(got, reference(*case), atol=2e-5, rtol=0)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_thread_count_computes_the_same(threads):
    """The start-up choice may run the kernel on one thread (``CpuBackend.choose_decode``):
    each (sequence, head) task is computed whole by one thread, so the result is the same."""
    case = random_case(np.random.default_rng(5), True)
    want = np.array(cpu_decode.paged_decode_attention(*case))
    got = np.array(cpu_decode.paged_decode_attention(*case, threads=threads))
    np.testing.assert_array_equal(got, want)


def test_reads_only_its_own_blocks():
    """Keys past a sequence's end, in its padding and in other sequences' blocks are never
    read: poisoning them with NaN changes nothing."""
    q, pool_k, pool_v, tables, ends, scale, _, q_lens = random_case(np.random.default_rng(7), False)
    args = (tables[:1], ends[:1], scale, None, q_lens[:1])
    want = np.array(cpu_decode.paged_decode_attention(q[:1], pool_k, pool_v, *args))
    keep = np.zeros(pool_k.shape[:3], dtype=bool)
    for p in range(int(ends[0])):
        keep[:, tables[0][p // pool_k.shape[2]], p % pool_k.shape[2]] = True
    mask = mx.array(keep)[..., None]
    nan = mx.array(np.nan, dtype=mx.float32)
    poisoned_k, poisoned_v = mx.where(mask, pool_k, nan), mx.where(mask, pool_v, nan)
    got = np.array(cpu_decode.paged_decode_attention(q[:1], poisoned_k, poisoned_v, *args))
    assert not np.isnan(want).any()
    np.testing.assert_array_equal(got, want)


def test_output_dtype_follows_the_queries():
    q, pool_k, pool_v, tables, ends, scale, _, _ = random_case(np.random.default_rng(3), False)
    out = cpu_decode.paged_decode_attention(
        q.astype(mx.float16), pool_k, pool_v, tables, ends, scale
    )
    assert out.dtype == mx.float16


def test_what_it_serves():
    q = mx.zeros((2, 8, 1, 64))
    pool = mx.zeros((2, 4, 16, 64))
    assert cpu_decode.supports(q, pool, pool)
    assert cpu_decode.supports(mx.zeros((2, 8, 17, 64)), pool, pool)  # a decode and 16 drafts
    assert not cpu_decode.supports(mx.zeros((2, 8, 18, 64)), pool, pool)  # prefill
    assert not cpu_decode.supports(q, pool.astype(mx.float16), pool.astype(mx.float16))
    assert not cpu_decode.supports(mx.zeros((2, 6, 1, 64)), mx.zeros((4, 4, 16, 64)), pool)
    assert not cpu_decode.supports(mx.zeros((2, 8, 1, 32)), pool, pool)
    with pytest.raises(ValueError, match="window"):
        cpu_decode.paged_decode_attention(q, pool, pool, np.zeros((2, 1), np.int32), [1, 1], 1.0, 0)


@pytest.mark.skipif(mx.default_device() == mx.gpu, reason="the CPU backend's choice")
def test_the_switch_turns_it_off():
    off = AttentionOptions(cpu_decode_kernel=False)  # --no-cpu-decode-kernel
    runner = ModelRunner.create(tiny_model("llama"), num_blocks=8, attention=off)
    choice = runner.choose_decode_attention(batch=2, context=16, repeats=1)
    assert choice.kernel_s == 0 and runner.attention.decode_path != "kernel"


def test_its_threads_follow_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.delenv("KVSERVE_BLAS_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert cpu_decode._thread_count(64) == 3  # a cpuset of 3 on a 64-core machine
    assert cpu_decode._thread_count(2) == 2  # never more than numba's pool
    monkeypatch.setenv("KVSERVE_BLAS_THREADS", "1")  # an operator's cap, as for the BLAS
    assert cpu_decode._thread_count(64) == 1


def test_the_c_build_is_made_once_and_needs_no_llvm(tmp_path, monkeypatch):
    """The kernel is built from C with the system's compiler into the cache (once: a second
    build finds the file), and a process that runs it loads neither numba nor LLVM (159 MiB
    of a worker's memory, measured)."""
    from worker.model.attention import c_kernel

    if c_kernel.compiler() is None:
        pytest.skip("no C compiler here: the kernel is numba's")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = c_kernel.build(cpu_decode.SOURCE)
    assert built is not None and built.parent == tmp_path / "kvserve" / "kernels"
    stamp = built.stat().st_mtime_ns
    assert c_kernel.build(cpu_decode.SOURCE) == built and built.stat().st_mtime_ns == stamp
    assert not list(built.parent.glob(".*"))  # no temporary file left behind
    code = (
        "import sys, numpy as np, mlx.core as mx\n"
        "from worker.model.attention import cpu_decode\n"
        "q = mx.ones((2, 4, 1, 8)); pool = mx.ones((2, 3, 4, 8))\n"
        "out = cpu_decode.paged_decode_attention("
        "q, pool, pool, np.array([[0], [1]], np.int32), np.array([3, 4]), 1.0)\n"
        "assert np.allclose(np.array(out), 1.0)\n"
        "print(cpu_decode.implementation(), 'numba' in sys.modules, 'llvmlite' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != cpu_decode.KERNEL_ENV}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["c", "False", "False"]


def test_without_a_compiler_numba_serves(monkeypatch):
    from worker.model.attention import c_kernel

    monkeypatch.setattr(c_kernel, "compiler", lambda: None)
    monkeypatch.delenv(cpu_decode.KERNEL_ENV, raising=False)
    for f in (cpu_decode._compiled, cpu_decode._c_compiled):
        f.cache_clear()
    try:
        assert cpu_decode._c_compiled() is None
        if importlib.util.find_spec("numba") is None:
            assert not cpu_decode.available()
        else:
            assert cpu_decode.implementation() == "numba"
            case = random_case(np.random.default_rng(2), False)
            got = np.array(cpu_decode.paged_decode_attention(*case))
            np.testing.assert_allclose(got, reference(*case), atol=2e-5, rtol=0)
    finally:
        for f in (cpu_decode._compiled, cpu_decode._c_compiled):
            f.cache_clear()


def test_a_build_that_fails_is_no_kernel(tmp_path, monkeypatch):
    from worker.model.attention import c_kernel

    if c_kernel.compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    broken = tmp_path / "broken.c"
    broken.write_text("int f( {\n")
    assert c_kernel.build(broken) is None and c_kernel.load(broken) is None
    assert not list((tmp_path / "kvserve" / "kernels").iterdir())
