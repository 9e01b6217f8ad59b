"""Decode attention over the paged KV pool on a GPU, reading blocks where they lie.

On a GPU the reference path gathers every sequence's context out of the pool into a dense copy
and runs SDPA on it; at decode that copy costs several times the attention itself (H100, batch 8,
context 4,096: 8.3x dense SDPA). :func:`paged_decode_attention` reads the K/V blocks through the
block table instead, with one custom kernel and a small reduction (0.98x dense SDPA there;
measurements and the correctness checks: ``docs/gpu-attention.md``).

The algorithm (split-K, "flash decoding"):

- A thread block handles one (sequence, KV head, split, row tile). A split is a contiguous run
  of the sequence's visible blocks; the number of splits is chosen from the batch and the
  context (:func:`choose_splits`) so that a few long sequences still fill the GPU.
- The ``rep = Hq / H`` query heads sharing a KV head, times the ``Nq`` queries of a sequence,
  are its *rows*; a tile holds up to 8 of them (``RT``), so each K/V vector read serves every
  row of the tile (grouped-query attention reads K/V once for a decode).
- Each warp takes whole blocks of the split in turn; a group of ``L = D / 8`` lanes takes one
  key, each lane 8 of its dims (one 16-byte load in half precision), so a warp reads
  ``32 / L`` keys at once. A group loads the raw K and V vectors of a chunk of ``KC`` keys
  (4, or 2 for 8-row tiles) before using any, so that several loads are in flight per lane;
  scores are reduced over the group with shuffles, and each group keeps a running max, sum
  and output per row (online softmax in fp32, base 2: ``q`` is pre-multiplied by
  ``scale * log2(e)``), rescaled once per chunk, without branches (masked keys get a finite
  "empty" score, ``-1e30``, whose weight is 0). Groups, then warps (through shared memory),
  are merged at the end. (The first version loaded and used one key at a time and branched
  per key: 174 us at batch 8 x 4k on an H100, against 128 us for this one.)
- With one split the kernel writes the normalized output in the model's dtype; with several it
  writes fp32 partial outputs and their (max, sum), and a second kernel merges the splits.

That is the CUDA-core variant. In half precision with head dim 64 or 128 and blocks of a
multiple of 16 keys, CUDA takes a **tensor-core variant** (``main_tc`` in the source;
:func:`uses_tensor_cores`): with GQA the CUDA-core one issues more instructions per byte than the
SM can (each K/V element costs an fp32 FMA per query row, plus the shuffles), so it read the
1B model's K/V at 2.2 TB/s of an H200's 4.8. The tensor-core variant keeps the thread blocks,
splits and merge, and changes how a warp reads: 16 rows (the KV head's rows, padding past them)
against 16 keys at a time through ``mma.sync.m16n8k16`` (fp32 accumulation, ``P`` rounded to the
model's dtype for ``P V`` as flash attention does), the keys copied into shared memory ahead of
use (``cp.async``, two or three stages a warp, ``tc_pipeline``), V's fragments transposed by
``ldmatrix``; the softmax bookkeeping is per row and quad, not per lane group. The helpers (mma,
ldmatrix, cp.async) are the prefill kernel's, which needs the same sm80+ GPU. Measurements:
``docs/gpu-attention.md``; ``KVSERVE_DECODE_KERNEL=core`` keeps the CUDA-core variant.

Masking is computed, not read: query ``i`` of a sequence whose pool holds ``ends[b]`` tokens
after this forward and which computes ``q_lens[b]`` queries sits at position
``ends[b] - q_lens[b] + min(i, q_lens[b] - 1)`` (padded rows repeat the last real one, as
``ForwardBatch.mask`` does) and sees key ``p`` iff ``p <= pos`` and, with a sliding window
``W``, ``p > pos - W``. Blocks outside every row's view are not read.

The kernel source is ``paged_decode.cu`` beside this file: one template rendered for CUDA
(``mx.fast.cuda_kernel``, the default where MLX runs on an NVIDIA GPU; ``attention.cuda``) or
for Metal (``mx.fast.metal_kernel``, with ``paged_decode.metal``'s header; ``attention.metal``):
the Metal version shares the algorithm and is **untested on hardware** (it has never run; no
Apple GPU was available), so nothing selects it unless a worker asks (``--attention metal``).
This module is the kernel's launcher: which calls it serves, its launch plan (splits, tiles,
grid), the launch itself (shared with the prefill kernel, whose splits the same reduction
merges) and the float64 reference it is tested against. One file because these are one
kernel's contract; the choice of when to call it is the backends' (``cuda.py``, ``metal.py``).
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from string import Template
from typing import Any

import mlx.core as mx
import numpy as np

from worker.model.attention.backend import AttentionCall, Declined
from worker.model.attention.kernel_source import sections

# Thread blocks to aim for: about eight per SM of an H100/H200 (132 SMs; three fit at once at
# head dim 128, GQA 4), so that long contexts at small batch still spread over the whole GPU
# and the last wave is a small part of the run (H100, batch 32 x 4k: 2 splits, 512 thread
# blocks, 337 us; 4 splits 288 us).
TARGET_CTAS = 1024
MAX_SPLITS = 64
WARPS = 4  # warps per thread block
MAX_ROWS_PER_TILE = 8  # query rows (query heads of a KV head x queries) a thread block serves
MAX_QUERIES = 17  # a decode and up to 16 speculative drafts; longer calls are prefill
TC_ROWS = 16  # rows of the tensor-core variant's tile: one mma.m16n8k16's
TC_KEYS = 16  # keys it takes at once
TC_HEAD_DIMS = (64, 128)
# (warps, stages) by head dim, measured on an H200 (docs/gpu-attention.md, "The tensor-core
# variant"): at 64 four warps of two stages were the fastest or tied; at 128 one warp of three
# was never slower than two of two and up to 14% faster (32 x 16k). Every pipeline that fits is
# checked against float64 on a GPU (tests/worker/test_gpu_attention.py).
TC_PIPELINES = {64: (4, 2), 128: (1, 3)}
KERNEL_ENV = "KVSERVE_DECODE_KERNEL"  # "core": CUDA cores even where tensor cores serve
HEAD_DIMS = (16, 32, 64, 128, 256)  # D / 8 lanes a key: a power of two up to a warp
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
LOG2E = 1.4426950408889634
# Threadgroup memory a Metal kernel may use; CUDA's static shared memory limit is 48 KB.
_SMEM_LIMIT = {"cuda": 48 * 1024, "metal": 32 * 1024}


def supports(queries: mx.array, pool_k: mx.array, pool_v: mx.array) -> bool:
    """Whether :func:`paged_decode_attention` serves these shapes and dtypes."""
    if queries.ndim != 4 or pool_k.ndim != 4 or pool_v.ndim != 4:
        return False
    _, hq, nq, d = queries.shape
    h, _, _, dk = pool_k.shape
    return (
        1 <= nq <= MAX_QUERIES
        and d == dk == pool_v.shape[-1]
        and d in HEAD_DIMS
        and pool_v.shape[:3] == pool_k.shape[:3]
        and h >= 1
        and hq % h == 0
        and pool_k.dtype == pool_v.dtype
        and pool_k.dtype in DTYPES
        and queries.dtype in DTYPES
    )


def serve(call: AttentionCall, backend: str = "cuda") -> mx.array | Declined:
    """A decode call (``AttentionBackend.decode``) through the kernel, built for ``backend``
    ("cuda" or "metal"), or the reason it does not take it."""
    if not call.reads_pool():
        return Declined("keys changed after the fetch, or a mask the kernel cannot rebuild")
    known, window = call.kernel_window()
    pool_k, pool_v = call.pool_arrays()
    if not known or not supports(call.queries, pool_k, pool_v):
        return Declined("a mask, dtype or head dim the decode kernel does not take")
    tables, ends, query_lens = call.batch.kernel_inputs()
    return paged_decode_attention(
        call.queries, pool_k, pool_v, tables, ends, call.scale, window, query_lens, backend=backend
    )


def rows_per_tile(rep: int, nq: int) -> int:
    """Query rows a thread block serves: the rows of a KV head (``rep * nq``) rounded up to a
    power of two, at most :data:`MAX_ROWS_PER_TILE` (more rows take more thread blocks)."""
    rows = rep * nq
    return min(MAX_ROWS_PER_TILE, 1 << (rows - 1).bit_length())


def choose_splits(ctas: int, key_blocks: int, warps: int = WARPS) -> int:
    """Splits of each sequence's blocks, given ``ctas`` thread blocks per split (sequences x KV
    heads x row tiles) and ``key_blocks`` visible blocks of the longest sequence: enough splits
    for about :data:`TARGET_CTAS` thread blocks, but at least one block per warp in a split."""
    by_gpu = -(-TARGET_CTAS // max(1, ctas))
    by_len = key_blocks // warps
    return max(1, min(by_gpu, by_len, MAX_SPLITS))


def visible_blocks(key_blocks: int, block_size: int, nq: int, window: int | None) -> int:
    """Blocks a sequence's rows can see at most: all of them, or with a window of ``window``
    keys, the most blocks ``window + nq - 1`` consecutive positions can touch."""
    if window is None:
        return key_blocks
    return min(key_blocks, (window + nq - 3) // block_size + 2)


# ---------------------------------------------------------------------------------------------
# The kernel template (paged_decode.cu). $-names are filled per backend (see _BACKENDS); T, D,
# REP, RT, BS and NW are template parameters of the kernel (compile-time constants); KV_* macros
# and KvPack come from the backend's header.

_SOURCE = sections("paged_decode.cu")
_MAIN_BODY = _SOURCE["main"] + "\n" + _SOURCE["merge"]
_TC_BODY = _SOURCE["main_tc"] + "\n" + _SOURCE["merge"]
_WRITE_SINGLE = _SOURCE["write_single"]
_WRITE_PARTIAL = _SOURCE["write_partial"]
_REDUCE_BODY = _SOURCE["reduce"]
_CUDA_HEADER = _SOURCE["cuda_header"]
# The tensor-core variant's helpers (mma, ldmatrix, cp.async) are the prefill kernel's.
_TC_HEADER = sections("paged_prefill.cu")["header"] + "\n" + _CUDA_HEADER
_METAL_HEADER = sections("paged_decode.metal")["metal_header"]

_BACKENDS: dict[str, dict[str, str]] = {
    "cuda": {
        "tid_x": "threadIdx.x",
        "cta_x": "blockIdx.x",
        "cta_y": "blockIdx.y",
        "ctas_x": "gridDim.x",
        "unroll": "#pragma unroll",
    },
    "metal": {
        "tid_x": "thread_position_in_threadgroup.x",
        "cta_x": "threadgroup_position_in_grid.x",
        "cta_y": "threadgroup_position_in_grid.y",
        "ctas_x": "threadgroups_per_grid.x",
        "unroll": "",
    },
}


def render(backend: str, kind: str, tc: bool = False) -> tuple[str, str]:
    """(header, body) of one kernel for ``backend`` ("cuda" or "metal"): ``kind`` "single"
    (one split, normalized output), "partial" (split outputs) or "reduce" (merge of splits);
    ``tc``: the tensor-core variant of "single" and "partial" (CUDA only)."""
    if tc and (backend != "cuda" or kind == "reduce"):
        raise ValueError(f"no tensor-core {kind} kernel for {backend}")
    names = _BACKENDS[backend]
    if kind == "reduce":
        body = _REDUCE_BODY
    else:
        write = _WRITE_SINGLE if kind == "single" else _WRITE_PARTIAL
        body = (_TC_BODY if tc else _MAIN_BODY).replace("$write", write)
    header = _TC_HEADER if tc else _CUDA_HEADER if backend == "cuda" else _METAL_HEADER
    return header, Template(body).substitute(names)


_INPUTS = {
    "single": ["q", "pool_k", "pool_v", "tables", "ends", "q_lens", "params"],
    "partial": ["q", "pool_k", "pool_v", "tables", "ends", "q_lens", "params"],
    "reduce": ["o_part", "ml_part"],
}
_OUTPUTS = {"single": ["out"], "partial": ["o_part", "ml_part"], "reduce": ["out"]}


@functools.cache
def _kernel(backend: str, kind: str, tc: bool = False) -> Callable[..., list[mx.array]]:
    header, body = render(backend, kind, tc)
    make = mx.fast.cuda_kernel if backend == "cuda" else mx.fast.metal_kernel
    return make(  # type: ignore[return-value]
        name=f"kvserve_paged_attention_{'tc_' if tc else ''}{kind}",
        input_names=_INPUTS[kind],
        output_names=_OUTPUTS[kind],
        source=body,
        header=header,
    )


# Small per-call arrays, made once: (scale, window) parameters and default query lengths.
_CACHE_SIZE = 256
_small: OrderedDict[tuple[Any, ...], mx.array] = OrderedDict()


def cached_array(key: tuple[Any, ...], make: Callable[[], mx.array]) -> mx.array:
    """A small per-call input (kernel parameters, default query lengths), made once."""
    arr = _small.get(key)
    if arr is None:
        arr = _small[key] = make()
        if len(_small) > _CACHE_SIZE:
            _small.popitem(last=False)
    else:
        _small.move_to_end(key)
    return arr


def paged_decode_attention(
    queries: mx.array,
    pool_k: mx.array,
    pool_v: mx.array,
    tables: mx.array,
    context_lens: mx.array,
    scale: float,
    window: int | None = None,
    query_lens: mx.array | None = None,
    *,
    splits: int | None = None,
    backend: str = "cuda",
    kernel: str | None = None,
    warps: int | None = None,
    stages: int | None = None,
) -> mx.array:
    """Attention of ``queries`` ``[B, Hq, Nq, D]`` over the pool blocks of each sequence.

    ``pool_k``/``pool_v``: one layer's pool ``[H, num_blocks, block_size, D]`` (query head
    ``h * rep + r`` reads KV head ``h``); ``tables`` ``[B, max_blocks]`` int32 block ids;
    ``context_lens`` ``[B]`` int32: tokens in the pool for each sequence, this forward's
    included (keys at positions >= it are never read). Query ``i`` sits at position
    ``len - Nq + i`` (causal); with ``query_lens`` ``[B]`` int32, sequence ``b`` has
    ``query_lens[b]`` real queries and rows past them repeat the last one's position.
    ``window``: key ``p`` is visible to a query at ``q`` iff ``q - window < p <= q``. Returns
    ``[B, Hq, Nq, D]`` in the queries' dtype; accumulates in fp32. Block ids are not checked:
    they must index ``pool_k``. ``backend="metal"`` builds the Metal twin: untested on
    hardware. For benchmarks and tests: ``splits`` overrides :func:`choose_splits`, ``kernel``
    picks the variant ("tc" tensor cores, "core" CUDA cores; default: :func:`uses_tensor_cores`)
    and ``warps`` / ``stages`` the tensor-core variant's warps and copy stages.
    """
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    dtype = pool_k.dtype
    tc = uses_tensor_cores(pool_k, backend) if kernel is None else kernel == "tc"
    plan = _plan(
        tuple(queries.shape),
        tuple(pool_k.shape),
        dtype,
        tables.shape[1],
        window,
        splits,
        backend,
        (tc, warps, stages),
    )
    b, _, nq, _ = queries.shape
    if query_lens is None:
        query_lens = cached_array(("q_lens", b, nq), lambda: mx.full((b,), nq, dtype=mx.int32))
    params = cached_array(
        ("params", scale, window),
        lambda: mx.array([scale * LOG2E, float(window or 0)], dtype=mx.float32),
    )
    inputs = [queries.astype(dtype), pool_k, pool_v, tables, context_lens, query_lens, params]
    variant = functools.partial(_kernel, backend, tc=plan.tc)
    out = launch(variant, inputs, plan.template, plan.grid, plan.threads, plan.splits, backend)
    return out if queries.dtype == dtype else out.astype(queries.dtype)


@dataclass(frozen=True, slots=True)
class _Plan:
    """How one call shape launches: the kernel's template arguments, grid and splits."""

    template: list[tuple[str, Any]]
    grid: tuple[int, int, int]
    threads: int
    splits: int
    tc: bool


