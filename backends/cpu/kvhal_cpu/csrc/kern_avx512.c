/* AVX-512 (F, BW, VL, DQ) + VNNI kernels: Ice Lake / Sapphire Rapids / Zen 4 and later.
 *
 * Float formats (f32, f16, bf16) run the shared template's driver with blocked f32 K and V tile kernels
 * (k_tile_float_512 / v_tile_float_512 below: F16C or a bf16 shift, FMA). Quantized formats run integer kernels
 * (kern_avx512_int.h): q is quantized to 16 bits per row and K.q is done with VPDPBUSD on the stored
 * nibbles/bytes, P.V with VPDPWSSD on 16-bit weights, so no f32 copy of K or V is ever made. */
/* 64-token tiles: the per-tile work (softmax reductions, scale and weight quantization, output
 * accumulation, row pointers) is halved per token, ~8% faster decode than 32; the int16 weights then
 * share one scale over 64 tokens, which raised the worst contract-case error from 1.5e-4 to 1.65e-4
 * (tolerance 5e-4). Defined before any include: kvcpu.h reads it. kern_avx512_t128.c builds this file
 * again with 128-token tiles. */
#ifndef KV_T
#define KV_T 64
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <string.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#endif

#include "half.h"

#ifndef FN
#define FN(x) x##_avx512
#endif
#define ISA_NAME "avx512"

#include "simd_avx2.h"

typedef __m512 VF;
#define VL 16
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vfma _mm512_fmadd_ps
#define vmax _mm512_max_ps
#define vhsum _mm512_reduce_add_ps
#define vhmax _mm512_reduce_max_ps
#define vexp2 kv_exp2_512

/* 2^x for x <= 0; x < -126 (and -inf) give exactly 0, NaN gives NaN (as kv_exp2_256) */
static inline __m512 kv_exp2_512(__m512 x) {
    __m512 lim = _mm512_set1_ps(-126.0f);
    __mmask16 live = _mm512_cmp_ps_mask(x, lim, _CMP_NLT_UQ);
    x = _mm512_max_ps(lim, x);
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = KV_EXP2_POLY(f, _mm512_fmadd_ps, _mm512_set1_ps);
    return _mm512_maskz_scalef_ps(live, p, n);
}

#define F16_TO_F32(src, dst, n) kv_f16_to_f32_row_f16c(src, dst, n)
#define F32_TO_F16(src, dst, n) kv_f32_to_f16_row_f16c(src, dst, n)
#define F32_TO_F16_1(x) ((uint16_t)_cvtss_sh((x), _MM_FROUND_TO_NEAREST_INT))

#include "kern_avx512_int.h"
#include "kern_avx512_decode.h"

/* q8_0 / q4_0 rows, 16 lanes at a time, bit-exact with the template's scalar loops (same operations in
 * the same order: x*id, exact roundf via trunc and the exact fraction, trunc(x*id + 8.5)) */
static inline float kv512_inv(float d) { /* the template's inverse(): d ? 1/d : 0, 0 when 1/d overflows */
    float id = 1.0f / d;
    return (d == 0.0f || !isfinite(id)) ? 0.0f : id;
}

