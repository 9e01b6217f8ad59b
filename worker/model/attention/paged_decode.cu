// Paged decode attention (split-K "flash decoding") over the KV pool's block tables. Read by
// gpu_decode.py (kernel_source.sections): each "@section NAME" line starts a piece of source that ends where the next one starts. "main", "write_single",
// "write_partial" and "reduce" are templates: "$name" placeholders (thread and block indices,
// the unroll pragma) are filled for CUDA or for Metal (paged_decode.metal holds Metal's header),
// and "$write" in "main" takes one of the two write sections. The algorithm is described at the
// top of gpu_decode.py.
// @section cuda_header

#define KV_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KV_MAX(a, b) ((a) > (b) ? (a) : (b))
// "No key yet": finite, so that exp2(KV_EMPTY - KV_EMPTY) is 1, not NaN, and exp2 of
// KV_EMPTY minus any real score is 0.
#define KV_EMPTY (-1.0e30f)
#define KV_SHFL_XOR(x, o) __shfl_xor_sync(0xffffffffu, (x), (o))
#define KV_EXP2(x) exp2f(x)
#define KV_SHARED __shared__
#define KV_BARRIER __syncthreads()
#define KV_ALIGNED(p) ((reinterpret_cast<size_t>(p) & 15) == 0)

// 8 consecutive elements of a K or V row, raw: 16 bytes in half precision, 32 in fp32.
template <typename T>
struct KvPack {
    uint4 w[sizeof(T) / 2];
};

template <typename T>
__device__ __forceinline__ KvPack<T> kv_load(const T* p, bool aligned) {
    KvPack<T> r;
    if (aligned) {
#pragma unroll
        for (int i = 0; i < int(sizeof(T) / 2); ++i) r.w[i] = reinterpret_cast<const uint4*>(p)[i];
    } else {
        T* e = reinterpret_cast<T*>(&r);
#pragma unroll
        for (int i = 0; i < 8; ++i) e[i] = p[i];
    }
    return r;
}

template <typename T>
__device__ __forceinline__ void kv_unpack(const KvPack<T>& r, float* out) {
    const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(e[i]);
}

