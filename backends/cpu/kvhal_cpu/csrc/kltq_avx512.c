/* kltq attention with AVX-512 (see kltq.c). Two kernels: keys in lanes (attn_task_t, below; AVX-512 VBMI, heads
 * whose 8-code groups each span <= 8 bytes), else keys one at a time (attn_task: each record's code windows by
 * a byte permute, or a gather without VBMI, per 16 coefficients, levels by permutes or gathers, scores by
 * 16-lane FMAs and horizontal sums). Window loads read up to 127 bytes past a record; the cpu backend pads a
 * kltq K pool by 128 bytes.
 */
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef KLTQ_DEBUG
#include <stdio.h>
#endif

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")
#endif

#include "kltq.h"

#define KLTQ_DMAX 512
#define KLTQ_T 16 /* keys per tile */

/* the 16 horizontal sums of a[0..15] as one vector (lane u: the sum of a[u]), by halving and interleaving */
static inline __m512 sums16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int k = 0; k < 8; k++)
        b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[k], a[k + 8], 0x44), _mm512_shuffle_f32x4(a[k], a[k + 8], 0xEE));
    for (int k = 0; k < 4; k++)
        c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[k], b[k + 4], 0x88), _mm512_shuffle_f32x4(b[k], b[k + 4], 0xDD));
    for (int k = 0; k < 2; k++)
        d[k] = _mm512_add_ps(_mm512_unpacklo_ps(c[k], c[k + 2]), _mm512_unpackhi_ps(c[k], c[k + 2]));
    const __m512 f = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]))));
    /* f holds the sums of keys 0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15 (an involution: the same index sorts it) */
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 13, 14, 12, 7, 5, 6, 4, 11, 9, 10, 8, 3, 1, 2, 0), f);
}

/* e^x for x <= 0 (x = -inf: 0): 2^(x log2 e) as 2^n 2^f, |f| <= 1/2, 2^f by its degree-7 Taylor series
 * (relative error under 2e-8, below f32's) */
