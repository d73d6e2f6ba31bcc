/* kltq K and V on the cpu backend: what kltq.c and kltq_avx512.c share (see kltq.c). */
#ifndef KV_KLTQ_H
#define KV_KLTQ_H

#include "kvcpu.h"
#include <math.h>
#include <string.h>

#define KLTQ_BMAX 12 /* the widest code (kvhal.formats.kltq.MAX_BITS) */

/* one layer's kltq side data and call settings; the K side's fields describe K's records (krow bytes each) unless
 * kfmt >= 0 (K in that block format, its side fields unused); v: V's kltq side (a kltq_layer whose krow is V's record
 * bytes), NULL where V is in the block format vfmt */
typedef struct kltq_layer {
    int32_t H, D, bs, vfmt, isa, threads;
    int64_t krow, vrow;
    const int32_t *start, *width, *off; /* [H][D] bit start, bits, offset of the scaled levels */
    const float *levels;                /* sigma_i * codebook[width_i][...] per coefficient */
    const float *mean, *analysis, *synthesis, *sigma, *books; /* side data of the layer ([H][D], [H][D][D], books [13][4096]) */
    const uint8_t *alloc;
    int32_t kfmt;
    const struct kltq_layer *v;
} kltq_layer;

static inline uint32_t kltq_code(const uint8_t *row, int64_t nbytes, int32_t start, int32_t width) {
    if (!width) return 0;
    const int64_t byte = start >> 3;
    uint32_t w = 0;
    if (byte + 4 <= nbytes)
        memcpy(&w, row + byte, 4);
    else
        for (int64_t b = byte; b < nbytes; b++) w |= (uint32_t)row[b] << (8 * (b - byte));
    return (w >> (start & 7)) & ((1u << width) - 1u);
}

/* the decoded coefficients c'_i = levels[off_i + code_i] of head h's record row (L->krow bytes; reads inside it) */
static inline void kltq_coeffs(const kltq_layer *L, int h, const uint8_t *restrict row, float *restrict c) {
    const int D = L->D;
    const int64_t krow = L->krow;
    const int32_t *restrict st = L->start + h * D, *restrict wd = L->width + h * D, *restrict of = L->off + h * D;
    const float *restrict lv = L->levels;
    int i = 0;
    /* coefficients whose 4-byte window lies inside the record: branch-free (starts ascend with i) */
    for (; i < D && (st[i] >> 3) + 4 <= krow; i++) {
        uint32_t w;
        memcpy(&w, row + (st[i] >> 3), 4);
        c[i] = lv[of[i] + ((w >> (st[i] & 7)) & ((1u << wd[i]) - 1u))];
    }
    for (; i < D; i++) c[i] = lv[of[i] + kltq_code(row, krow, st[i], wd[i])];
}

/* one V row of head h as attention weighs it: a kltq V record's decoded coefficients (the cache maps the output
 * back to values), else the block format's dequantized values */
static inline void kltq_v_row(const kltq_layer *L, const kv_isa *isa, int h, const uint8_t *row, float *out) {
    if (L->v)
        kltq_coeffs(L->v, h, row, out);
    else
        isa->dequantize(L->vfmt, row, out, L->D);
}

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

/* an item's online-softmax state before its first key: no output, running max -inf, sum 0 per query row */
static inline void kltq_state_init(int R, int D, float *o, float *m, float *l) {
    for (int r = 0; r < R; r++) m[r] = -INFINITY, l[r] = 0.0f;
    memset(o, 0, sizeof(float) * (size_t)R * D);
}

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