static int quant_row_512(int fmt, const float *x, uint8_t *y, int d) {
    if (fmt != KV_Q8_0 && fmt != KV_Q4_0) return 0;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int b = 0; b < d / KV_QK; b++, x += KV_QK) {
        __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        __m512 a0 = _mm512_andnot_ps(sign, x0), a1 = _mm512_andnot_ps(sign, x1);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        if (fmt == KV_Q8_0) {
            float dd = amax / 127.0f, id = kv512_inv(dd);
            uint16_t h = (uint16_t)_cvtss_sh(dd, _MM_FROUND_TO_NEAREST_INT);
            memcpy(y, &h, 2);
            __m512 vid = _mm512_set1_ps(id);
            for (int half = 0; half < 2; half++) {
                __m512 v = _mm512_mul_ps(half ? x1 : x0, vid), av = _mm512_andnot_ps(sign, v);
                __m512i r = _mm512_cvttps_epi32(av);
                __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(av, _mm512_cvtepi32_ps(r)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
                r = _mm512_mask_add_epi32(r, up, r, _mm512_set1_epi32(1));
                __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
                r = _mm512_mask_sub_epi32(r, neg, _mm512_setzero_si512(), r);
                _mm_storeu_si128((__m128i *)(void *)(y + 2 + 16 * half), _mm512_cvtepi32_epi8(r));
            }
            y += KV_Q8_0_BYTES;
        } else {
            /* ggml's signed max: the first value of largest magnitude; +0.0 when all are zero */
            __mmask32 hit = (__mmask32)_mm512_cmp_ps_mask(a0, _mm512_set1_ps(amax), _CMP_EQ_OQ) |
                            ((__mmask32)_mm512_cmp_ps_mask(a1, _mm512_set1_ps(amax), _CMP_EQ_OQ) << 16);
            float mx = amax > 0.0f ? x[__builtin_ctz(hit)] : 0.0f;
            float dd = mx / -8.0f, id = kv512_inv(dd);
            uint16_t h = (uint16_t)_cvtss_sh(dd, _MM_FROUND_TO_NEAREST_INT);
            memcpy(y, &h, 2);
            __m512 vid = _mm512_set1_ps(id), c85 = _mm512_set1_ps(8.5f);
            __m512i fifteen = _mm512_set1_epi32(15);
            __m512i lo = _mm512_min_epi32(_mm512_cvttps_epi32(_mm512_add_ps(_mm512_mul_ps(x0, vid), c85)), fifteen);
            __m512i hi = _mm512_min_epi32(_mm512_cvttps_epi32(_mm512_add_ps(_mm512_mul_ps(x1, vid), c85)), fifteen);
            _mm_storeu_si128((__m128i *)(void *)(y + 2), _mm512_cvtepi32_epi8(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4))));
            y += KV_Q4_0_BYTES;
        }
    }
    return 1;
}
#define QUANT_BLOCK_OVERRIDE(fmt, x, dst, d) quant_row_512(fmt, x, dst, d)

/* 16 values of nibbles (lo: low nibbles of 16 bytes, else high) with the 5th bits of qh (bits 0-15 for the
 * low nibbles, 16-31 for the high), as f32 */
static inline __m512 kv512_nib(__m512i n, int hi, uint32_t qh, int has_qh) {
    __m512i v = hi ? _mm512_srli_epi32(n, 4) : _mm512_and_si512(n, _mm512_set1_epi32(15));
    if (has_qh) v = _mm512_or_si512(v, _mm512_maskz_mov_epi32((__mmask16)(hi ? qh >> 16 : qh), _mm512_set1_epi32(16)));
    return _mm512_cvtepi32_ps(v);
}

/* every format's row, 16 lanes at a time, bit-exact with the template's scalar loops (the same d*(n-o),
 * d*n + m and bit moves, no FMA) */
