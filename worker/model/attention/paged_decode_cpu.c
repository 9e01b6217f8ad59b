// Decode attention over the paged KV pool on the CPU (worker/model/attention/cpu_decode.py).
//
// Compiled once per machine with the system's C compiler, loaded with ctypes: the same
// algorithm as the numba kernel it replaces where a compiler exists, without an LLVM in the
// serving process. One task per (sequence, KV head); each walks the sequence's blocks through
// its block table and keeps a running max, sum and output per query row (online softmax in
// fp32, as SDPA accumulates), so grouped-query heads read each K/V vector once. Tasks are dealt
// to `threads` threads round-robin (sequences of different lengths spread evenly), from a pool
// kept for the process (see pool_main).
//
// q [B, Hq, NQ, D] fp32; pool_k/pool_v [H, blocks, BS, D] fp32; tables [B, W] int32;
// ends/q_lens [B] int64: query i of sequence b sits at ends[b] - q_lens[b] + min(i, q_lens[b]
// - 1) and sees keys up to it (the last `window` only, when window > 0); out [B, Hq, NQ, D].
// Block ids are not checked here: the caller's ForwardBatch checked them.

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    const float *q;
    const float *k;
    const float *v;
    const int32_t *tables;
    const int64_t *ends;
    const int64_t *q_lens;
    float *out;
    int64_t batch, hq, nq, dim, heads, blocks, bs, width, window;
    float scale;
    int64_t first, stride;  // this thread's tasks: first, first + stride, ...
    int failed;
} job_t;

static void run_tasks(job_t *j) {
    const int64_t rep = j->hq / j->heads, rows = rep * j->nq, dim = j->dim, bs = j->bs;
    float *qs = malloc(sizeof(float) * rows * dim);
    float *acc = malloc(sizeof(float) * rows * dim);
    float *top = malloc(sizeof(float) * rows);
    float *total = malloc(sizeof(float) * rows);
    float *scores = malloc(sizeof(float) * bs);
    int64_t *his = malloc(sizeof(int64_t) * rows);
    int64_t *los = malloc(sizeof(int64_t) * rows);
    if (!qs || !acc || !top || !total || !scores || !his || !los) {
        j->failed = 1;
        goto done;
    }
    for (int64_t task = j->first; task < j->batch * j->heads; task += j->stride) {
        const int64_t b = task / j->heads, h = task % j->heads;
        const int64_t last = j->ends[b] - 1, first_pos = j->ends[b] - j->q_lens[b];
        int64_t lo_min = last + 1;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t rr = r / j->nq, i = r % j->nq;
            int64_t pos = first_pos + i;
            if (pos > last) pos = last;
            his[r] = pos + 1;
            los[r] = 0;
            if (j->window > 0 && pos + 1 - j->window > 0) los[r] = pos + 1 - j->window;
            if (los[r] < lo_min) lo_min = los[r];
            const float *src = j->q + (((b * j->hq) + h * rep + rr) * j->nq + i) * dim;
            for (int64_t d = 0; d < dim; d++) qs[r * dim + d] = src[d] * j->scale;
            top[r] = -INFINITY;
            total[r] = 0.0f;
            for (int64_t d = 0; d < dim; d++) acc[r * dim + d] = 0.0f;
        }
        const int64_t end_block = (j->ends[b] + bs - 1) / bs;
        for (int64_t jb = lo_min / bs; jb < end_block; jb++) {
            const int64_t block = j->tables[b * j->width + jb];
            const float *keys = j->k + (h * j->blocks + block) * bs * dim;
            const float *values = j->v + (h * j->blocks + block) * bs * dim;
            for (int64_t r = 0; r < rows; r++) {
                int64_t t0 = los[r] - jb * bs, t1 = his[r] - jb * bs;
                if (t0 < 0) t0 = 0;
                if (t1 > bs) t1 = bs;
                if (t0 >= t1) continue;
                const float *qr = qs + r * dim;
                float best = top[r];
                for (int64_t t = t0; t < t1; t++) {
                    const float *kt = keys + t * dim;
                    float s = 0.0f;
                    for (int64_t d = 0; d < dim; d++) s += qr[d] * kt[d];
                    scores[t] = s;
                    if (s > best) best = s;
                }
                const float shrink = expf(top[r] - best);  // 0 for the first block (-inf)
                float *ar = acc + r * dim;
                total[r] *= shrink;
                for (int64_t d = 0; d < dim; d++) ar[d] *= shrink;
                top[r] = best;
                for (int64_t t = t0; t < t1; t++) {
                    const float w = expf(scores[t] - best);
                    const float *vt = values + t * dim;
                    total[r] += w;
                    for (int64_t d = 0; d < dim; d++) ar[d] += w * vt[d];
                }
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            const int64_t rr = r / j->nq, i = r % j->nq;
            float *dst = j->out + (((b * j->hq) + h * rep + rr) * j->nq + i) * dim;
            for (int64_t d = 0; d < dim; d++) dst[d] = acc[r * dim + d] / total[r];
        }
    }
done:
    free(qs);
    free(acc);
    free(top);
    free(total);
    free(scores);
    free(his);
    free(los);
}

