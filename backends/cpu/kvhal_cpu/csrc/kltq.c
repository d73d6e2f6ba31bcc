/* kltq K and V (kvhal/formats/kltq.py, the spec): store, load and attention over records with side data.
 *
 * A record (one token of one KV head) is a little-endian, LSB-first bit stream: coefficient i of the
 * head takes width[i] bits (its allocation) from bit start[i]. Store: c = T (x - mu) in double, z = c / sigma,
 * code = the number of codebook midpoints below z (numpy's searchsorted, side left). Load: x' = mu + S c'.
 * Attention: the cache hands q already in coefficient space (S^T q) for kltq K; scores are q' . c' with
 * c'_i = levels[off[i] + code_i] (sigma_i times the level, precomputed per layer on the Python side), one
 * online softmax per query row and head. V rows: dequantized by the ISA's row kernel, or for kltq V its
 * decoded coefficients (the cache maps the output back: mean + S o'). K in a block format (kfmt >= 0, with kltq
 * V) is dequantized by the row kernel and scored against q as given. Work items are (sequence, KV head) pairs
 * on the thread pool.
 */
#include <stdlib.h>
#include <string.h>

#include "kltq.h"

int kvc_isa_supported(int isa); /* api.c */

static const kv_isa *kltq_isa(int isa) {
    if (!kvc_isa_supported(isa)) return &kv_isa_scalar;
#if defined(__x86_64__) || defined(_M_X64)
    if (isa == KV_ISA_AVX512 || isa == KV_ISA_AMX) return &kv_isa_avx512;
    if (isa == KV_ISA_AVX2) return &kv_isa_avx2;
#endif
#if defined(__aarch64__)
    if (isa == KV_ISA_NEON) return &kv_isa_neon;
#endif
    return &kv_isa_scalar;
}

/* q . c with 16 independent partial sums (vectorizes without reassociating a single sum) */
static inline float kltq_dot(const float *restrict q, const float *restrict c, int D) {
    float acc[16] = {0};
    int d = 0;
    for (; d + 16 <= D; d += 16)
        for (int e = 0; e < 16; e++) acc[e] += q[d + e] * c[d + e];
    float sum = 0.0f;
    for (; d < D; d++) sum += q[d] * c[d];
    for (int e = 0; e < 16; e++) sum += acc[e];
    return sum;
}

/* -- store ------------------------------------------------------------------------------------------ */

typedef struct {
    const kltq_layer *L;
    const float *x, *v;
    const int64_t *slots;
    uint8_t *pool, *vpool;
    const double *mids, *vmids; /* K's (V's) width b codebook midpoints in double from mids + moff[b], +inf after */
    int32_t moff[KLTQ_BMAX + 2];
} kstore_ctx;

/* the number of midpoints below z (mids ascending): a branch-free binary search; at midpoint lo + step - 1
 * lie the levels lo + step - 1 and lo + step */
KV_INLINE int32_t kltq_search(const double *mids, int b, double z) {
    int32_t lo = 0;
    for (int32_t step = 1 << (b - 1); step; step >>= 1) lo += mids[lo + step - 1] < z ? step : 0;
    return lo;
}

