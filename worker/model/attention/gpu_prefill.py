"""Prefill attention over the paged KV pool on an NVIDIA GPU, reading blocks where they lie.

The prefill path before this kernel gathered each sequence's whole context out of the pool and
ran cuDNN's fused attention on the copy, one causal call per group of sequences with the same
(queries, context) (``attention.cuda.exact_context_attention``). cuDNN builds a graph for every
new shape on first use, 45-130 ms on an H100, and every prefill over a cached prefix whose
(queries, context) was not seen before is a new shape: in serving, nearly every such chunk. This
kernel is compiled once per (dtype, head dim, block size, GQA factor), at warm-up; shapes are
runtime arguments. It also needs no gathered copy.

The algorithm (flash attention, tensor cores through ``mma.sync.m16n8k16``):

- A thread block of four warps handles one (sequence, KV head, split, row tile). The rows of a
  KV head are its ``rep = Hq / H`` query heads times the sequence's queries, ordered query-major
  (row ``i * rep + r``), so each K/V tile read serves every query head of the group (GQA) and a
  tile's rows span few positions. A tile is 64 rows, 16 a warp.
- Keys come in tiles of 64 positions, each 16-byte piece from the block the table names for it,
  into shared memory (rows padded by 16 bytes so fragment reads hit distinct banks). Each warp
  computes its 16 x 64 scores with fp32 accumulation, masks them from positions (causal, and a
  sliding window), keeps a running max and sum per row (base 2: scores are scaled by
  ``scale * log2(e)``), and adds ``P V`` with ``P`` rounded to the model's dtype, as flash
  attention does; ``V``'s fragments come transposed out of shared memory (``ldmatrix.trans``).
- Only the key tiles some row of the thread block can see are read (causal: up to its last
  row's position; with a window, from its first row's window start). When the batch gives too
  few thread blocks to fill the GPU (a short chunk over a long prefix), each sequence's visible
  tiles are split, each split writes fp32 partial outputs and its (max, sum), and the decode
  kernel's reduction merges them (``gpu_decode``'s ``reduce``).

Masking follows ``ForwardBatch.mask``: query ``i`` of a sequence whose pool holds ``ends[b]``
tokens after this forward and which computes ``q_lens[b]`` queries sits at position
``ends[b] - q_lens[b] + min(i, q_lens[b] - 1)`` (padded rows repeat the last real one) and sees
key ``p`` iff ``p <= pos`` and, with a window ``W``, ``p > pos - W``.

Half precision only (fp16, bf16; the tensor cores' inputs) and head dims 64 and 128; anything
else keeps the gather-then-cuDNN path. CUDA only: an Apple GPU keeps that path too (its
tensor-core equivalent, ``simdgroup_matrix``, is a different kernel, not written).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import mlx.core as mx

from worker.model.attention import gpu_decode
from worker.model.attention.kernel_source import sections

ROWS = 64  # query rows a thread block serves: four warps of 16
KEYS = 64  # keys a tile
WARPS = 4
HEAD_DIMS = (64, 128)
DTYPES = (mx.float16, mx.bfloat16)


def supports(queries: mx.array, pool_k: mx.array, pool_v: mx.array) -> bool:
    """Whether :func:`paged_prefill_attention` serves these shapes and dtypes."""
    if queries.ndim != 4 or pool_k.ndim != 4 or pool_v.ndim != 4:
        return False
    _, hq, _, d = queries.shape
    h = pool_k.shape[0]
    return (
        d == pool_k.shape[-1] == pool_v.shape[-1]
        and d in HEAD_DIMS
        and pool_v.shape[:3] == pool_k.shape[:3]
        and h >= 1
        and hq % h == 0
        and pool_k.dtype == pool_v.dtype
        and pool_k.dtype in DTYPES
        and queries.dtype in gpu_decode.DTYPES
    )


# The kernel source (paged_prefill.cu); "$write" in the body takes one of the two writes.
_SOURCE = sections("paged_prefill.cu")
_HEADER = _SOURCE["header"]
_BODY = _SOURCE["body"]
_WRITE_SINGLE = _SOURCE["write_single"]
_WRITE_PARTIAL = _SOURCE["write_partial"]

_INPUTS = ["q", "pool_k", "pool_v", "tables", "ends", "q_lens", "params"]
_OUTPUTS = {"single": ["out"], "partial": ["o_part", "ml_part"]}


def render(kind: str) -> tuple[str, str]:
    """(header, body) of the kernel: ``kind`` "single" (one split, normalized output) or
    "partial" (split outputs for ``gpu_decode``'s reduction)."""
    write = _WRITE_SINGLE if kind == "single" else _WRITE_PARTIAL
    return _HEADER, _BODY.replace("$write", write)


@functools.cache
def _kernel(kind: str) -> Callable[..., list[mx.array]]:
    header, body = render(kind)
    return mx.fast.cuda_kernel(  # type: ignore[return-value]
        name=f"kvserve_paged_prefill_{kind}",
        input_names=_INPUTS,
        output_names=_OUTPUTS[kind],
        source=body,
        header=header,
    )


def row_tiles(rep: int, nq: int) -> int:
    """Thread blocks a (sequence, KV head) needs for its ``rep * nq`` rows."""
    return -(-(rep * nq) // ROWS)


def choose_splits(b: int, h: int, rep: int, nq: int, keys: int, window: int | None) -> int:
    """Splits of each sequence's key tiles for ``b`` sequences of ``nq`` queries over at most
    ``keys`` keys, ``h`` KV heads of ``rep`` query heads each: as for decodes
    (``gpu_decode.choose_splits``), enough thread blocks to fill the GPU, at least four
    tiles a split. A window bounds the tiles a row tile sees."""
    key_tiles = -(-keys // KEYS)
    if window is not None:
        key_tiles = min(key_tiles, (window + ROWS // max(1, rep) + 2 * KEYS - 2) // KEYS)
    return gpu_decode.choose_splits(b * h * row_tiles(rep, nq), key_tiles)


def paged_prefill_attention(
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
) -> mx.array:
    """Attention of ``queries`` ``[B, Hq, Nq, D]`` over the pool blocks of each sequence; the
    arguments and the result are those of ``gpu_decode.paged_decode_attention`` (which
    this computes for any number of queries, on tensor cores, in fp16 or bf16 only: see
    :func:`supports`). ``splits`` overrides the choice of key splits (benchmarks, tests)."""
    b, hq, nq, d = queries.shape
    h, _, bs, _ = pool_k.shape
    rep = hq // h
    dtype = pool_k.dtype
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    tiles = row_tiles(rep, nq)
    if splits is None:
        splits = choose_splits(b, h, rep, nq, tables.shape[1] * bs, window)
    if query_lens is None:
        query_lens = gpu_decode.cached_array(
            ("q_lens", b, nq), lambda: mx.full((b,), nq, dtype=mx.int32)
        )
    params = gpu_decode.cached_array(
        ("params", scale, window),
        lambda: mx.array([scale * gpu_decode.LOG2E, float(window or 0)], dtype=mx.float32),
    )
    q = queries.astype(dtype)
    template: list[tuple[str, Any]] = [("T", dtype), ("D", d), ("BS", bs), ("REP", rep)]
    inputs = [q, pool_k, pool_v, tables, context_lens, query_lens, params]
    grid = (32 * WARPS * b * h * splits, tiles, 1)
    out = gpu_decode.launch(_kernel, inputs, template, grid, 32 * WARPS, splits)
    return out if queries.dtype == dtype else out.astype(queries.dtype)


class ShapeHistory:
    """Which cuDNN attention shapes recur, so that only recurring ones are built.

    The gather-then-cuDNN path (``attention.cuda.exact_context_attention``) is faster than
    this kernel once cuDNN has built a graph for the shape (H100, fp16, per layer: 2,048
    queries over 30k 1.4 against 3.2 ms), and 40-85 ms slower the first time, when it builds
    it; in serving most prefill chunks over a cached prefix have a (queries, context) never
    seen before, and some repeat (a long prompt's fixed-size chunks, repeated requests). A
    forward therefore takes this kernel unless every cuDNN call it would make has a shape seen
    in an earlier forward: the second sighting builds the graph, later ones reuse it.

    Process-wide and per thread in MLX (its graph cache is per thread, 256 entries by
    default); one history serves the model thread. ``capacity`` stays under MLX's so that a
    shape remembered here is still built there."""

    def __init__(self, capacity: int = 128) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[Hashable, int] = OrderedDict()

    def recurring(self, shapes: Sequence[Hashable]) -> bool:
        """Record one forward's cuDNN call shapes; whether all were seen before it."""
        ready = all(shape in self._seen for shape in shapes)
        for shape in shapes:
            self._seen[shape] = self._seen.get(shape, 0) + 1
            self._seen.move_to_end(shape)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return ready

    def clear(self) -> None:
        self._seen.clear()
