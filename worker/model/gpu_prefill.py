"""Prefill attention over the paged KV pool on an NVIDIA GPU, reading blocks where they lie.

The prefill path before this kernel gathered each sequence's whole context out of the pool and
ran cuDNN's fused attention on the copy, one causal call per group of sequences with the same
(queries, context) (``block_attention.exact_context_attention``). cuDNN builds a graph for every
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
  kernel's reduction merges them (``gpu_attention``'s ``reduce``).

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
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import mlx.core as mx

from worker.model import gpu_attention

ROWS = 64  # query rows a thread block serves: four warps of 16
KEYS = 64  # keys a tile
WARPS = 4
HEAD_DIMS = (64, 128)
DTYPES = (mx.float16, mx.bfloat16)

# Environment switch: KVSERVE_CUDA_PREFILL=0 keeps prefill on gather-then-cuDNN.
ENV_SWITCH = "KVSERVE_CUDA_PREFILL"


def active() -> bool:
    """Whether prefill attention on the paged path runs this kernel: the decode kernel's
    conditions (``gpu_attention.active``) and not switched off (``KVSERVE_CUDA_PREFILL=0``)."""
    return gpu_attention.active() and os.environ.get(ENV_SWITCH, "1") != "0"


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
        and queries.dtype in gpu_attention.DTYPES
    )


_HEADER = """
#define PF_EMPTY (-1.0e30f)

template <typename T>
__device__ __forceinline__ unsigned int pf_pack(float lo, float hi);

template <>
__device__ __forceinline__ unsigned int pf_pack<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned int*>(&v);
}

template <>
__device__ __forceinline__ unsigned int pf_pack<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned int*>(&v);
}

// c += a * b: a 16x16 (row), b 16x8 (col), c 16x8 fp32.
template <typename T>
__device__ __forceinline__ void pf_mma(float* c, const unsigned int* a, unsigned int b0,
                                       unsigned int b1);