static inline __m512 vexp(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* which of the tile's nt keys from j0 on the query row at position pos sees (causal, window) */
static inline __mmask16 tile_vis(const kattn_ctx *a, int j0, int nt, int pos, int n_kv) {
    const __m512i jv = _mm512_add_epi32(_mm512_set1_epi32(j0), _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const int hi = a->causal ? pos : n_kv - 1, lo = a->window > 0 ? pos - a->window + 1 : 0;
    return (__mmask16)((1u << nt) - 1u) & _mm512_cmpge_epi32_mask(jv, _mm512_set1_epi32(lo)) &
           _mm512_cmple_epi32_mask(jv, _mm512_set1_epi32(hi));
}

/* the task for nv = head_dim / 16 vectors; inlined with nv a constant for the usual head_dims (unrolled loops,
 * q and the output row in registers) */
/* One tile of up to 16 keys for one query row: the online softmax over its scaled, masked scores ``sv`` (lanes
 * outside ``vis`` are not seen) and P.V into the row's output ``orow`` (nv vectors of 16), from the tile's
 * decoded V rows ``vt`` (nt rows of D floats, 64-byte aligned); ``*m``, ``*l``: the row's running max and sum. */
static inline __attribute__((always_inline)) void tile_step(__m512 sv, __mmask16 vis, int nt, int nv, int D,
                                                            const float *vt, float *orow, float *m, float *l) {
    __m512 ov[KLTQ_DMAX / 16];
    const float mt = _mm512_mask_reduce_max_ps(vis, sv);
    for (int e = 0; e < nv; e++) ov[e] = _mm512_loadu_ps(orow + 16 * e);
    if (mt > *m) {
        const float f = expf(*m - mt); /* 0 from -inf */
        *l *= f;
        const __m512 fv = _mm512_set1_ps(f);
        for (int e = 0; e < nv; e++) ov[e] = _mm512_mul_ps(ov[e], fv);
        *m = mt;
    }
    const __m512 pv = _mm512_maskz_mov_ps(vis, vexp(_mm512_sub_ps(sv, _mm512_set1_ps(*m))));
    *l += _mm512_reduce_add_ps(pv);
    float pa[16] __attribute__((aligned(64)));
    _mm512_store_ps(pa, pv);
    for (int u = 0; u < nt; u++) {
        const __m512 pu = _mm512_set1_ps(pa[u]);
        const float *v = vt + (size_t)u * D;
        for (int e = 0; e < nv; e++) ov[e] = _mm512_fmadd_ps(pu, _mm512_load_ps(v + 16 * e), ov[e]);
    }
    for (int e = 0; e < nv; e++) _mm512_storeu_ps(orow + 16 * e, ov[e]);
}

/* kltq V rows decoded to their coefficients 16 at a time: each coefficient's 32-bit window (a byte permute of the
 * 64 bytes from the vector's first window with VBMI, else a gather), shifted and masked, then its level: where
 * the vector's widths are all <= 5, a two-register permute of each width's codebook times sigma (the spec's f32
 * product, as the K kernel), else a gather of the scaled levels; width 0 gives 0. The cpu backend pads a kltq V
 * pool as a K pool: window loads read up to 63 bytes past a record. */
typedef struct {
    int32_t boff[KLTQ_DMAX] __attribute__((aligned(64)));
    int32_t sh[KLTQ_DMAX] __attribute__((aligned(64)));
    int32_t mk[KLTQ_DMAX] __attribute__((aligned(64)));
    int32_t of[KLTQ_DMAX] __attribute__((aligned(64)));
    float sg[KLTQ_DMAX] __attribute__((aligned(64)));
    uint8_t bp[KLTQ_DMAX * 4] __attribute__((aligned(64)));
    int nw[KLTQ_DMAX / 16], wl[KLTQ_DMAX / 16][6];
    __mmask16 wm[KLTQ_DMAX / 16][6];
} vplan;

static void vplan_build(vplan *P, const kltq_layer *V, int h) {
    const int D = V->D;
    const int32_t *st = V->start + h * D, *wd = V->width + h * D, *of = V->off + h * D;
    for (int i = 0; i < D; i++) {
        P->boff[i] = st[i] >> 3, P->sh[i] = st[i] & 7, P->mk[i] = (int32_t)((1u << wd[i]) - 1u), P->of[i] = of[i];
        P->sg[i] = wd[i] ? V->sigma[h * D + i] : 0.0f;
    }
    for (int e = 0; e < D / 16; e++) {
        for (int u = 0; u < 16; u++)
            for (int b = 0; b < 4; b++) P->bp[64 * e + 4 * u + b] = (uint8_t)(P->boff[16 * e + u] - P->boff[16 * e] + b);
        int n = 0, covered = 0;
        for (int b = 0; b <= 5; b++) {
            __mmask16 mask = 0;
            for (int u = 0; u < 16; u++)
                if (wd[16 * e + u] == b) mask |= (__mmask16)(1u << u);
            if (mask) P->wl[e][n] = b, P->wm[e][n] = mask, n++, covered += __builtin_popcount(mask);
        }
        P->nw[e] = covered == 16 ? n : 0;
    }
}

static inline __attribute__((always_inline)) void v_decode(const vplan *P, const kltq_layer *V, const uint8_t *rec,
                                                           float *out, int nv, int vbmi) {
    for (int e = 0; e < nv; e++) {
        const __m512i w = vbmi ? _mm512_permutexvar_epi8(_mm512_load_si512(P->bp + 64 * e),
                                                         _mm512_loadu_si512(rec + P->boff[16 * e]))
                               : _mm512_i32gather_epi32(_mm512_load_si512(P->boff + 16 * e), (const void *)rec, 1);
        const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(w, _mm512_load_si512(P->sh + 16 * e)),
                                              _mm512_load_si512(P->mk + 16 * e));
        if (P->nw[e] > 0) {
            __m512 lv = _mm512_setzero_ps();
            for (int k = 0; k < P->nw[e]; k++) {
                const float *bk = V->books + P->wl[e][k] * 4096;
                lv = _mm512_mask_mov_ps(lv, P->wm[e][k],
                                        _mm512_permutex2var_ps(_mm512_loadu_ps(bk), code, _mm512_loadu_ps(bk + 16)));
            }
            _mm512_store_ps(out + 16 * e, _mm512_mul_ps(lv, _mm512_load_ps(P->sg + 16 * e)));
        } else {
            _mm512_store_ps(out + 16 * e, _mm512_i32gather_ps(_mm512_add_epi32(code, _mm512_load_si512(P->of + 16 * e)),
                                                              V->levels, 4));
        }
    }
}

/* v_decode of a tile's nt records rec[u] into rows vt + u D, a vector of 16 coefficients at a time across the keys
 * (its width books loaded once per tile, not once per key) */
static inline __attribute__((always_inline)) void v_decode_tile(const vplan *P, const kltq_layer *V,
                                                                const uint8_t *const *rec, int nt, float *vt, int D,
                                                                int nv) {
    for (int e = 0; e < nv; e++) {
        const __m512i bp = _mm512_load_si512(P->bp + 64 * e), sh = _mm512_load_si512(P->sh + 16 * e);
        const __m512i mk = _mm512_load_si512(P->mk + 16 * e);
        const __m512 sg = _mm512_load_ps(P->sg + 16 * e);
        const int nw = P->nw[e], b0 = P->boff[16 * e];
        if (nw == 0 || nw > 3) {
            for (int u = 0; u < nt; u++) v_decode(P, V, rec[u], vt + (size_t)u * D, nv, 1); /* whole rows: rare */
            return;
        }
        __m512 lo[3], hi[3];
        __mmask16 wm[3];
        for (int k = 0; k < 3; k++) {
            const float *bk = V->books + P->wl[e][k < nw ? k : 0] * 4096;
            lo[k] = _mm512_loadu_ps(bk), hi[k] = _mm512_loadu_ps(bk + 16), wm[k] = k < nw ? P->wm[e][k] : 0;
        }
        for (int u = 0; u < nt; u++) {
            const __m512i w = _mm512_permutexvar_epi8(bp, _mm512_loadu_si512(rec[u] + b0));
            const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(w, sh), mk);
            __m512 lv = _mm512_maskz_permutex2var_ps(wm[0], lo[0], code, hi[0]);
            lv = _mm512_mask_mov_ps(lv, wm[1], _mm512_permutex2var_ps(lo[1], code, hi[1]));
            if (nw == 3) lv = _mm512_mask_mov_ps(lv, wm[2], _mm512_permutex2var_ps(lo[2], code, hi[2]));
            _mm512_store_ps(vt + (size_t)u * D + 16 * e, _mm512_mul_ps(lv, sg));
        }
    }
}