static int dequant_row_512(int fmt, const uint8_t *y, float *dst, int d) {
    if (fmt == KV_F32 || fmt == KV_F16 || d % KV_QK) return 0; /* memcpy / F16C already; odd tails */
    if (fmt == KV_BF16) {
        for (int i = 0; i < d; i += 16) {
            __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(y + 2 * i)));
            _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
        }
        return 1;
    }
    const int bb = kv_block_bytes[fmt];
    for (int b = 0; b < d / KV_QK; b++, dst += KV_QK, y += bb) {
        const __m512 s = _mm512_set1_ps(_cvtsh_ss(kv_load_u16(y)));
        if (fmt == KV_Q8_0) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(const void *)(y + 2));
            _mm512_storeu_ps(dst, _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)))));
            _mm512_storeu_ps(dst + 16, _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)))));
            continue;
        }
        /* nibble formats: q4_0 (qs at 2), q5_0 (qh at 2, qs at 6), q4_1 (m at 2, qs at 4), q5_1 (m, qh at 4, qs at 8) */
        const int has_min = fmt == KV_Q4_1 || fmt == KV_Q5_1, has_qh = fmt == KV_Q5_0 || fmt == KV_Q5_1;
        const int qs = fmt == KV_Q4_0 ? 2 : fmt == KV_Q5_0 ? 6 : fmt == KV_Q4_1 ? 4 : 8;
        const uint32_t qh = has_qh ? kv_load_u32(y + (has_min ? 4 : 2)) : 0;
        const __m512i n = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(y + qs)));
        for (int hi = 0; hi < 2; hi++) {
            __m512 x = kv512_nib(n, hi, qh, has_qh), r;
            if (has_min)
                r = _mm512_add_ps(_mm512_mul_ps(s, x), _mm512_set1_ps(_cvtsh_ss(kv_load_u16(y + 2))));
            else
                r = _mm512_mul_ps(s, _mm512_sub_ps(x, _mm512_set1_ps(has_qh ? 16.0f : 8.0f)));
            _mm512_storeu_ps(dst + 16 * hi, r);
        }
    }
    return 1;
}
#define DEQUANT_ROW_OVERRIDE(fmt, src, dst, d) dequant_row_512(fmt, src, dst, d)

/* 16 vectors into one: lane i = the sum of a[i]'s lanes (a tree of in-lane unpacks, then 128-bit lane
 * shuffles: 30 shuffles and 15 adds for 16 dot products, instead of a serial reduction per product) */
static inline __m512 kv512_hsum16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88), _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
}

/* The float formats (f32, f16, bf16) on AVX-512: 16 values of dims [j, j+16) of a stored row as f32
 * (F16C for f16, a 16-bit shift for bf16: both exact) */
#define KV512_LD_F32(p, j) _mm512_loadu_ps((const float *)(const void *)(p) + (j))
#define KV512_LD_F16(p, j) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)((p) + 2 * (j))))
#define KV512_LD_BF16(p, j) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)((p) + 2 * (j)))), 16))

/* Scores S[r][t] = q_r . k_t of R rows q [R][D] against the KV_T rows of a tile, 4 rows x 4 tokens at a
 * time: each K vector, converted once, feeds 4 rows and each q vector 4 tokens (16 independent FMA
 * chains), and one lane-sum tree gives the 16 products. The generic loop (a dot and a serial
 * horizontal sum per row and token, from an f32 copy of the tile) was latency-bound. Rows past R
 * repeat row 0 and are not stored. */
#define KV512_K4X4(NAME, LOADK)                                                                              \
    static void NAME(const float *q, float *S, int R, const uint8_t *const *rows, int D) {                   \
        for (int r0 = 0; r0 < R; r0 += 4) {                                                                  \
            const int nr = R - r0 < 4 ? R - r0 : 4;                                                          \
            const float *q0 = q + (size_t)r0 * D, *q1 = nr > 1 ? q0 + D : q0, *q2 = nr > 2 ? q0 + 2 * D : q0, \
                        *q3 = nr > 3 ? q0 + 3 * D : q0;                                                      \
            for (int t0 = 0; t0 < KV_T; t0 += 4) {                                                           \
                const uint8_t *p0 = rows[t0], *p1 = rows[t0 + 1], *p2 = rows[t0 + 2], *p3 = rows[t0 + 3];    \
                __m512 acc[16];                                                                              \
                for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();                                   \
                for (int j = 0; j < D; j += 16) {                                                            \
                    const __m512 k0 = LOADK(p0, j), k1 = LOADK(p1, j), k2 = LOADK(p2, j), k3 = LOADK(p3, j); \
                    const float *qq[4] = {q0, q1, q2, q3};                                                   \
                    for (int i = 0; i < 4; i++) {                                                            \
                        const __m512 qv = _mm512_loadu_ps(qq[i] + j);                                        \
                        acc[4 * i] = _mm512_fmadd_ps(qv, k0, acc[4 * i]);                                    \
                        acc[4 * i + 1] = _mm512_fmadd_ps(qv, k1, acc[4 * i + 1]);                            \
                        acc[4 * i + 2] = _mm512_fmadd_ps(qv, k2, acc[4 * i + 2]);                            \
                        acc[4 * i + 3] = _mm512_fmadd_ps(qv, k3, acc[4 * i + 3]);                            \
                    }                                                                                        \
                }                                                                                            \
                const __m512 res = kv512_hsum16(acc); /* lane 4i + u: row r0 + i, token t0 + u */            \
                for (int i = 0; i < nr; i++)                                                                 \
                    _mm512_mask_storeu_ps(S + (size_t)(r0 + i) * KV_T + t0 - 4 * i, (__mmask16)(0xfu << (4 * i)), res); \
            }                                                                                                \
        }                                                                                                    \
    }