/* head h's record of row x into row (L->krow bytes) */
static void kltq_encode(const kltq_layer *L, const double *mids, const int32_t *moff, int h, const float *x,
                        uint8_t *row) {
    const int D = L->D;
    const float *mu = L->mean + h * D, *T = L->analysis + (int64_t)h * D * D, *sg = L->sigma + h * D;
    const uint8_t *al = L->alloc + h * D;
    double y[512], cs[512];
    for (int j = 0; j < D; j++) y[j] = (double)x[j] - (double)mu[j];
#if defined(__x86_64__) || defined(_M_X64)
    if (kltq_isa(L->isa) == &kv_isa_avx512 && D % 16 == 0)
        kv_kltq_analysis_avx512(T, y, al, D, cs);
    else
#endif
        for (int i = 0; i < D; i++) {
            double c = 0.0;
            if (al[i])
                for (int j = 0; j < D; j++) c += (double)T[i * D + j] * y[j];
            cs[i] = c;
        }
    /* the codes into a local copy of the record (the last write may run 7 bytes past it), then the record */
    uint8_t rec[512 * 12 / 8 + 8];
    memset(rec, 0, (size_t)L->krow + 8);
    double z[512];
    int32_t code[512];
    for (int i = 0; i < D; i++) z[i] = cs[i] / (sg[i] > 0.0f ? (double)sg[i] : 1.0);
#if defined(__x86_64__) || defined(_M_X64)
    if (kltq_isa(L->isa) == &kv_isa_avx512)
        kv_kltq_codes_avx512(mids, moff, z, al, D, code);
    else
#endif
        for (int i = 0; i < D; i++) code[i] = al[i] ? kltq_search(mids + moff[al[i]], al[i], z[i]) : 0;
    /* the codes in order (start[i] is the sum of the widths before i), 32 bits written at a time */
    uint64_t acc = 0;
    int nb = 0;
    uint8_t *p = rec;
    for (int i = 0; i < D; i++) {
        acc |= (uint64_t)code[i] << nb, nb += al[i];
        if (nb >= 32) memcpy(p, &acc, 4), p += 4, acc >>= 32, nb -= 32;
    }
    memcpy(p, &acc, 8);
    memcpy(row, rec, (size_t)L->krow);
}

static void kstore_task(void *ctx, int64_t t, int worker) {
    (void)worker;
    const kstore_ctx *s = (const kstore_ctx *)ctx;
    const kltq_layer *L = s->L;
    const int H = L->H, D = L->D;
    const int64_t n = t / H;
    const int h = (int)(t % H);
    const int64_t r = ((s->slots[n] / L->bs) * H + h) * L->bs + s->slots[n] % L->bs;
    const float *x = s->x + (n * H + h) * D, *v = s->v + (n * H + h) * D;
    if (L->v)
        kltq_encode(L->v, s->vmids, s->moff, h, v, s->vpool + r * L->vrow);
    else
        kltq_isa(L->isa)->quantize(L->vfmt, v, s->vpool + r * L->vrow, D);
    if (L->kfmt >= 0)
        kltq_isa(L->isa)->quantize(L->kfmt, x, s->pool + r * L->krow, D);
    else
        kltq_encode(L, s->mids, s->moff, h, x, s->pool + r * L->krow);
}

/* every width's codebook midpoints of books [13][4096] in double, +inf padded (NULL: out of memory) */
static double *kltq_mids(const float *books, const int32_t *moff) {
    double *mids = (double *)malloc(sizeof(double) * (size_t)moff[KLTQ_BMAX + 1]);
    if (!mids) return NULL;
    for (int b = 0; b <= KLTQ_BMAX; b++) {
        const float *lv = books + b * 4096;
        for (int k = 0; k < moff[b + 1] - moff[b]; k++)
            mids[moff[b] + k] = b && k < (1 << b) - 1 ? ((double)lv[k] + (double)lv[k + 1]) / 2 : INFINITY;
    }
    return mids;
}

KV_EXPORT int kvc_kltq_store(const kltq_layer *L, const float *x, const float *v, const int64_t *slots, int64_t n,
                             uint8_t *kpool, uint8_t *vpool) {
    if (L->D > 512) return -3;
    kstore_ctx c = {L, x, v, slots, kpool, vpool, NULL, NULL, {0}};
    for (int b = 0; b <= KLTQ_BMAX; b++) c.moff[b + 1] = c.moff[b] + (b < 3 ? 8 : 1 << b);
    double *mids = L->kfmt < 0 ? kltq_mids(L->books, c.moff) : NULL, *vmids = L->v ? kltq_mids(L->v->books, c.moff) : NULL;
    if ((L->kfmt < 0 && !mids) || (L->v && !vmids)) {
        free(mids), free(vmids);
        return -2;
    }
    c.mids = mids, c.vmids = vmids;
    kv_pool_run(kstore_task, &c, n * L->H, L->threads);
    free(mids), free(vmids);
    return 0;
}

/* -- load ------------------------------------------------------------------------------------------- */

typedef struct {
    const kltq_layer *L;
    const int64_t *blocks;
    int64_t n;
    const uint8_t *kpool, *vpool;
    float *kout, *vout;
} kload_ctx;