static inline __attribute__((always_inline)) void attn_task(kattn_ctx *a, int64_t t, const int nv) {
    const kltq_layer *L = a->L;
    const int H = L->H, D = L->D, G = a->Hq / H;
    const int s = (int)(t / H), h = (int)(t % H);
    const int n_kv = a->seq_lens[s], n_q = a->q_lens[s];
    const int64_t q0 = a->q_start[s];
    const int R = n_q * G;
    if (!R) return;
    const size_t nbuf = ((size_t)R * (D + 2) + 15) / 16 * 16;
    float *buf = (float *)aligned_alloc(64, sizeof(float) * (nbuf + 2 * (size_t)KLTQ_T * D));
    if (!buf) {
        a->failed = 1;
        return;
    }
    float *o = buf, *m = o + (size_t)R * D, *l = m + R, *ct = buf + nbuf, *vt = ct + (size_t)KLTQ_T * D;
    int32_t boff[KLTQ_DMAX] __attribute__((aligned(64))), sh[KLTQ_DMAX] __attribute__((aligned(64)));
    int32_t mk[KLTQ_DMAX] __attribute__((aligned(64)));
    const int32_t *st = L->start + h * D, *wd = L->width + h * D, *of = L->off + h * D;
    int32_t bo[KLTQ_DMAX] __attribute__((aligned(64)));
    float sg[KLTQ_DMAX] __attribute__((aligned(64)));
    for (int i = 0; i < D; i++) {
        boff[i] = st[i] >> 3, sh[i] = st[i] & 7, mk[i] = (int32_t)((1u << wd[i]) - 1u);
        bo[i] = wd[i] * 4096, sg[i] = wd[i] ? L->sigma[h * D + i] : 0.0f; /* width 0: level 0 of book 0 (zeros) */
    }
    const int vbmi = __builtin_cpu_supports("avx512vbmi");
    vplan vp;
    if (L->v) vplan_build(&vp, L->v, h);
    uint8_t bp[KLTQ_DMAX * 4] __attribute__((aligned(64))); /* per vector: the byte permute of its windows */
    for (int e = 0; e < nv; e++)
        for (int u = 0; u < 16; u++)
            for (int b = 0; b < 4; b++) bp[64 * e + 4 * u + b] = (uint8_t)(boff[16 * e + u] - boff[16 * e] + b);
    /* per vector of 16 coefficients: its distinct widths and their lanes when all are <= 5 (nw > 0), else nw = 0 */
    int nw[KLTQ_DMAX / 16], wl[KLTQ_DMAX / 16][6];
    __mmask16 wm[KLTQ_DMAX / 16][6];
    for (int e = 0; e < nv; e++) {
        nw[e] = 0;
        for (int b = 0; b <= 5; b++) {
            __mmask16 mask = 0;
            for (int u = 0; u < 16; u++)
                if (wd[16 * e + u] == b) mask |= (__mmask16)(1u << u);
            if (mask) wl[e][nw[e]] = b, wm[e][nw[e]] = mask, nw[e]++;
        }
        int covered = 0;
        for (int k = 0; k < nw[e]; k++) covered += __builtin_popcount(wm[e][k]);
        if (covered != 16) nw[e] = 0;
    }
    kltq_state_init(R, D, o, m, l);
    const int hi_all = n_kv - 1; /* the last key any row sees (the last row's own position, causal or not) */
    const kv_isa *isa = &kv_isa_avx512;
    /* tiles of KLTQ_T keys: every record's gathers first (independent, so their latencies overlap), the next
     * tile's records and V rows prefetched, then the scores and the output rows key by key */
    for (int j0 = 0; j0 <= hi_all && j0 < n_kv; j0 += KLTQ_T) {
        const int nt = (hi_all + 1 - j0 < KLTQ_T ? hi_all + 1 - j0 : KLTQ_T);
        const uint8_t *vrec[KLTQ_T];
        for (int u = 0; u < nt; u++) {
            const int j = j0 + u;
            const int32_t blk = a->block_table[(int64_t)s * a->max_blocks + j / L->bs];
            const int64_t row = ((int64_t)blk * H + h) * L->bs + j % L->bs;
            const int jn = j + KLTQ_T;
            if (jn <= hi_all) {
                const int32_t bn = a->block_table[(int64_t)s * a->max_blocks + jn / L->bs];
                const int64_t rn = ((int64_t)bn * H + h) * L->bs + jn % L->bs;
                _mm_prefetch((const char *)(a->kpool + rn * L->krow), _MM_HINT_T0);
                for (int64_t b = 0; b < L->vrow; b += 64) _mm_prefetch((const char *)(a->vpool + rn * L->vrow + b), _MM_HINT_T0);
            }
            const uint8_t *rec = a->kpool + row * L->krow;
            float *cu = ct + (size_t)u * D;
            if (L->kfmt >= 0) { /* K in a block format beside kltq V: its row kernel, scored against q */
                isa->dequantize(L->kfmt, rec, cu, D);
            } else {
#ifdef KLTQ_SCALAR_DECODE
                for (int i = 0; i < D; i++) {
                    uint32_t w;
                    memcpy(&w, rec + boff[i], 4);
                    cu[i] = L->levels[of[i] + ((w >> sh[i]) & (uint32_t)mk[i])];
                }
                if (0)
#endif
                for (int e = 0; e < nv; e++) {
                    /* each coefficient's 32-bit window: one byte permute of the 64 bytes from the vector's first
                     * window (16 coefficients of <= 12 bits span <= 27 bytes), or a gather without VBMI */
                    const __m512i w = vbmi ? _mm512_permutexvar_epi8(_mm512_load_si512(bp + 64 * e),
                                                                     _mm512_loadu_si512(rec + boff[16 * e]))
                                           : _mm512_i32gather_epi32(_mm512_load_si512(boff + 16 * e), (const void *)rec, 1);
                    const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(w, _mm512_load_si512(sh + 16 * e)),
                                                          _mm512_load_si512(mk + 16 * e));
                    /* the level from the layer's codebook of the coefficient's width, times its sigma (the spec's f32
                     * product): widths <= 5 (32 levels) by a two-register permute per width in the vector, else a gather */
                    __m512 lv;
                    if (nw[e] > 0) {
                        lv = _mm512_setzero_ps();
                        for (int k = 0; k < nw[e]; k++) {
                            const float *bk = L->books + wl[e][k] * 4096;
                            lv = _mm512_mask_mov_ps(lv, wm[e][k],
                                                    _mm512_permutex2var_ps(_mm512_loadu_ps(bk), code, _mm512_loadu_ps(bk + 16)));
                        }
                    } else {
                        lv = _mm512_i32gather_ps(_mm512_add_epi32(code, _mm512_load_si512(bo + 16 * e)), L->books, 4);
                    }
                    _mm512_store_ps(cu + 16 * e, _mm512_mul_ps(lv, _mm512_load_ps(sg + 16 * e)));
                }
            }
            if (L->vfmt == KV_Q8_0) { /* ggml's q8_0 inline: {f16 d; int8 q[32]} -> d * q */
                const uint8_t *vb = a->vpool + row * L->vrow;
                float *vu = vt + (size_t)u * D;
                for (int blk = 0; blk < nv / 2; blk++) {
                    uint16_t dh;
                    memcpy(&dh, vb + 34 * blk, 2);
                    const __m512 d = _mm512_set1_ps(_cvtsh_ss(dh));
                    for (int half = 0; half < 2; half++) {
                        const __m128i q = _mm_loadu_si128((const __m128i *)(vb + 34 * blk + 2 + 16 * half));
                        _mm512_store_ps(vu + 32 * blk + 16 * half, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d));
                    }
                }
            } else {
                if (L->v) {
                    vrec[u] = a->vpool + row * L->vrow;
                    if (!vbmi) v_decode(&vp, L->v, vrec[u], vt + (size_t)u * D, nv, 0);
                } else
                    isa->dequantize(L->vfmt, a->vpool + row * L->vrow, vt + (size_t)u * D, D);
            }
        }
        if (L->v && vbmi) v_decode_tile(&vp, L->v, vrec, nt, vt, D, nv);
        if (nt < KLTQ_T) memset(ct + (size_t)nt * D, 0, sizeof(float) * (size_t)(KLTQ_T - nt) * D);
        /* per query row and head: the tile's scores in one vector, one rescale, one vector exp */
        for (int i = 0; i < n_q; i++) {
            const __mmask16 vis = tile_vis(a, j0, nt, n_kv - n_q + i, n_kv);
            if (!vis) continue;
            for (int g = 0; g < G; g++) {
                const int r = i * G + g;
                const float *qr = a->q + ((q0 + i) * a->Hq + h * G + g) * D;
                __m512 qv[KLTQ_DMAX / 16];
                for (int e = 0; e < nv; e++) qv[e] = _mm512_loadu_ps(qr + 16 * e);
                __m512 acc[16];
                for (int u = 0; u < 16; u++) {
                    const float *c = ct + (size_t)u * D; /* rows past nt hold zeros */
                    acc[u] = _mm512_mul_ps(qv[0], _mm512_load_ps(c));
                    for (int e = 1; e < nv; e++) acc[u] = _mm512_fmadd_ps(qv[e], _mm512_load_ps(c + 16 * e), acc[u]);
                }
                const __m512 sv = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), vis, sums16(acc), _mm512_set1_ps(a->scale));
                tile_step(sv, vis, nt, nv, D, vt, o + (size_t)r * D, &m[r], &l[r]);
            }
        }
    }
    kltq_write_out(a, q0, h, n_q, G, D, o, m, l);
    free(buf);
}