/* O[r] += sum_t P[r][t] v_t for R rows, 4 rows x 64 dims at a time: each V vector, converted once,
 * feeds 4 rows (16 accumulators in registers over the whole tile) */
#define KV512_V4(NAME, LOADV)                                                                                \
    static void NAME(const float *P, float *O, int R, const uint8_t *const *rows, int D) {                   \
        for (int r0 = 0; r0 < R; r0 += 4) {                                                                  \
            const int nr = R - r0 < 4 ? R - r0 : 4;                                                          \
            const float *pp[4];                                                                              \
            for (int i = 0; i < 4; i++) pp[i] = P + (size_t)(r0 + (i < nr ? i : 0)) * KV_T;                  \
            for (int j0 = 0; j0 < D; j0 += 64) {                                                             \
                __m512 acc[4][4];                                                                            \
                for (int i = 0; i < 4; i++)                                                                  \
                    for (int u = 0; u < 4; u++)                                                              \
                        acc[i][u] = _mm512_loadu_ps(O + (size_t)(r0 + (i < nr ? i : 0)) * D + j0 + 16 * u);  \
                for (int t = 0; t < KV_T; t++) {                                                             \
                    const uint8_t *p = rows[t];                                                              \
                    const __m512 v0 = LOADV(p, j0), v1 = LOADV(p, j0 + 16), v2 = LOADV(p, j0 + 32),         \
                                 v3 = LOADV(p, j0 + 48);                                                     \
                    for (int i = 0; i < 4; i++) {                                                            \
                        const __m512 w = _mm512_set1_ps(pp[i][t]);                                           \
                        acc[i][0] = _mm512_fmadd_ps(w, v0, acc[i][0]);                                       \
                        acc[i][1] = _mm512_fmadd_ps(w, v1, acc[i][1]);                                       \
                        acc[i][2] = _mm512_fmadd_ps(w, v2, acc[i][2]);                                       \
                        acc[i][3] = _mm512_fmadd_ps(w, v3, acc[i][3]);                                       \
                    }                                                                                        \
                }                                                                                            \
                for (int i = 0; i < nr; i++)                                                                 \
                    for (int u = 0; u < 4; u++) _mm512_storeu_ps(O + (size_t)(r0 + i) * D + j0 + 16 * u, acc[i][u]); \
            }                                                                                                \
        }                                                                                                    \
    }

KV512_K4X4(k4x4_f32, KV512_LD_F32)
KV512_K4X4(k4x4_f16, KV512_LD_F16)
KV512_K4X4(k4x4_bf16, KV512_LD_BF16)
KV512_V4(v4_f32, KV512_LD_F32)
KV512_V4(v4_f16, KV512_LD_F16)
KV512_V4(v4_bf16, KV512_LD_BF16)

/* More than 8 rows (prefill) convert an f16/bf16 tile into L1 once (tb) rather than once per 4 rows */
#define KV512_FLOAT_ROWS 8

static void tile_to_f32_512(int fmt, const uint8_t *const *rows, float *tb, const uint8_t **trows, int D) {
    for (int t = 0; t < KV_T; t++) {
        float *dst = tb + (size_t)t * D;
        for (int j = 0; j < D; j += 16)
            _mm512_storeu_ps(dst + j, fmt == KV_F16 ? KV512_LD_F16(rows[t], j) : KV512_LD_BF16(rows[t], j));
        trows[t] = (const uint8_t *)dst;
    }
}

