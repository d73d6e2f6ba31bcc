/* kltq K on the cpu backend: what kltq.c and kltq_avx512.c share (see kltq.c). */
#ifndef KV_KLTQ_H
#define KV_KLTQ_H

#include "kvcpu.h"
#include <math.h>

#define KLTQ_BMAX 12 /* the widest code (kvhal.formats.kltq.MAX_BITS) */

typedef struct {
    int32_t H, D, bs, vfmt, isa, threads;
    int64_t krow, vrow;
    const int32_t *start, *width, *off; /* [H][D] bit start, bits, offset of the scaled levels */
    const float *levels;                /* sigma_i * codebook[width_i][...] per coefficient */
    const float *mean, *analysis, *synthesis, *sigma, *books; /* side data of the layer ([H][D], [H][D][D], books [13][4096]) */
    const uint8_t *alloc;
} kltq_layer;

typedef struct {
    const kltq_layer *L;
    const float *q; /* [sum q_lens][Hq][D], coefficient space */
    float *out;
    double *lse;
    const uint8_t *kpool, *vpool;
    const int32_t *block_table, *seq_lens, *q_lens;
    const int64_t *q_start;
    int32_t Hq, max_blocks, causal, window, failed;
    float scale;
} kattn_ctx;

/* the finished rows of one (sequence, KV head) item: each query row r = i * G + g's accumulated output o[r]
 * divided by its softmax sum l[r] (0 where it saw no key), and its log-sum-exp m[r] + log l[r] where asked */
static inline void kltq_write_out(const kattn_ctx *a, int64_t q0, int h, int n_q, int G, int D, const float *o,
                                  const float *m, const float *l) {
    for (int i = 0; i < n_q; i++)
        for (int g = 0; g < G; g++) {
            const int r = i * G + g;
            const int64_t qrow = q0 + i, head = (int64_t)h * G + g;
            const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            float *dst = a->out + (qrow * a->Hq + head) * D;
            for (int d = 0; d < D; d++) dst[d] = o[(size_t)r * D + d] * inv;
            if (a->lse) a->lse[qrow * a->Hq + head] = l[r] > 0.0f ? (double)m[r] + log((double)l[r]) : -INFINITY;
        }
}

/* one (sequence, KV head) item of attention with the AVX-512 kernels (kltq_avx512.c; x86-64 only) */
void kv_kltq_attn_task_avx512(void *ctx, int64_t t, int worker);
/* c[i] = T[i] . y (double) for every coefficient with bits (al[i] > 0; al NULL: every one), D a multiple of 16 */
void kv_kltq_analysis_avx512(const float *T, const double *y, const uint8_t *al, int D, double *c);

/* code[i] = the number of width al[i]'s midpoints (mids + moff[al[i]], +inf padded to 8) below z[i]; 0 where
 * al[i] is 0 */
void kv_kltq_codes_avx512(const double *mids, const int32_t *moff, const double *z, const uint8_t *al, int D,
                          int32_t *code);

#endif