/* -- the token-lane path: lanes are 16 keys, one coefficient at a time ---------------------------------
 * Every key of a head has the same bit layout, so a coefficient's level table is the same in all 16 lanes: a
 * tile's codes become bytes (one two-register byte permute, one multishift and one mask per 64 coefficients of a
 * record: each qword of 8 codes from the <= 8 bytes they span), a 16x16 dword transpose turns them into one
 * vector per 4 coefficients (lane u: key u's 4 code bytes), and each coefficient's 16 levels are one permute of
 * its 32-entry scaled table (widths <= 5), two and a blend (6), or a gather (7, 8); a score row is then
 * sum_i q_i * level_i, 16 keys per FMA, with no horizontal sums. Codes over 8 bits are read one key at a time.
 * A head whose 8-code groups span more than 8 bytes (wide budgets) takes attn_task above. */

#define KLTQ_RB 8 /* score rows per pass (registers) */

typedef struct {
    int ok, nch, nA, nB, nC, nW;
    int32_t base[KLTQ_DMAX / 64];
    uint8_t idx[KLTQ_DMAX / 64][64], shf[KLTQ_DMAX / 64][64], msk[KLTQ_DMAX / 64][64];
    int16_t A[KLTQ_DMAX], B[KLTQ_DMAX], C[KLTQ_DMAX], W[KLTQ_DMAX]; /* coefficients by lookup kind */
} tplan;