static int k_tile_float_512(const kv_call *c, kv_scratch *ws, int r0, int R, const uint8_t *const *rows, float *tb) {
    const int fmt = c->kfmt, D = c->head_dim;
    if (fmt > KV_BF16 || D % 16) return 0;
    const float *q = ws->qf + (size_t)r0 * D;
    const uint8_t *trows[KV_T];
    if (fmt == KV_F32)
        k4x4_f32(q, ws->s, R, rows, D);
    else if (R > KV512_FLOAT_ROWS) {
        tile_to_f32_512(fmt, rows, tb, trows, D);
        k4x4_f32(q, ws->s, R, trows, D);
    } else if (fmt == KV_F16)
        k4x4_f16(q, ws->s, R, rows, D);
    else
        k4x4_bf16(q, ws->s, R, rows, D);
    return 1;
}

static int v_tile_float_512(const kv_call *c, kv_scratch *ws, int r0, int R, const uint8_t *const *rows, float *tb) {
    const int fmt = c->vfmt, D = c->head_dim;
    if (fmt > KV_BF16 || D % 64) return 0;
    float *o = ws->o + (size_t)r0 * D;
    const uint8_t *trows[KV_T];
    if (fmt == KV_F32)
        v4_f32(ws->s, o, R, rows, D);
    else if (R > KV512_FLOAT_ROWS) {
        tile_to_f32_512(fmt, rows, tb, trows, D);
        v4_f32(ws->s, o, R, trows, D);
    } else if (fmt == KV_F16)
        v4_f16(ws->s, o, R, rows, D);
    else
        v4_bf16(ws->s, o, R, rows, D);
    return 1;
}
/* one 32-channel group of a per-channel K page row (kern_template.h's kpage_rows): codes as 32-bit lanes,
 * then d * code + m with the multiply and the add rounded apart, as the spec */
static inline void kpage_group_512(int four, const uint8_t *y, const float *d, const float *m, float *out) {
    __m128i a, b;
    kv_kpage_codes(four, y, &a, &b);
    const __m512 qa = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(a)), qb = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(d), qa), _mm512_loadu_ps(m)));
    _mm512_storeu_ps(out + 16, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(d + 16), qb), _mm512_loadu_ps(m + 16)));
}
#define KPAGE_GROUP(four, y, d, m, out) kpage_group_512(four, y, d, m, out)
/* 16 values' nearest e2m1 codes against the candidates v[16] (kern_v2.h's e2m1_codes), lowest code on ties */
static inline void e2m1_codes16_512(const float *x, const float *v, int32_t *code) {
    const __m512 xv = _mm512_loadu_ps(x), sign = _mm512_set1_ps(-0.0f);
    __m512 best = _mm512_andnot_ps(sign, _mm512_sub_ps(_mm512_set1_ps(v[0]), xv));
    __m512i c = _mm512_setzero_si512();
    for (int k = 1; k < 16; k++) {
        const __m512 e = _mm512_andnot_ps(sign, _mm512_sub_ps(_mm512_set1_ps(v[k]), xv));
        const __mmask16 better = _mm512_cmp_ps_mask(e, best, _CMP_LT_OQ);
        c = _mm512_mask_mov_epi32(c, better, _mm512_set1_epi32(k));
        best = _mm512_mask_mov_ps(best, better, e);
    }
    _mm512_storeu_si512((void *)code, c);
}
#define E2M1_CODES16(x, v, code) e2m1_codes16_512(x, v, code)
#define K_TILE_FLOAT(c, ws, r0, R, rows, tb) k_tile_float_512(c, ws, r0, R, rows, tb)
#define V_TILE_FLOAT(c, ws, r0, R, rows, tb) v_tile_float_512(c, ws, r0, R, rows, tb)
#include "kern_template.h"

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