/* head h's record row back to values: mean + S c' (double sums), f32 */
static void kltq_synth(const kltq_layer *L, int h, const uint8_t *row, float *out) {
    const int D = L->D;
    float c[512];
    double cd[512], xs[512];
    kltq_coeffs(L, h, row, c);
    const float *S = L->synthesis + (int64_t)h * D * D, *mu = L->mean + h * D;
    for (int k = 0; k < D; k++) cd[k] = (double)c[k];
#if defined(__x86_64__) || defined(_M_X64)
    if (kltq_isa(L->isa) == &kv_isa_avx512 && D % 16 == 0)
        kv_kltq_analysis_avx512(S, cd, NULL, D, xs); /* the same product: S c' */
    else
#endif
        for (int i = 0; i < D; i++) {
            double acc = 0.0;
            for (int k = 0; k < D; k++) acc += (double)S[i * D + k] * cd[k];
            xs[i] = acc;
        }
    for (int i = 0; i < D; i++) out[i] = (float)(xs[i] + (double)mu[i]);
}

static void kload_task(void *ctx, int64_t t, int worker) {
    (void)worker;
    const kload_ctx *s = (const kload_ctx *)ctx;
    const kltq_layer *L = s->L;
    const int H = L->H, D = L->D;
    const kv_isa *isa = kltq_isa(L->isa);
    for (int64_t j = t * L->bs; j < s->n && j < (t + 1) * L->bs; j++) {
        const int64_t blk = s->blocks[j / L->bs];
        for (int h = 0; h < H; h++) {
            const int64_t r = (blk * H + h) * L->bs + j % L->bs;
            if (L->kfmt >= 0)
                isa->dequantize(L->kfmt, s->kpool + r * L->krow, s->kout + (j * H + h) * D, D);
            else
                kltq_synth(L, h, s->kpool + r * L->krow, s->kout + (j * H + h) * D);
            if (L->v)
                kltq_synth(L->v, h, s->vpool + r * L->vrow, s->vout + (j * H + h) * D);
            else
                isa->dequantize(L->vfmt, s->vpool + r * L->vrow, s->vout + (j * H + h) * D, D);
        }
    }
}

KV_EXPORT int kvc_kltq_load(const kltq_layer *L, const int64_t *blocks, int64_t n, const uint8_t *kpool,
                            const uint8_t *vpool, float *kout, float *vout) {
    if (L->D > 512) return -3;
    kload_ctx c = {L, blocks, n, kpool, vpool, kout, vout};
    kv_pool_run(kload_task, &c, (n + L->bs - 1) / L->bs, L->threads);
    return 0;
}

/* -- attention -------------------------------------------------------------------------------------- */

static void kattn_task(void *ctx, int64_t t, int worker) {
    (void)worker;
    kattn_ctx *a = (kattn_ctx *)ctx;
    const kltq_layer *L = a->L;
    const int H = L->H, D = L->D, G = a->Hq / H;
    const int s = (int)(t / H), h = (int)(t % H);
    const int n_kv = a->seq_lens[s], n_q = a->q_lens[s];
    const int64_t q0 = a->q_start[s];
    const int R = n_q * G; /* (query row, head of the group) pairs */
    if (!R) return;
    const kv_isa *isa = kltq_isa(L->isa);
    float *buf = (float *)malloc(sizeof(float) * ((size_t)R * (D + 2) + 2 * (size_t)D));
    if (!buf) {
        a->failed = 1;
        return;
    }
    float *o = buf, *m = o + (size_t)R * D, *l = m + R, *c = l + R, *v = c + D;
    kltq_state_init(R, D, o, m, l);
    const int hi_all = n_kv - 1; /* the last key any row sees (the last row's own position, causal or not) */
    for (int j = 0; j <= hi_all && j < n_kv; j++) {
        const int32_t blk = a->block_table[(int64_t)s * a->max_blocks + j / L->bs];
        const int64_t row = ((int64_t)blk * H + h) * L->bs + j % L->bs;
        int decoded = 0;
        for (int i = 0; i < n_q; i++) {
            const int pos = n_kv - n_q + i;
            const int hi = a->causal ? pos : n_kv - 1, lo = a->window > 0 ? pos - a->window + 1 : 0;
            if (j > hi || j < lo) continue;
            if (!decoded) {
                if (L->kfmt >= 0)
                    isa->dequantize(L->kfmt, a->kpool + row * L->krow, c, D);
                else
                    kltq_coeffs(L, h, a->kpool + row * L->krow, c);
                kltq_v_row(L, isa, h, a->vpool + row * L->vrow, v);
                decoded = 1;
            }
            for (int g = 0; g < G; g++) {
                const int r = i * G + g;
                const float *qr = a->q + ((q0 + i) * a->Hq + h * G + g) * D;
                const float sc = kltq_dot(qr, c, D) * a->scale;
                float *restrict orow = o + (size_t)r * D;
                const float *restrict vr = v;
                if (sc > m[r]) {
                    const float f = expf(m[r] - sc);
                    l[r] *= f;
                    for (int d = 0; d < D; d++) orow[d] *= f;
                    m[r] = sc;
                }
                const float p = expf(sc - m[r]);
                l[r] += p;
                for (int d = 0; d < D; d++) orow[d] += p * vr[d];
            }
        }
    }
    kltq_write_out(a, q0, h, n_q, G, D, o, m, l);
    free(buf);
}