static void tplan_build(tplan *P, const int32_t *st, const int32_t *wd, int D) {
    P->ok = 0, P->nch = (D + 63) / 64, P->nA = P->nB = P->nC = P->nW = 0;
    memset(P->idx, 0, sizeof P->idx), memset(P->shf, 0, sizeof P->shf), memset(P->msk, 0, sizeof P->msk);
    for (int c = 0; c < P->nch; c++) {
        P->base[c] = st[64 * c] >> 3;
        for (int q = 0; q < 8 && 64 * c + 8 * q < D; q++) {
            int lo = -1, hi = -1;
            for (int k = 8 * (8 * c + q); k < 8 * (8 * c + q) + 8 && k < D; k++)
                if (wd[k] > 0 && wd[k] <= 8) {
                    if (lo < 0) lo = st[k] >> 3;
                    hi = (st[k] + wd[k] - 1) >> 3;
                }
            if (lo < 0) continue;
            if (hi - lo >= 8 || lo - P->base[c] + 7 >= 128) return;
            for (int b = 0; b < 8; b++) P->idx[c][8 * q + b] = (uint8_t)(lo - P->base[c] + b);
            for (int k = 8 * (8 * c + q); k < 8 * (8 * c + q) + 8 && k < D; k++)
                if (wd[k] > 0 && wd[k] <= 8)
                    P->shf[c][k - 64 * c] = (uint8_t)(st[k] - 8 * lo), P->msk[c][k - 64 * c] = (uint8_t)((1u << wd[k]) - 1u);
        }
    }
    for (int i = 0; i < D; i++) {
        if (wd[i] <= 5)
            P->A[P->nA++] = (int16_t)i; /* width 0: code 0 of a zero table */
        else if (wd[i] == 6)
            P->B[P->nB++] = (int16_t)i;
        else if (wd[i] <= 8)
            P->C[P->nC++] = (int16_t)i;
        else
            P->W[P->nW++] = (int16_t)i;
    }
    P->ok = 1;
}

/* 16 rows of 16 dwords transposed in place */
static inline void transpose16(__m512i *r) {
    __m512i t[16];
    for (int k = 0; k < 8; k++) t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]), t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 2; b++) {
            r[4 * k + 2 * b] = _mm512_unpacklo_epi64(t[4 * k + b], t[4 * k + 2 + b]);
            r[4 * k + 2 * b + 1] = _mm512_unpackhi_epi64(t[4 * k + b], t[4 * k + 2 + b]);
        }
    /* r[4k + m] lane-block L: rows 4k..4k+3 of columns 4L + m */
    for (int k = 0; k < 2; k++)
        for (int m = 0; m < 4; m++) {
            t[8 * k + m] = _mm512_shuffle_i32x4(r[8 * k + m], r[8 * k + 4 + m], 0x88);
            t[8 * k + 4 + m] = _mm512_shuffle_i32x4(r[8 * k + m], r[8 * k + 4 + m], 0xDD);
        }
    for (int m = 0; m < 4; m++) {
        r[m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0x88);
        r[8 + m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0xDD);
        r[4 + m] = _mm512_shuffle_i32x4(t[4 + m], t[12 + m], 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(t[4 + m], t[12 + m], 0xDD);
    }
}