// @section main

    // Inputs: q [B, HQ, NQ, D] T; pool_k, pool_v [H, NB, BS, D] T; tables [B, MB] int32;
    // ends [B], q_lens [B] int32; params [2] float32 = (scale * log2(e), window or 0).
    constexpr int L = D / 8;        // lanes that share a key, 8 dims each
    constexpr int KW = 32 / L;      // keys a warp reads at once
    constexpr int KC = RT <= 4 ? 4 : 2;  // keys a lane group loads before using them
    const int B = q_shape[0];
    const int NQ = q_shape[2];
    const int H = pool_k_shape[0];
    const int NB = pool_k_shape[1];
    const int MB = tables_shape[1];
    const int HQ = H * REP;
    const int S = $ctas_x / (B * H);
    const int tid = $tid_x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane / L;
    const int e0 = (lane % L) * 8;
    const int cta = $cta_x;
    const int tile = $cta_y;
    const int s = cta % S;
    const int h = (cta / S) % H;
    const int b = cta / (S * H);
    const int ctx = ends[b];
    const int qlen = q_lens[b];
    const float qscale = params[0];
    const int W = int(params[1]);
    const int rows = REP * NQ;

    // Rows of this tile: row j is query i of query head h * REP + r, at position qpos[j].
    float qf[RT][8];
    float acc[RT][8];
    float m[RT];
    float l[RT];
    int qpos[RT];
    bool row_ok[RT];
    int lo = ctx;
    int hi = 0;
    for (int j = 0; j < RT; ++j) {
        const int row = tile * RT + j;
        row_ok[j] = row < rows;
        const int i = row_ok[j] ? row % NQ : 0;
        qpos[j] = ctx - qlen + KV_MIN(i, qlen - 1);
        if (row_ok[j]) {
            lo = KV_MIN(lo, W > 0 ? KV_MAX(0, qpos[j] - W + 1) : 0);
            hi = KV_MAX(hi, qpos[j] + 1);
        }
        const size_t qoff = ((size_t)(b * HQ + h * REP) * NQ + (row_ok[j] ? row : 0)) * D + e0;
        for (int e = 0; e < 8; ++e) {
            qf[j][e] = static_cast<float>(q[qoff + e]) * qscale;
            acc[j][e] = 0.0f;
        }
        m[j] = KV_EMPTY;
        l[j] = 0.0f;
    }

    // This split's share of the visible blocks [lo / BS, ceil(hi / BS)).
    const int first = lo / BS;
    const int span = KV_MAX(0, (hi + BS - 1) / BS - first);
    const int per = (span + S - 1) / S;
    const int begin = first + KV_MIN(span, s * per);
    const int end = first + KV_MIN(span, (s + 1) * per);

    // Each warp takes whole blocks; each lane group a chunk of KC keys at a time: their raw
    // K/V vectors are all loaded before any is used, then one rescale per row and chunk.
    const bool aligned = KV_ALIGNED(pool_k) && KV_ALIGNED(pool_v);
    for (int blk = begin + warp; blk < end; blk += NW) {
        const int phys = tables[(size_t)b * MB + blk];
        const size_t base = ((size_t)(h * NB + phys) * BS) * D + e0;
        $unroll
        for (int t0 = 0; t0 < BS; t0 += KW * KC) {
            KvPack<T> kp[KC];
            KvPack<T> vp[KC];
            for (int c = 0; c < KC; ++c) {
                const int t = t0 + c * KW + g;
                const size_t off = base + (size_t)((BS % (KW * KC) == 0 || t < BS) ? t : 0) * D;
                kp[c] = kv_load(pool_k + off, aligned);
                vp[c] = kv_load(pool_v + off, aligned);
            }
            float sc[KC][RT];
            for (int c = 0; c < KC; ++c) {
                float kf[8];
                kv_unpack(kp[c], kf);
                for (int j = 0; j < RT; ++j) {
                    float dot = 0.0f;
                    for (int e = 0; e < 8; ++e) {
                        dot += qf[j][e] * kf[e];
                    }
                    sc[c][j] = dot;
                }
            }
            for (int o = L / 2; o > 0; o >>= 1) {
                for (int c = 0; c < KC; ++c) {
                    for (int j = 0; j < RT; ++j) {
                        sc[c][j] += KV_SHFL_XOR(sc[c][j], o);
                    }
                }
            }
            for (int j = 0; j < RT; ++j) {
                float mn = m[j];
                for (int c = 0; c < KC; ++c) {
                    const int t = t0 + c * KW + g;
                    const int pos = blk * BS + t;
                    const bool seen = row_ok[j] && (BS % (KW * KC) == 0 || t < BS)
                        && pos <= qpos[j] && (W <= 0 || pos > qpos[j] - W);
                    sc[c][j] = seen ? sc[c][j] : KV_EMPTY;
                    mn = KV_MAX(mn, sc[c][j]);
                }
                const float corr = KV_EXP2(m[j] - mn);
                m[j] = mn;
                l[j] *= corr;
                for (int e = 0; e < 8; ++e) {
                    acc[j][e] *= corr;
                }
            }
            for (int c = 0; c < KC; ++c) {
                float vf[8];
                kv_unpack(vp[c], vf);
                for (int j = 0; j < RT; ++j) {
                    const float p = sc[c][j] == KV_EMPTY ? 0.0f : KV_EXP2(sc[c][j] - m[j]);
                    l[j] += p;
                    for (int e = 0; e < 8; ++e) {
                        acc[j][e] += p * vf[e];
                    }
                }
            }
        }
    }

    // Merge the KW key groups of each warp (lanes g * L + x, same x).
    for (int o = L; o < 32; o <<= 1) {
        for (int j = 0; j < RT; ++j) {
            const float mo = KV_SHFL_XOR(m[j], o);
            const float lo2 = KV_SHFL_XOR(l[j], o);
            const float mn = KV_MAX(m[j], mo);
            const float a = KV_EXP2(m[j] - mn);
            const float c = KV_EXP2(mo - mn);
            l[j] = l[j] * a + lo2 * c;
            m[j] = mn;
            for (int e = 0; e < 8; ++e) {
                acc[j][e] = acc[j][e] * a + KV_SHFL_XOR(acc[j][e], o) * c;
            }
        }
    }

    // Merge the warps through shared memory.
    KV_SHARED float sm_acc[NW * RT * D];
    KV_SHARED float sm_m[NW * RT];
    KV_SHARED float sm_l[NW * RT];
    if (lane < L) {
        for (int j = 0; j < RT; ++j) {
            for (int e = 0; e < 8; ++e) {
                sm_acc[(warp * RT + j) * D + e0 + e] = acc[j][e];
            }
            if (lane == 0) {
                sm_m[warp * RT + j] = m[j];
                sm_l[warp * RT + j] = l[j];
            }
        }
    }
    KV_BARRIER;
    for (int idx = tid; idx < RT * D; idx += NW * 32) {
        const int j = idx / D;
        const int d = idx % D;
        const int row = tile * RT + j;
        if (row >= rows) {
            continue;
        }
        float mx_ = KV_EMPTY;
        for (int w = 0; w < NW; ++w) {
            mx_ = KV_MAX(mx_, sm_m[w * RT + j]);
        }
        float sum = 0.0f;
        float val = 0.0f;
        for (int w = 0; w < NW; ++w) {
            const float mw = sm_m[w * RT + j];
            const float f = KV_EXP2(mw - mx_);
            sum += sm_l[w * RT + j] * f;
            val += sm_acc[(w * RT + j) * D + d] * f;
        }
        const size_t out_row = (size_t)(b * HQ + h * REP) * NQ + row;
$write
    }

// @section write_single
        out[out_row * D + d] = static_cast<T>(sum > 0.0f ? val / sum : 0.0f);
// @section write_partial
        o_part[(out_row * S + s) * D + d] = val;
        if (d == 0) {
            ml_part[(out_row * S + s) * 2] = mx_;
            ml_part[(out_row * S + s) * 2 + 1] = sum;
        }
// @section reduce

    // o_part [R, S, D], ml_part [R, S, 2] float32 -> out [R, D] T; one thread a (row, dim).
    const int S = o_part_shape[1];
    const size_t row = $cta_x;
    const int d = $tid_x;
    float mx_ = KV_EMPTY;
    for (int s = 0; s < S; ++s) {
        mx_ = KV_MAX(mx_, ml_part[(row * S + s) * 2]);
    }
    float sum = 0.0f;
    float val = 0.0f;
    for (int s = 0; s < S; ++s) {
        const float ms = ml_part[(row * S + s) * 2];
        const float f = KV_EXP2(ms - mx_);
        sum += ml_part[(row * S + s) * 2 + 1] * f;
        val += o_part[(row * S + s) * D + d] * f;
    }
    out[row * D + d] = static_cast<T>(sum > 0.0f ? val / sum : 0.0f);

