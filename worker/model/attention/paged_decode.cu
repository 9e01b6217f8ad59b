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
// @section main_tc

    // Tensor-core variant (fp16/bf16, sm80+; the helpers are paged_prefill.cu's header). Same
    // inputs, outputs and thread blocks as "main"; RT is 16 (one mma's rows: rows past the
    // KV head's rows are padding) and ST the stages of each warp's copy pipeline.
    // Inputs: q [B, HQ, NQ, D] T; pool_k, pool_v [H, NB, BS, D] T; tables [B, MB] int32;
    // ends [B], q_lens [B] int32; params [2] float32 = (scale * log2(e), window or 0).
    constexpr int KT = 16;           // keys a warp takes at once: one k-step of P . V
    constexpr int CPB = BS / KT;     // chunks of a block
    constexpr int LD = D + 8;        // shared-memory row, padded 16 bytes (distinct banks)
    constexpr int DK = D / 16;       // k-steps of q . k
    constexpr int DN = D / 8;        // n-tiles of the output
    constexpr int VEC = D / 8;       // 16-byte pieces a key row
    constexpr int STAGE = 2 * KT * LD;  // 16-bit elements a stage: K rows, then V rows
    constexpr int COPY_BYTES = NW * ST * STAGE * 2;
    constexpr int MERGE_BYTES = (NW * RT * D + 2 * NW * RT) * 4;
    __shared__ __align__(16) unsigned char kv_smem[COPY_BYTES > MERGE_BYTES ? COPY_BYTES : MERGE_BYTES];
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
    const int g = lane >> 2;         // fragment row (and row + 8)
    const int t4 = lane & 3;         // fragment column pair
    const int cta = blockIdx.x;
    const int tile = blockIdx.y;
    const int s = cta % S;
    const int h = (cta / S) % H;
    const int b = cta / (S * H);
    const int ctx = ends[b];
    const int qlen = q_lens[b];
    const float qscale = params[0];
    const int W = int(params[1]);
    const int rows = REP * NQ;

    // The keys some row of the tile sees: [lo, hi).
    int lo = ctx;
    int hi = 0;
    for (int j = 0; j < RT; ++j) {
        const int row = tile * RT + j;
        if (row < rows) {
            const int pos = ctx - qlen + KV_MIN(row % NQ, qlen - 1);
            lo = KV_MIN(lo, W > 0 ? KV_MAX(0, pos - W + 1) : 0);
            hi = KV_MAX(hi, pos + 1);
        }
    }
    // This thread's two rows (head-major, as "main": row r * NQ + i), g and g + 8.
    int qpos[2];
    bool ok[2];
    size_t qrow[2];
    for (int x = 0; x < 2; ++x) {
        const int row = tile * RT + g + 8 * x;
        ok[x] = row < rows;
        const int rr = ok[x] ? row : tile * RT;
        qpos[x] = ctx - qlen + KV_MIN(rr % NQ, qlen - 1);
        qrow[x] = (size_t)(b * HQ + h * REP) * NQ + rr;
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

    // This split's share of the visible blocks [lo / BS, ceil(hi / BS)), as in "main".
    const int first = lo / BS;
    const int span = KV_MAX(0, (hi + BS - 1) / BS - first);
    const int per = (span + S - 1) / S;
    const int begin = first + KV_MIN(span, s * per);
    const int end = first + KV_MIN(span, (s + 1) * per);
    // Warp w takes blocks begin + w, begin + w + NW, ..., KT keys (a chunk) at a time, through
    // ST shared-memory stages of its own: chunk c + ST - 1 loads while chunk c is used.
    const int my_blocks = end - begin > warp ? (end - begin - warp + NW - 1) / NW : 0;
    const int chunks = my_blocks * CPB;
    unsigned short* stages = reinterpret_cast<unsigned short*>(kv_smem) + warp * ST * STAGE;
    const uint4* pk = reinterpret_cast<const uint4*>(pool_k);
    const uint4* pv = reinterpret_cast<const uint4*>(pool_v);
    auto load_chunk = [&](int c) {
        const int blk = begin + warp + (c / CPB) * NW;
        const int phys = tables[(size_t)b * MB + blk];
        const size_t src = (((size_t)h * NB + phys) * BS + (c % CPB) * KT) * VEC;
        unsigned short* dst = stages + (c % ST) * STAGE;
        for (int p = lane; p < KT * VEC; p += 32) {
            const int key = p / VEC;
            const int col = p % VEC;
            pf_cp_async(dst + key * LD + col * 8, pk + src + p);
            pf_cp_async(dst + (KT + key) * LD + col * 8, pv + src + p);
        }
    };

    float o[DN][4];
    for (int n = 0; n < DN; ++n) {
        o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    }
    float m[2] = {KV_EMPTY, KV_EMPTY};  // running max, scaled (base 2)
    float l[2] = {0.0f, 0.0f};          // running sum of this lane's keys (the quad's: at the end)
    const int mat = lane >> 3;

    for (int c = 0; c < ST - 1; ++c) {
        if (c < chunks) {
            load_chunk(c);
        }
        pf_cp_commit();
    }
    for (int c = 0; c < chunks; ++c) {
        if (c + ST - 1 < chunks) {
            load_chunk(c + ST - 1);
        }
        pf_cp_commit();
        pf_cp_wait<ST - 1>();  // chunk c's copies (this lane's) are done
        __syncwarp();          // and every lane's
        const int k0 = (begin + warp + (c / CPB) * NW) * BS + (c % CPB) * KT;
        if (k0 < hi && (W <= 0 || k0 + KT > lo)) {
            const unsigned short* ks = stages + (c % ST) * STAGE;
            const unsigned short* vs = ks + KT * LD;
            // Scores of 16 rows x 16 keys, raw: sc[n] covers keys n * 8 .. n * 8 + 7.
            float sc[2][4];
            for (int n = 0; n < 2; ++n) {
                sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
                const unsigned int* krow =
                    reinterpret_cast<const unsigned int*>(ks + (n * 8 + g) * LD);
                for (int k = 0; k < DK; ++k) {
                    pf_mma<T>(sc[n], qa[k], krow[k * 8 + t4], krow[k * 8 + 4 + t4]);
                }
            }
            // Mask, running max and rescale, per row x.
            float corr[2];
            for (int x = 0; x < 2; ++x) {
                float top = KV_EMPTY;
                for (int n = 0; n < 2; ++n) {
                    for (int e = 0; e < 2; ++e) {
                        const int p = k0 + n * 8 + 2 * t4 + e;
                        const bool seen = ok[x] && p <= qpos[x] && (W <= 0 || p > qpos[x] - W);
                        const float v = seen ? sc[n][2 * x + e] : KV_EMPTY;
                        sc[n][2 * x + e] = v;
                        top = fmaxf(top, v);
                    }
                }
                top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
                top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
                const float mn = fmaxf(m[x], top == KV_EMPTY ? KV_EMPTY : top * qscale);
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
            // P (rounded to T) times V.
            float pr[2][4];
            for (int n = 0; n < 2; ++n) {
                for (int e = 0; e < 4; ++e) {
                    const float v = sc[n][e];
                    pr[n][e] = v != KV_EMPTY ? pf_exp2(fmaf(v, qscale, -m[e >> 1])) : 0.0f;
                }
                l[0] += pr[n][0] + pr[n][1];
                l[1] += pr[n][2] + pr[n][3];
            }
            unsigned int pa[4];
            pa[0] = pf_pack<T>(pr[0][0], pr[0][1]);
            pa[1] = pf_pack<T>(pr[0][2], pr[0][3]);
            pa[2] = pf_pack<T>(pr[1][0], pr[1][1]);
            pa[3] = pf_pack<T>(pr[1][2], pr[1][3]);
            const int vrow = (lane & 7) + (mat & 1) * 8;
            for (int n = 0; n < DN; n += 2) {
                unsigned int vb[4];
                pf_ldmatrix_t(vb, vs + vrow * LD + n * 8 + (mat >> 1) * 8);
                pf_mma<T>(o[n], pa, vb[0], vb[1]);
                pf_mma<T>(o[n + 1], pa, vb[2], vb[3]);
            }
        }
        __syncwarp();  // every lane is done with this stage before it loads again
    }
    pf_cp_wait<0>();

    // Row sums over the quad's four lanes; then the warps' rows into shared memory (over the
    // stages: every warp must be done with its own first) for "merge".
    for (int x = 0; x < 2; ++x) {
        l[x] += __shfl_xor_sync(0xffffffffu, l[x], 1);
        l[x] += __shfl_xor_sync(0xffffffffu, l[x], 2);
    }
    float* sm_acc = reinterpret_cast<float*>(kv_smem);
    float* sm_m = sm_acc + NW * RT * D;
    float* sm_l = sm_m + NW * RT;
    __syncthreads();
    for (int x = 0; x < 2; ++x) {
        const int j = g + 8 * x;
        for (int n = 0; n < DN; ++n) {
            sm_acc[(warp * RT + j) * D + n * 8 + 2 * t4] = o[n][2 * x];
            sm_acc[(warp * RT + j) * D + n * 8 + 2 * t4 + 1] = o[n][2 * x + 1];
        }
        if (t4 == 0) {
            sm_m[warp * RT + j] = m[x];
            sm_l[warp * RT + j] = l[x];
        }
    }
    __syncthreads();
// @section merge

    // Merge the warps' (max, sum, output) rows from shared memory (sm_m, sm_l, sm_acc: warp w,
    // row j at w * RT + j) and write them: one thread a (row, dim).
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