/* the 16-key score vectors of nr rows (q rows qp[0..nr-1]) from the tile's transposed codes ct */
static inline __attribute__((always_inline)) void score_rows(const tplan *P, const int32_t *ct, const int32_t *wc,
                                                             const float *tab, const float *lvl, const int32_t *of,
                                                             const float *const *qp, const int nr, __m512 *out) {
    __m512 a0[KLTQ_RB], a1[KLTQ_RB];
    for (int r = 0; r < nr; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    int n = 0;
    for (; n + 2 <= P->nA; n += 2) {
        const int i = P->A[n], j = P->A[n + 1];
        const __m512i x = _mm512_srli_epi32(_mm512_load_si512(ct + 16 * (i >> 2)), 8 * (i & 3));
        const __m512i y = _mm512_srli_epi32(_mm512_load_si512(ct + 16 * (j >> 2)), 8 * (j & 3));
        const __m512 lx = _mm512_permutex2var_ps(_mm512_load_ps(tab + 32 * i), x, _mm512_load_ps(tab + 32 * i + 16));
        const __m512 ly = _mm512_permutex2var_ps(_mm512_load_ps(tab + 32 * j), y, _mm512_load_ps(tab + 32 * j + 16));
        for (int r = 0; r < nr; r++) {
            a0[r] = _mm512_fmadd_ps(lx, _mm512_set1_ps(qp[r][i]), a0[r]);
            a1[r] = _mm512_fmadd_ps(ly, _mm512_set1_ps(qp[r][j]), a1[r]);
        }
    }
    for (; n < P->nA; n++) {
        const int i = P->A[n];
        const __m512i x = _mm512_srli_epi32(_mm512_load_si512(ct + 16 * (i >> 2)), 8 * (i & 3));
        const __m512 lx = _mm512_permutex2var_ps(_mm512_load_ps(tab + 32 * i), x, _mm512_load_ps(tab + 32 * i + 16));
        for (int r = 0; r < nr; r++) a0[r] = _mm512_fmadd_ps(lx, _mm512_set1_ps(qp[r][i]), a0[r]);
    }
    for (n = 0; n < P->nB; n++) {
        const int i = P->B[n];
        const float *t = lvl + of[i];
        const __m512i x = _mm512_srli_epi32(_mm512_load_si512(ct + 16 * (i >> 2)), 8 * (i & 3));
        const __m512 lo = _mm512_permutex2var_ps(_mm512_loadu_ps(t), x, _mm512_loadu_ps(t + 16));
        const __m512 hi = _mm512_permutex2var_ps(_mm512_loadu_ps(t + 32), x, _mm512_loadu_ps(t + 48));
        const __m512 lx = _mm512_mask_blend_ps(_mm512_test_epi32_mask(x, _mm512_set1_epi32(32)), lo, hi);
        for (int r = 0; r < nr; r++) a1[r] = _mm512_fmadd_ps(lx, _mm512_set1_ps(qp[r][i]), a1[r]);
    }
    for (n = 0; n < P->nC; n++) {
        const int i = P->C[n];
        const __m512i x = _mm512_and_si512(_mm512_srli_epi32(_mm512_load_si512(ct + 16 * (i >> 2)), 8 * (i & 3)),
                                           _mm512_set1_epi32(255));
        const __m512 lx = _mm512_i32gather_ps(x, lvl + of[i], 4);
        for (int r = 0; r < nr; r++) a0[r] = _mm512_fmadd_ps(lx, _mm512_set1_ps(qp[r][i]), a0[r]);
    }
    for (n = 0; n < P->nW; n++) {
        const int i = P->W[n];
        const __m512 lx = _mm512_i32gather_ps(_mm512_load_si512(wc + 16 * n), lvl + of[i], 4);
        for (int r = 0; r < nr; r++) a1[r] = _mm512_fmadd_ps(lx, _mm512_set1_ps(qp[r][i]), a1[r]);
    }
    for (int r = 0; r < nr; r++) out[r] = _mm512_add_ps(a0[r], a1[r]);
}

/* the pool row of sequence s's key j in head h */
static inline int64_t kltq_row(const kattn_ctx *a, const kltq_layer *L, int s, int h, int j) {
    const int32_t blk = a->block_table[(int64_t)s * a->max_blocks + j / L->bs];
    return ((int64_t)blk * L->H + h) * L->bs + j % L->bs;
}

static inline __attribute__((always_inline)) void attn_task_t(kattn_ctx *a, int64_t t, const tplan *P, const int nv) {
    const kltq_layer *L = a->L;
    const int H = L->H, D = L->D, G = a->Hq / H;
    const int s = (int)(t / H), h = (int)(t % H);
    const int n_kv = a->seq_lens[s], n_q = a->q_lens[s];
    const int64_t q0 = a->q_start[s];
    const int R = n_q * G;
    if (!R) return;
    const int Dp = P->nch * 64;
    /* o [R][D], m, l [R], scores [R][16], V tile [16][D], codes [Dp/4][16], wide codes [nW][16], tables [D][32] */
    const size_t no = ((size_t)R * (D + 2) + 15) / 16 * 16, nsc = (size_t)R * 16, nvt = (size_t)KLTQ_T * D;
    const size_t nct = (size_t)Dp / 4 * 16, nwc = (size_t)P->nW * 16, ntab = (size_t)D * 32;
    float *buf = (float *)aligned_alloc(64, sizeof(float) * (no + nsc + nvt + nct + nwc + ntab));
    if (!buf) {
        a->failed = 1;
        return;
    }
    float *o = buf, *m = o + (size_t)R * D, *l = m + R, *sc = buf + no, *vt = sc + nsc;
    int32_t *ct = (int32_t *)(vt + nvt), *wc = ct + nct;
    float *tab = (float *)(wc + nwc);
    vplan vp;
    if (L->v) vplan_build(&vp, L->v, h);
    const int32_t *st = L->start + h * D, *wd = L->width + h * D, *of = L->off + h * D;
    memset(tab, 0, sizeof(float) * ntab);
    for (int i = 0; i < D; i++)
        if (wd[i] > 0 && wd[i] <= 5) memcpy(tab + 32 * i, L->levels + of[i], sizeof(float) << wd[i]);
    kltq_state_init(R, D, o, m, l);
    const int hi_all = n_kv - 1; /* the last key any row sees (the last row's own position, causal or not) */
    const kv_isa *isa = &kv_isa_avx512;
    const float **qp = (const float **)malloc(sizeof(float *) * (size_t)R);
    if (!qp) {
        free(buf);
        a->failed = 1;
        return;
    }
    for (int i = 0; i < n_q; i++)
        for (int g = 0; g < G; g++) qp[i * G + g] = a->q + ((q0 + i) * a->Hq + h * G + g) * D;
    for (int j0 = 0; j0 <= hi_all && j0 < n_kv; j0 += KLTQ_T) {
        const int nt = (hi_all + 1 - j0 < KLTQ_T ? hi_all + 1 - j0 : KLTQ_T);
        const uint8_t *rec[KLTQ_T], *vrec[KLTQ_T];
        /* where blocks hold whole tiles (block size a multiple of 16): one block lookup per tile and its next */
        const int whole = L->bs % KLTQ_T == 0;
        const int64_t row0 = whole ? kltq_row(a, L, s, h, j0) : 0;
        const int64_t rn0 = whole && j0 + KLTQ_T <= hi_all ? kltq_row(a, L, s, h, j0 + KLTQ_T) : 0;
        for (int u = 0; u < KLTQ_T; u++) {
            const int j = j0 + (u < nt ? u : 0); /* keys past the tile: key j0 again, masked off below */
            const int64_t row = whole ? row0 + (j - j0) : kltq_row(a, L, s, h, j);
            rec[u] = a->kpool + row * L->krow, vrec[u] = a->vpool + row * L->vrow;
            const int jn = j + KLTQ_T;
            if (u < nt && jn <= hi_all) {
                const int64_t rn = whole ? rn0 + u : kltq_row(a, L, s, h, jn);
                _mm_prefetch((const char *)(a->kpool + rn * L->krow), _MM_HINT_T0);
                for (int64_t b = 0; b < L->vrow; b += 64) _mm_prefetch((const char *)(a->vpool + rn * L->vrow + b), _MM_HINT_T0);
            }
            if (u >= nt) continue;
            const uint8_t *vb = a->vpool + row * L->vrow;
            float *vu = vt + (size_t)u * D;
            if (L->vfmt == KV_Q8_0) { /* ggml's q8_0 inline: {f16 d; int8 q[32]} -> d * q */
                for (int b = 0; b < nv / 2; b++) {
                    uint16_t dh;
                    memcpy(&dh, vb + 34 * b, 2);
                    const __m512 d = _mm512_set1_ps(_cvtsh_ss(dh));
                    for (int half = 0; half < 2; half++) {
                        const __m128i q = _mm_loadu_si128((const __m128i *)(vb + 34 * b + 2 + 16 * half));
                        _mm512_store_ps(vu + 32 * b + 16 * half, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d));
                    }
                }
            } else if (!L->v) {
                isa->dequantize(L->vfmt, vb, vu, D);
            }
        }
        if (L->v) v_decode_tile(&vp, L->v, vrec, nt, vt, D, nv);
        for (int c = 0; c < P->nch; c++) {
            const __m512i ix = _mm512_load_si512(P->idx[c]), sh = _mm512_load_si512(P->shf[c]), mk = _mm512_load_si512(P->msk[c]);
            __m512i r[16];
            for (int u = 0; u < 16; u++) {
                const uint8_t *p = rec[u] + P->base[c];
                const __m512i w = _mm512_permutex2var_epi8(_mm512_loadu_si512(p), ix, _mm512_loadu_si512(p + 64));
                r[u] = _mm512_and_si512(_mm512_multishift_epi64_epi8(sh, w), mk);
            }
            transpose16(r);
            for (int k = 0; k < 16; k++) _mm512_store_si512(ct + 256 * c + 16 * k, r[k]);
        }
        for (int n = 0; n < P->nW; n++) {
            const int i = P->W[n];
            for (int u = 0; u < 16; u++) {
                uint32_t w;
                memcpy(&w, rec[u] + (st[i] >> 3), 4);
                wc[16 * n + u] = (int32_t)((w >> (st[i] & 7)) & ((1u << wd[i]) - 1u));
            }
        }
        for (int r0 = 0; r0 < R; r0 += KLTQ_RB) {
            const int nr = R - r0 < KLTQ_RB ? R - r0 : KLTQ_RB;
            __m512 sv[KLTQ_RB];
            switch (nr) {
            case 1: score_rows(P, ct, wc, tab, L->levels, of, qp + r0, 1, sv); break;
            case 2: score_rows(P, ct, wc, tab, L->levels, of, qp + r0, 2, sv); break;
            case 4: score_rows(P, ct, wc, tab, L->levels, of, qp + r0, 4, sv); break;
            case 8: score_rows(P, ct, wc, tab, L->levels, of, qp + r0, 8, sv); break;
            default: score_rows(P, ct, wc, tab, L->levels, of, qp + r0, nr, sv);
            }
            for (int r = 0; r < nr; r++) _mm512_store_ps(sc + 16 * (size_t)(r0 + r), sv[r]);
        }
        for (int i = 0; i < n_q; i++) {
            const __mmask16 vis = tile_vis(a, j0, nt, n_kv - n_q + i, n_kv);
            if (!vis) continue;
            for (int g = 0; g < G; g++) {
                const int r = i * G + g;
                const __m512 svr = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), vis, _mm512_load_ps(sc + 16 * (size_t)r),
                                                      _mm512_set1_ps(a->scale));
                tile_step(svr, vis, nt, nv, D, vt, o + (size_t)r * D, &m[r], &l[r]);
            }
        }
    }
    kltq_write_out(a, q0, h, n_q, G, D, o, m, l);
    free(qp);
    free(buf);
}