// A pool of threads kept for the life of the process: a thread started per call cost more than
// the kernel's work at a decode's sizes (2 threads: 0.97 ms against 0.58 for numba's pool, batch
// 32 at context 160). Idle threads sleep on a condition variable: they take no core from the
// BLAS between calls. One caller at a time (the Python side holds a lock).
#define MAX_THREADS 64

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t go = PTHREAD_COND_INITIALIZER;
static pthread_cond_t finished = PTHREAD_COND_INITIALIZER;
static int64_t pool_size = 0;   // threads started (job indices 1..pool_size)
static uint64_t generation = 0; // bumped for each call
static job_t *current = NULL;
static int64_t active = 0;    // job indices < active run in this generation
static int64_t remaining = 0; // of those, not finished (index 0 is the caller's)

static void *pool_main(void *arg) {
    const int64_t index = (int64_t)(intptr_t)arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (generation == seen) pthread_cond_wait(&go, &mu);
        seen = generation;
        if (index < active) {
            job_t *job = &current[index];
            pthread_mutex_unlock(&mu);
            run_tasks(job);
            pthread_mutex_lock(&mu);
            if (--remaining == 0) pthread_cond_signal(&finished);
        }
    }
    return NULL;
}

// Returns 0 on success, -1 where memory could not be had (the output is then incomplete; the
// caller raises). Where a thread cannot be started, fewer run.
int paged_decode(const float *q, const float *pool_k, const float *pool_v, const int32_t *tables,
                 const int64_t *ends, const int64_t *q_lens, float *out, int64_t batch,
                 int64_t hq, int64_t nq, int64_t dim, int64_t heads, int64_t blocks, int64_t bs,
                 int64_t width, int64_t window, float scale, int64_t threads) {
    const int64_t tasks = batch * heads;
    if (threads > tasks) threads = tasks;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    pthread_mutex_lock(&mu);
    while (pool_size < threads - 1) {
        pthread_t id;
        if (pthread_create(&id, NULL, pool_main, (void *)(intptr_t)(pool_size + 1)) != 0) break;
        pthread_detach(id);
        pool_size++;
    }
    if (threads > pool_size + 1) threads = pool_size + 1;
    pthread_mutex_unlock(&mu);
    job_t jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++) {
        job_t j = {q,     pool_k, pool_v, tables, ends,   q_lens, out,   batch, hq, nq,
                   dim,   heads,  blocks, bs,     width,  window, scale, t,     threads, 0};
        jobs[t] = j;
    }
    if (threads > 1) {
        pthread_mutex_lock(&mu);
        current = jobs;
        active = threads;
        remaining = threads - 1;
        generation++;
        pthread_cond_broadcast(&go);
        pthread_mutex_unlock(&mu);
    }
    run_tasks(&jobs[0]);
    if (threads > 1) {
        pthread_mutex_lock(&mu);
        while (remaining > 0) pthread_cond_wait(&finished, &mu);
        active = 0;
        current = NULL;
        pthread_mutex_unlock(&mu);
    }
    int failed = 0;
    for (int64_t t = 0; t < threads; t++) failed |= jobs[t].failed;
    return failed ? -1 : 0;
}
