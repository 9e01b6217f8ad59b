// Paged prefill attention (flash attention on tensor cores, mma.sync.m16n8k16) over the KV
// pool's block tables. Read by gpu_prefill.py (kernel_source.sections): each "@section NAME"
// line starts a piece of source that ends where the next one starts; "$write" in "body" takes
// one of the two write sections. The algorithm is described at the top of gpu_prefill.py.
// @section header

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
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void pf_mma<__nv_bfloat16>(float* c, const unsigned int* a,
                                                      unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared, asynchronously (sm80+), and its group fences.
__device__ __forceinline__ void pf_cp_async(void* smem, const void* gmem) {
    unsigned int addr = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem));
}

__device__ __forceinline__ void pf_cp_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int N>
__device__ __forceinline__ void pf_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
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
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "r"(addr));
}

// @section body

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

// @section write_single

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

// @section write_partial

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