void kv_kltq_analysis_avx512(const float *T, const double *y, const uint8_t *al, int D, double *c) {
    for (int i = 0; i < D; i++) {
        if (al && !al[i]) {
            c[i] = 0.0;
            continue;
        }
        const float *ti = T + (int64_t)i * D;
        __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
        for (int j = 0; j < D; j += 16) {
            a0 = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(ti + j)), _mm512_loadu_pd(y + j), a0);
            a1 = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(ti + j + 8)), _mm512_loadu_pd(y + j + 8), a1);
        }
        c[i] = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
    }
}

void kv_kltq_codes_avx512(const double *mids, const int32_t *moff, const double *z, const uint8_t *al, int D,
                          int32_t *code) {
    for (int i = 0; i < D; i++) {
        const int b = al[i];
        const double *m = mids + moff[b];
        if (b <= 7) { /* count the midpoints below z, 8 per compare (width 0: a table of +inf, 0) */
            const __m512d zv = _mm512_set1_pd(z[i]);
            int n = 0;
            for (int k = 0; k < moff[b + 1] - moff[b]; k += 8)
                n += __builtin_popcount(_mm512_cmp_pd_mask(_mm512_loadu_pd(m + k), zv, _CMP_LT_OQ));
            code[i] = n;
        } else {
            int32_t lo = 0;
            for (int32_t step = 1 << (b - 1); step; step >>= 1) lo += m[lo + step - 1] < z[i] ? step : 0;
            code[i] = lo;
        }
    }
}