@functools.lru_cache(maxsize=256)
def _plan(
    q_shape: tuple[int, ...],
    pool_shape: tuple[int, ...],
    dtype: mx.Dtype,
    max_blocks: int,
    window: int | None,
    splits: int | None,
    backend: str,
    variant: tuple[bool, int | None, int | None],
) -> _Plan:
    """The launch of :func:`paged_decode_attention` for these shapes, worked out once: every
    layer of a forward, and every step of a steady batch, makes the same call (host time is
    most of a small model's decode step on a GPU). ``variant``: (tensor cores, their warps and
    stages, None for the defaults)."""
    b, hq, nq, d = q_shape
    h, _, bs, _ = pool_shape
    rep = hq // h
    tc, warps, stages = variant
    if tc:
        rt = TC_ROWS
        nw, st = tc_pipeline(d, warps, stages)
    else:
        rt = rows_per_tile(rep, nq)
        nw = WARPS
        while nw > 1 and (nw * rt * d + 2 * nw * rt) * 4 > _SMEM_LIMIT[backend]:
            nw //= 2
    tiles = -(-(rep * nq) // rt)
    if splits is None:
        splits = choose_splits(b * h * tiles, visible_blocks(max_blocks, bs, nq, window), nw)
    template: list[tuple[str, Any]] = [
        ("T", dtype),
        ("D", d),
        ("REP", rep),
        ("RT", rt),
        ("BS", bs),
        ("NW", nw),
    ]
    if tc:
        template.append(("ST", st))
    grid = (32 * nw * b * h * splits, tiles, 1)
    return _Plan(template, grid, 32 * nw, splits, tc)


def uses_tensor_cores(pool: mx.array, backend: str = "cuda") -> bool:
    """Whether decodes over ``pool`` (one layer's ``[H, num_blocks, block_size, D]``) take the
    tensor-core variant: on CUDA, half precision, head dims :data:`TC_HEAD_DIMS`, blocks of a
    multiple of 16 keys (a chunk never straddles blocks), unless the environment's
    ``KVSERVE_DECODE_KERNEL`` is ``core`` (docs/configuration.md)."""
    return (
        backend == "cuda"
        and os.environ.get(KERNEL_ENV, "auto") != "core"
        and pool.dtype in (mx.float16, mx.bfloat16)
        and pool.shape[-1] in TC_HEAD_DIMS
        and pool.shape[2] % TC_KEYS == 0
    )


def tc_pipeline(d: int, warps: int | None = None, stages: int | None = None) -> tuple[int, int]:
    """(warps, stages) of the tensor-core variant at head dim ``d``: :data:`TC_PIPELINES`'
    measured choice, else the most warps (at most :data:`WARPS`), then the most stages (2 or
    3), whose copy buffers fit CUDA's 48 KB of static shared memory; ``warps`` / ``stages`` fix
    either (benchmarks)."""
    if warps is None and stages is None and d in TC_PIPELINES:
        return TC_PIPELINES[d]
    for nw in [warps] if warps else [WARPS, WARPS // 2, 1]:
        for st in [stages] if stages else [3, 2]:
            if nw * st * 2 * TC_KEYS * (d + 8) * 2 <= _SMEM_LIMIT["cuda"]:
                return nw, st
    raise ValueError(f"no tensor-core pipeline fits head dim {d} ({warps} warps, {stages} stages)")


def splits_for(
    queries: mx.array,
    pool_k: mx.array,
    max_blocks: int,
    window: int | None = None,
    kernel: str | None = None,
) -> int:
    """The splits :func:`paged_decode_attention` chooses for this call (benchmarks, tests)."""
    tc = uses_tensor_cores(pool_k) if kernel is None else kernel == "tc"
    shapes = (tuple(queries.shape), tuple(pool_k.shape), pool_k.dtype, max_blocks, window)
    return _plan(*shapes, None, "cuda", (tc, None, None)).splits


def launch(
    kernel: Callable[[str], Callable[..., list[mx.array]]],
    inputs: list[mx.array],
    template: list[tuple[str, Any]],
    grid: tuple[int, int, int],
    threads: int,
    splits: int,
    backend: str = "cuda",
) -> mx.array:
    """Run an attention kernel over the queries ``inputs[0]`` ``[B, Hq, Nq, D]`` and the pool
    ``inputs[1]``: its one-pass variant (``kernel("single")``, normalized output in the pool's
    dtype) with one split, else its ``kernel("partial")`` variant (fp32 partial outputs
    ``[rows, S, D]`` and their (max, sum) ``[rows, S, 2]`` in base-2 scores, rows
    ``(b * Hq + head) * Nq + query``) merged by the ``reduce`` kernel. Shared with the prefill
    kernel (``worker.model.gpu_prefill``)."""
    shape = tuple(inputs[0].shape)
    dtype = inputs[1].dtype
    b, hq, nq, d = shape
    if splits == 1:
        (out,) = kernel("single")(
            inputs=inputs,
            template=template,
            grid=grid,
            threadgroup=(threads, 1, 1),
            output_shapes=[shape],
            output_dtypes=[dtype],
        )
        return out
    rows = b * hq * nq
    o_part, ml_part = kernel("partial")(
        inputs=inputs,
        template=template,
        grid=grid,
        threadgroup=(threads, 1, 1),
        output_shapes=[(rows, splits, d), (rows, splits, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    (out,) = _kernel(backend, "reduce")(
        inputs=[o_part, ml_part],
        template=[("T", dtype), ("D", d)],
        grid=(rows * d, 1, 1),
        threadgroup=(d, 1, 1),
        output_shapes=[shape],
        output_dtypes=[dtype],
    )
    return out


def reference_attention(
    queries: np.ndarray,
    pool_k: np.ndarray,
    pool_v: np.ndarray,
    tables: np.ndarray,
    context_lens: np.ndarray,
    scale: float,
    window: int | None = None,
    query_lens: np.ndarray | None = None,
) -> np.ndarray:
    """What :func:`paged_decode_attention` computes, in float64 numpy, one sequence at a time
    (the correctness reference of ``bench/gpu/check_attention.py`` and the tests)."""
    b, hq, nq, _ = queries.shape
    h, _, bs, dv = pool_v.shape
    rep = hq // h
    out = np.zeros((b, hq, nq, dv))
    for i in range(b):
        ctx = int(context_lens[i])
        ql = nq if query_lens is None else int(query_lens[i])
        blocks = np.asarray(tables[i][: -(-ctx // bs)], dtype=np.int64)
        k = pool_k[:, blocks].reshape(h, -1, pool_k.shape[-1])[:, :ctx].astype(np.float64)
        v = pool_v[:, blocks].reshape(h, -1, dv)[:, :ctx].astype(np.float64)
        q = queries[i].astype(np.float64).reshape(h, rep * nq, -1)
        scores = q @ k.transpose(0, 2, 1) * scale  # [h, rep * nq, ctx]
        qpos = ctx - ql + np.minimum(np.arange(nq), ql - 1)
        keys = np.arange(ctx)
        seen = keys[None, :] <= qpos[:, None]
        if window is not None:
            seen &= keys[None, :] > qpos[:, None] - window
        seen = np.tile(seen, (rep, 1))  # rows r * nq + j
        scores = np.where(seen[None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out[i] = (p @ v).reshape(hq, nq, dv)
    return out
