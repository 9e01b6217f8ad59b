// Whole pool blocks copied into a contiguous [B, H, MB * BS, D], 16 bytes a thread. Read by
// gpu_gather.py (kernel_source.sections); T is a template parameter (the pool's dtype).
// @section gather

    const int B = tables_shape[0];
    const int MB = tables_shape[1];
    const int H = pool_shape[0];
    const int NB = pool_shape[1];
    const int BS = pool_shape[2];
    const int VEC = pool_shape[3] * (int)sizeof(T) / 16;
    const long long per_block = (long long)BS * VEC;
    const long long total = (long long)B * H * MB * per_block;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) {
        return;
    }
    const long long inner = i % per_block;
    long long rest = i / per_block;
    const int j = (int)(rest % MB);
    rest /= MB;
    const int h = (int)(rest % H);
    const int b = (int)(rest / H);
    const long long block = tables[(long long)b * MB + j];
    const uint4* src = reinterpret_cast<const uint4*>(pool);
    uint4* dst = reinterpret_cast<uint4*>(out);
    dst[i] = src[((long long)h * NB + block) * per_block + inner];

