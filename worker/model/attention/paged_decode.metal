// The Metal twin's header for the paged decode kernel of paged_decode.cu (whose "main",
// "write_*" and "reduce" templates it renders with Metal's names). Untested on hardware: no
// Apple GPU has run it; nothing selects it unless a worker asks for --attention metal.
// @section metal_header

#define KV_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KV_MAX(a, b) ((a) > (b) ? (a) : (b))
#define KV_EMPTY (-1.0e30f)
#define KV_SHFL_XOR(x, o) simd_shuffle_xor((x), (ushort)(o))
#define KV_EXP2(x) metal::exp2(x)
#define KV_SHARED threadgroup
#define KV_BARRIER threadgroup_barrier(mem_flags::mem_threadgroup)
#define KV_ALIGNED(p) true

template <typename T>
struct KvPack {
    T e[8];
};

template <typename T>
inline KvPack<T> kv_load(const device T* p, bool) {
    KvPack<T> r;
    for (int i = 0; i < 8; ++i) r.e[i] = p[i];
    return r;
}

template <typename T>
inline void kv_unpack(thread const KvPack<T>& r, thread float* out) {
    for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(r.e[i]);
}