KV_EXPORT int kvc_kltq_attention(const kltq_layer *L, const float *q, float *out, double *lse, const uint8_t *kpool,
                                 const uint8_t *vpool, const int32_t *block_table, const int32_t *seq_lens,
                                 const int32_t *q_lens, int32_t n_seqs, int32_t max_blocks, int32_t n_heads,
                                 int32_t causal, int32_t window, float scale) {
    if (L->D > 512 || n_heads % L->H) return -3;
    int64_t *q_start = (int64_t *)malloc(sizeof(int64_t) * ((size_t)n_seqs + 1));
    if (!q_start) return -2;
    q_start[0] = 0;
    for (int s = 0; s < n_seqs; s++) q_start[s + 1] = q_start[s] + q_lens[s];
    kattn_ctx c = {L, q, out, lse, kpool, vpool, block_table, seq_lens, q_lens, q_start, n_heads, max_blocks,
                   causal, window, 0, scale};
    kv_task_fn task = kattn_task;
#if defined(__x86_64__) || defined(_M_X64)
    if (kltq_isa(L->isa) == &kv_isa_avx512 && L->D % 16 == 0) task = kv_kltq_attn_task_avx512;
#endif
    kv_pool_run(task, &c, (int64_t)n_seqs * L->H, L->threads);
    free(q_start);
    return c.failed ? -2 : 0;
}

/* -- attention mass --------------------------------------------------------------------------------- */

static void kltq_kdecode(const void *L, int h, const uint8_t *row, float *out) {
    kltq_coeffs((const kltq_layer *)L, h, row, out);
}

/* kvc_attention_mass (api.c) over kltq records: the same driver and per-ISA mass items, each tile's K rows
 * made their coefficients (kltq_coeffs, as attention scores them) and scored against q in coefficient space;
 * lse: kvc_kltq_attention's, which leaves out q . mu as the scores do. total, window as kvc_attention_mass's. */
KV_EXPORT int kvc_kltq_attention_mass(const kltq_layer *L, const float *q, double *lse, const uint8_t *kpool,
                                      const int32_t *block_table, const int32_t *seq_lens, const int32_t *q_lens,
                                      int32_t n_seqs, int32_t max_blocks, int32_t n_heads, int32_t causal,
                                      int32_t window, float scale, int32_t tail, double *total, double *window_out) {
    if (L->D > 512) return -3;
    kv_call c = {n_seqs, n_heads, L->H, L->D, L->bs, max_blocks, KV_F32, L->vfmt, causal, window, L->krow, L->vrow,
                 scale * 1.4426950408889634f, q, NULL, lse, kpool, NULL, block_table, seq_lens, q_lens, NULL, 0, 0,
                 kltq_kdecode, L};
    return kv_attention_mass_run(c, kltq_isa(L->isa), NULL, L->threads, tail, total, window_out);
}