template <>
__device__ __forceinline__ void pf_mma<__half>(float* c, const unsigned int* a, unsigned int b0,
                                               unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void pf_mma<__nv_bfloat16>(float* c, const unsigned int* a,
                                                      unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared, asynchronously (sm80+), and its group fences.
__device__ __forceinline__ void pf_cp_async(void* smem, const void* gmem) {
    unsigned int addr = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" ::"r"(addr), "l"(gmem));
}

__device__ __forceinline__ void pf_cp_commit() {
    asm volatile("cp.async.commit_group;\\n" ::);
}

template <int N>
__device__ __forceinline__ void pf_cp_wait() {
    asm volatile("cp.async.wait_group %0;\\n" ::"n"(N));
}

__device__ __forceinline__ float pf_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Four 8x8 b16 matrices out of shared memory, transposed; lane l addresses row l % 8 of
// matrix l / 8.
__device__ __forceinline__ void pf_ldmatrix_t(unsigned int* r, const void* smem) {
    unsigned int addr = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
    asm volatile(
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "r"(addr));
}
"""

_BODY = """
    // Inputs: q [B, HQ, NQ, D] T; pool_k, pool_v [H, NB, BS, D] T; tables [B, MB] int32;
    // ends [B], q_lens [B] int32; params [2] float32 = (scale * log2(e), window or 0).
    constexpr int KT = D >= 128 ? 32 : 64;  // keys a tile (two tiles of K and V fit 48 KB)
    constexpr int NT = KT / 8;      // n-tiles of the scores
    constexpr int KS = KT / 16;     // k-steps of P . V
    constexpr int LD = D + 8;       // shared-memory row, padded 16 bytes
    constexpr int DK = D / 16;      // k-steps of q . k
    constexpr int DN = D / 8;       // n-tiles of the output
    constexpr int VEC = D / 8;      // 16-byte pieces a key row
    const int B = q_shape[0];
    const int NQ = q_shape[2];
    const int H = pool_k_shape[0];
    const int NB = pool_k_shape[1];
    const int MB = tables_shape[1];
    const int HQ = H * REP;
    const int S = gridDim.x / (B * H);
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;        // fragment row (and row + 8)
    const int t4 = lane & 3;        // fragment column pair
    const int cta = blockIdx.x;
    const int s = cta % S;
    const int h = (cta / S) % H;
    const int b = cta / (S * H);
    const int tile = blockIdx.y;
    const int ctx = ends[b];
    const int qlen = q_lens[b];
    const float qscale = params[0];
    const int W = int(params[1]);
    const int rows = REP * NQ;

    // Two tiles of K and V, raw 16-bit (a __shared__ array of a class type may not be
    // allowed): the next tile loads while this one is used.
    __shared__ __align__(16) unsigned short ks[2][KT * LD];
    __shared__ __align__(16) unsigned short vs[2][KT * LD];

    // This thread's two rows: row0 = tile * 64 + warp * 16 + g, row1 = row0 + 8.
    int pos[2];
    bool ok[2];
    size_t qrow[2];
    for (int x = 0; x < 2; ++x) {
        const int row = tile * 64 + warp * 16 + g + 8 * x;
        ok[x] = row < rows;
        const int rr = ok[x] ? row : 0;
        const int i = rr / REP;
        const int r = rr % REP;
        pos[x] = ctx - qlen + min(i, qlen - 1);
        qrow[x] = (size_t)(b * HQ + h * REP + r) * NQ + i;
    }

    // Q fragments (row-major A), unscaled: qa[k][0..3] for k-step k.
    unsigned int qa[DK][4];
    {
        const unsigned int* q0 = reinterpret_cast<const unsigned int*>(q + qrow[0] * D);
        const unsigned int* q1 = reinterpret_cast<const unsigned int*>(q + qrow[1] * D);
        for (int k = 0; k < DK; ++k) {
            qa[k][0] = q0[k * 8 + t4];
            qa[k][1] = q1[k * 8 + t4];
            qa[k][2] = q0[k * 8 + 4 + t4];
            qa[k][3] = q1[k * 8 + 4 + t4];
        }
    }

    // Rows are query-major, so positions never decrease along them: the first and last row of
    // the thread block (and of each warp) bound the positions it sees.
    const int first_row = tile * 64;
    const int last_row = min(tile * 64 + 63, rows - 1);
    const int pos_lo = ctx - qlen + min(first_row / REP, qlen - 1);
    const int pos_hi = ctx - qlen + min(last_row / REP, qlen - 1);
    const int w_lo = ctx - qlen + min(min(first_row + warp * 16, last_row) / REP, qlen - 1);
    const int w_hi = ctx - qlen + min(min(first_row + warp * 16 + 15, last_row) / REP, qlen - 1);
    const int key_lo = W > 0 ? max(0, pos_lo - W + 1) : 0;
    const int t_first = key_lo / KT;
    const int span = max(0, pos_hi / KT + 1 - t_first);
    const int per = (span + S - 1) / S;
    const int t_begin = t_first + min(span, s * per);
    const int t_end = t_first + min(span, (s + 1) * per);

    float o[DN][4];
    for (int n = 0; n < DN; ++n) {
        o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    }
    float m[2] = {PF_EMPTY, PF_EMPTY};  // running max, scaled (base 2)
    float l[2] = {0.0f, 0.0f};

    const uint4* pk = reinterpret_cast<const uint4*>(pool_k);
    const uint4* pv = reinterpret_cast<const uint4*>(pool_v);
    auto load_tile = [&](int kt, int buf) {
        for (int c = tid; c < KT * VEC; c += 128) {
            const int key = c / VEC;
            const int col = (c % VEC) * 8;
            const int p = kt * KT + key;
            const int blk = min(p / BS, MB - 1);
            const int phys = tables[(size_t)b * MB + blk];
            const size_t src = (((size_t)h * NB + phys) * BS + p % BS) * VEC + col / 8;
            pf_cp_async(&ks[buf][key * LD + col], pk + src);
            pf_cp_async(&vs[buf][key * LD + col], pv + src);
        }
        pf_cp_commit();
    };
    if (t_begin < t_end) {
        load_tile(t_begin, 0);
    }
    for (int kt = t_begin; kt < t_end; ++kt) {
        const int buf = (kt - t_begin) & 1;
        if (kt + 1 < t_end) {
            load_tile(kt + 1, buf ^ 1);
            pf_cp_wait<1>();
        } else {
            pf_cp_wait<0>();
        }
        __syncthreads();  // this tile is in shared memory for every warp

        const int k0 = kt * KT;
        // Keys this warp's rows all see (no mask), or none of them sees (nothing to do).
        const bool full = k0 + KT - 1 <= w_lo && (W <= 0 || k0 > w_hi - W);
        const bool none = k0 > w_hi || (W > 0 && k0 + KT - 1 <= w_lo - W);
        if (!none) {
            // Scores of 16 rows x KT keys, raw: sc[n] covers keys n * 8 .. n * 8 + 7.
            float sc[NT][4];
            for (int n = 0; n < NT; ++n) {
                sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
                const unsigned int* krow =
                    reinterpret_cast<const unsigned int*>(&ks[buf][(n * 8 + g) * LD]);
                for (int k = 0; k < DK; ++k) {
                    pf_mma<T>(sc[n], qa[k], krow[k * 8 + t4], krow[k * 8 + 4 + t4]);
                }
            }

            // Mask (unless the whole tile is seen), running max and rescale, per row x.
            float corr[2];
            for (int x = 0; x < 2; ++x) {
                float top = PF_EMPTY;
                for (int n = 0; n < NT; ++n) {
                    for (int e = 0; e < 2; ++e) {
                        float v = sc[n][2 * x + e];
                        if (!full) {
                            const int p = k0 + n * 8 + 2 * t4 + e;
                            const bool seen = ok[x] && p <= pos[x] && (W <= 0 || p > pos[x] - W);
                            v = seen ? v : PF_EMPTY;
                            sc[n][2 * x + e] = v;
                        }
                        top = fmaxf(top, v);
                    }
                }
                top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
                top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
                const float mn = fmaxf(m[x], top == PF_EMPTY ? PF_EMPTY : top * qscale);
                corr[x] = pf_exp2(m[x] - mn);
                m[x] = mn;
                l[x] *= corr[x];
            }
            for (int n = 0; n < DN; ++n) {
                o[n][0] *= corr[0];
                o[n][1] *= corr[0];
                o[n][2] *= corr[1];
                o[n][3] *= corr[1];
            }

            // P (rounded to T) times V, 16 keys a step.
            const int mat = lane >> 3;
            for (int kk = 0; kk < KS; ++kk) {
                unsigned int pa[4];
                float pr[2][4];
                for (int half = 0; half < 2; ++half) {
                    const int n = 2 * kk + half;
                    for (int e = 0; e < 4; ++e) {
                        const float v = sc[n][e];
                        const float p = pf_exp2(fmaf(v, qscale, -m[e >> 1]));
                        pr[half][e] = (full || v != PF_EMPTY) ? p : 0.0f;
                    }
                    l[0] += pr[half][0] + pr[half][1];
                    l[1] += pr[half][2] + pr[half][3];
                }
                pa[0] = pf_pack<T>(pr[0][0], pr[0][1]);
                pa[1] = pf_pack<T>(pr[0][2], pr[0][3]);
                pa[2] = pf_pack<T>(pr[1][0], pr[1][1]);
                pa[3] = pf_pack<T>(pr[1][2], pr[1][3]);
                const int vrow = kk * 16 + (lane & 7) + (mat & 1) * 8;
                for (int n = 0; n < DN; n += 2) {
                    unsigned int vb[4];
                    pf_ldmatrix_t(vb, &vs[buf][vrow * LD + n * 8 + (mat >> 1) * 8]);
                    pf_mma<T>(o[n], pa, vb[0], vb[1]);
                    pf_mma<T>(o[n + 1], pa, vb[2], vb[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with this buffer before it is loaded again
    }

    // Row sums over the quad's four lanes, then write.
    for (int x = 0; x < 2; ++x) {
        l[x] += __shfl_xor_sync(0xffffffffu, l[x], 1);
        l[x] += __shfl_xor_sync(0xffffffffu, l[x], 2);
    }
$write
"""

_WRITE_SINGLE = """
    for (int x = 0; x < 2; ++x) {
        if (!ok[x]) {
            continue;
        }
        const float inv = l[x] > 0.0f ? 1.0f / l[x] : 0.0f;
        unsigned int* dst = reinterpret_cast<unsigned int*>(out + qrow[x] * D);
        for (int n = 0; n < DN; ++n) {
            dst[n * 4 + t4] = pf_pack<T>(o[n][2 * x] * inv, o[n][2 * x + 1] * inv);
        }
    }
"""

_WRITE_PARTIAL = """
    for (int x = 0; x < 2; ++x) {
        if (!ok[x]) {
            continue;
        }
        float* dst = o_part + (qrow[x] * S + s) * D;
        for (int n = 0; n < DN; ++n) {
            dst[n * 8 + 2 * t4] = o[n][2 * x];
            dst[n * 8 + 2 * t4 + 1] = o[n][2 * x + 1];
        }
        if (t4 == 0) {
            ml_part[(qrow[x] * S + s) * 2] = m[x];
            ml_part[(qrow[x] * S + s) * 2 + 1] = l[x];
        }
    }
"""

_INPUTS = ["q", "pool_k", "pool_v", "tables", "ends", "q_lens", "params"]
_OUTPUTS = {"single": ["out"], "partial": ["o_part", "ml_part"]}


def render(kind: str) -> tuple[str, str]:
    """(header, body) of the kernel: ``kind`` "single" (one split, normalized output) or
    "partial" (split outputs for ``gpu_attention``'s reduction)."""
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
    (``gpu_attention.choose_splits``), enough thread blocks to fill the GPU, at least four
    tiles a split. A window bounds the tiles a row tile sees."""
    key_tiles = -(-keys // KEYS)
    if window is not None:
        key_tiles = min(key_tiles, (window + ROWS // max(1, rep) + 2 * KEYS - 2) // KEYS)
    return gpu_attention.choose_splits(b * h * row_tiles(rep, nq), key_tiles)


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
    arguments and the result are those of ``gpu_attention.paged_decode_attention`` (which
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
        query_lens = gpu_attention.cached_array(
            ("q_lens", b, nq), lambda: mx.full((b,), nq, dtype=mx.int32)
        )
    params = gpu_attention.cached_array(
        ("params", scale, window),
        lambda: mx.array([scale * gpu_attention.LOG2E, float(window or 0)], dtype=mx.float32),
    )
    q = queries.astype(dtype)
    template: list[tuple[str, Any]] = [("T", dtype), ("D", d), ("BS", bs), ("REP", rep)]
    inputs = [q, pool_k, pool_v, tables, context_lens, query_lens, params]
    grid = (32 * WARPS * b * h * splits, tiles, 1)
    out = gpu_attention.launch(_kernel, inputs, template, grid, 32 * WARPS, splits)
    return out if queries.dtype == dtype else out.astype(queries.dtype)


class ShapeHistory:
    """Which cuDNN attention shapes recur, so that only recurring ones are built.

    The gather-then-cuDNN path (``block_attention.exact_context_attention``) is faster than
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


HISTORY = ShapeHistory()