void kv_kltq_attn_task_avx512(void *ctx, int64_t t, int worker) {
    (void)worker;
    kattn_ctx *a = (kattn_ctx *)ctx;
    if (__builtin_cpu_supports("avx512vbmi") && a->L->kfmt < 0) { /* keys in lanes: kltq K only */
        const kltq_layer *L = a->L;
        const int h = (int)(t % L->H);
        tplan *P = (tplan *)aligned_alloc(64, (sizeof(tplan) + 63) / 64 * 64);
        if (!P) {
            a->failed = 1;
            return;
        }
        tplan_build(P, L->start + h * L->D, L->width + h * L->D, L->D);
        if (P->ok) {
            switch (L->D) {
            case 64: attn_task_t(a, t, P, 4); break;
            case 128: attn_task_t(a, t, P, 8); break;
            case 256: attn_task_t(a, t, P, 16); break;
            default: attn_task_t(a, t, P, L->D / 16);
            }
            free(P);
            return;
        }
#ifdef KLTQ_DEBUG
        fprintf(stderr, "fallback h%d\n", h);
#endif
        free(P);
    }
    switch (a->L->D) {
    case 64: attn_task(a, t, 4); break;
    case 128: attn_task(a, t, 8); break;
    case 256: attn_task(a, t, 16); break;
    default: attn_task(a, t, a->L->D / 16);
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
